import Glibc
import Synchronization

/// Where the pieces of a deleter's directory came from (see `TreeRemover`):
/// the reaper empties such a directory as its deleter and moves each
/// subdirectory out as an entry of its own. `rm -r` leaves a directory it
/// could not empty where it was, and its ancestors with it; so a piece its
/// deleter cannot wholly remove goes back into the directory it came from,
/// which waits for its pieces before it is removed, and then, not empty, is
/// held in turn, up to the entry that was buried, which goes back where it
/// was deleted from (`Reaper.Hooks.onHeld`).
///
/// Kept in memory only: after a restart, a waiting directory is removed
/// when empty and a piece is held on its own, restorable with --to.
///
/// Lock order: `state` is a leaf.
final class PieceFamilies: Sendable {
    /// Where a piece came from: the entry it was moved out of (in the shard
    /// whose fd is `shardFD`) and its name there.
    struct Origin: Sendable {
        let parent: String
        let shardFD: Int32
        let name: [UInt8]
    }

    private struct State {
        var origins: [String: Origin] = [:]
        /// Entries with pieces still out: how many.
        var waiting: [String: Int] = [:]
        /// Entries' children that came back: never moved out again.
        var kept: [String: Set<[UInt8]>] = [:]
    }

    private let state = Mutex(State())
    /// Whether anything is known, so the reaper's passes skip the lock when
    /// nothing is. Set and cleared under the lock.
    private let known = Atomic<Bool>(false)

    var isEmpty: Bool { !known.load(ordering: .relaxed) }

    /// At most this many pieces are followed at once (a few hundred bytes each):
    /// beyond, a directory does not wait, and a piece is held on its own.
    static let followed = 20_000

    /// The entry `parent` (in shard `shardFD`) had `pieces` moved out: it
    /// waits for them. False if it may not (too many followed already).
    func split(_ parent: String, shardFD: Int32, into pieces: [(entry: String, name: [UInt8])]) -> Bool {
        guard !pieces.isEmpty else { return false }
        return state.withLock { s in
            guard s.origins.count + pieces.count <= Self.followed else { return false }
            for p in pieces { s.origins[p.entry] = Origin(parent: parent, shardFD: shardFD, name: p.name) }
            s.waiting[parent, default: 0] += pieces.count
            known.store(true, ordering: .relaxed)
            return true
        }
    }

    /// Whether the entry `name` waits for pieces still out.
    func isWaiting(_ name: UnsafePointer<CChar>) -> Bool {
        guard !isEmpty else { return false }
        let id = String(cString: name)
        return state.withLock { $0.waiting[id] != nil }
    }

    /// Whether `child` of the entry `parent` came back and stays.
    func keeps(_ parent: String, _ child: UnsafePointer<CChar>) -> Bool {
        guard !isEmpty else { return false }
        let bytes = Array(UnsafeRawBufferPointer(start: child, count: strlen(child)))
        return state.withLock { $0.kept[parent]?.contains(bytes) == true }
    }

    /// Where the piece `entry` came from, if known.
    func origin(of entry: String) -> Origin? {
        guard !isEmpty else { return nil }
        return state.withLock { $0.origins[entry] }
    }

    /// The piece `entry` is done with: freed, or back in its parent
    /// (`cameBack`). Returns its parent's shard fd when the parent waits
    /// for no other piece (it is due again).
    func pieceDone(_ entry: String, cameBack: Bool) -> Int32? {
        guard !isEmpty else { return nil }
        return state.withLock { s -> Int32? in
            guard let o = s.origins.removeValue(forKey: entry) else { return nil }
            if cameBack { s.kept[o.parent, default: []].insert(o.name) }
            guard let n = s.waiting[o.parent] else { return nil }
            if n > 1 {
                s.waiting[o.parent] = n - 1
                return nil
            }
            s.waiting[o.parent] = nil
            return o.shardFD
        }
    }

    /// The entry `entry` is gone or held: nothing of it is kept any more.
    func forget(_ entry: String) {
        guard !isEmpty else { return }
        state.withLock { s in
            s.kept[entry] = nil
            // Under the lock, so a `split` meanwhile is never hidden.
            if s.origins.isEmpty && s.waiting.isEmpty && s.kept.isEmpty { known.store(false, ordering: .relaxed) }
        }
    }
}
