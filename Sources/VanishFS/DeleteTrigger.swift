import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import SystemPackage
import VanishGraveyard

/// The delete trigger: `setxattr(PATH, "user.vanish.delete", "", 0,
/// XATTR_CREATE | XATTR_REPLACE)` removes PATH, a file or a whole tree, with
/// one rename into the graveyard (what `vanish rm` does), from any program,
/// no socket needed. With other flags the name is stored as data.
struct DeleteTrigger: Sendable {
    let namespace: BackingNamespace
    let changes: any ChangeObserver
    let deleter: Deleter
    /// Trees gone in one step, waiting for their check.
    let oneStep: OneStepBurials
    /// Where the kernel is told to drop the removed name.
    let invalidations: EntryInvalidations
    /// What is mounted inside the source (a tree holding a mount is refused).
    let source: SourceRoot
    /// The mount's own path, where programs may mount on top of its paths too.
    let mountpoint: String?
    /// Directories to remove this way at their next rmdir (`vanish rm -r`).
    let armed: ArmedRemovals
    let log: Logger

    private var table: InodeTable { namespace.table }

    /// Removes the entry `ino` was last looked up as, a file or a whole
    /// tree, in one step: one rename into the caller's room made with the
    /// caller's credentials, so the kernel decides as it would for `mv` into
    /// another directory, and the request walks nothing (`OneStepBurials`
    /// then checks, in the background, that `rm -r` by the caller would
    /// have emptied it, or puts it back). A file with other hard links is
    /// refused (EMLINK): the request names the inode, not which of its names
    /// the caller meant; a tree with a filesystem mounted inside, EBUSY.
    /// `expiring`: the kernel is told to drop the entry before the answer;
    /// an rmdir's caller (`removeArmed`) needs not, the kernel drops it then.
    func delete(_ req: Request, _ ino: fuse_ino_t, expiring: Bool = true) throws(Errno) -> Deleted {
        let node = table.inode(ino)
        guard node !== table.root else { throw .resourceBusy }
        guard let (parent, name) = table.location(of: node) else { throw .noSuchFileOrDirectory }
        // Inside an entry of the desktop trash names are removed for good, one
        // by one, as rm does there: as on a filesystem without the trigger.
        if table.isInTrash(parent) { throw .fileExists }
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
                    let held = try rooms.room(for: caller.uid, gid: caller.gid)
                    let room = held.fd
                    defer { withExtendedLifetime(held) {} }
                    let reservation = graveyard.reserve(by: deletedBy)
                    let record = deleter.trashRecord(entry, parent: parent, name: n.baseAddress!, caller: caller)
                    // Where it came from, for a start after a stop before its check.
                    let origin = record ?? TrashRecord(path: deleter.table.path(of: parent, appending: n.baseAddress!),
                                                       uid: caller.uid, gid: caller.gid, bytes: nil,
                                                       kind: TrashRecord.Kind(mode: entry.st_mode), window: 0)
                    do throws(Errno) {
                        try graveyard.withName(reservation) { g throws(Errno) in
                            // Not a reason to refuse the delete (a full filesystem): without
                            // the note a crash before the check holds the tree under its entry name.
                            do throws(Errno) { try rooms.notePending(caller.uid, g, origin) } catch {
                                log.debug("no note of a one-step delete's origin", metadata: ["error": "\(error)"])
                            }
                            do throws(Errno) {
                                try permissions.acting { () throws(Errno) in try Sys.renameNoReplace(pfd, n.baseAddress!, room, g) }
                            } catch {
                                rooms.settled(caller.uid, g)
                                throw error
                            }
                        }
                        grave = try graveyard.withName(reservation) { String(cString: $0) }
                        oneStep.add(.init(deleterRoom: held, reservation: reservation, permissions: permissions, caller: caller,
                                          st: entry, parent: parent, name: name, record: record))
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
        if !expiring { return Deleted(parent: table.nodeID(parent), name: name, child: table.nodeID(node), uid: caller.uid) }
        // Up to 5 s: under load the parent's lock can be held a second and
        // more by requests queued in it, and answering before the entry is
        // gone would let the caller still find the tree (the model check did).
        if !invalidations.expire(parent: table.nodeID(parent), name: name, by: caller.uid, timeout: .seconds(5)) {
            log.warning("answering a delete trigger before the kernel dropped the entry (its parent stayed locked 5 s)")
        }
        return Deleted(parent: table.nodeID(parent), name: name, child: table.nodeID(node), uid: caller.uid)
    }

    /// rmdir of `name` in `parent` by a thread that armed that very
    /// directory (`ArmedRemovals`): removes it with all it holds, as
    /// `delete`, and answers. False if the thread armed nothing or another
    /// directory: a plain rmdir then.
    func removeArmed(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) -> Bool {
        guard let ino = armed.take(pid: req.caller.pid, uid: req.caller.uid) else { return false }
        let node = table.inode(ino)
        guard let place = table.location(of: node), table.nodeID(place.parent) == parent, !table.isInTrash(place.parent),
              place.name.withUnsafeBufferPointer({ strcmp($0.baseAddress!, name) == 0 }) else { return false }
        _ = try delete(req, ino, expiring: false)
        req.replyOK()
        return true
    }

    /// An entry `delete` removed, for the kernel to hear of once the request is answered.
    struct Deleted {
        let parent: fuse_ino_t
        let name: ContiguousArray<CChar>
        let child: fuse_ino_t
        /// Whose delete it was, whom its notice is charged to.
        let uid: UInt32
    }

    /// After the answer to `delete`: the kernel drops the entry for good
    /// and tells its watchers (see `EntryInvalidations.deleted`).
    func answered(_ d: Deleted) {
        invalidations.deleted(parent: d.parent, name: d.name, child: d.child, by: d.uid)
    }

    /// Whether a filesystem is mounted anywhere below the directory `name`
    /// in `parentFD` (the inode `parent`): on the source, or on top of the
    /// mount's own paths, which a program can mount on as well. A rename
    /// takes mounts on the source along, so a tree buried whole would carry
    /// one into the graveyard, where the reaper must not cross into it; one
    /// on the mount's path would be detached when the kernel forgets the
    /// name. `rm -r` stops at either (EBUSY).
    private func hasMounts(below parentFD: Int32, _ name: UnsafePointer<CChar>, in parent: Inode) -> Bool {
        if let mountpoint {
            var prefix = Self.mountinfoEscaped(Array(mountpoint.utf8))
            if prefix.last != 0x2F { prefix.append(0x2F) }
            prefix += Self.mountinfoEscaped(table.path(of: parent, appending: name))
            prefix.append(0x2F)
            if source.mounts.any(startingWith: prefix) { return true }
        }
        // A private copy of the source's mount holds no other mount, and its
        // fds' paths are not the namespace's.
        if source.isPrivateMount { return false }
        // The directory's path as mountinfo prints it, with a slash after.
        var link = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let n = (try? Sys.withProcPath(parentFD) { path throws(Errno) in
            let r = link.withUnsafeMutableBytes { Glibc.readlink(path, $0.baseAddress!, $0.count - 1) }
            if r < 0 { throw Errno(rawValue: errno) }
            return r
        }) ?? -1
        guard n > 0 else { return false }
        var prefix = Self.mountinfoEscaped(link[..<n])
        if prefix.last != 0x2F { prefix.append(0x2F) }
        prefix += Self.mountinfoEscaped(UnsafeRawBufferPointer(start: name, count: strlen(name)))
        prefix.append(0x2F)
        return source.mounts.any(startingWith: prefix)
    }

    /// `bytes` as /proc/self/mountinfo prints a path: space, tab, newline
    /// and backslash as octal escapes.
    private static func mountinfoEscaped(_ bytes: some Sequence<UInt8>) -> [UInt8] {
        var out: [UInt8] = []
        for b in bytes {
            switch b {
            case 0x20, 0x09, 0x0A, 0x5C: out += [0x5C, 0x30 + (b >> 6), 0x30 + ((b >> 3) & 7), 0x30 + (b & 7)]
            default: out.append(b)
            }
        }
        return out
    }
}
