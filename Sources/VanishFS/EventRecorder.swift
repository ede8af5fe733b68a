import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage
import VanishEvents
import VanishGraveyard
import VanishClient
import Logging

/// Writing sessions, for the `written` event ("finished copying"): one per
/// inode, reported when its last writable handle is released, if any of
/// them wrote. A program's close() is not enough: another copy of the fd
/// (dup, fork) or another open may still be writing, so the kernel's
/// RELEASE, sent once the last reference is gone, ends the session. The
/// kernel queues it before close() returns, so it comes ahead of the
/// program's next request, though another thread of the daemon may report
/// a request handled at the same moment first.
///
/// Lock order: `state` is a leaf lock (nothing is called while it is held).
final class WritingHandles: Sendable {
    /// One writable handle, by its backing fd.
    struct Handle {
        var caller: Caller
        /// The opener's command name, taken while it surely ran: a short-lived
        /// writer is gone by its RELEASE, and /proc with it. Only where names
        /// cost a lookup (`CommandNames.remembers`); "" elsewhere.
        var comm = ""
        /// Set when the data came from another file in the mount (copy_file_range).
        var source: (path: [UInt8], id: String)?
        /// For a passthrough handle, whose writes the daemon never sees: the
        /// file's mtime and size when it was opened or last rebased.
        var unseenSince: Stamp?
        /// A write came through the daemon.
        var wrote: Bool
        /// How far copy_file_range filled the file from `source`, in one run
        /// from offset 0 at the same offsets, and the source's size then.
        var copiedEnd: off_t = 0
        var sourceSize: off_t = -1
        /// Data came otherwise too (a write, a copy that was not that run):
        /// the file is not a copy of `source` alone.
        var mixed = false

        /// `source`, if the file (`size` bytes now) is exactly a copy of it.
        func wholeCopy(size: off_t) -> (path: [UInt8], id: String)? {
            guard let source, !mixed, copiedEnd == size, sourceSize == size else { return nil }
            return source
        }
    }

    /// The writable handles of one inode and what the released ones did.
    struct Session {
        var open = 0
        var handles: [Int32: Handle] = [:]
        var wrote = false
        /// The last writer's caller and copy source, for the event.
        var caller: Caller?
        var comm = ""
        var source: (path: [UInt8], id: String)?
        /// The process that opened the file for writing, while only one did,
        /// and the file it had open for reading then (see `ReadingHandles`).
        var writer: pid_t?
        var copyCandidate: Inode?
    }

    /// What a write changes: mtime and size (not ctime, which chmod moves too).
    struct Stamp: Equatable {
        var mtime: timespec
        var size: off_t
        init(_ st: stat) { mtime = st.st_mtim; size = st.st_size }
        static func == (a: Stamp, b: Stamp) -> Bool {
            a.mtime.tv_sec == b.mtime.tv_sec && a.mtime.tv_nsec == b.mtime.tv_nsec && a.size == b.size
        }
    }

    // Sized at mount: see `InodeTable.lock`.
    private let state = Lock<[ObjectIdentifier: Session]>(Dictionary(minimumCapacity: 64))
    /// Passthrough handles open now: a setattr needs to look for them only when any are.
    private let following = Atomic<Int>(0)

    /// A writable handle of `node` was opened; `stamp` (the file's stat now)
    /// for a passthrough handle, whose writes show only in the file.
    /// `candidate`: the file the caller has open for reading, if any.
    func opened(_ fd: Int32, _ node: Inode, _ caller: Caller, passthroughStamp stamp: Stamp?, copyCandidate candidate: Inode?) {
        let comm = CommandNames.shared.remembers ? CommandNames.shared.name(of: caller.pid) : ""
        state.withLock { m in
            var s = m[ObjectIdentifier(node)] ?? Session(writer: caller.pid, copyCandidate: candidate)
            // A second writing process: the file is not one process's copy.
            if s.writer != caller.pid { s.writer = nil; s.copyCandidate = nil }
            s.open += 1
            s.handles[fd] = Handle(caller: caller, comm: comm, unseenSince: stamp, wrote: false)
            m[ObjectIdentifier(node)] = s
        }
        if stamp != nil { following.add(1, ordering: .relaxed) }
    }

