import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishClient
import VanishGraveyard

/// In-band controls any program can use through the mount, no socket needed:
///
/// - `setxattr(PATH, "user.vanish.delete", …)` removes PATH, a file or a
///   whole tree, with one rename into the graveyard (what `vanish rm` does);
/// - `getxattr(MOUNT_ROOT, "user.vanish.status")` answers JSON about the
///   graveyard and the reaper (what `vanish status` reads).
/// The mount's own xattr names, compared without allocating.
enum ControlNames {
    static let deleteAttribute = ControlProtocol.deleteAttribute
    static let statusAttribute = ControlProtocol.statusAttribute

    /// True if `name` is the delete trigger.
    @inline(__always)
    static func isDeleteTrigger(_ name: UnsafePointer<CChar>) -> Bool {
        name[0] == 0x75 && strcmp(name, deleteAttribute) == 0
    }

    /// True for either control name (`user.vanish.delete`, `user.vanish.status`):
    /// reserved, never stored in the source.
    @inline(__always)
    static func isControlName(_ name: UnsafePointer<CChar>) -> Bool {
        name[0] == 0x75 && (strcmp(name, deleteAttribute) == 0 || strcmp(name, statusAttribute) == 0)
    }

    @inline(__always)
    static func isStatusQuery(_ ino: fuse_ino_t, _ name: UnsafePointer<CChar>) -> Bool {
        ino == fuse_ino_t(FUSE_ROOT_ID) && name[0] == 0x75 && strcmp(name, statusAttribute) == 0
    }
}

extension VanishFilesystem {
    /// Removes the entry `ino` was last looked up as, a file or a whole
    /// tree, in one step: one rename into the caller's room made with the
    /// caller's credentials, so the kernel decides as it would for `mv` into
    /// another directory, and the request walks nothing (`OneStepBurials`
    /// then checks, in the background, that `rm -r` by the caller would
    /// have emptied it, or puts it back). A file with other hard links is
    /// refused (EMLINK): the request names the inode, not which of its names
    /// the caller meant; a tree with a filesystem mounted inside, EBUSY.
    func deleteByTrigger(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        let node = inode(ino)
        guard node !== table.root else { throw .resourceBusy }
        guard let (parent, name) = table.location(of: node) else { throw .noSuchFileOrDirectory }
        let caller = req.caller
        changes.awaitEarlierChanges(req)
        let permissions = try RemovalCheck(req, caller)
        try name.withUnsafeBufferPointer { n throws(Errno) in
            try namespace.removing(parent, n.baseAddress!) { pfd throws(Errno) in
                let entry = try Sys.lstatat(pfd, n.baseAddress!)
                guard entry.st_dev == node.key.dev, entry.st_ino == node.key.ino else { throw .noSuchFileOrDirectory }
                let isDirectory = entry.st_mode & S_IFMT == S_IFDIR
                if !isDirectory && entry.st_nlink > 1 { throw .tooManyLinks }
                // As rm -r would stop at it: the caller unmounts it first.
                if isDirectory, hasMounts(below: pfd, n.baseAddress!, in: parent) { throw .resourceBusy }
                let id = changes.removing(pfd, n.baseAddress!, entry)
                var grave: String?
                // What the tree holds when the reaper comes is freed with the caller's rights.
                let deletedBy = try deleter.graveyard?.identify(permissions.credentials)
                if let graveyard = deleter.graveyard, let rooms = deleter.rooms, entry.st_dev == graveyard.device {
                    let room = try rooms.room(for: caller.uid, gid: caller.gid)
                    let reservation = graveyard.reserve(by: deletedBy)
                    do throws(Errno) {
                        try graveyard.withName(reservation) { g throws(Errno) in
                            try permissions.acting { () throws(Errno) in try Sys.renameNoReplace(pfd, n.baseAddress!, room, g) }
                        }
                        grave = try graveyard.withName(reservation) { String(cString: $0) }
                        oneStep.add(.init(room: room, reservation: reservation, permissions: permissions, caller: caller,
                                          st: entry, parent: parent, name: name,
                                          record: deleter.trashRecord(entry, parent: parent, name: n.baseAddress!,
                                                                      caller: caller)))
                    } catch .improperLink {
                        // The source's filesystem refuses this move (overlayfs, for a
                        // directory of a lower layer): checked and removed in place below.
                    }
                }
                if grave == nil {
                    // On a filesystem mounted inside the source, without a graveyard,
                    // or where the move was refused with EXDEV: checked here, then
                    // buried, or deleted with the caller's rights.
                    let extent = try permissions.check(pfd, n.baseAddress!, recursive: isDirectory)
                    grave = try deleter.buryTree(pfd, n.baseAddress!, st: entry, from: parent, caller: caller,
                                                 counted: extent, by: deletedBy, as: permissions.credentials)
                }
                if isDirectory { table.markBuried(node) }
                changes.deleted(req, parent: parent, name: n.baseAddress!, mode: entry.st_mode, id: id, tree: true,
                                entry: grave)
            }
        }
        // The path must be gone for everyone once the caller has our answer
        // (a program may make it again next), so the kernel drops it first.
        // That needs the parent's lock, which a later create in it may hold
        // while it waits for this request's event: it need not any more.
        req.doneRecordingChanges()
        // Up to 5 s: under load the parent's lock can be held a second and
        // more by requests queued in it, and answering before the entry is
        // gone would let the caller still find the tree (the model check did).
        if !caches.invalidations.expire(parent: table.nodeID(parent), name: name, deleted: table.nodeID(node), timeout: .seconds(5)) {
            log.warning("answering a delete trigger before the kernel dropped the entry (its parent stayed locked 5 s)")
        }
    }

