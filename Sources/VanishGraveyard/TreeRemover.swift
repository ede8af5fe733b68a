import CLinux
import Glibc
import LinuxSyscalls
import SystemPackage

/// Deletes one graveyard entry with fd-relative calls only (openat, readdir,
/// unlinkat). A directory's files are unlinked and each subdirectory is
/// moved back into the graveyard as an entry of its own, one rename each,
/// instead of being descended into. So one huge tree becomes many
/// independent entries that every reaper worker can take (parallel per
/// directory, as rmz is), no path is ever longer than one name, depth costs
/// neither stack nor fds, and a stop or a crash leaves only whole entries.
///
/// A directory whose name says who buried it (`DeletedBy`) is emptied with
/// that user's credentials: what it holds goes only where the kernel lets
/// them remove it, as `rm -r` run by them would. Its subdirectories leave
/// through their room, moved as them, and go on into the graveyard as the
/// daemon; the directory waits for them (`PieceFamilies`), and what they
/// could not remove comes back into it, so it stays with its ancestors.
///
/// Either way, a subdirectory that may have been moved in after the burial
/// by someone else (`cameInLater`) is left where it is, and so is the entry
/// holding it: its deleter's `rm -r` could never have reached it.
struct TreeRemover {
    /// What the current entry freed so far.
    var freed = Freed()
    /// Whether the last `remove` took the entry away itself. While a reaper
    /// finishes, every worker sweeps every shard, so two may work on one
    /// entry: only the one whose unlink took it counts it.
    var removedEntry = false
    /// Whether the entry was already gone when the last `remove` began.
    var vanished = false
    /// The first error that kept the last `remove` from deleting something
    /// (an immutable file, a directory the daemon may not write); ENOENT is
    /// not one: another worker got there first.
    var failure: Errno?
    /// Whether the last `remove` left a subdirectory that came in after the
    /// burial (`cameInLater`): the entry is held for good, not retried.
    var keptLater = false
    let graveyard: Graveyard
    /// The reaper's running totals, fed as files go (`freed` is the
    /// current entry's alone).
    let progress: ReapProgress
    /// Counted in `freed` but not yet in `progress`: adding to the shared
    /// totals file by file would have the workers contend for them.
    var unreported = Freed()
    let limiter: RateLimiter?
    var gate: ForegroundGate?
    let shouldStop: () -> Bool
    /// The deletion the entry being removed is part of (see Reaper's tallies).
    var origin: String?
    /// Called with the shard a subdirectory was handed back to, its new
    /// entry name, and `origin`.
    let handedBack: (Int, String, String?) -> Void
    /// Where a deleter's pieces came from, and the shard (fd) being reaped.
    let families: PieceFamilies
    let shardFD: Int32
    /// `shardFD`'s index: a directory the daemon empties hands its first
    /// subdirectory back there, so the worker reaping it goes on with it,
    /// with no other worker woken. A chain of single subdirectories (1,800
    /// deep) otherwise went from worker to worker, a sleep and a wakeup per
    /// level: 18 s idle, and minutes beside busy processes, in the idle class
    /// each wakeup starts in. A deleter's pieces stay spread: their parents
    /// wait in the shard for them, and a pass reads every waiting one.
    let shardIndex: Int?
    /// Told of each file with other links unlinked (`Reaper.Hooks.onLinkDropped`).
    let linkDropped: (@Sendable (stat) -> Void)?
    /// The graveyard's mount, and whether its filesystem is remote (`look`).
    var home: (mount: UInt64, remote: Bool)? = nil