    /// What a copy_file_range into a file brought: from which file, at
    /// which offsets, how much, how big that file was, and the copy's stamp
    /// after (a passthrough handle's later writes show as a change from it).
    struct Copy {
        var source: (path: [UInt8], id: String)
        var inputOffset: off_t
        var outputOffset: off_t
        var length: Int
        var sourceSize: off_t
        var after: Stamp?
    }

    /// Notes a write by `caller` through the daemon on `fd` (a copy_file_range
    /// when `copy`); cheap after the first plain one.
    @inline(__always)
    func wrote(_ fd: Int32, _ node: Inode, _ caller: Caller, copy: Copy? = nil) {
        state.withLock { m in
            let key = ObjectIdentifier(node)
            guard m[key] != nil else { return }  // not opened for writing (cannot happen) or not observed then
            var h = m[key]!.handles[fd] ?? Handle(caller: caller, comm: "", wrote: false)
            guard !h.wrote || copy != nil || !h.mixed else { return }
            h.wrote = true
            if let copy {
                if copy.inputOffset == h.copiedEnd, copy.outputOffset == h.copiedEnd,
                   h.source == nil || h.source?.id == copy.source.id {
                    h.source = copy.source
                    h.copiedEnd += off_t(copy.length)
                    h.sourceSize = copy.sourceSize
                } else {
                    h.mixed = true
                }
                if let after = copy.after, h.unseenSince != nil { h.unseenSince = after }
            } else {
                h.mixed = true
            }
            m[key]!.handles[fd] = h
        }
    }

    /// A writable handle of `node` is released; `st` is the file's stat now.
    /// Returns the session to report when it was the last one and any wrote.
    func released(_ fd: Int32, _ node: Inode, _ st: stat?) -> Session? {
        let key = ObjectIdentifier(node)
        let (session, passthrough): (Session?, Bool) = state.withLock { m in
            guard var s = m[key] else { return (nil, false) }
            let h = s.handles.removeValue(forKey: fd)
            if let h {
                var wrote = h.wrote
                var handle = h
                // A passthrough handle changed the file since its last copy: a write of its own.
                if let since = h.unseenSince, let st, Stamp(st) != since {
                    wrote = true
                    handle.mixed = true
                }
                if wrote {
                    s.wrote = true
                    s.caller = h.caller
                    s.comm = h.comm
                    if let st, let whole = handle.wholeCopy(size: st.st_size) { s.source = whole } else { s.source = nil }
                }
            }
            s.open -= 1
            if s.open > 0 {
                m[key] = s
                return (nil, h?.unseenSince != nil)
            }
            m[key] = nil
            return (s.wrote ? s : nil, h?.unseenSince != nil)
        }
        if passthrough { following.subtract(1, ordering: .relaxed) }
        return session
    }

    /// Whether passthrough handles of `node` are being followed.
    func follows(_ node: Inode) -> Bool {
        guard following.load(ordering: .relaxed) > 0 else { return false }
        return state.withLock { $0[ObjectIdentifier(node)]?.handles.values.contains { $0.unseenSince != nil } ?? false }
    }

    /// A setattr through the daemon moves mtime or size without writing:
    /// what changed before it (`before`) was written; the passthrough
    /// handles of `node` then follow the file from `after`.
    func attributesChanged(_ node: Inode, before: stat, after: stat) {
        let (was, now) = (Stamp(before), Stamp(after))
        state.withLock { m in
            guard var s = m[ObjectIdentifier(node)] else { return }
            for (fd, var h) in s.handles {
                guard let since = h.unseenSince else { continue }
                if since != was { h.wrote = true }
                h.unseenSince = now
                s.handles[fd] = h
            }
            m[ObjectIdentifier(node)] = s
        }
    }
}


/// The change observer with events on: every change made through the mount
/// becomes one event in the journal, from the handler that made it.
final class EventRecorder: ChangeObserver {
    let journal: Journal
    private let table: InodeTable
    let namespace: BackingNamespace
    private let log: Logger
    /// Whether the daemon may read files without touching their access time (root).
    let readsWithoutAtime: Bool
    private let writing = WritingHandles()
    /// Read-only handles by process, for telling copies (`copied_from`).
    private let reading = ReadingHandles()
    /// What each user may have the daemon read to compare copies.
    let compareBudget = CompareBudget()

