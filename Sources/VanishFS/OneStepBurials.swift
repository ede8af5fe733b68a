import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import SystemPackage
import VanishEvents
import VanishGraveyard

/// The second half of a one-step delete, off the request path.
///
/// The request moves the tree into its deleter's room with one rename made
/// with the deleter's credentials (`DeleterRooms`), so it returns at once
/// whatever the tree's size. Here, on a background thread and again with the
/// deleter's credentials, `RemovalCheck` sorts it by what `rm -r` by that
/// user would remove. All of it: it goes on into the graveyard (the undo
/// window and the reaper take it from there). Part: the parts that go move
/// out as the deleter and on into the graveyard, and the rest is put back
/// where it was, with the deleter's credentials again, as `rm -r` leaves it.
final class OneStepBurials: Sendable {
    /// One tree in its deleter's room, waiting for its check.
    struct Pending: Sendable {
        /// Held while the tree waits: the room stays open, whatever other rooms are opened meanwhile.
        let deleterRoom: DeleterRooms.Room
        var room: Int32 { deleterRoom.fd }
        let reservation: Graveyard.Reservation
        let permissions: RemovalCheck
        let caller: Caller
        let st: stat
        /// Where the tree was: for the put-back.
        let parent: Inode
        let name: ContiguousArray<CChar>
        /// Its trash record, made when the caller removed it.
        let record: TrashRecord?
    }

    private struct State {
        var queue: [Pending] = []
        var running = false
        var stopping = false
        /// The deleter whose tree is being sorted now, if any.
        var busy: uid_t?
        var putBack = 0

        /// Whether a tree of `uid`'s waits or is being sorted.
        func hasPending(of uid: uid_t) -> Bool { busy == uid || queue.contains { $0.caller.uid == uid } }

        /// The next tree to sort: the oldest, unless its deleter's account
        /// had the last sorted and another's waits (one user's stream of
        /// trees, from however many of their subordinate uids, must not hold
        /// everyone else's back).
        mutating func takeNext() -> Pending? {
            guard let first = queue.first else { return nil }
            let account = { (p: Pending) in SubordinateIDs.shared.owner(of: p.caller.uid) }
            var i = 0
            if account(first) == lastAccount, let other = queue.firstIndex(where: { account($0) != lastAccount }) { i = other }
            let p = queue.remove(at: i)
            busy = p.caller.uid
            lastAccount = account(p)
            return p
        }
        var lastAccount: uid_t?
    }
    private let state = Lock(State())
    private let wake = Condition()
    private let deleter: Deleter
    private let changes: any ChangeObserver
    private let invalidations: EntryInvalidations
    private let log: Logger

    init(deleter: Deleter, changes: any ChangeObserver, invalidations: EntryInvalidations, log: Logger) {
        self.deleter = deleter
        self.changes = changes
        self.invalidations = invalidations
        self.log = log
    }

    /// Trees moved in and not yet checked (for status and tests).
    var count: Int { state.withLock { $0.queue.count + ($0.busy != nil ? 1 : 0) } }
    /// Waits (up to `timeout`) until every tree `uid` moved in so far is
    /// sorted: in the graveyard, and the trash if there is a window, or put
    /// back. Another user's trees are not waited for: their deletes must
    /// not delay this user's requests.
    func awaitSorted(of uid: uid_t, timeout: Duration) {
        let deadline = Condition.now() &+ timeout.nanoseconds
        while state.withLock({ $0.hasPending(of: uid) }) && Condition.now() < deadline { usleep(2_000) }
    }

    /// Trees put back since the mount, whole or as `rm -r` leaves them (for status).
    var putBack: Int { state.withLock { $0.putBack } }

    func start() {
        state.withLock { $0.running = true }
        // Requests are served from now on: a tree named later is this daemon's own, on its way.
        let started = deleter.graveyard?.clock.now() ?? 0
        // RemovalCheck recurses once per directory level, up to its maxDepth.
        spawnThread("vanish-onestep", stackSize: 256 << 20) { [self] in
            becomeBackgroundThread(nice: 10)
            recoverLeftovers(namedBefore: started)
            run()
        }
    }

    func add(_ p: Pending) {
        let run = state.withLock { s in
            s.queue.append(p)
            return s.running
        }
        if run {
            wake.lock(); wake.broadcast(); wake.unlock()
        } else {
            // Before start or after stop: check it here and now.
            settle(p)
        }
    }

    /// Checks every tree still waiting, then ends the thread.
    func stop() {
        state.withLock { $0.stopping = true }
        wake.lock(); wake.broadcast(); wake.unlock()
        wake.lock()
        while state.withLock({ $0.running }) { _ = wake.wait(until: Condition.now() + Duration.milliseconds(100).nanoseconds) }
        wake.unlock()
    }

