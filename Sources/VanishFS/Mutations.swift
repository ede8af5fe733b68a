import FUSEKit
import CLinux
import Glibc
import Synchronization
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

// The one place where entries leave the backing directory: removed, replaced
// by a rename, or buried in the graveyard (instant delete).
extension Deleter {
    /// Removes the file `name` from the directory `parentFD` (the inode `parent`).
    ///
    /// unlink is one rename into the graveyard, so the caller never waits for
    /// data to be freed, except where unlinking frees no data anyway and a
    /// graveyard link would show: a file with other hard links (their
    /// st_nlink must drop now) or one programs hold open (fstat must say
    /// st_nlink 0; its space returns at the last close, as POSIX says).
    /// Within an undo window a file with other hard links that the window
    /// keeps is buried like any other, as a desktop trash moves it:
    /// restoring the directory it was in (a `git clone`'s objects) must
    /// bring it back.
    /// An empty file is unlinked in place too unless there is an undo
    /// window, as rmdir is: burying it would cost a rename now and the
    /// reaper's unlink later, to free nothing. (Not "no blocks": ext4 can
    /// report st_blocks 0 for a file whose data is being written back.)
    /// Usually the rename or unlink waits until the caller has its answer:
    /// then a `DeferredBurial` comes back, for `afterReply`.
    /// `st` is the entry's lstat.
    func removeFile(parent: Inode, parentFD: Int32, name: UnsafePointer<CChar>, st: stat,
                    caller: Caller) throws(Errno) -> DeferredBurial? {
        if st.st_mode & S_IFMT == S_IFDIR { throw .isDirectory }
        let freesNothing = st.st_size == 0 && undoWindow == 0
        // Buried only if the window keeps it: a graveyard link the reaper
        // frees at once would show in st_nlink meanwhile for nothing.
        let linked = st.st_nlink > 1
            && (undoWindow == 0 || !keeps(st, name, by: caller))
        // On a filesystem short of space the data goes now, kept or not: the
        // window would give it up at once anyway.
        let freesNow = !freesNothing && st.st_dev == graveyard?.device
            && (reaper?.freesAtOnce(bytes: UInt64(st.st_blocks) * 512, keeping: undoWindow > 0) ?? false)
        if linked || holdIfOpen(st) || freesNow {
            if !freesNow { keepRestorable(parentFD, name, st: st, parent: parent, caller: caller) }
            try Sys.unlinkat(parentFD, name, 0)
        } else if defersUnlink, let graveyard, st.st_dev == graveyard.device {
            let ticket = burials.begin(parent, name, by: caller.uid)
            // An immutable or append-only directory would refuse the rename
            // after the reply. Asked when its queue starts, not for every
            // file: `rm -rf` pays one statx a directory, and a chattr in the
            // queue's lifetime (a second at most) is no different from one
            // just after the rename.
            if ticket.first, (try? Sys.lstatatProtected(parentFD, ""))?.protected == true {
                ticket.end()
                throw .notPermitted
            }
            let file = DeferredBurials.File(st: st, inPlace: freesNothing, deleted: Sys.wallClockNow())
            let record = freesNothing ? nil : trashRecord(st, parent: parent, name: name, caller: caller)
            if recordIntent(file, parent: parent, name: name, caller: caller, unkept: undoWindow > 0 && record == nil) {
                return DeferredBurial(ticket: ticket, file: file, record: record)
            }
            ticket.end()
            if freesNothing {
                try Sys.unlinkat(parentFD, name, 0)
            } else {
                try bury(parentFD, name, st: st, from: parent, caller: caller)
            }
        } else if freesNothing {
            try Sys.unlinkat(parentFD, name, 0)
        } else {
            try bury(parentFD, name, st: st, from: parent, caller: caller)
        }
        return nil
    }