    init(journal: Journal, table: InodeTable, namespace: BackingNamespace, log: Logger, readsWithoutAtime: Bool) {
        self.journal = journal
        self.table = table
        self.namespace = namespace
        self.log = log
        self.readsWithoutAtime = readsWithoutAtime
    }

    /// Events name their callers: whether those names can be remembered
    /// (process notices) or are read for every event.
    var callerNames: String { CommandNames.shared.remembers ? "remembered" : "read each time" }
    var recordsIDs: Bool { true }

    /// Records the reaper's `reaped` and `shortened` events.
    func recordReaping(of reaper: Reaper) {
        let logged = reaper.hooks.onShortened
        reaper.hooks.onShortened = { [journal] s in
            logged?(s)
            journal.append(.shortened) { e in
                e.int("entries", UInt64(s.entries))
                e.int("bytes", s.bytes)
                e.string("because", s.because)
            }
        }
        reaper.hooks.onReaped = { [journal] id, freed in
            journal.append(.reaped) { e in
                e.string("entry", id)
                e.int("files", freed.files)
                e.int("directories", freed.directories)
                e.int("data_bytes", freed.dataBytes)
                e.int("disk_bytes", freed.diskBytes)
            }
        }
    }

    /// `mv f g` right after a writer closed f is "written f", then "renamed g <- f".
    @inline(__always)
    func awaitEarlierChanges(_ req: Request) { req.awaitEarlierChanges() }

    /// Appends an event caused by `caller` (nil for Vanish's own doing),
    /// recorded while handling `req` (nil: no request).
    /// `knownComm`: the caller's command name as taken earlier, if it may be gone now.
    private func emit(_ type: EventType, _ caller: Caller?, during req: Request?, knownComm: String = "",
                      _ fill: (inout EventRecord) -> Void) {
        // In the kernel's order of requests: a RELEASE handled beside its
        // program's next request is recorded first (causal order per process).
        if let req, !req.awaitEarlierChanges() {
            log.notice("recorded a change without waiting longer for an earlier request", metadata: ["event": "\(type)"])
        }
        let comm = caller.map { c in
            let now = CommandNames.shared.name(of: c.pid)
            return now.isEmpty ? knownComm : now
        }
        journal.append(type) { e in
            fill(&e)
            if let caller, let comm {
                e.int("uid", caller.uid)
                e.int("gid", caller.gid)
                e.int("pid", caller.pid)
                e.string("comm", comm)
            }
        }
    }

    /// The file id of a known inode, asked of the backing filesystem once.
    /// `fd` is an fd on it if the caller has one.
    private func fileID(of node: Inode, fd: Int32? = nil) -> String {
        table.fileID(of: node) {
            if let fd { return FileID.read(fd, nil) }
            return namespace.withFDIfPossible(node) { FileID.read($0, nil) } ?? ""
        }
    }

    /// Path of an inode by its last known name.
    private func path(of node: Inode) -> [UInt8] { table.path(of: node, appending: nil) }

    func created(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, node: Inode, st: stat, fd: Int32) {
        let id = fileID(of: node, fd: fd)
        emit(.created, req.caller, during: req) { e in
            e.path("path", of: parent, appending: name, in: table)
            e.string("kind", FileID.kindName(st.st_mode))
            e.string("id", id)
        }
    }

    func linking(_ node: Inode, unnamed: Bool) -> [UInt8] { unnamed ? [] : path(of: node) }

    /// An O_TMPFILE file getting its first name is a creation, as inotify
    /// reports it, not a second name of a file already seen.
    func linked(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, parentFD: Int32, node: Inode,
                st: stat, target: [UInt8], unnamed: Bool) {
        if unnamed {
            namespace.withFDIfPossible(node) { fd in created(req, parent: parent, name: name, node: node, st: st, fd: fd) }
            return
        }
        let id = FileID.read(parentFD, name)
        emit(.linked, req.caller, during: req) { e in
            e.path("path", of: parent, appending: name, in: table)
            e.path("target", target)
            e.string("kind", FileID.kindName(st.st_mode))
            e.string("id", id)
            e.int("links", st.st_nlink)
        }
    }

