import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import SystemPackage


/// The handlers of names: finding, making, linking, renaming and removing
/// entries. New entries are made as their caller (`asCaller`), removed
/// ones go to the graveyard (`Deleter`), and every change is told to
/// `changes` with its request.
struct EntryHandlers: Sendable {
    let namespace: BackingNamespace
    let replies: EntryReplies
    let changes: any ChangeObserver
    let deleter: Deleter
    /// Where the kernel is told to drop an inode's attributes.
    let invalidations: EntryInvalidations
    /// For create and O_TMPFILE, which make open handles.
    let files: FileHandlers
    let statahead: Statahead
    /// What the kernel agreed to at INIT (whether it leaves the umask to us).
    let kernel: KernelTerms
    /// How long the kernel may remember that a name is absent (0: not at all).
    let negativeTimeout: Double
    /// `readdirplus=walk`: lookups tell which listings want attributes.
    let lookupsTellWalks: Bool
    let log: Logger

    var table: InodeTable { namespace.table }

    @inline(__always)
    private func inode(_ id: fuse_ino_t) -> Inode { table.inode(id) }

    /// LOOKUP of a name ("." and ".." come only for file handles, and go to
    /// `ExportedHandles.lookup`).
    func lookup(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        let p = inode(parent)
        let (st, birth, generation): (stat, UInt64, UInt32?)
        do throws(Errno) {
            // The state directory does not exist as far as the mount is concerned.
            if deleter.isStateDirectory(p, name) { throw Errno.noSuchFileOrDirectory }
            (st, birth, generation) = try namespace.atName(p, name) { pfd throws(Errno) in
                let (st, birth) = try Sys.lstatatWithBirth(pfd, name)
                return (st, birth, replies.generationForID(pfd, name, st, birth: birth))
            }
        } catch .noSuchFileOrDirectory where negativeTimeout > 0 {
            // A negative entry: the kernel remembers the name is absent, which
            // spares compilers and shells a round trip per failed probe.
            var e = fuse_entry_param()
            e.entry_timeout = replies.cacheTimeout(p)
            req.reply(entry: &e)
            return
        }
        if st.st_dev != p.key.dev { noteCrossing(into: st, at: name) }
        let node = table.remember(st, birth: birth, parent: p, name: name, lookedUp: lookupsTellWalks,
                                  generation: generation)
        changes.sawDirectory(node, st)
        var e = replies.entry(node, st)
        req.reply(entry: &e)
        // Files only: a names-only walk looks up directories, never files.
        if st.st_mode & S_IFMT != S_IFDIR { statahead.lookedUp(name, in: p) }
    }

    func forget(_ ino: fuse_ino_t, count: UInt64) {
        let node = inode(ino)
        if table.forget(node, count: count) { namespace.drop(node) }
    }