    /// Within an undo window, a file still open when it is unlinked keeps a
    /// hard link in the graveyard with its trash record, so it stays
    /// restorable like any other; its name is then unlinked in place, and
    /// its data goes when the window ends and the last handle closes. (An
    /// open handle's fstat shows st_nlink 1 meanwhile, not 0.) Without a
    /// window, or if the link fails, it is unlinked as before.
    private func keepRestorable(_ parentFD: Int32, _ name: UnsafePointer<CChar>, st: stat, parent: Inode,
                                caller: Caller) {
        guard let graveyard, let reaper, undoWindow > 0, st.st_mode & S_IFMT == S_IFREG,
              st.st_dev == graveyard.device, let record = trashRecord(st, parent: parent, name: name, caller: caller)
        else { return }
        do throws(Errno) {
            reaper.noteBuried(shard: try graveyard.bury(parentFD, name, record: record, linking: true, file: true))
        } catch {
            log.debug("an open file could not be kept for the undo window", metadata: ["error": "\(error)"])
        }
    }

    /// An unlink answered before its rename into the graveyard: the ticket
    /// that hides its name until the burial lands, and what landing needs.
    /// `file.deleted` is when the unlink came: landings after the reply run
    /// on the handlers' threads and may finish in another order than the
    /// unlinks came (the undo window's byte limit then freed a newer file
    /// before an older one).
    struct DeferredBurial: ~Copyable {
        let ticket: DeferredBurials.Ticket
        let file: DeferredBurials.File
        /// Made when the unlink came, so it names the path the caller removed.
        let record: TrashRecord?
    }

    /// After the unlink's reply: queues the burial on its directory (see
    /// `DeferredBurials`), or lands it now when the queue is full.
    func afterReply(_ d: consuming DeferredBurial, parent: Inode, parentFD: Int32, name: UnsafePointer<CChar>,
                    caller: Caller) {
        let file = d.file, record = d.record
        guard let ticket = burials.queue(d.ticket, file, in: parent, name: name, caller: caller, record: record)
        else { return }
        landBurial(file, record: record, parent: parent, parentFD: parentFD, name: name, caller: caller)
        ticket.end()
    }

    /// Lands a queued burial (for `DeferredBurials`, which ends its ticket);
    /// `parentFD` is its directory's.
    func landQueued(_ q: DeferredBurials.Queued, parentFD: Int32) {
        q.name.withUnsafeBufferPointer {
            landBurial(q.file, record: q.record, parent: q.directory, parentFD: parentFD, name: $0.baseAddress!, caller: q.caller)
        }
    }

    /// The rename into the graveyard an answered unlink owes. It cannot
    /// fail the unlink any more, so if it fails the file is unlinked in
    /// place, and if even that fails it stays and the failure is logged.
    private func landBurial(_ d: DeferredBurials.File, record: TrashRecord?, parent: Inode, parentFD: Int32,
                            name: UnsafePointer<CChar>, caller: Caller) {
        do throws(Errno) {
            if d.inPlace {
                try Sys.unlinkat(parentFD, name, 0)
                return
            }
            do throws(Errno) {
                do throws(Errno) {
                    try bury(parentFD, name, st: d.st, from: parent, caller: caller, made: (record, d.deleted))
                } catch where error == .tooManyOpenFiles || error == .tooManyOpenFilesInSystem {
                    // Not a reason to lose the file's place in the undo window:
                    // the fd cache gives up half its descriptors for one more try.
                    namespace.shrink()
                    try bury(parentFD, name, st: d.st, from: parent, caller: caller, made: (record, d.deleted))
                }
            } catch .isDirectory {
                // A directory exchanged onto the name: it stays there (logged by `bury`).
            } catch where error != .noSuchFileOrDirectory {
                log.warning("could not move an unlinked file into the graveyard; unlinking it in place",
                            metadata: ["name": "\(String(cString: name))", "error": "\(error)"])
                try Sys.unlinkat(parentFD, name, 0)
            }
        } catch where error == .noSuchFileOrDirectory {
            // Gone already: its directory went to the graveyard with it.
        } catch {
            log.error("an unlinked file could not be removed from the source",
                      metadata: ["name": "\(String(cString: name))", "error": "\(error)"])
        }
    }