    private func run() {
        while true {
            if let next = state.withLock({ $0.takeNext() }) {
                settle(next)
                state.withLock { $0.busy = nil }
                continue
            }
            wake.lock()
            let done = state.withLock { s in
                if s.stopping && s.queue.isEmpty { s.running = false; return true }
                return false
            }
            if done {
                wake.broadcast()
                wake.unlock()
                return
            }
            if state.withLock({ $0.queue.isEmpty }) { _ = wake.wait(until: Condition.now() + Duration.seconds(1).nanoseconds) }
            wake.unlock()
        }
    }

    /// Into the graveyard if its deleter could have removed all of it;
    /// else what `rm -r` by them would have removed goes, and the rest,
    /// its directories as they were, goes back.
    private func settle(_ p: Pending) {
        // Its origin record goes once the tree has left the room (buried, put back or held).
        defer {
            try? deleter.graveyard?.withName(p.reservation) { grave throws(Errno) in
                if (try? Sys.lstatat(p.room, grave)) == nil { deleter.rooms?.settled(p.caller.uid, grave) }
            }
        }
        do throws(Errno) {
            let sifted = try deleter.graveyard!.withName(p.reservation) { grave throws(Errno) -> RemovalCheck.Sifted in
                let sifted = try p.permissions.sift(p.room, grave)
                if sifted.whole {
                    _ = try deleter.buryTree(p.room, grave, st: p.st, from: p.parent, caller: p.caller,
                                             counted: sifted.extent, reserved: p.reservation, record: p.record, by: nil,
                                             as: p.permissions.credentials)
                    rememberWhereFrom(p, grave)
                } else {
                    for path in sifted.goes { bury(path, of: grave, p) }
                }
                return sifted
            }
            if !sifted.whole { putBack(p, because: sifted.why ?? .permissionDenied) }
        } catch {
            putBack(p, because: error)
        }
    }

    /// Without a window the tree has no record; should the reaper hold what
    /// is moved into it later (through a descriptor held inside), it puts
    /// that back where the tree was, so the daemon remembers where.
    private func rememberWhereFrom(_ p: Pending, _ grave: UnsafePointer<CChar>) {
        guard p.record == nil, p.reservation.deleter != nil, p.st.st_mode & S_IFMT == S_IFDIR,
              let graveyard = deleter.graveyard else { return }
        let path = p.name.withUnsafeBufferPointer { deleter.table.path(of: p.parent, appending: $0.baseAddress!) }
        graveyard.remember(entry: String(cString: grave),
                           deletedFrom: TrashRecord(path: path, uid: p.caller.uid, gid: p.caller.gid, bytes: nil,
                                                    kind: .directory, window: 0, from: p.parent.origin))
    }

