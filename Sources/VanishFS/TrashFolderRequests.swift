import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage
import VanishGraveyard

/// A listing of a folder of `TrashFolders`, taken whole at opendir.
final class TrashListing {
    let names: [(name: [UInt8], type: UInt8)]
    /// Whose open handles it counts in (`TrashHandleCounts`).
    let account: uid_t
    init(_ names: [(name: [UInt8], type: UInt8)], account: uid_t) { (self.names, self.account) = (names, account) }

    static func from(_ fi: UnsafeMutablePointer<fuse_file_info>) -> TrashListing {
        Unmanaged<TrashListing>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeUnretainedValue()
    }
}

/// How many trash folder handles each account holds open. Each holds a
/// listing as long as the account's trash (one user's 90,000 entries made
/// it 1.1 MB a handle, and 5,000 handles took 5.8 GB of the daemon's
/// memory); file managers and trash-cli hold one or two.
final class TrashHandleCounts: Sendable {
    static let perAccount = 16
    private let counts = Mutex<[uid_t: Int]>([:])

    init() {}

    /// Counts one more for `uid`'s account (root's are not counted: it may
    /// open every user's); EMFILE past `perAccount`.
    func take(_ uid: uid_t) throws(Errno) -> uid_t {
        let account = SubordinateIDs.shared.owner(of: uid)
        if account == 0 { return 0 }
        try counts.withLock { c throws(Errno) in
            guard c[account, default: 0] < Self.perAccount else { throw .tooManyOpenFiles }
            c[account, default: 0] += 1
        }
        return account
    }

    func giveBack(_ account: uid_t) {
        if account == 0 { return }
        counts.withLock { c in
            let left = c[account, default: 1] - 1
            c[account] = left > 0 ? left : nil
        }
    }
}

/// The handlers of requests on the desktop trash folders (see
/// `TrashFolders`). The daemon answers for what it makes up, so it checks
/// the caller itself: a folder is its user's (and root's) alone, as its
/// mode 0700 says. What leaves or enters the trash moves as for `vanish
/// restore` and unlink: as the caller, checked by the kernel.
struct TrashRequests: Sendable {
    /// The folders (nil without an undo window: no request reaches here then).
    let trashFolders: TrashFolders?
    let namespace: BackingNamespace
    let replies: EntryReplies
    let reserved: ReservedNames
    /// For what the trash takes in or lets go as an unlink or a rename would.
    let entries: EntryHandlers
    let changes: any ChangeObserver
    let deleter: Deleter
    /// Restores and emptying, as the control requests do them.
    let control: MountControl
    let handleCounts = TrashHandleCounts()

    private var table: InodeTable { namespace.table }

    @inline(__always)
    private func inode(_ id: fuse_ino_t) -> Inode { table.inode(id) }

    private func folderNode(_ id: fuse_ino_t) throws(Errno) -> (TrashFolders, TrashFolders.Node) {
        guard let folders = trashFolders, let node = folders.node(id) else { throw .staleNFSFileHandle }
        return (folders, node)
    }

    /// The caller may look inside `uid`'s folder: theirs, or root.
    private func checkOwner(_ req: Request, _ uid: UInt32) throws(Errno) {
        let caller = req.caller.uid
        guard caller == uid || caller == 0 || !SourceRoot.actsForOthers && caller == geteuid() else { throw .permissionDenied }
    }

    private func replyEntry(_ req: Request, _ folders: TrashFolders, _ uid: UInt32, _ kind: TrashFolders.Kind) {
        let id = folders.node(uid, kind)
        var e = fuse_entry_param()
        e.ino = fuse_ino_t(id)
        e.generation = 1
        e.attr = folders.attributes(fuse_ino_t(id), folders.node(fuse_ino_t(id))!)
        req.reply(entry: &e)
    }

    private static let dir = UInt8(DT_DIR)

    /// `files` or `info`, the parts of a folder.
    private static func part(_ name: [UInt8]) -> TrashFolders.Kind? {
        name == Array("files".utf8) ? .files : name == Array("info".utf8) ? .info
            : name == Array("expunged".utf8) ? .expunged : nil
    }