    func mkdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t) throws(Errno) {
        try makeEntry(req, parent: parent, name: name) { pfd throws(Errno) in try Sys.mkdirat(pfd, name, mode) }
    }

    func mknod(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t,
                      rdev: dev_t) throws(Errno) {
        try makeEntry(req, parent: parent, name: name) { pfd throws(Errno) in try Sys.mknodat(pfd, name, mode, rdev) }
    }

    func symlink(_ req: Request, target: UnsafePointer<CChar>, parent: fuse_ino_t,
                        name: UnsafePointer<CChar>) throws(Errno) {
        try makeEntry(req, parent: parent, name: name) { pfd throws(Errno) in try Sys.symlinkat(target, pfd, name) }
    }

    /// Makes an entry with `make`, run as the caller (`asCaller`), and
    /// replies with it. Nothing is chowned afterwards: the backing kernel
    /// gave it its owner and group as it made it.
    private func makeEntry(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>,
                           _ make: (Int32) throws(Errno) -> Void) throws(Errno) {
        let p = inode(parent)
        try checkChangeable(p, name)
        let caller = req.caller
        try namespace.making(p, name) { pfd throws(Errno) -> (Inode, stat) in
            try deleter.makingRoom { () throws(Errno) in try asCaller(req, caller) { () throws(Errno) in try make(pfd) } }
            let fd = OwnedDescriptor(try namespace.retryingOnFDExhaustion { () throws(Errno) in
                try Sys.openat(pfd, name, VANISH_O_PATH | O_NOFOLLOW)
            })
            let (st, birth) = try Sys.fstatWithBirth(fd.raw)
            let made = madeIdentity(fd.raw, st, birth: birth)
            let node = table.remember(st, birth: birth, parent: p, name: name, generation: made.generation)
            if let id = made.id { _ = table.fileID(of: node) { id } }
            changes.sawDirectory(node, st)
            changes.created(req, parent: p, name: name, node: node, st: st, fd: fd.raw)
            namespace.adopt(node, fd: fd.take())
            return (node, st)
        } answer: { (node, st) in
            var e = replies.entry(node, st)
            req.reply(entry: &e)
        }
    }

    func link(_ req: Request, _ ino: fuse_ino_t, newParent: fuse_ino_t,
                     newName: UnsafePointer<CChar>) throws(Errno) {
        let node = inode(ino)
        let np = inode(newParent)
        try checkChangeable(np, newName)
        // A kept entry seen through the desktop trash gets no other name: emptying it would free nothing.
        if table.isInTrash(node) { throw .notPermitted }
        try namespace.making(np, newName) { npfd throws(Errno) -> (Inode, stat) in
            let unnamed = table.isUnnamed(node)
            let target = changes.linking(node, unnamed: unnamed)
            try namespace.withFD(node) { fd throws(Errno) in
                try asCaller(req, req.caller, umask: false) { () throws(Errno) in try Sys.link(fd: fd, npfd, newName) }
            }
            let (st, birth) = try Sys.lstatatWithBirth(npfd, newName)
            let linked = table.remember(st, birth: birth, parent: np, name: newName,
                                        generation: replies.generationForID(npfd, newName, st, birth: birth))
            changes.linked(req, parent: np, name: newName, parentFD: npfd, node: linked, st: st,
                           target: target, unnamed: unnamed)
            return (linked, st)
        } answer: { (linked, st) in
            var e = replies.entry(linked, st)
            req.reply(entry: &e)
        }
    }

    func unlink(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        let p = inode(parent)
        if table.isInTrash(p) { return try removeInTrash(req, p, name, directory: false) }
        let caller = req.caller
        try removingEntry(req, p, name) { pfd, st throws(Errno) in
            let id = changes.removing(pfd, name, st)
            let deferred = try deleter.removeFile(parent: p, parentFD: pfd, name: name, st: st, caller: caller)
            changes.deleted(req, parent: p, name: name, mode: st.st_mode, id: id, tree: false, entry: nil)
            req.replyOK()
            // Kept in an undo window, a hard-linked file's link count does not
            // drop, where the kernel dropped its own copy on the answer.
            if st.st_nlink > 1, deleter.undoWindow > 0, let node = table.known(st) {
                invalidations.attributes(of: table.nodeID(node), wait: false)
            }
            // The caller's next request runs on another handler thread meanwhile.
            if let burial = consume deferred { deleter.afterReply(burial, parent: p, parentFD: pfd, name: name, caller: caller) }
        }
    }

    func rmdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        let p = inode(parent)
        if table.isInTrash(p) { return try removeInTrash(req, p, name, directory: true) }
        try checkChangeable(p, name)
        changes.awaitEarlierChanges(req)
        let caller = req.caller
        try namespace.removing(p, name) { pfd throws(Errno) in
            let (id, st) = try changes.removingDirectory(pfd, name)
            try deleter.removeDirectory(parent: p, parentFD: pfd, name: name, caller: caller, groups: { req.groups() },
                                        known: st)
            changes.deleted(req, parent: p, name: name, mode: S_IFDIR, id: id, tree: false, entry: nil)
        }
        req.replyOK()
    }

    func rename(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, newParent: fuse_ino_t,
                       newName: UnsafePointer<CChar>, flags: UInt32) throws(Errno) {
        let p = inode(parent)
        let np = inode(newParent)
        try checkChangeable(p, name)
        try checkChangeable(np, newName)
        changes.awaitEarlierChanges(req)
        let caller = req.caller
        let exchange = flags & VANISH_RENAME_EXCHANGE != 0
        // The move is the caller's, checked by the kernel as they make it: an
        // entry exchanged onto the name on the source since the kernel's
        // own check moves only where the caller could move it.
        let credentials = callerCredentials(req, caller)
        try namespace.renaming(p, name, np, newName, exchange: exchange) { pfd, npfd throws(Errno) in
            // Most renames replace nothing: try that first, which spares
            // them the lstat of the new name.
            var target: stat? = nil
            if try !renameIfFree(pfd, name, npfd, newName, flags: flags, as: credentials) {
                // What the new name holds now: a file it replaces goes to the
                // graveyard, and the event says it was replaced.
                target = exchange ? nil : try? Sys.lstatat(npfd, newName)
                try deleter.replace(pfd, name, npfd, newName, target: target, flags: flags, newParent: np, caller: caller,
                                    as: credentials)
            }
            // Keep the moved inode reachable under its new name (and the
            // other one, for an exchange) so its fd can be reopened later.
            let st = try? Sys.lstatat(npfd, newName)
            let moved = st.flatMap { table.moved($0, to: np, name: newName) }
            if flags & VANISH_RENAME_EXCHANGE != 0, let st = try? Sys.lstatat(pfd, name) {
                table.moved(st, to: p, name: name)
            }
            changes.renamed(req, from: p, name, to: np, newName, newParentFD: npfd, moved: moved, st: st,
                            exchange: exchange, replaced: target != nil)
        } answer: {
            req.replyOK()
        }
    }

    func create(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t,
                       _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let p = inode(parent)
        try checkChangeable(p, name)
        let flags = files.openFlags.backing(fi.pointee.flags)
        let caller = req.caller
        try files.openFiles.shares.take(caller.uid)
        var handed = false
        defer { if !handed { files.openFiles.shares.giveBack(caller.uid) } }
        try namespace.making(p, name) { pfd throws(Errno) -> (Int32, Inode, stat) in
            // O_EXCL: only a file this call makes is opened, so one renamed
            // onto the name on the source meanwhile is never opened with
            // the daemon's rights; O_NOFOLLOW refuses a symlink raced into place.
            let fd: Int32
            do throws(Errno) {
                fd = try deleter.makingRoom { () throws(Errno) in
                    try namespace.retryingOnFDExhaustion { () throws(Errno) in
                        try asCaller(req, caller) { () throws(Errno) in
                            try Sys.openat(pfd, name, flags | O_CREAT | O_EXCL | O_NOFOLLOW, mode)
                        }
                    }
                }
            } catch .fileExists where fi.pointee.flags & O_EXCL == 0 {
                // The kernel believed the name absent, but it was made on the
                // source since. ESTALE makes the kernel walk the path again
                // with a fresh LOOKUP, then open what is there as an open
                // checked with the caller's rights, as natively.
                throw .staleNFSFileHandle
            }
            let owned = OwnedDescriptor(fd)
            let (st, birth) = try Sys.fstatWithBirth(fd)
            let made = madeIdentity(fd, st, birth: birth)
            let node = table.remember(st, birth: birth, parent: p, name: name, generation: made.generation)
            node.madeBy.store(caller.pid, ordering: .relaxed)
            if let id = made.id { _ = table.fileID(of: node) { id } }
            changes.created(req, parent: p, name: name, node: node, st: st, fd: fd)
            return (owned.take(), node, st)
        } answer: { (fd, node, st) in
            handed = true
            let backing = files.opened(node, fd: fd, flags: flags, caller: caller, stat: st, fi, req)
            var e = replies.entry(node, st)
            if req.reply(created: &e, fi, backing: backing) == -ENOENT { files.abandonHandle(node, fi) }
        }
    }

    /// `open(O_TMPFILE)`: a file with no name in `parent`, made in the
    /// backing directory the same way and given to the caller as a create
    /// would. It has no name to be reopened by, so its fd stays held while it
    /// is open (as for an open file whose last name was removed); `linkat`
    /// gives it one (`link`), and unlinked it goes with its last close, as
    /// natively. No event until then: nothing in the tree changed.
    func tmpfile(_ req: Request, parent: fuse_ino_t, mode: mode_t,
                        _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let p = inode(parent)
        if table.isBuried(p) { throw .noSuchFileOrDirectory }
        let flags = (files.openFlags.backing(fi.pointee.flags) & ~O_CREAT) | VANISH_O_TMPFILE
        let caller = req.caller
        try files.openFiles.shares.take(caller.uid)
        var handed = false
        defer { if !handed { files.openFiles.shares.giveBack(caller.uid) } }
        let (fd, node, st) = try namespace.withFD(p) { pfd throws(Errno) -> (Int32, Inode, stat) in
            let fd = OwnedDescriptor(try namespace.retryingOnFDExhaustion { () throws(Errno) in
                try asCaller(req, caller) { () throws(Errno) in try Sys.openat(pfd, ".", flags, mode) }
            })
            let (st, birth) = try Sys.fstatWithBirth(fd.raw)
            let pathFD = try Sys.withProcPath(fd.raw) { path throws(Errno) in try Sys.open(path, VANISH_O_PATH) }
            // No name: a reopen by name finds nothing (ENOENT), never another file.
            let node = table.remember(st, birth: birth, parent: p, name: "",
                                      generation: replies.generationForID(fd.raw, nil, st, birth: birth))
            namespace.adopt(node, fd: pathFD)
            return (fd.take(), node, st)
        }
        handed = true
        let backing = files.opened(node, fd: fd, flags: flags, caller: caller, stat: st, fi, req)
        _ = namespace.holdIfOpen(node)
        var e = replies.entry(node, st)
        if req.reply(created: &e, fi, backing: backing) == -ENOENT { files.abandonHandle(node, fi) }
    }

    /// Logs the first crossing into each filesystem mounted inside the source.
    private func noteCrossing(into st: stat, at name: UnsafePointer<CChar>) {
        guard replies.devices.index(of: st.st_dev).new else { return }
        log.info("serving a filesystem mounted inside the source (inode numbers remapped, renames across give EXDEV)",
                 metadata: ["at": "\(String(cString: name))", "dev": "\(st.st_dev)"])
    }
}