    /// The inode's cached id when the kernel knows it (a file made through
    /// the mount always is), so most deletes ask the backing filesystem nothing more.
    func removing(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat) -> String {
        guard let node = table.known(st) else { return FileID.read(dirFD, name) }
        return table.fileID(of: node) { FileID.read(dirFD, name) }
    }

    func removingDirectory(_ dirFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (id: String, st: stat?) {
        let st = try Sys.lstatat(dirFD, name)
        return (removing(dirFD, name, st), st)
    }

    /// For `vanish rm`, `entry` is its graveyard entry: the `reaped` event
    /// with the same `entry` counts the whole tree's files and bytes once
    /// they are freed (counting them here would walk the tree in the
    /// request, which is what `vanish rm` exists to avoid).
    func deleted(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, mode: mode_t, id: String, tree: Bool,
                 entry: String?) {
        emit(.deleted, req.caller, during: req) { e in
            e.path("path", of: parent, appending: name, in: table)
            e.string("kind", FileID.kindName(mode))
            e.string("id", id)
            // vanish rm: one event for the whole subtree.
            if tree && mode & S_IFMT == S_IFDIR { e.bool("tree", true) }
            if let entry { e.string("entry", entry) }
        }
    }

    func renamed(_ req: Request, from parent: Inode, _ name: UnsafePointer<CChar>, to newParent: Inode,
                 _ newName: UnsafePointer<CChar>, newParentFD: Int32, moved: Inode?, st: stat?, exchange: Bool,
                 replaced: Bool) {
        let id = moved.map { fileID(of: $0) } ?? FileID.read(newParentFD, newName)
        let kind = st.map { FileID.kindName($0.st_mode) } ?? ""
        emit(.renamed, req.caller, during: req) { e in
            e.path("path", of: newParent, appending: newName, in: table)
            e.path("from", of: parent, appending: name, in: table)
            e.string("kind", kind)
            e.string("id", id)
            if exchange { e.bool("exchange", true) }
            if replaced { e.bool("replaced", true) }
        }
    }

    func restored(into dirFD: Int32, _ leaf: UnsafePointer<CChar>, path: [UInt8], kind: String, entry: String,
                  uid: uid_t, kept: Bool) {
        let id = FileID.read(dirFD, leaf)
        emit(.restored, nil, during: nil) { ev in
            ev.path("path", path)
            ev.string("kind", kind)
            ev.string("id", id)
            ev.string("entry", entry)
            ev.int("uid", uid)
            if kept { ev.string("reason", "kept: its deleter could not have removed all of it with rm -r") }
        }
    }

    /// A directory's moved mtime that no change of Vanish's own explains
    /// becomes one `rescan` event (see `Inode.willChangeEntries`).
    @inline(__always)
    func sawDirectory(_ node: Inode, _ st: stat) {
        guard node.isDirectory else { return }
        let mtime = Sys.nanoseconds(st.st_mtim)
        let seen = node.mtimeSeen.exchange(mtime, ordering: .sequentiallyConsistent)
        guard seen != mtime, seen != 0 else { return }
        if node.changedHere.exchange(false, ordering: .sequentiallyConsistent) { return }
        emit(.rescan, nil, during: nil) { e in
            e.path("path", of: node, in: table)
            e.string("kind", "directory")
            e.string("reason", "its entries changed behind this mount (another client, or the backing directory)")
        }
    }

    func opened(_ fd: Int32, _ node: Inode, writing writes: Bool, passthrough: Bool, stat known: stat?, _ req: Request) {
        let caller = req.caller
        if writes {
            // A writer's RELEASE the kernel sent before this open ends its
            // writing session first: handled after this open joined the
            // session, it would leave its `written` to this writer's close
            // (dd; touch -d: "attributes" before dd's "written").
            req.awaitEarlierChanges()
            // The kernel writes a passthrough file without us: the writing
            // session is told by the file's change since the open.
            let stamp = passthrough ? (known ?? (try? Sys.fstat(fd))).map(WritingHandles.Stamp.init) : nil
            writing.opened(fd, node, caller, passthroughStamp: stamp, copyCandidate: reading.newest(of: caller.pid))
        } else if node.type == S_IFREG {
            reading.opened(fd, node, by: caller.pid)
        }
    }

    @inline(__always)
    func wrote(_ fd: Int32, _ node: Inode, _ req: Request) { writing.wrote(fd, node, req.caller) }

    /// The new file's data comes from another file in the mount: say which.
    func copied(from input: Inode, _ inFD: Int32, at inputOffset: off_t, into output: Inode, _ outFD: Int32,
                at outputOffset: off_t, length: Int, _ req: Request) {
        let after = try? Sys.fstat(outFD)
        let copy = WritingHandles.Copy(source: (path(of: input), fileID(of: input, fd: inFD)),
                                       inputOffset: inputOffset, outputOffset: outputOffset, length: length,
                                       sourceSize: (try? Sys.fstat(inFD))?.st_size ?? -1,
                                       after: after.map(WritingHandles.Stamp.init))
        writing.wrote(outFD, output, req.caller, copy: copy)
    }

    func released(_ fd: Int32, _ node: Inode, writing writes: Bool, report: Bool, during req: Request?) {
        if writes {
            if report { recordWritten(node, fd: fd, during: req) } else { _ = writing.released(fd, node, nil) }
        } else if node.type == S_IFREG {
            reading.released(fd)
        }
    }

    /// A writable handle is released: the `written` event when it was the
    /// inode's last and any of them wrote, unless the file is gone (its
    /// `deleted` came already).
    private func recordWritten(_ node: Inode, fd: Int32, during req: Request?) {
        let st = try? Sys.fstat(fd)
        guard let session = writing.released(fd, node, st), let caller = session.caller,
              (st?.st_nlink ?? 0) > 0, !table.isBuried(node) else { return }
        let id = fileID(of: node, fd: fd)
        var source = session.source
        if source == nil, let candidate = session.copyCandidate, let st,
           sameContent(node, size: st.st_size, as: candidate, uid: caller.uid) {
            source = (path(of: candidate), fileID(of: candidate))
        }
        emit(.written, caller, during: req, knownComm: session.comm) { e in
            e.path("path", of: node, in: table)
            e.string("kind", "file")
            e.string("id", id)
            e.int("size", st?.st_size ?? 0)
            if let source {
                e.path("copied_from", source.path)
                e.string("copied_from_id", source.id)
            }
        }
    }

    /// Passthrough writers' sessions tell writes by mtime and size, which a
    /// setattr may move: what changed before it was written.
    func settingAttributes(_ node: Inode, toSet: Int32, stat: () -> stat?) -> stat? {
        guard toSet & (FUSE_SET_ATTR_SIZE | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW) != 0,
              writing.follows(node) else { return nil }
        return stat()
    }

    func attributesChanged(_ req: Request, _ node: Inode, toSet: Int32, before: stat?, after: stat) {
        if let before { writing.attributesChanged(node, before: before, after: after) }
        recordAttributes(req, node, toSet: toSet, st: after, xattr: nil)
    }

    func flagsChanged(_ req: Request, _ node: Inode) {
        recordAttributes(req, node, toSet: 0, st: nil, xattr: nil, fileFlags: true)
    }

    func xattrChanged(_ req: Request, _ node: Inode, name: UnsafePointer<CChar>) {
        recordAttributes(req, node, toSet: 0, st: nil, xattr: name)
    }

    func follows(_ node: Inode) -> Bool { writing.follows(node) }

    private func recordAttributes(_ req: Request, _ node: Inode, toSet: Int32, st: stat?, xattr: UnsafePointer<CChar>?,
                                  fileFlags: Bool = false) {
        let id = fileID(of: node)
        if toSet & FUSE_SET_ATTR_SIZE != 0 {
            emit(.truncated, req.caller, during: req) { e in
                e.path("path", of: node, in: table)
                e.string("kind", "file")
                e.string("id", id)
                e.int("size", st?.st_size ?? 0)
            }
        }
        var changed = ""
        func add(_ what: StaticString) {
            if !changed.isEmpty { changed += "," }
            changed += what.description
        }
        if toSet & FUSE_SET_ATTR_MODE != 0 { add("mode") }
        if toSet & FUSE_SET_ATTR_UID != 0 { add("uid") }
        if toSet & FUSE_SET_ATTR_GID != 0 { add("gid") }
        if toSet & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_ATIME_NOW) != 0 { add("atime") }
        if toSet & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW) != 0 { add("mtime") }
        if xattr != nil { add("xattr") }
        if fileFlags { add("flags") }
        guard !changed.isEmpty else { return }
        emit(.attributes, req.caller, during: req) { e in
            e.path("path", of: node, in: table)
            e.string("kind", FileID.kindName(node.type))
            e.string("id", id)
            e.string("changed", changed)
            if let xattr { e.string("xattr", String(cString: xattr)) }
            if let st {
                if toSet & FUSE_SET_ATTR_MODE != 0 { e.int("mode", st.st_mode & 0o7777) }
                if toSet & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID) != 0 { e.int("owner_uid", st.st_uid); e.int("owner_gid", st.st_gid) }
            }
        }
    }
}