    private static func bytes(_ name: UnsafePointer<CChar>) -> [UInt8] {
        Array(UnsafeRawBufferPointer(start: name, count: strlen(name)))
    }

    func lookupFolder(_ req: Request, _ uid: UInt32) throws(Errno) {
        // An unlink answered a moment ago is in the folder as soon as its owner looks for it.
        if (try? checkOwner(req, uid)) != nil { namespace.landQueued(keptFor: uid) }
        guard let folders = trashFolders, folders.exists(uid) else { throw .noSuchFileOrDirectory }
        replyEntry(req, folders, uid, .folder)
    }

    /// Whether the request is the `TrashAnnouncer`'s, for `name` in `parent`.
    @inline(__always)
    func isAnnouncing(_ req: Request, _ parent: fuse_ino_t, _ name: UnsafePointer<CChar>) -> Bool {
        trashFolders?.announcer?.isAnnouncing(req.caller.pid, parent, name) == true
    }

    func lookup(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        // Absent to the announcer, which then makes the kernel create it.
        if isAnnouncing(req, parent, name) { throw .noSuchFileOrDirectory }
        try answer(req, parent: parent, name: name)
    }

    /// The entry `name` in `parent`, as a lookup finds it (or the `TrashAnnouncer`'s create).
    func answer(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        let (folders, dir) = try folderNode(parent)
        try checkOwner(req, dir.uid)
        namespace.landQueued(keptFor: dir.uid)
        let n = Self.bytes(name)
        switch dir.kind {
        case .folder:
            if let part = Self.part(n), folders.has(dir.uid, part) { return replyEntry(req, folders, dir.uid, part) }
        case .info:
            if folders.infoContents(dir.uid, n) != nil { return replyEntry(req, folders, dir.uid, .infoFile(n)) }
        case .files:
            guard let e = folders.entry(dir.uid, named: n) else { break }
            let anchor = folders.anchor(e.shard)
            let (st, birth) = try namespace.withFD(anchor) { sfd throws(Errno) in try Sys.lstatatWithBirth(sfd, e.id) }
            let node = table.remember(st, birth: birth, parent: anchor, name: e.id)
            var reply = replies.entry(node, st)
            // Names here change as entries come and go: the kernel asks each time.
            reply.entry_timeout = 0
            req.reply(entry: &reply)
            return
        case .infoFile:
            throw .notDirectory
        case .expunged:
            break
        }
        throw .noSuchFileOrDirectory
    }

    func getattr(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        var st = folders.attributes(ino, node)
        req.reply(attr: &st, timeout: 0)
    }