    /// Removes the directory `name` from `parentFD` (the inode `parent`).
    ///
    /// rmdir stays a real rmdir (only an empty directory may go, and removing
    /// one frees no data) unless there is an undo window: then the empty
    /// directory is kept too, so restoring a tree removed with `rm -rf`
    /// brings its directories back with their modes and owners.
    /// A directory whose only entries are unlinked files still queued for
    /// the graveyard goes there whole instead, with them: `rm -rf` costs one
    /// rename per directory rather than one per file. Within a window it is
    /// then kept as one entry with its files, as `vanish rm -r` keeps a tree;
    /// a file another user deleted, or one the window does not keep, lands
    /// on its own first.
    /// `known` is the entry's lstat when the caller already made one.
    /// `groups` gives the caller's supplementary groups, asked only when the
    /// directory goes to the graveyard: what it holds then (a descriptor
    /// inside it can still add to it) is freed with the caller's rights.
    func removeDirectory(parent: Inode, parentFD: Int32, name: UnsafePointer<CChar>, caller: Caller,
                         groups: () -> [gid_t], known: stat? = nil) throws(Errno) {
        guard undoWindow > 0 else {
            if !burials.isEmpty {
                let st = try lstatUnlessKnown(known, parentFD, name)
                let taken = burials.takeDirectory(InodeKey(dev: st.st_dev, ino: st.st_ino))
                if !taken.isEmpty && st.st_mode & S_IFMT == S_IFDIR
                    && buryWhole(parentFD, name, st: st, holding: taken.items, from: parent, caller: caller, groups: groups) {
                    taken.wentWithDirectory()
                    return
                }
                // Its files' burials must land first, or it is not empty yet.
                taken.land()
            }
            try Sys.unlinkat(parentFD, name, AT_REMOVEDIR)
            return
        }
        let st = try lstatUnlessKnown(known, parentFD, name)
        guard st.st_mode & S_IFMT == S_IFDIR else { throw .notDirectory }
        if !burials.isEmpty {
            let taken = burials.takeDirectory(InodeKey(dev: st.st_dev, ino: st.st_ino))
                .landing { $0.record == nil || $0.caller.uid != caller.uid }
            if !taken.isEmpty
                && buryWhole(parentFD, name, st: st, holding: taken.items, from: parent, caller: caller, groups: groups) {
                taken.wentWithDirectory()
                return
            }
            // Its files' burials land first, or it is not empty yet.
            taken.land()
        }
        let empty = try requireEmptyDirectory(parentFD, name)
        try bury(parentFD, name, st: empty, from: parent, caller: caller, by: identify(caller, groups))
    }

    /// Buries the directory `name` whole with the unlinked files still
    /// queued in it (`taken`), if they are all it holds: `rm -rf` then costs
    /// one rename per directory rather than one per file. The kernel holds
    /// the directory's lock for the rmdir: nothing can be made in it through
    /// the mount meanwhile. False if it must be emptied file by file.
    private func buryWhole(_ parentFD: Int32, _ name: UnsafePointer<CChar>, st: stat, holding taken: [DeferredBurials.Queued],
                           from parent: Inode, caller: Caller, groups: () -> [gid_t]) -> Bool {
        guard holdsOnly(taken, parentFD, name) else { return false }
        do throws(Errno) {
            let entry = try bury(parentFD, name, st: st, from: parent, caller: caller, wantEntry: true,
                                 by: identify(caller, groups))
            // What it holds, for status's estimate (it counted as one entry).
            if let entry { reaper?.expectTree(entry, count: taken.count + 1) }
            return true
        } catch {
            log.debug("an emptied directory could not go whole", metadata: ["error": "\(error)"])
            return false
        }
    }

    /// The name mark for what `caller` buries (see `Graveyard.identify`).
    func identify(_ caller: Caller, _ groups: () -> [gid_t]) throws(Errno) -> DeletedBy? {
        guard let graveyard, caller.uid != geteuid(), Credentials.canSwitch else { return nil }
        return try graveyard.identify(Credentials(uid: caller.uid, gid: caller.gid, groups: groups()))
    }

    /// The trash record for an entry about to be buried, when there is an
    /// undo window: where it was (as the kernel names it now), who deleted it.
    func trashRecord(_ st: stat, parent: Inode, name: UnsafePointer<CChar>, caller: Caller) -> TrashRecord? {
        guard undoWindow > 0, keeps(st, name, by: caller) else { return nil }
        let type = st.st_mode & S_IFMT
        // A tree's size is unknown without walking it; a file's is its blocks.
        // A directory's size is what it holds: unknown here, measured in the background (Reaper's warden).
        let bytes: UInt64? = type == S_IFDIR ? nil : Sys.diskBytes(st)
        let path = table.path(of: parent, appending: name)
        // Longer than a path may be, no program could restore it by its path;
        // kept, each level of a deep chain costs its whole path (memory and disk
        // the square of the depth).
        guard path.count < Int(PATH_MAX) else { return nil }
        return TrashRecord(path: path, uid: caller.uid, gid: caller.gid,
                           bytes: bytes, kind: TrashRecord.Kind(mode: st.st_mode),
                           from: type == S_IFDIR ? parent.origin : nil)
    }