    /// Removes `name` in the directory `parentFD`; returns false if told to
    /// stop before it was gone.
    mutating func remove(_ parentFD: Int32, _ name: UnsafePointer<CChar>) -> Bool {
        removedEntry = false
        vanished = false
        failure = nil
        keptLater = false
        let st: stat
        do {
            st = try look(parentFD, name)
        } catch {
            if error == .noSuchFileOrDirectory { vanished = true } else { note(error) }
            return true
        }
        if st.st_mode & S_IFMT != S_IFDIR {
            // A file holds nothing: its graveyard name is the daemon's own to remove.
            guard pace() else { return false }
            if unlink(parentFD, name, 0) { count(st); removedEntry = true }
            return true
        }
        // A directory under a file's name was swapped in behind a check:
        // never walked with the daemon's rights (see `Graveyard.namesFile`).
        if Graveyard.namesFile(name) {
            note(.notPermitted)
            return true
        }
        let since = Graveyard.burialTime(name)
        if let who = graveyard.credentials(ofEntry: name) {
            return remove(parentFD, name, st, as: who, id: DeletedBy(entryName: name)!, since: since)
        }
        let daemon = geteuid()
        makeRemovable(parentFD, name, st, owner: geteuid())
        let fd: Int32
        do { fd = try Sys.openat(parentFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW) } catch { note(error); return true }
        let dp: OpaquePointer
        do throws(Errno) { dp = try Sys.directoryStream(adopting: fd) } catch { note(error); return true }
        let dfd = dirfd(dp)
        var stays = true
        while let d = readdir(dp) {
            let child = vanish_dirent_name(d)!
            if isDotOrDotDot(child) { continue }
            // Without a burial time, nothing to judge: moved on the readdir's word.
            if since == nil, d.pointee.d_type == UInt8(DT_DIR), handBack(dfd, child, since, stays: stays) {
                stays = false
                continue
            }
            if let cst = lookInside(dfd, child) {
                if cst.st_mode & S_IFMT == S_IFDIR {
                    if Self.cameInLater(cst, since: since, deleter: daemon, fine: graveyard.clock.fine) {
                        keptLater = true
                    } else if handBack(dfd, child, since, checked: cst, stays: stays) {
                        stays = false
                    }
                } else {
                    guard pace() else { closedir(dp); return false }
                    if unlink(dfd, child, 0) { count(cst) }
                }
            }
            if shouldStop() { closedir(dp); return false }
        }
        closedir(dp)
        guard pace() else { return false }
        if unlink(parentFD, name, AT_REMOVEDIR) { count(Freed(directories: 1)); removedEntry = true }
        return true
    }