// Where new entries get their owner, and what may be changed at all.
extension EntryHandlers {
    /// A file just made through the mount (`fd` opens it): the generation
    /// its new node carries (as `generationForID`) and, when events carry
    /// ids, its event id, from one name_to_handle_at rather than one each.
    func madeIdentity(_ fd: Int32, _ st: stat, birth: UInt64) -> (generation: UInt32?, id: String?) {
        let codec = table.codec.flatMap { table.wantsGeneration(st, birth: birth) ? $0 : nil }
        let ids = changes.recordsIDs
        guard codec != nil || ids else { return (nil, nil) }
        return FileID.withHandle(fd, nil) { handle in
            guard let handle else { return (nil, nil) }
            return (codec?.generation(of: handle, ino: UInt64(st.st_ino)), ids ? FileID.hex(handle) : nil)
        }
    }

    /// A plain rename done as renameat2(RENAME_NOREPLACE): true if it
    /// happened; false if the new name exists, or the filesystem lacks the
    /// flag (EINVAL, as for an invalid rename), and the caller must look at
    /// what the new name holds. The check and the rename are one step, so a
    /// true answer cannot be stale.
    func renameIfFree(_ pfd: Int32, _ name: UnsafePointer<CChar>, _ npfd: Int32, _ newName: UnsafePointer<CChar>,
                      flags: UInt32, as credentials: Credentials?) throws(Errno) -> Bool {
        guard flags == 0 else { return false }
        do throws(Errno) {
            try Credentials.acting(credentials) { () throws(Errno) in
                try Sys.renameat2(pfd, name, npfd, newName, VANISH_RENAME_NOREPLACE)
            }
            return true
        } catch .fileExists {
            return false
        } catch .invalidArgument {
            return false
        }
    }