    /// Whether the window keeps `name` (stat `st`) that `caller` deletes:
    /// not a file the same process made through the mount moments ago (a
    /// journal, a swap or lock file, a placeholder: its birth as the inode
    /// table knows it), not a name the mount excludes. Directories are
    /// always kept: what rm -rf deleted inside them is restored with them.
    private func keeps(_ st: stat, _ name: UnsafePointer<CChar>, by caller: Caller) -> Bool {
        guard st.st_mode & S_IFMT != S_IFDIR else { return true }
        if keepMinAge > 0, let node = table.known(st), node.birth > 0,
           node.madeBy.load(ordering: .relaxed) == caller.pid, Sys.wallClockNow() &- node.birth < keepMinAge {
            return false
        }
        for pattern in keepExclude where fnmatch(pattern, name, 0) == 0 { return false }
        return true
    }

    @inline(__always)
    private func lstatUnlessKnown(_ known: stat?, _ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> stat {
        if let known { return known }
        return try Sys.lstatat(parentFD, name)
    }

    /// Whether the directory `name` holds exactly the files `taken` from its
    /// queue and nothing else, compared by name (no allocation per entry).
    private func holdsOnly(_ taken: [DeferredBurials.Queued], _ parentFD: Int32,
                           _ name: UnsafePointer<CChar>) -> Bool {
        let key = taken[0].key.directory
        var byHash: [UInt64: Int] = [:]
        byHash.reserveCapacity(taken.count)
        for (i, q) in taken.enumerated() { byHash[q.key.nameHash] = i }
        var matched = 0
        let complete = try? forEachEntry(parentFD, name) { entry in
            guard let i = byHash[DeferredBurials.hash(key, entry)],
                  taken[i].name.withUnsafeBufferPointer({ strcmp($0.baseAddress!, entry) == 0 }) else { return false }
            matched += 1
            return true
        }
        return complete == true && matched == taken.count
    }

    /// ENOTEMPTY unless the directory holds nothing but `.` and `..`;
    /// returns the stat of the directory found empty, the one the rename
    /// after must move (another may be exchanged onto the name meanwhile).
    private func requireEmptyDirectory(_ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> stat {
        let dp = try Sys.openDirectory(parentFD, name)
        defer { closedir(dp) }
        let st = try Sys.fstat(dirfd(dp))
        while let d = Glibc.readdir(dp) {
            if !isDotOrDotDot(vanish_dirent_name(d)!) { throw .directoryNotEmpty }
        }
        return st
    }

    /// Calls `body` with each name in the directory `name` but `.` and `..`
    /// (never following a symlink) until it returns false; returns whether
    /// every entry was seen.
    private func forEachEntry(_ parentFD: Int32, _ name: UnsafePointer<CChar>,
                              _ body: (UnsafePointer<CChar>) -> Bool) throws(Errno) -> Bool {
        let dp = try Sys.openDirectory(parentFD, name)
        defer { closedir(dp) }
        while let d = Glibc.readdir(dp) {
            let entry = vanish_dirent_name(d)!
            if !isDotOrDotDot(entry) && !body(entry) { return false }
        }
        return true
    }

    /// When `bury` last said the disk is too full for the graveyard (CLOCK_MONOTONIC ns).
    private static let lastNoSpaceWarning = Atomic<UInt64>(0)

    /// Moves an entry into the graveyard (with its trash record when there
    /// is an undo window); on another filesystem (EXDEV) deletes it at once instead.
    /// Returns the graveyard entry's name when `wantEntry` (nil if it was deleted at once).
    /// An answered unlink landing later passes the record and time made when it came (`made`).
    @discardableResult
    /// `by`: whom what a directory holds is freed as (nil: the daemon).
    /// `wholeTree`: a whole tree may go (`vanish rm`), deleted at once with
    /// `credentials` (nil: the daemon's, for its own user) where it cannot
    /// reach the graveyard; otherwise a file goes only by unlink and a
    /// directory only by rmdir, whatever was swapped onto the name since
    /// `st` was taken.
    func bury(_ parentFD: Int32, _ name: UnsafePointer<CChar>, st: stat, from parent: Inode,
              caller: Caller, asName: UnsafePointer<CChar>? = nil, wantEntry: Bool = false,
              made: (record: TrashRecord?, deleted: UInt64)? = nil,
              reserved: Graveyard.Reservation? = nil, by deletedBy: DeletedBy? = nil,
              wholeTree: Bool = false, as credentials: Credentials? = nil) throws(Errno) -> String? {
        let isFile = st.st_mode & S_IFMT != S_IFDIR
        let deleteNow = { () throws(Errno) in
            try self.deleteNow(parentFD, name, file: isFile, wholeTree: wholeTree, as: credentials)
        }
        guard let graveyard, let reaper else {
            try deleteNow()
            return nil
        }
        let record = made.map(\.record) ?? trashRecord(st, parent: parent, name: asName ?? name, caller: caller)
        // Inside a window, what it does not keep (a program's own scratch
        // file, an excluded name) is due at once: dated now, it would wait
        // out the window outside every limit and could fill the disk.
        let deletion: Graveyard.Deletion = record == nil && undoWindow > 0 ? .unheld(since: made?.deleted)
            : made.map { .at($0.deleted) } ?? .now
        // The directory checked: one from a one-step delete's room is its own.
        let checked = isFile || reserved != nil ? nil : st.st_ino
        var entry: String?
        do {
            if wantEntry {
                reaper.noteBuried(shard: try graveyard.bury(parentFD, name, record: record, deletion: deletion,
                                                            reserved: reserved, by: deletedBy, file: isFile,
                                                            checked: checked) { entry = String(cString: $0) },
                                  dueNow: deletion.isUnheld,
                                  sizeUnknown: record != nil && record?.bytes == nil, bytes: Self.freedBytes(st))
            } else {
                reaper.noteBuried(shard: try graveyard.bury(parentFD, name, record: record, deletion: deletion,
                                                            by: deletedBy, file: isFile, checked: checked),
                                  dueNow: deletion.isUnheld,
                                  sizeUnknown: record != nil && record?.bytes == nil, bytes: Self.freedBytes(st))
            }
        } catch .isDirectory where isFile {
            logSwappedDirectory(name)
            throw .isDirectory
        } catch .directoryNotEmpty where checked != nil {
            logSwappedDirectory(name)
            throw .directoryNotEmpty
        } catch .improperLink {
            // On a filesystem mounted inside the source: its own graveyard, if
            // it can have one. On the source's own filesystem EXDEV means it
            // refuses this rename (overlayfs, for a directory from a lower
            // layer): delete in place rather than fail the delete.
            do throws(Errno) {
                guard parent.key.dev != table.root.key.dev,
                      let (nestedGraveyard, nestedReaper) = nestedGraveyard(under: parent) else {
                    throw .improperLink
                }
                // What a directory holds is freed as its deleter there too.
                nestedReaper.noteBuried(shard: try nestedGraveyard.bury(parentFD, name, by: deletedBy, file: isFile,
                                                                        checked: checked) { entry = String(cString: $0) })
            } catch .improperLink {
                try deleteNow()
            }
        } catch where error == .noSpace || error == .diskQuotaExceeded {
            // A full disk must not stop deletes, least of all then. The trash
            // record is all a burial writes: bury without it (not restorable),
            // and if even the rename needs space (a shard directory's new
            // block), delete in place.
            // Once a minute at most: rm -rf of a big tree would write a line per file.
            let now = Condition.now(), last = Self.lastNoSpaceWarning.load(ordering: .relaxed)
            if last == 0 || now &- last > Duration.seconds(60).nanoseconds,
               Self.lastNoSpaceWarning.compareExchange(expected: last, desired: now, ordering: .relaxed).exchanged {
                log.warning("no space for the graveyard: deleting without an undo window (said once a minute)",
                            metadata: ["name": "\(String(cString: name))", "error": "\(error)"])
            }
            if record != nil,
               let shard = try? graveyard.bury(parentFD, name, deletion: .unheld(since: made?.deleted), by: deletedBy, file: isFile,
                                               named: { entry = String(cString: $0) }) {
                reaper.noteBuried(shard: shard, dueNow: true)
            } else {
                try deleteNow()
                entry = nil
            }
        }
        return entry
    }

    /// Another directory was found under the name of what went to the
    /// graveyard, and was put back (`Graveyard.returnSwapped`).
    func logSwappedDirectory(_ name: UnsafePointer<CChar>) {
        log.notice("a directory was exchanged onto a deleted entry's name before its burial: it stays where it is",
                   metadata: ["name": "\(String(cString: name))"])
    }

    /// A move into the desktop trash (`TrashFolders`): buries `name` with
    /// `record`, whatever the window's exclusions (its user asked for the
    /// trash), a directory whole, its contents freed as its deleter.
    /// Returns its graveyard entry and shard; nil without an undo window.
    func putInTrash(_ parentFD: Int32, _ name: UnsafePointer<CChar>, st: stat, from parent: Inode, record: TrashRecord,
                    caller: Caller, groups: () -> [gid_t]) throws(Errno) -> (id: String, shard: Int)? {
        guard let graveyard, let reaper, undoWindow > 0, st.st_dev == graveyard.device else { return nil }
        let directory = st.st_mode & S_IFMT == S_IFDIR
        let deletedBy = directory ? try identify(caller, groups) : nil
        var entry: String?
        let shard: Int
        do throws(Errno) {
            // A directory exchanged onto the name before the rename goes back (ENOTEMPTY).
            shard = try graveyard.bury(parentFD, name, record: record, by: deletedBy, file: !directory,
                                       checked: directory ? st.st_ino : nil) { entry = String(cString: $0) }
        } catch where (error == .isDirectory && !directory) || (error == .directoryNotEmpty && directory) {
            logSwappedDirectory(name)
            throw error
        }
        reaper.noteBuried(shard: shard, sizeUnknown: directory, bytes: Self.freedBytes(st))
        return entry.map { ($0, shard) }
    }

    /// `vanish rm`: moves the entry (a whole tree) into the graveyard and
    /// returns its graveyard entry (nil if it was deleted at once). The
    /// permission walk `counted` what the reaper will delete: status can
    /// tell how long that takes, and how much space waits in the graveyard.
    /// `reserved` and `record`: the name and trash record a one-step delete
    /// took when its caller removed the tree (`OneStepBurials`).
    func buryTree(_ parentFD: Int32, _ name: UnsafePointer<CChar>, st: stat, from parent: Inode, caller: Caller,
                  counted: RemovalCheck.Extent, reserved: Graveyard.Reservation? = nil,
                  record: TrashRecord? = nil, by deletedBy: DeletedBy?, as credentials: Credentials?) throws(Errno) -> String? {
        let made = reserved.map { _ in (record: record, deleted: UInt64(0)) }
        let grave = try bury(parentFD, name, st: st, from: parent, caller: caller, wantEntry: true, made: made,
                             reserved: reserved, by: deletedBy, wholeTree: true, as: credentials)
        if st.st_mode & S_IFMT == S_IFDIR, let grave, st.st_dev == table.root.key.dev {
            if counted.entries > 1 { reaper?.expectTree(grave, count: counted.entries) }
            reaper?.noteHeld(bytes: counted.bytes)
        }
        return grave
    }

    /// The disk space reaping an entry of stat `st` gives back, as the
    /// reaper counts it: a file's blocks (none with other links), not a
    /// directory's (what a tree holds is added by its walk).
    @inline(__always)
    static func freedBytes(_ st: stat) -> UInt64 {
        st.st_mode & S_IFMT == S_IFDIR || st.st_nlink > 1 ? 0 : Sys.diskBytes(st)
    }

    /// Deletes an entry that cannot reach the graveyard (a nested
    /// filesystem, or no graveyard at all): a file by unlink, a directory by
    /// rmdir, and a whole tree only when `vanish rm` asked (`wholeTree`),
    /// removed with `credentials` so the kernel checks each entry. A
    /// directory exchanged onto a file's name, or a full one onto an empty
    /// one's, since the caller's check is refused (EISDIR, ENOTEMPTY), not emptied.
    private func deleteNow(_ parentFD: Int32, _ name: UnsafePointer<CChar>, file: Bool, wholeTree: Bool,
                           as credentials: Credentials?) throws(Errno) {
        if file { return try Sys.unlinkat(parentFD, name, 0) }
        do {
            try Sys.unlinkat(parentFD, name, AT_REMOVEDIR)
        } catch .directoryNotEmpty where wholeTree {
            try Credentials.acting(credentials) { () throws(Errno) in try removeTree(parentFD, name) }
        }
    }

    /// Removes a directory and everything in it with fd-relative calls,
    /// never following a symlink and never crossing into another filesystem.
    private func removeTree(_ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) {
        let dp = try Sys.openDirectory(parentFD, name)
        var failure: Errno?
        // Closed before its directory goes.
        do {
            defer { closedir(dp) }
            let dev = try Sys.fstat(dirfd(dp)).st_dev
            while let d = Glibc.readdir(dp) {
                let child = vanish_dirent_name(d)!
                if isDotOrDotDot(child) { continue }
                do throws(Errno) {
                    let st = try Sys.lstatat(dirfd(dp), child)
                    if st.st_mode & S_IFMT != S_IFDIR {
                        try Sys.unlinkat(dirfd(dp), child, 0)
                    } else if st.st_dev != dev {
                        throw Errno.resourceBusy  // a mountpoint: rm -r would refuse it too
                    } else {
                        try removeTree(dirfd(dp), child)
                    }
                } catch {
                    failure = failure ?? error
                }
            }
        }
        if let failure { throw failure }
        try Sys.unlinkat(parentFD, name, AT_REMOVEDIR)
    }

    /// Keeps a file that is about to lose its name reachable while programs
    /// have it open; returns whether any do.
    @discardableResult
    func holdIfOpen(_ st: stat) -> Bool {
        guard namespace.anyOpen, st.st_mode & S_IFMT == S_IFREG, let node = table.known(st) else { return false }
        return namespace.holdIfOpen(node)
    }

    /// A rename that may replace a file (see `EntryHandlers.rename`),
    /// with renameat2 semantics (NOREPLACE, EXCHANGE passed through).
    /// `target`: what `newName` held just before (nil: nothing, or an exchange).
    /// The renames run with `credentials` (the caller's; nil: the daemon's own).
    func replace(_ pfd: Int32, _ name: UnsafePointer<CChar>, _ npfd: Int32, _ newName: UnsafePointer<CChar>,
                 target: stat?, flags: UInt32, newParent: Inode, caller: Caller,
                 as credentials: Credentials?) throws(Errno) {
        if flags == 0, let target, target.st_mode & S_IFMT != S_IFDIR, target.st_nlink == 1, !holdIfOpen(target),
           !(reaper?.freesAtOnce(bytes: UInt64(target.st_blocks) * 512, keeping: undoWindow > 0) ?? false),
           let source = try? Sys.lstatat(pfd, name), source.st_mode & S_IFMT != S_IFDIR,
           source.st_ino != target.st_ino || source.st_dev != target.st_dev {
            // Replacing a file whose data the replacement would free: swap the
            // two atomically (the new name never goes missing), then bury the
            // old target from where the source was, so the reaper frees it.
            do throws(Errno) {
                try Credentials.acting(credentials) { () throws(Errno) in
                    try Sys.renameat2(pfd, name, npfd, newName, VANISH_RENAME_EXCHANGE)
                }
            } catch .invalidArgument {
                // Two files can always be exchanged, so the backing filesystem
                // lacks the flag (NFS, many FUSE filesystems): rename plainly,
                // and it frees the replaced file itself.
                try Credentials.acting(credentials) { () throws(Errno) in try Sys.renameat2(pfd, name, npfd, newName, 0) }
                return
            }
            // Its trash record names where it was: the target's path. A
            // directory exchanged onto the name since goes back there (and
            // stays): the rename itself is done.
            do throws(Errno) {
                try bury(pfd, name, st: target, from: newParent, caller: caller, asName: newName)
            } catch .isDirectory {}
            return
        }
        try Credentials.acting(credentials) { () throws(Errno) in try Sys.renameat2(pfd, name, npfd, newName, flags) }
    }
}

extension Inode {
    /// Its identity as a trash record keeps it: where a directory was deleted from.
    var origin: TrashRecord.Origin { TrashRecord.Origin(inode: UInt64(key.ino), birth: birth) }
}