/// What events say of a file: its id and its kind.
package enum FileID {
    /// The file id: the backing filesystem's file handle for the entry (hex),
    /// which names the inode and its generation, so it survives renames and
    /// remounts and is never given to another file. "" if the filesystem
    /// has no handles.
    package static func read(_ dirFD: Int32, _ name: UnsafePointer<CChar>?) -> String {
        withHandle(dirFD, name) { handle in handle.map(hex) ?? "" }
    }

    /// Runs `body` with the backing handle of `name` in `dirFD` (of `dirFD`
    /// itself without a name) as `vanish_file_handle` gives it (type, then
    /// handle), or nil if the filesystem gave none. One name_to_handle_at,
    /// into a buffer on the stack: this runs for every event and new node.
    package static func withHandle<R>(_ dirFD: Int32, _ name: UnsafePointer<CChar>?,
                                      _ body: (UnsafeRawBufferPointer?) -> R) -> R {
        withUnsafeTemporaryAllocation(byteCount: 4 + Int(VANISH_MAX_HANDLE_SZ), alignment: 8) { raw in
            let buffer = raw.bindMemory(to: UInt8.self)
            let empty: CChar = 0
            let n = withUnsafePointer(to: empty) { emptyName in
                vanish_file_handle(dirFD, name ?? emptyName, name == nil ? VANISH_AT_EMPTY_PATH : 0,
                                   buffer.baseAddress, Int32(buffer.count))
            }
            return body(n > 0 ? UnsafeRawBufferPointer(rebasing: raw[..<Int(n)]) : nil)
        }
    }

    /// The file id of a handle as `read` gets it (type, then handle).
    package static func hex(_ handle: UnsafeRawBufferPointer) -> String {
        String(unsafeUninitializedCapacity: handle.count * 2) { out in
            for (i, byte) in handle.enumerated() {
                out[2 * i] = hexDigits[Int(byte >> 4)]
                out[2 * i + 1] = hexDigits[Int(byte & 0xF)]
            }
            return handle.count * 2
        }
    }

    /// The `kind` field of events for a st_mode.
    package static func kindName(_ mode: mode_t) -> String {
        switch mode & S_IFMT {
        case S_IFREG: "file"
        case S_IFDIR: "directory"
        case S_IFLNK: "symlink"
        case S_IFIFO: "fifo"
        case S_IFSOCK: "socket"
        case S_IFCHR: "char-device"
        case S_IFBLK: "block-device"
        default: "other"
        }
    }
}

extension EventRecord {
    /// Adds the path of `name` in `dir` (of `dir` itself without a name)
    /// without building it as an array first.
    /// Marks it `<key>_private` when other users could not have seen it
    /// then (`InodeTable.othersMaySee`): subscribers other than root and
    /// the user who made the change are never shown it, whatever the
    /// directories' modes when they read it.
    mutating func path(_ key: StaticString, of dir: Inode, appending name: UnsafePointer<CChar>? = nil,
                       in table: InodeTable) {
        table.withPath(of: dir, appending: name) { path(key, $0) }
        if !table.othersMaySee(dir, named: name != nil) { bool(EventRecord.privateKey(key), true) }
    }

    /// `path` → `path_private`, `from` → `from_private`, and so on.
    static func privateKey(_ key: StaticString) -> StaticString {
        switch key.utf8Start[0] {
        case UInt8(ascii: "f"): "from_private"
        case UInt8(ascii: "t"): "target_private"
        case UInt8(ascii: "c"): "copied_from_private"
        default: "path_private"
        }
    }
}

private let hexDigits: [UInt8] = Array("0123456789abcdef".utf8)