    /// Empties the directory entry `name` as `who` (see the type's comment),
    /// then removes it from the graveyard as the daemon.
    private mutating func remove(_ parentFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat,
                                 as who: Credentials, id: DeletedBy, since: UInt64?) -> Bool {
        let held: DeleterRooms.Room
        let top: Int32
        do {
            guard let rooms = graveyard.rooms else { throw Errno.notPermitted }
            held = try rooms.room(for: who.uid, gid: who.gid)
            top = try Sys.openat(parentFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        } catch {
            note(error as? Errno ?? .notPermitted)
            return true
        }
        let room = held.fd
        defer {
            Sys.close(top)
            withExtendedLifetime(held) {}
        }
        let entry = String(cString: name)
        var pieces: [(room: String, name: [UInt8])] = []
        // Directories exchanged in while they were moved out, that could not go back (`keepStranger`).
        var strangers: [String] = []
        var stopped = false
        do throws(Errno) {
            try who.acting { () throws(Errno) in
                // Opened as them: rm -r must be able to list it (an empty one
                // it removes without listing, as the rmdir below does). Their
                // own read-only directory is left as it is: rm -r by them
                // cannot empty it either, and it goes back as it was.
                let fd: Int32
                do throws(Errno) { fd = try Sys.openat(top, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) } catch .permissionDenied {
                    return
                }
                let dp = try Sys.directoryStream(adopting: fd)
                defer { closedir(dp) }
                let dfd = dirfd(dp)
                while let d = readdir(dp) {
                    let child = vanish_dirent_name(d)!
                    if isDotOrDotDot(child) { continue }
                    guard let cst = lookInside(dfd, child) else { continue }
                    if cst.st_mode & S_IFMT == S_IFDIR {
                        // Came back: what its deleter could not remove stays here.
                        if families.keeps(entry, child) { continue }
                        if Self.cameInLater(cst, since: since, deleter: who.uid, fine: graveyard.clock.fine) {
                            keptLater = true
                            continue
                        }
                        if let piece = handBack(dfd, child, cst, into: room, as: who, id: id) {
                            if piece.withCString({ Self.isSame(room, $0, cst) }) {
                                pieces.append((piece, Array(UnsafeRawBufferPointer(start: child, count: strlen(child)))))
                            } else {
                                if !piece.withCString({ keepStranger(room, $0, back: dfd, child, shard: nil) }) {
                                    strangers.append(piece)
                                }
                            }
                        }
                    } else {
                        guard pace() else { stopped = true; return }
                        if unlink(dfd, child, 0) { count(cst) }
                    }
                    if shouldStop() { stopped = true; return }
                }
            }
        } catch {
            note(error)
        }
        // As the daemon: on from the room into the graveyard (a crash between
        // leaves them in the room, where the next mount buries them as theirs).
        // The directory waits for its pieces, known before any is in the
        // graveyard for another worker to take: removed once they are gone,
        // or held with what came back (see `PieceFamilies`).
        let named = pieces.map { piece in
            let reservation = graveyard.reservePiece(by: id, of: since)
            return (reservation, piece, (try? graveyard.withName(reservation) { String(cString: $0) }) ?? "")
        }
        let waits = families.split(entry, shardFD: shardFD, into: named.map { ($0.2, $0.1.name) })
        var buried = false
        for (reservation, piece, pieceEntry) in named {
            do throws(Errno) {
                let shard = try graveyard.bury(room, piece.room, deletion: .piece(of: since), reserved: reservation)
                buried = true
                handedBack(shard, pieceEntry, origin)
            } catch {
                note(error)
                if waits { _ = families.pieceDone(pieceEntry, cameBack: false) }
            }
        }
        for stranger in strangers {
            do throws(Errno) {
                let reservation = graveyard.reservePiece(by: id, of: since)
                let shard = try graveyard.bury(room, stranger, deletion: .piece(of: since), reserved: reservation)
                _ = try graveyard.withName(reservation) { graveyard.hold(shard: shard, $0, because: .later) }
            } catch {
                note(error)
            }
        }
        if stopped || (waits && buried) { return !stopped }
        guard pace() else { return false }
        if unlink(parentFD, name, AT_REMOVEDIR) { count(Freed(directories: 1)); removedEntry = true }
        return true
    }

    /// Moves the subdirectory `child` of `dirFD` into `who`'s room, as them
    /// (on this thread's credentials): the kernel lets it go only if they may
    /// remove it from `dirFD`. Returns its name in the room. A directory the
    /// move needs write permission on and they may not write (its ".." would
    /// change; their own read-only one too) goes with rmdir if it is empty,
    /// as `rm -r` takes it, and else stays.
    private mutating func handBack(_ dirFD: Int32, _ child: UnsafePointer<CChar>, _ st: stat, into room: Int32,
                                   as who: Credentials, id: DeletedBy) -> String? {
        let reservation = graveyard.reserve(by: id)
        do throws(Errno) {
            return try graveyard.withName(reservation) { piece throws(Errno) -> String in
                try Sys.renameNoReplace(dirFD, child, room, piece)
                return String(cString: piece)
            }
        } catch .permissionDenied {
            if unlink(dirFD, child, AT_REMOVEDIR) { count(Freed(directories: 1)) }
        } catch {
            note(error)
        }
        return nil
    }

    /// The lstat of `name` in `dirFD`, refused (EBUSY) where a filesystem is
    /// mounted: a descriptor held inside a buried tree can mount one there
    /// (a FUSE server that then stops, an NFS export that hangs), and no
    /// worker may wait on it. The kernel's cached attributes say so without
    /// asking that filesystem; on a remote graveyard the entry is then asked
    /// afresh. Without mount ids (an old kernel), a plain lstat.
    private mutating func look(_ dirFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> stat {
        if home == nil, let mount = try? Sys.mountID(shardFD) { home = (mount, FilesystemKind.isRemote(shardFD)) }
        guard let home else { return try Sys.lstatat(dirFD, name) }
        let (st, mount) = try Sys.lstatatCached(dirFD, name)
        if mount != home.mount { throw .resourceBusy }
        return home.remote ? try Sys.lstatat(dirFD, name) : st
    }

    /// `look` for what a directory being emptied holds: nil if it is gone,
    /// and a filesystem mounted there is noted (the entry is tried again later).
    private mutating func lookInside(_ dirFD: Int32, _ name: UnsafePointer<CChar>) -> stat? {
        do throws(Errno) { return try look(dirFD, name) } catch {
            if error == .resourceBusy { note(error) }
            return nil
        }
    }

    /// unlinkat; a failure other than ENOENT is noted.
    private mutating func unlink(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ flags: Int32) -> Bool {
        do {
            try Sys.unlinkat(dirFD, name, flags)
            return true
        } catch {
            note(error)
            return false
        }
    }

    private mutating func note(_ error: Errno) {
        if failure == nil && error != .noSuchFileOrDirectory { failure = error }
    }

    /// Moves a subdirectory back into the graveyard as an entry of its own.
    /// A failure is noted only if the directory is still there: the first
    /// attempt is made on the readdir's word alone, which may be stale.
    /// `checked`: what was judged under the name (`cameInLater`); another
    /// directory found moved instead is a stranger (`keepStranger`).
    @discardableResult
    private mutating func handBack(_ dirFD: Int32, _ child: UnsafePointer<CChar>, _ since: UInt64?,
                                   checked: stat? = nil, stays: Bool) -> Bool {
        var piece = ""
        let shard: Int
        do {
            shard = try graveyard.bury(dirFD, child, deletion: .piece(of: since), shard: stays ? shardIndex : nil,
                                       named: { piece = String(cString: $0) })
        } catch {
            guard let st = lookInside(dirFD, child), st.st_mode & S_IFMT == S_IFDIR else { return false }
            // Moving a directory rewrites its "..": it must be writable.
            if error == .permissionDenied && makeRemovable(dirFD, child, st, owner: geteuid()) {
                return handBack(dirFD, child, since, checked: checked, stays: stays)
            }
            note(error)
            return false
        }
        let sfd = graveyard.shardFDs[shard]
        if let checked, !piece.withCString({ Self.isSame(sfd, $0, checked) }) {
            _ = piece.withCString { keepStranger(sfd, $0, back: dirFD, child, shard: shard) }
            return true
        }
        handedBack(shard, piece, origin)
        return true
    }

    /// Whether `name` in `dirFD` is the directory `checked` was taken of.
    private static func isSame(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ checked: stat) -> Bool {
        guard let st = try? Sys.lstatat(dirFD, name) else { return false }
        return st.st_ino == checked.st_ino && st.st_dev == checked.st_dev
    }

    /// A directory exchanged onto a name between its look (`cameInLater`)
    /// and its move out as a piece, by someone holding a descriptor inside
    /// the tree: the top of a piece is never judged again, so it must not
    /// become one. It goes back under the name, if that is free, to be judged
    /// as what came in later; else, once in the graveyard (`shard`), it is
    /// held for its deleter, never freed.
    /// True if it went back.
    @discardableResult
    private mutating func keepStranger(_ fromFD: Int32, _ piece: UnsafePointer<CChar>, back dirFD: Int32,
                                       _ child: UnsafePointer<CChar>, shard: Int?) -> Bool {
        keptLater = true
        note(.directoryNotEmpty)
        if (try? Sys.renameNoReplace(fromFD, piece, dirFD, child)) != nil { return true }
        if let shard { _ = graveyard.hold(shard: shard, piece, because: .later) }
        return false
    }

    /// Whether the subdirectory `st` of a tree buried at `since` (ns since
    /// the epoch) may have been moved in afterwards, through a descriptor
    /// held inside the tree, by someone other than `deleter`: it changed
    /// since (ctime: a rename sets it, and nothing sets it back), and it is
    /// not one only its deleter could have moved (theirs, writable by no one
    /// else: moving a directory to another parent needs write permission on
    /// it). Natively such a move comes after the `rm -r` and fails, so what
    /// it holds is never the deleter's to free. Also true of another user's
    /// directory still being written in when it is reached: held, never freed
    /// with the deleter's rights, so the mistake is on the safe side.
    /// `fine`: `since` is the filesystem's own stamp (`ChangeClock`), which
    /// every later change reaches. Else the filesystem's clock ticks coarsely
    /// (a change may be stamped up to a tick before `since`); one whose stamps
    /// carry no nanoseconds, by the second.
    static func cameInLater(_ st: stat, since: UInt64?, deleter: uid_t, fine: Bool = false) -> Bool {
        guard let since else { return false }
        let changed = Sys.nanoseconds(st.st_ctim)
        let slack = st.st_ctim.tv_nsec == 0 ? Duration.seconds(1).nanoseconds : fine ? 0 : Sys.coarseClockResolution
        guard changed &+ slack >= since else { return false }
        return st.st_uid != deleter || st.st_mode & 0o022 != 0
    }

    /// Gives a directory `owner` owns u+rwx if it lacks any of them: a
    /// read-only tree (Go's module cache, an unpacked archive) is not
    /// removable even by its owner, and an unprivileged daemon would
    /// otherwise leave it stuck in the graveyard. It is deleted already;
    /// only its owner's own mode bits stood in the way (`go clean -modcache`
    /// does the same). Root is never refused, but may still find modes
    /// changed. Only for what the daemon frees with its own rights: a deleter's
    /// own read-only directories stay, as `rm -r` by them leaves them.
    @discardableResult
    private func makeRemovable(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat, owner: uid_t) -> Bool {
        guard st.st_mode & 0o700 != 0o700, st.st_uid == owner else { return false }
        return fchmodat(dirFD, name, (st.st_mode & 0o7777) | 0o700, 0) == 0
    }

    /// Waits for the rate limit and for a pause in requests through the
    /// mount; false if told to stop meanwhile.
    private mutating func pace() -> Bool {
        // About to wait: first show what is done (a rate-limited reaper
        // could otherwise take a minute to report 64 files).
        if !unreported.isEmpty && (limiter != nil || gate?.mayWait == true) { report() }
        if gate != nil, !gate!.wait(unless: shouldStop) { return false }
        return limiter?.take(unless: shouldStop) ?? true
    }

    private mutating func count(_ st: stat) {
        // Data and space go only with the last link.
        let last = st.st_nlink <= 1
        if !last { linkDropped?(st) }
        count(Freed(files: 1, dataBytes: last ? UInt64(max(0, st.st_size)) : 0,
                    diskBytes: last ? Sys.diskBytes(st) : 0))
    }

    @inline(__always)
    private mutating func count(_ f: Freed) {
        freed += f
        unreported += f
        if unreported.entries >= 64 { report() }
    }

    /// Adds what is not yet in the reaper's totals.
    mutating func report() {
        guard !unreported.isEmpty else { return }
        progress.freed(unreported)
        unreported = Freed()
    }
}