    func setattr(_ req: Request, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>, toSet: Int32) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        try checkOwner(req, node.uid)
        let mode = Int32(FUSE_SET_ATTR_MODE), size = Int32(FUSE_SET_ATTR_SIZE)
        // A truncate also carries the times it sets and, for a caller without
        // CAP_FSETID, the setuid bits to clear: none of them apply to an info file.
        let withSize = Int32(FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW | FUSE_SET_ATTR_CTIME
                             | FUSE_SET_ATTR_KILL_SUID | FUSE_SET_ATTR_KILL_SGID | FUSE_SET_ATTR_KILL_PRIV)
        if case .infoFile(let name) = node.kind, toSet & ~(size | mode | withSize) == 0, toSet & size != 0 {
            try folders.truncateLoose(node.uid, name, to: Int(attr.pointee.st_size))
        } else if toSet != mode || attr.pointee.st_mode & 0o7777 != (node.kind.isDirectory ? 0o700 : 0o600) {
            // trash-cli sets the folder's mode to the 0700 it has: that much is granted.
            throw .notPermitted
        }
        var st = folders.attributes(ino, node)
        req.reply(attr: &st, timeout: 0)
    }

    func access(_ req: Request, _ ino: fuse_ino_t, mask: Int32) throws(Errno) {
        let (_, node) = try folderNode(ino)
        if mask != F_OK { try checkOwner(req, node.uid) }
        req.replyOK()
    }

    func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        try checkOwner(req, node.uid)
        let account = try handleCounts.take(req.caller.uid)
        var handed = false
        defer { if !handed { handleCounts.giveBack(account) } }
        namespace.landQueued(keptFor: node.uid)
        var names: [(name: [UInt8], type: UInt8)] = [([0x2E], Self.dir), ([0x2E, 0x2E], Self.dir)]
        switch node.kind {
        case .folder:
            for (name, part) in [("files", TrashFolders.Kind.files), ("info", .info), ("expunged", .expunged)] where folders.has(node.uid, part) {
                names.append((Array(name.utf8), Self.dir))
            }
        case .files:
            folders.announcer?.watch(node.uid, folders)
            let listing = folders.listing(node.uid)
            for name in listing.names {
                let type: UInt8 = switch listing.entries[name]!.record.kind {
                case .file: UInt8(DT_REG)
                case .directory: Self.dir
                case .symlink: UInt8(DT_LNK)
                case .other: UInt8(DT_UNKNOWN)
                }
                names.append((name, type))
            }
        case .info:
            folders.announcer?.watch(node.uid, folders)
            names += folders.infoNames(node.uid).map { ($0, UInt8(DT_REG)) }
        case .expunged: break
        case .infoFile: throw .notDirectory
        }
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(TrashListing(names, account: account)).toOpaque()))
        handed = true
        req.reply(open: fi)
    }

    func readdir(_ req: Request, size: Int, offset: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>,
                      plus: Bool) throws(Errno) {
        let listing = TrashListing.from(fi)
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: size, alignment: 8)
        defer { buffer.deallocate() }
        let base = buffer.baseAddress!.assumingMemoryBound(to: CChar.self)
        var used = 0
        var i = Int(max(offset, 0))
        while i < listing.names.count {
            let (name, type) = listing.names[i]
            let added: Int = (name + [0]).withUnsafeBufferPointer { n in
                let p = UnsafeRawPointer(n.baseAddress!).assumingMemoryBound(to: CChar.self)
                if plus {
                    // Node id 0: the kernel takes the name and type only.
                    var e = fuse_entry_param()
                    e.attr.st_ino = ino_t(i + 1)
                    e.attr.st_mode = mode_t(type) << 12
                    return fuse_add_direntry_plus(req.raw, base + used, size - used, p, &e, off_t(i + 1))
                }
                var st = stat()
                // Not 0, which readdir(3) skips as a deleted entry; not looked up by it.
                st.st_ino = ino_t(i + 1)
                st.st_mode = mode_t(type) << 12
                return fuse_add_direntry(req.raw, base + used, size - used, p, &st, off_t(i + 1))
            }
            if added > size - used { break }
            used += added
            i += 1
        }
        req.reply(bytes: UnsafeRawBufferPointer(start: buffer.baseAddress, count: used))
    }

    func releasedir(_ req: Request, _ fi: UnsafeMutablePointer<fuse_file_info>) {
        let listing = Unmanaged<TrashListing>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!)
        handleCounts.giveBack(listing.takeUnretainedValue().account)
        listing.release()
        req.replyOK()
    }

    /// mkdir of `.Trash-$uid` (the root's) or of its `files` and `info`, which always exist.
    func mkdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        guard let folders = trashFolders else { throw .notPermitted }
        if let uid = reserved.trashFolderUID(parent, name) {
            try checkOwner(req, uid)
            guard folders.make(uid, gid: req.caller.gid) else { throw .fileExists }
            return replyEntry(req, folders, uid, .folder)
        }
        let (_, dir) = try folderNode(parent)
        try checkOwner(req, dir.uid)
        guard dir.kind == .folder, let part = Self.part(Self.bytes(name)) else { throw .notPermitted }
        guard folders.make(dir.uid, part, gid: req.caller.gid) else { throw .fileExists }
        replyEntry(req, folders, dir.uid, part)
    }

    func rmdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        guard let folders = trashFolders else { throw .notPermitted }
        if let uid = reserved.trashFolderUID(parent, name) {
            try checkOwner(req, uid)
            try folders.remove(uid)
            return req.replyOK()
        }
        let (_, dir) = try folderNode(parent)
        try checkOwner(req, dir.uid)
        guard dir.kind == .files else { throw dir.kind == .folder ? .notPermitted : .notDirectory }
        try empty(req, dir.uid, Self.bytes(name), directory: true)
    }

    func unlink(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        let (folders, dir) = try folderNode(parent)
        try checkOwner(req, dir.uid)
        let n = Self.bytes(name)
        switch dir.kind {
        case .files: try empty(req, dir.uid, n, directory: false)
        case .info:
            if folders.removeLoose(dir.uid, n) { return req.replyOK() }
            // Removing an entry's info file gives the entry up with it.
            guard n.count > TrashFolders.suffix.count, n.suffix(TrashFolders.suffix.count).elementsEqual(TrashFolders.suffix),
                  let e = folders.entry(dir.uid, named: Array(n.dropLast(TrashFolders.suffix.count))) else {
                throw .noSuchFileOrDirectory
            }
            _ = control.letGo([e])
            req.replyOK()
        case .folder: throw .notPermitted
        case .infoFile: throw .notDirectory
        case .expunged: throw .noSuchFileOrDirectory
        }
    }

    /// Deleting `files/name`: the entry leaves the window and the reaper
    /// frees it at once. Its info file stays (loose) for the client to remove.
    /// `directory`: whether rmdir (true) or unlink (false) asked; nil for a move into `expunged`.
    private func empty(_ req: Request, _ uid: UInt32, _ name: [UInt8], directory: Bool?) throws(Errno) {
        guard let folders = trashFolders, let e = folders.entry(uid, named: name) else { throw .noSuchFileOrDirectory }
        if let directory, directory != (e.record.kind == .directory) { throw directory ? .notDirectory : .isDirectory }
        guard control.letGo([e]).count == 1 else { throw .noSuchFileOrDirectory }
        folders.leaveInfo(uid, name, of: e)
        req.replyOK()
    }

    /// rename into, out of, or inside the trash folders: `files/NAME` out
    /// restores it; a file into `files/` deletes it into the window.
    func rename(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, newParent: fuse_ino_t,
                     newName: UnsafePointer<CChar>, flags: UInt32) throws(Errno) {
        guard let folders = trashFolders else { throw .notPermitted }
        if flags & ~VANISH_RENAME_NOREPLACE != 0 { throw .invalidArgument }
        let from = TrashFolders.owns(parent) ? folders.node(parent) : nil
        let to = TrashFolders.owns(newParent) ? folders.node(newParent) : nil
        if let from, let to, from.kind == .files, to.kind == .expunged, from.uid == to.uid {
            try checkOwner(req, from.uid)
            return try empty(req, from.uid, Self.bytes(name), directory: nil)
        }
        if let from, to == nil, from.kind == .files {
            try checkOwner(req, from.uid)
            return try restore(req, folders, from.uid, Self.bytes(name), to: inode(newParent), newName,
                                    replacing: flags & VANISH_RENAME_NOREPLACE == 0)
        }
        if let to, from == nil, !TrashFolders.owns(parent), to.kind == .files {
            try checkOwner(req, to.uid)
            return try put(req, folders, inode(parent), name, into: to.uid, as: Self.bytes(newName))
        }
        throw .notPermitted
    }

    /// `replacing`: a plain rename, which replaces what the new name holds
    /// (that goes to the graveyard as the caller's deletion, as a rename
    /// over it through the mount does); with RENAME_NOREPLACE, EEXIST.
    private func restore(_ req: Request, _ folders: TrashFolders, _ uid: UInt32, _ name: [UInt8],
                              to np: Inode, _ newName: UnsafePointer<CChar>, replacing: Bool) throws(Errno) {
        guard let e = folders.entry(uid, named: name) else { throw .noSuchFileOrDirectory }
        try entries.checkChangeable(np, newName)
        changes.awaitEarlierChanges(req)
        let caller = req.caller
        let who = Credentials(uid: caller.uid, gid: caller.gid, groups: caller.uid == 0 ? [] : req.groups())
        let path = table.path(of: np, appending: newName)
        try namespace.withFD(np) { npfd throws(Errno) in
            var replaced = false
            while true {
                do throws(MountControl.PutBackFailure) {
                    try control.putBack(e, into: npfd, leaf: newName, path: path, as: who, byRename: true)
                    return
                } catch {
                    switch error {
                    case .gone: throw .noSuchFileOrDirectory
                    case .taken where replacing && !replaced:
                        try removeReplaced(req, np, npfd, newName, by: e.record.kind == .directory)
                        replaced = true
                    case .taken: throw .fileExists
                    case .failed(let errno): throw errno
                    }
                }
            }
        }
        folders.leaveInfo(uid, name, of: e)
        req.replyOK()
    }

    /// What `newName` in `np` holds, replaced by a restore by rename: buried
    /// as the caller's deletion, with rename's rules (a directory only by a
    /// directory, and only empty; a file only by a non-directory). The kernel
    /// checked the caller may remove it, as for any rename over a name.
    private func removeReplaced(_ req: Request, _ np: Inode, _ npfd: Int32, _ newName: UnsafePointer<CChar>,
                                by directory: Bool) throws(Errno) {
        let caller = req.caller
        let target = try Sys.lstatat(npfd, newName)
        let isDirectory = target.st_mode & S_IFMT == S_IFDIR
        if directory != isDirectory { throw directory ? .notDirectory : .isDirectory }
        if isDirectory {
            let (id, st) = try changes.removingDirectory(npfd, newName)
            try deleter.removeDirectory(parent: np, parentFD: npfd, name: newName, caller: caller,
                                        groups: { req.groups() }, known: st)
            changes.deleted(req, parent: np, name: newName, mode: S_IFDIR, id: id, tree: false, entry: nil)
        } else {
            let id = changes.removing(npfd, newName, target)
            // At once, not after the reply: the name must be free for the restore.
            _ = try deleter.bury(npfd, newName, st: target, from: np, caller: caller)
            changes.deleted(req, parent: np, name: newName, mode: target.st_mode, id: id, tree: false, entry: nil)
        }
    }

    /// `name` in `p` into the trash as `files/newName`: deleted as by unlink
    /// (a directory as by `vanish rm -r`, whole), and kept whatever the
    /// window's exclusions, since its user asked for the trash.
    private func put(_ req: Request, _ folders: TrashFolders, _ p: Inode, _ name: UnsafePointer<CChar>,
                          into uid: UInt32, as newName: [UInt8]) throws(Errno) {
        let caller = req.caller
        try entries.removingEntry(req, p, name) { pfd, st throws(Errno) in
            let directory = st.st_mode & S_IFMT == S_IFDIR
            // Moving a directory to another parent rewrites its "..": the caller
            // must be allowed to write it. Asked as the caller of the very inode,
            // which the burial then moves or puts back (`checked`): a directory
            // exchanged onto the name on the source since the kernel's own check
            // is not moved with the daemon's rights.
            if directory, let credentials = entries.callerCredentials(req, caller) {
                let fd = OwnedDescriptor(try Sys.openat(pfd, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW))
                let opened = try Sys.fstat(fd.raw)
                guard opened.st_dev == st.st_dev, opened.st_ino == st.st_ino else { throw .staleNFSFileHandle }
                try Credentials.acting(credentials) { () throws(Errno) in try Sys.access(fd.raw, W_OK) }
            }
            let id = directory ? (try changes.removingDirectory(pfd, name)).id : changes.removing(pfd, name, st)
            let record = TrashRecord(path: table.path(of: p, appending: name), uid: uid, gid: caller.gid,
                                     bytes: directory ? nil : Sys.diskBytes(st), kind: TrashRecord.Kind(mode: st.st_mode),
                                     from: directory ? p.origin : nil)
            guard let grave = try deleter.putInTrash(pfd, name, st: st, from: p, record: record, caller: caller,
                                                     groups: { req.groups() }) else { throw .notSupported }
            folders.chose(newName, for: grave.id, of: uid)
            _ = folders.removeLoose(uid, newName + TrashFolders.suffix)
            // The kernel now holds the file as files/newName: reopen it there.
            table.moved(st, to: folders.anchor(grave.shard), name: grave.id)
            changes.deleted(req, parent: p, name: name, mode: st.st_mode, id: id, tree: directory, entry: grave.id)
        }
        req.replyOK()
    }

    /// create of an info file (`info/NAME.trashinfo`), as clients write one before moving its file in.
    func create(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>,
                     _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let (folders, dir) = try folderNode(parent)
        try checkOwner(req, dir.uid)
        let n = Self.bytes(name)
        guard dir.kind == .info, n.count > TrashFolders.suffix.count,
              n.suffix(TrashFolders.suffix.count).elementsEqual(TrashFolders.suffix) else { throw .notPermitted }
        guard try folders.makeLoose(dir.uid, n) else {
            if fi.pointee.flags & O_EXCL != 0 || !folders.isLoose(dir.uid, n) { throw .fileExists }
            return try openCreated(req, folders, dir.uid, n, fi)
        }
        try openCreated(req, folders, dir.uid, n, fi)
    }

    private func openCreated(_ req: Request, _ folders: TrashFolders, _ uid: UInt32, _ name: [UInt8],
                                  _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if fi.pointee.flags & O_TRUNC != 0 { try folders.truncateLoose(uid, name, to: 0) }
        let id = folders.node(uid, .infoFile(name))
        var e = fuse_entry_param()
        e.ino = fuse_ino_t(id)
        e.generation = 1
        e.attr = folders.attributes(fuse_ino_t(id), folders.node(fuse_ino_t(id))!)
        fi.pointee.fh = 0
        fi.pointee.direct_io = 1
        req.reply(created: &e, fi)
    }

    func open(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        try checkOwner(req, node.uid)
        guard case .infoFile(let name) = node.kind else { throw .isDirectory }
        if fi.pointee.flags & O_ACCMODE != O_RDONLY || fi.pointee.flags & O_TRUNC != 0 {
            guard folders.isLoose(node.uid, name) else { throw .permissionDenied }
            if fi.pointee.flags & O_TRUNC != 0 { try folders.truncateLoose(node.uid, name, to: 0) }
        }
        fi.pointee.fh = 0
        fi.pointee.direct_io = 1
        req.reply(open: fi)
    }

    func read(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        guard case .infoFile(let name) = node.kind else { throw .isDirectory }
        guard let bytes = folders.infoContents(node.uid, name) else { throw .staleNFSFileHandle }
        let start = min(Int(max(offset, 0)), bytes.count), end = min(start + size, bytes.count)
        bytes[start..<end].withUnsafeBytes { req.reply(bytes: $0) }
    }

    func write(_ req: Request, _ ino: fuse_ino_t, _ buf: UnsafeMutablePointer<fuse_bufvec>, offset: off_t) throws(Errno) {
        let (folders, node) = try folderNode(ino)
        guard case .infoFile(let name) = node.kind else { throw .isDirectory }
        let size = fuse_buf_size(buf)
        guard size <= TrashFolders.looseLimit else { throw .fileTooLarge }
        let memory = UnsafeMutableRawBufferPointer.allocate(byteCount: max(size, 1), alignment: 8)
        defer { memory.deallocate() }
        var into = fuse_bufvec()
        into.count = 1
        into.buf.size = size
        into.buf.mem = memory.baseAddress
        into.buf.fd = -1
        let n = fuse_buf_copy(&into, buf, fuse_buf_copy_flags(rawValue: 0))
        if n < 0 { throw Errno(rawValue: Int32(-n)) }
        try folders.writeLoose(node.uid, name, UnsafeRawBufferPointer(rebasing: memory[..<n]), at: Int(offset))
        req.reply(written: n)
    }
}

extension TrashFolders.Kind {
    var isDirectory: Bool {
        if case .infoFile = self { return false }
        return true
    }
}
