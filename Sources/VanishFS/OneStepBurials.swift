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
/// deleter's credentials, `RemovalCheck` asks whether `rm -r` by that user
/// would have emptied the tree. If so it goes on into the graveyard (the
/// undo window and the reaper take it from there); if not, it is put back
/// where it was, with the deleter's credentials again, and nothing of it is
/// freed: no reaper ever deletes what its deleter could not.
final class OneStepBurials: Sendable {
    /// One tree in its deleter's room, waiting for its check.
    struct Pending: Sendable {
        let room: Int32
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
        var busy = false
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
    var count: Int { state.withLock { $0.queue.count + ($0.busy ? 1 : 0) } }

    func start() {
        state.withLock { $0.running = true }
        spawnThread("vanish-onestep") { [self] in
            becomeBackgroundThread(nice: 10)
            recoverLeftovers()
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
        while state.withLock({ $0.running }) { _ = wake.wait(until: Condition.now() + 100_000_000) }
        wake.unlock()
    }

    private func run() {
        while true {
            let next: Pending? = state.withLock { s in
                if s.queue.isEmpty { return nil }
                s.busy = true
                return s.queue.removeFirst()
            }
            if let next {
                settle(next)
                state.withLock { $0.busy = false }
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
            if state.withLock({ $0.queue.isEmpty }) { _ = wake.wait(until: Condition.now() + 1_000_000_000) }
            wake.unlock()
        }
    }

    /// Into the graveyard if its deleter could have removed all of it, else back.
    private func settle(_ p: Pending) {
        let isDirectory = p.st.st_mode & S_IFMT == S_IFDIR
        do throws(Errno) {
            try deleter.graveyard!.withName(p.reservation) { grave throws(Errno) in
                let extent = try p.permissions.check(p.room, grave, recursive: isDirectory)
                _ = try deleter.buryTree(p.room, grave, st: p.st, from: p.parent, caller: p.caller, counted: extent,
                                         reserved: p.reservation, record: p.record, by: nil)
            }
        } catch {
            putBack(p, because: error)
        }
    }

    /// Trees a daemon that stopped between a one-step delete and its check
    /// left in a room: checked as the room's user (their groups as the user
    /// database has them now) and buried, not restorable, or else left
    /// where they are and logged: where they were is not known any more.
    private func recoverLeftovers() {
        guard let rooms = deleter.rooms, let graveyard = deleter.graveyard, let reaper = deleter.reaper else { return }
        for (uid, gid, room, names) in rooms.leftovers() {
            let credentials = Credentials.ofUser(uid, fallbackGID: gid)
            let check = RemovalCheck(credentials: uid == 0 ? nil : credentials)
            for name in names {
                do throws(Errno) {
                    let st = try Sys.lstatat(room, name)
                    try check.check(room, name, recursive: st.st_mode & S_IFMT == S_IFDIR)
                    // Freed as its deleter: as its name says, or else as the room's user.
                    var by = name.withCString { DeletedBy(entryName: $0) }
                    if by == nil { by = try graveyard.identify(uid == 0 ? nil : credentials) }
                    reaper.noteBuried(shard: try graveyard.bury(room, name, by: by))
                } catch .noSuchFileOrDirectory {
                    // A reaper moving a piece on through the room took it first.
                } catch {
                    log.warning("a one-step delete left unchecked by an earlier daemon stays in its deleter's room",
                                metadata: ["uid": "\(uid)", "entry": "\(name)", "error": "\(error)"])
                }
            }
        }
    }

    /// Moves the tree back to its name, as its deleter; where that fails
    /// (the name was taken, its directory went) it stays in the room, where
    /// nothing frees it, and the log says so.
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
                        _ = invalidations.send(parent: deleter.table.nodeID(p.parent), name: p.name, timeout: .seconds(1))
                        changes.restored(into: pfd, n.baseAddress!, path: path, kind: TrashRecord.Kind(mode: p.st.st_mode).name,
                                         entry: String(cString: grave), uid: p.caller.uid)
                    }
                }
            }
            log.notice("a one-step delete was put back: its deleter could not have removed all of it with rm -r",
                       metadata: ["path": "\(String(decoding: path, as: UTF8.self))", "uid": "\(p.caller.uid)",
                                  "error": "\(why)"])
        } catch {
            log.warning("a one-step delete its deleter could not have completed stays in their room: its place is taken or gone",
                        metadata: ["path": "\(String(decoding: path, as: UTF8.self))", "uid": "\(p.caller.uid)",
                                   "why": "\(why)", "error": "\(error)"])
        }
    }
}