    /// `body` with `p`'s fd and the lstat of `name` in it, for a request that
    /// takes `name` away whole (unlink, a move into the desktop trash), once
    /// the name may change, earlier changes are recorded, and the entry is
    /// neither immutable nor append-only: checked here, not left to the
    /// rename, which may come after the reply.
    func removingEntry<R>(_ req: Request, _ p: Inode, _ name: UnsafePointer<CChar>,
                          _ body: (Int32, stat) throws(Errno) -> R) throws(Errno) -> R {
        try checkChangeable(p, name)
        changes.awaitEarlierChanges(req)
        return try namespace.removing(p, name) { pfd throws(Errno) in
            let (st, protected) = try Sys.lstatatProtected(pfd, name)
            if protected { throw .notPermitted }
            return try body(pfd, st)
        }
    }

    /// unlink or rmdir inside an entry seen through the desktop trash
    /// (emptying it file by file, as `trash-empty` and file managers do): the
    /// name goes for good, removed as the caller, so the kernel decides.
    private func removeInTrash(_ req: Request, _ p: Inode, _ name: UnsafePointer<CChar>, directory: Bool) throws(Errno) {
        let caller = req.caller
        try namespace.removing(p, name) { pfd throws(Errno) in
            try asCaller(req, caller, umask: false) { () throws(Errno) in
                try Sys.unlinkat(pfd, name, directory ? AT_REMOVEDIR : 0)
            }
        }
        // What the entry holds changed: trash list measures it again.
        if let entry = table.trashEntry(of: p) { deleter.graveyard?.forgetExtent(entry) }
        req.replyOK()
    }

