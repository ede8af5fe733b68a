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

// The observer: every change made through the mount becomes one event in
// the journal, from the handler that made it.
extension PassthroughFilesystem {
    /// Starts recording events (before mounting).
    public func attach(journal: Journal) {
        events = journal
        reaper?.onReaped = { id, freed in
            journal.append(.reaped) { e in
                e.string("entry", id)
                e.int("files", freed.files)
                e.int("directories", freed.directories)
                e.int("data_bytes", freed.dataBytes)
                e.int("disk_bytes", freed.diskBytes)
            }
        }
    }

    @inline(__always)
    var observing: Bool { events != nil }

    /// `.vanish/events`, made if needed: where the journal lives. nil
    /// without a state directory (read-only mounts have no journal).
    public func openEventsDirectory() -> Int32? {
        guard let graveyard else { return nil }
        if mkdirat(graveyard.stateFD, "events", 0o700) != 0 && errno != EEXIST { return nil }
        let fd = openat(graveyard.stateFD, "events", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        return fd >= 0 ? fd : nil
    }

    /// The journal, for the control socket.
    public var journal: Journal? { events }

    /// Before a change of names (a rename, an unlink, an rmdir, a tree
    /// deleted in one step): an earlier request still recording its event
    /// (a RELEASE's `written`) names its file as it is then, so it must
    /// record first: `mv f g` right after a writer closed f is "written f",
    /// then "renamed g <- f".
    @inline(__always)
    func awaitEarlierEvents() {
        if events != nil { Request.waitForEarlierChanges() }
    }

    /// Appends an event caused by `caller` (nil for Vanish's own doing).
    /// `knownComm`: the caller's command name as taken earlier, if it may be gone now.
    func emit(_ type: EventType, _ caller: Caller?, knownComm: String = "", _ fill: (inout EventRecord) -> Void) {
        guard let events else { return }
        // In the kernel's order of requests: a RELEASE handled beside its
        // program's next request is recorded first (causal order per process).
        if caller != nil, !Request.waitForEarlierChanges() {
            log.notice("recorded a change without waiting longer for an earlier request", metadata: ["event": "\(type)"])
        }
        let comm = caller.map { c in
            let now = CommandNames.shared.name(of: c.pid)
            return now.isEmpty ? knownComm : now
        }
        events.append(type) { e in
            fill(&e)
            if let caller, let comm {
                e.int("uid", caller.uid)
                e.int("gid", caller.gid)
                e.int("pid", caller.pid)
                e.string("comm", comm)
            }
        }
    }

    /// The file id: the backing filesystem's file handle for the entry (hex),
    /// which names the inode and its generation, so it survives renames and
    /// remounts and is never given to another file. "" if the filesystem
    /// has no handles.
    package func fileID(_ dirFD: Int32, _ name: UnsafePointer<CChar>?) -> String {
        // On the stack: this runs for every event.
        withUnsafeTemporaryAllocation(byteCount: 4 + Int(VANISH_MAX_HANDLE_SZ), alignment: 8) { raw in
            let buffer = raw.bindMemory(to: UInt8.self)
            let empty: CChar = 0
            let n = withUnsafePointer(to: empty) { emptyName in
                vanish_file_handle(dirFD, name ?? emptyName, name == nil ? VANISH_AT_EMPTY_PATH : 0,
                                   buffer.baseAddress, Int32(buffer.count))
            }
            guard n > 0 else { return "" }
            return String(unsafeUninitializedCapacity: Int(n) * 2) { out in
                for i in 0..<Int(n) {
                    out[2 * i] = hexDigits[Int(buffer[i] >> 4)]
                    out[2 * i + 1] = hexDigits[Int(buffer[i] & 0xF)]
                }
                return Int(n) * 2
            }
        }
    }

    /// The id and lstat of `name` in `dirFD` before it is removed: the
    /// inode's cached id when the kernel knows it (a file made through the
    /// mount always is), so most deletes ask the backing filesystem nothing more.
    func idBeforeRemoval(_ dirFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (String, stat) {
        let st = try Sys.lstatat(dirFD, name)
        return (idBeforeRemoval(dirFD, name, st), st)
    }

    /// As above, for an entry already stat'ed.
    func idBeforeRemoval(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat) -> String {
        guard let node = table.known(st) else { return fileID(dirFD, name) }
        return table.fileID(of: node) { fileID(dirFD, name) }
    }

    /// The file id of a known inode, asked of the backing filesystem once.
    /// `fd` is an fd on it if the caller has one.
    func fileID(of node: Inode, fd: Int32? = nil) -> String {
        table.fileID(of: node) {
            if let fd { return fileID(fd, nil) }
            return namespace.withFDIfPossible(node) { fileID($0, nil) } ?? ""
        }
    }

    func kindName(_ mode: mode_t) -> String { Self.kindName(mode) }

    /// The `kind` field of events for a st_mode.
    public static func kindName(_ mode: mode_t) -> String {
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

    /// Path of an inode by its last known name.
    func path(of node: Inode) -> [UInt8] { table.path(of: node, appending: nil) }

    func emitCreated(_ caller: Caller, parent: Inode, name: UnsafePointer<CChar>, node: Inode, st: stat, fd: Int32) {
        guard observing else { return }
        let id = fileID(of: node, fd: fd)
        emit(.created, caller) { e in
            e.path("path", of: parent, appending: name, in: table)
            e.string("kind", kindName(st.st_mode))
            e.string("id", id)
        }
    }

    /// A writable handle is released: the `written` event when it was the
    /// inode's last and any of them wrote, unless the file is gone (its
    /// `deleted` came already).
    func emitWritten(_ node: Inode, fd: Int32) {
        let st = try? Sys.fstat(fd)
        guard let session = writing.released(fd, node, st), let caller = session.caller,
              (st?.st_nlink ?? 0) > 0, !table.isBuried(node) else { return }
        let id = fileID(of: node, fd: fd)
        var source = session.source
        if source == nil, let candidate = session.copyCandidate, let st,
           sameContent(node, size: st.st_size, as: candidate, uid: caller.uid) {
            source = (path(of: candidate), fileID(of: candidate))
        }
        emit(.written, caller, knownComm: session.comm) { e in
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
}

extension PassthroughFilesystem {
    /// `entry`: for `vanish rm`, its graveyard entry. The `reaped` event with
    /// the same `entry` counts the whole tree's files and bytes once they are
    /// freed (counting them here would walk the tree in the request, which is
    /// what `vanish rm` exists to avoid).
    func emitDeleted(_ caller: Caller, parent: Inode, name: UnsafePointer<CChar>, mode: mode_t, id: String, tree: Bool,
                     entry: String? = nil) {
        guard observing else { return }
        emit(.deleted, caller) { e in
            e.path("path", of: parent, appending: name, in: table)
            e.string("kind", kindName(mode))
            e.string("id", id)
            // vanish rm: one event for the whole subtree.
            if tree && mode & S_IFMT == S_IFDIR { e.bool("tree", true) }
            if let entry { e.string("entry", entry) }
        }
    }

    func emitAttributes(_ caller: Caller, _ node: Inode, toSet: Int32, st: stat?, xattr: UnsafePointer<CChar>?,
                        fileFlags: Bool = false) {
        let id = fileID(of: node)
        if toSet & FUSE_SET_ATTR_SIZE != 0 {
            emit(.truncated, caller) { e in
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
        emit(.attributes, caller) { e in
            e.path("path", of: node, in: table)
            e.string("kind", kindName(node.type))
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