    /// "on", or "off: " and why (an option, the kernel, the daemon's rights).
    var passthroughState: String {
        if openFiles.passthrough.active { return "on" }
        let why = kernel.passthroughReason.withLock { $0 }
        return why == "on" ? "off: the kernel refused backing files" : why
    }

    /// getxattr of the status name on the root: the status, as JSON, for the caller.
    func replyStatus(_ req: Request, size: Int) throws(Errno) {
        guard var json = statusJSON(for: req.caller.uid) else { throw .noData }
        let count = json.utf8.count
        if size == 0 { req.reply(xattrSize: count); return }
        guard size >= count else { throw .outOfRange }
        json.withUTF8 { req.reply(bytes: UnsafeRawBufferPointer($0)) }
    }

    /// The status attribute's value for `uid` (`StatusReport`): nil before INIT.
    func statusJSON(for uid: uid_t) -> String? {
        guard let transport = kernel.transport.withLock({ $0 }) else { return nil }
        return StatusReport.json(statusFacts(for: uid, transport: transport), for: uid)
    }

    /// What `vanish status` shows `uid`: counts for the whole mount, and
    /// the undo window's entries of `uid` (none listed for root, who gets
    /// the totals), from the per-user index; how requests are served from
    /// the session's `transport`.
    package func statusFacts(for uid: uid_t, transport: Transport) -> StatusFacts {
        let d = deleter
        return StatusFacts(
            place: .init(source: source.path, stateDirectory: d.stateDirectory, graveyard: d.graveyard != nil,
                         socket: control.status.socket, log: control.status.log, client: d.graveyard?.client.name,
                         leaseSeconds: Duration.nanoseconds(d.leases?.length ?? 0).inSeconds, otherClients: d.leases?.peers ?? []),
            reaping: d.reapingFacts(oneStep: oneStep, heldPutBack: control.heldEntriesPutBack),
            undoWindow: d.undoWindowFacts(for: uid),
            serving: .init(knownInodes: table.count, stataheadEntries: caches.statahead.prefetched.load(ordering: .relaxed),
                           cachedFDs: namespace.cachedFDs, fdCacheLimit: namespace.fdLimit,
                           kernelFeatures: "\(transport.granted)", passthrough: passthroughState,
                           spinMicroseconds: transport.spinMicroseconds,
                           cacheSeconds: caches.watch != nil ? SourceWatch.timeout : options.attrTimeout,
                           fileHandles: table.codec != nil ? "exportable" : "while cached", requests: transport.channel))
    }
}