    /// Refuses making, removing or renaming `name` in `parent` when it is
    /// the state directory's name (EPERM), or when `parent` is in a tree
    /// `vanish rm` removed (ENOENT, as in a directory removed while a
    /// process was inside it).
    @inline(__always)
    func checkChangeable(_ parent: Inode, _ name: UnsafePointer<CChar>) throws(Errno) {
        if deleter.isStateDirectory(parent, name) { throw .notPermitted }
        if table.isBuried(parent) { throw .noSuchFileOrDirectory }
    }

    /// Runs `make`, which makes a file for `caller`, with the caller's umask
    /// where the kernel left it to the daemon: the backing filesystem applies
    /// it, or the directory's default ACL in its place, as natively.
    @inline(__always)
    func withCallersUmask<R>(_ caller: Caller, _ make: () throws(Errno) -> R) throws(Errno) -> R {
        guard caller.umask != 0 && kernel.leavesUmask.load(ordering: .relaxed) else { return try make() }
        return try Credentials.withUmask(caller.umask, make)
    }

    /// Runs `body`, which makes or links an entry for the request's caller,
    /// as that caller: on a root daemon serving others, with the caller's
    /// fsuid, fsgid and supplementary groups on this thread alone, so the
    /// backing kernel checks the directory at the moment of the call and
    /// gives the entry its owner and group (a setgid directory's included);
    /// with `umask`, the caller's umask where the kernel left it to the daemon.
    /// A daemon run by an ordinary user cannot switch: it serves only its
    /// user, or with allow_other makes entries as its user, as bindfs does.
    @inline(__always)
    func asCaller<R>(_ req: Request, _ caller: Caller, umask: Bool = true,
                     _ body: () throws(Errno) -> R) throws(Errno) -> R {
        guard let credentials = callerCredentials(req, caller) else {
            return umask ? try withCallersUmask(caller, body) : try body()
        }
        return try credentials.acting { () throws(Errno) -> R in
            umask ? try withCallersUmask(caller, body) : try body()
        }
    }

    /// The caller's identity for `Credentials.acting`; nil where the daemon
    /// acts as itself (it serves only its own user, or the caller is root).
    func callerCredentials(_ req: Request, _ caller: Caller) -> Credentials? {
        guard SourceRoot.actsForOthers, caller.uid != 0 || caller.gid != 0 else { return nil }
        // Root's capabilities pass every check its groups could change.
        return Credentials(uid: caller.uid, gid: caller.gid, groups: caller.uid == 0 ? [] : req.groups())
    }
}