    /// Moves the part `path` (from the top of the tree `grave` in the
    /// room) out into the room as its deleter, who may remove it, and on
    /// into the graveyard; a part that cannot be moved stays with the tree.
    private func bury(_ path: [[CChar]], of grave: UnsafePointer<CChar>, _ p: Pending) {
        guard let graveyard = deleter.graveyard, let reaper = deleter.reaper, let leaf = path.last else { return }
        do throws(Errno) {
            let by = try graveyard.identify(p.permissions.credentials)
            // Deleted with the tree: what came into it after that is judged so (`TreeRemover.cameInLater`).
            let reservation = graveyard.reserve(by: by, at: p.reservation.time)
            try p.permissions.acting { () throws(Errno) in
                var dir = try Sys.openat(p.room, grave, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                defer { Sys.close(dir) }
                for name in path.dropLast() {
                    let next = try Sys.openat(dir, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                    Sys.close(dir)
                    dir = next
                }
                try graveyard.withName(reservation) { part throws(Errno) in try Sys.renameNoReplace(dir, leaf, p.room, part) }
            }
            var record: TrashRecord?
            if var r = p.record {
                for name in path { r.path += [UInt8(ascii: "/")] + name.dropLast().map { UInt8(bitPattern: $0) } }
                let st = try graveyard.withName(reservation) { part throws(Errno) in try Sys.lstatat(p.room, part) }
                r.kind = TrashRecord.Kind(mode: st.st_mode)
                r.bytes = st.st_mode & S_IFMT == S_IFDIR ? nil : Sys.diskBytes(st)
                record = r
            }
            try graveyard.withName(reservation) { part throws(Errno) in
                reaper.noteBuried(shard: try graveyard.bury(p.room, part, record: record, reserved: reservation))
            }
        } catch {
            log.debug("a part of a one-step delete its deleter may remove stays with the tree",
                      metadata: ["error": "\(error)"])
        }
    }

    /// Trees a daemon that stopped between a one-step delete and its check
    /// left in a room, checked as the room's user (their groups as the user
    /// database has them now), as `settle` would have: buried (restorable
    /// where the undo window kept it) if they could have removed all of
    /// it, else put back where it was deleted from, as them, or where that
    /// fails held in their trash until restored. Where it came from was
    /// written before it moved in (`DeleterRooms.notePending`); a tree
    /// without that record (a piece the reaper moved on through the room)
    /// is held under its entry name. Trees named since `started` are this
    /// daemon's own one-step deletes, already queued for their check.
    private func recoverLeftovers(namedBefore started: UInt64) {
        guard let rooms = deleter.rooms, let graveyard = deleter.graveyard, let reaper = deleter.reaper else { return }
        for (uid, gid, held, names) in rooms.leftovers() {
            let room = held.fd
            defer { withExtendedLifetime(held) {} }
            let credentials = Credentials.ofUser(uid, fallbackGID: gid)
            let check = RemovalCheck(credentials: uid == 0 ? nil : credentials)
            for name in names where name.withCString({ Graveyard.burialTime($0) }).map({ $0 < started }) ?? true {
                let origin = name.withCString { rooms.pending(uid, $0) }
                do throws(Errno) {
                    let st = try Sys.lstatat(room, name)
                    // Freed as its deleter: as its name says when that is the
                    // room's user (a piece the reaper moved on as them), else
                    // as the room's user, whatever the name: they may have
                    // put anything in their room, under any name.
                    var by = name.withCString { DeletedBy(entryName: $0) }
                    if by?.uid != uid { by = try graveyard.identify(uid == 0 ? nil : credentials) }
                    // Deleted when its name says, if not later than now: what came
                    // into it after that is judged so (`TreeRemover.cameInLater`).
                    let deleted = min(name.withCString { Graveyard.burialTime($0) } ?? .max, Sys.wallClockNow())
                    do throws(Errno) {
                        try check.check(room, name, recursive: st.st_mode & S_IFMT == S_IFDIR)
                    } catch where error != .noSuchFileOrDirectory {
                        putBackLeftover(room, name, st: st, as: uid == 0 ? nil : credentials, origin: origin,
                                        deleted: deleted, by: by, why: error)
                        name.withCString { rooms.settled(uid, $0) }
                        continue
                    }
                    // A record the window kept (its window nil: the graveyard's), not one noted only for its path (0).
                    let kept = origin.flatMap { $0.window == 0 ? nil : $0 }
                    reaper.noteBuried(shard: try graveyard.bury(room, name, record: kept, deletion: .at(deleted), by: by))
                    name.withCString { rooms.settled(uid, $0) }
                } catch .noSuchFileOrDirectory {
                    // A reaper moving a piece on through the room took it first.
                } catch {
                    log.warning("a one-step delete left unchecked by an earlier daemon stays in its deleter's room",
                                metadata: ["uid": "\(uid)", "entry": "\(name)", "error": "\(error)"])
                }
            }
        }
        rooms.forgetSettled()
    }

    /// `putBack` for a tree an earlier daemon left unchecked: renamed to
    /// the path its origin record names, through directories opened one by
    /// one from the source's root without following a symlink, all as its
    /// deleter (`who`; nil for root); else held in their trash.
    private func putBackLeftover(_ room: Int32, _ name: String, st: stat, as who: Credentials?, origin: TrashRecord?,
                                 deleted: UInt64, by: DeletedBy?, why: Errno) {
        guard let graveyard = deleter.graveyard, let reaper = deleter.reaper else { return }
        let uid = who?.uid ?? 0
        var held = TrashRecord.Held.gone
        if let origin, case let parts = origin.path.split(separator: UInt8(ascii: "/")), let leaf = parts.last {
            do throws(Errno) {
                try Credentials.acting(who) { () throws(Errno) in
                    var dir = OwnedDescriptor(try Sys.openat(deleter.rootFD, ".", VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW))
                    for part in parts.dropLast() {
                        let next = try (Array(part) + [0]).withUnsafeBufferPointer { b throws(Errno) in
                            try b.withMemoryRebound(to: CChar.self) { c throws(Errno) in
                                try Sys.openat(dir.raw, c.baseAddress!, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                            }
                        }
                        dir = OwnedDescriptor(next)
                    }
                    try (Array(leaf) + [0]).withUnsafeBufferPointer { b throws(Errno) in
                        try b.withMemoryRebound(to: CChar.self) { c throws(Errno) in
                            try Sys.renameNoReplace(room, name, dir.raw, c.baseAddress!)
                            changes.restored(into: dir.raw, c.baseAddress!, path: origin.path,
                                             kind: TrashRecord.Kind(mode: st.st_mode).name, entry: name, uid: uid, kept: true)
                        }
                    }
                }
                state.withLock { $0.putBack += 1 }
                log.notice("a one-step delete an earlier daemon left unchecked was put back: its deleter could not have removed all of it with rm -r",
                           metadata: ["path": "\(String(decoding: origin.path, as: UTF8.self))", "uid": "\(uid)",
                                      "error": "\(why)"])
                return
            } catch {
                held = error == .fileExists || error == .directoryNotEmpty ? .taken
                    : error == .noSuchFileOrDirectory || error == .notDirectory ? .gone : .failed
            }
        }
        var record = origin ?? TrashRecord(path: Array(name.utf8), uid: uid, gid: who?.gid ?? 0, bytes: nil,
                                           kind: TrashRecord.Kind(mode: st.st_mode))
        record.held = held
        do throws(Errno) {
            reaper.noteBuried(shard: try graveyard.bury(room, name, record: record, deletion: .at(deleted), by: by))
            log.warning("a one-step delete an earlier daemon left unchecked is kept in its deleter's trash until restored",
                        metadata: ["path": "\(String(decoding: record.path, as: UTF8.self))", "uid": "\(uid)",
                                   "held": "\(held.rawValue)", "why": "\(why)"])
        } catch {
            log.warning("a one-step delete left unchecked by an earlier daemon stays in its deleter's room",
                        metadata: ["uid": "\(uid)", "entry": "\(name)", "error": "\(error)"])
        }
    }

    /// Moves the tree back to its name, as its deleter; where that fails
    /// (the name was taken, its directory went) it goes into their trash,
    /// held until restored (by them or root) whatever the window, with why.
    private func putBack(_ p: Pending, because why: Errno) {
        let path = p.name.withUnsafeBufferPointer { deleter.table.path(of: p.parent, appending: $0.baseAddress!) }
        do throws(Errno) {
            try deleter.graveyard!.withName(p.reservation) { grave throws(Errno) in
                try p.name.withUnsafeBufferPointer { n throws(Errno) in
                    try deleter.namespace.withFD(p.parent) { pfd throws(Errno) in
                        try p.permissions.acting { () throws(Errno) in
                            try Sys.renameNoReplace(p.room, grave, pfd, n.baseAddress!)
                        }
                        // As after a restore: the tree is usable again, and the
                        // kernel forgets any absence of the name it remembers.
                        if let st = try? Sys.lstatat(pfd, n.baseAddress!) { deleter.table.moved(st, to: p.parent, name: n.baseAddress!) }
                        _ = invalidations.send(parent: deleter.table.nodeID(p.parent), name: p.name, by: p.caller.uid,
                                               timeout: .seconds(1))
                        changes.restored(into: pfd, n.baseAddress!, path: path, kind: TrashRecord.Kind(mode: p.st.st_mode).name,
                                         entry: String(cString: grave), uid: p.caller.uid, kept: true)
                    }
                }
            }
            state.withLock { $0.putBack += 1 }
            log.notice("a one-step delete was put back: its deleter could not have removed all of it with rm -r",
                       metadata: ["path": "\(String(decoding: path, as: UTF8.self))", "uid": "\(p.caller.uid)",
                                  "error": "\(why)"])
        } catch {
            hold(p, path: path, because: error == .fileExists || error == .directoryNotEmpty ? .taken
                                         : error == .noSuchFileOrDirectory ? .gone : .failed, why: why, error: error)
        }
    }

    /// Buries what could not be put back as a trash entry of its deleter's
    /// that no window or limit frees; else it stays in the room, logged.
    private func hold(_ p: Pending, path: [UInt8], because held: TrashRecord.Held, why: Errno, error: Errno) {
        let shown = String(decoding: path, as: UTF8.self)
        var record = p.record ?? TrashRecord(path: path, uid: p.caller.uid, gid: p.caller.gid, bytes: nil,
                                             kind: TrashRecord.Kind(mode: p.st.st_mode))
        record.held = held
        do throws(Errno) {
            guard let graveyard = deleter.graveyard, let reaper = deleter.reaper else { throw .noSuchFileOrDirectory }
            try graveyard.withName(p.reservation) { grave throws(Errno) in
                reaper.noteBuried(shard: try graveyard.bury(p.room, grave, record: record, reserved: p.reservation))
            }
            log.warning("a one-step delete its deleter could not have completed is kept in their trash until restored",
                        metadata: ["path": "\(shown)", "uid": "\(p.caller.uid)", "held": "\(held.rawValue)",
                                   "why": "\(why)", "error": "\(error)"])
        } catch let kept {
            log.warning("a one-step delete its deleter could not have completed stays in their room: its place is taken or gone",
                        metadata: ["path": "\(shown)", "uid": "\(p.caller.uid)", "why": "\(why)", "error": "\(kept)"])
        }
    }
}
