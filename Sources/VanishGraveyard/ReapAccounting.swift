import Synchronization

/// What the reaper buried, freed and has left to do, for status: counts
/// kept as the work goes, and for each deletion taken apart in pieces
/// what it has freed so far. In memory only: a restart counts from zero.
final class ReapAccounting: Sendable {
    /// What has been freed, and the recent pace.
    let progress = ReapProgress()
    private let buried = Atomic<UInt64>(0)
    /// Directories a worker handed back to the graveyard for others to take.
    private let splits = Atomic<UInt64>(0)
    /// What each deletion being reaped adds up to (see `ReapTallies`).
    private let tallies = Mutex(ReapTallies())
    /// How many files and directories each tree buried whole (`vanish rm`)
    /// holds, counted by the walk that checked it could go: the work left in
    /// it is that less what its tally freed.
    private let treeSizes = Mutex<[String: UInt64]>([:])
    private let treesKnown = Atomic<Int>(0)
    /// Disk bytes buried since the start (files' blocks, trees' as their walk
    /// counted them): less what was freed, the space the graveyard holds.
    private let heldBytes = Atomic<UInt64>(0)

    /// Something was buried, holding `bytes` (0 if unknown).
    @inline(__always)
    func buried(bytes: UInt64) {
        buried.wrappingAdd(1, ordering: .sequentiallyConsistent)
        if bytes != 0 { heldBytes.wrappingAdd(bytes, ordering: .relaxed) }
    }

    /// `piece` was handed back to the graveyard from the deletion `origin` (nil: untracked).
    func split(_ piece: String, from origin: String?) {
        if let origin { tallies.withLock { $0.split(piece, from: origin) } }
        splits.wrappingAdd(1, ordering: .sequentiallyConsistent)
    }

    /// Changes whenever anything lands in the graveyard.
    var generation: UInt64 {
        buried.load(ordering: .sequentiallyConsistent) &+ splits.load(ordering: .sequentiallyConsistent)
    }

    var statistics: Reaper.Statistics {
        Reaper.Statistics(entries: progress.entries.load(ordering: .relaxed), freed: progress.total,
                          buried: buried.load(ordering: .relaxed))
    }

    /// A tree buried whole holds `bytes` more than its own directory's blocks.
    func held(bytes: UInt64) { heldBytes.wrappingAdd(bytes, ordering: .relaxed) }

    /// Disk space the graveyard holds as far as known: what was buried since
    /// the start less what was freed.
    var holdingBytes: UInt64 {
        let buried = heldBytes.load(ordering: .relaxed), freed = progress.total.diskBytes
        return buried > freed ? buried - freed : 0
    }

    /// The tree `entry` just buried holds `count` files and directories, itself included.
    func expectTree(_ entry: String, count: Int) {
        treeSizes.withLock { $0[entry] = UInt64(count) }
        treesKnown.wrappingAdd(1, ordering: .relaxed)
    }

    /// The tree `entry` left the graveyard without the reaper: its size no longer counts.
    func forgetTree(_ entry: String) {
        guard treesKnown.load(ordering: .relaxed) > 0, treeSizes.withLock({ $0.removeValue(forKey: entry) }) != nil else { return }
        treesKnown.wrappingSubtract(1, ordering: .relaxed)
    }

    /// Whether any tree's size is known: a worker then tracks where pieces came from.
    var knowsTrees: Bool { treesKnown.load(ordering: .relaxed) > 0 }

    /// The deletion `entry` belongs to: itself, or for a piece the entry it
    /// came from (nil for a piece left from before a restart).
    func origin(of entry: String, isPiece: Bool) -> String? {
        tallies.withLock { $0.origin(of: entry, isPiece: isPiece) }
    }

    /// Adds what removing `entry` freed to its deletion's tally; returns the
    /// whole deletion's total once nothing of it is left.
    func tally(_ origin: String, entry: String, freed: Freed, done: Bool) -> Freed? {
        guard let finished = tallies.withLock({ $0.add(freed, to: origin, entry: entry, done: done) }) else { return nil }
        forgetTree(origin)
        return finished
    }

    /// Deletions among the graveyard's `names` (each with whether it is a
    /// piece): a tree being taken apart counts once, until its last piece is
    /// gone, however many pieces it is in; pieces left from before a restart
    /// count as one. So the count never grows while the reaper works.
    func deletions(_ names: [(id: String, isPiece: Bool)]) -> Int {
        let pieces = tallies.withLock { $0.pieces }
        var originals = Set<String>()
        var split = Set<String>()
        var untracked = false
        for (id, isPiece) in names {
            if !isPiece {
                originals.insert(id)
            } else if let origin = pieces[id] {
                split.insert(origin)
            } else {
                untracked = true
            }
        }
        return originals.count + split.subtracting(originals).count + (untracked ? 1 : 0)
    }

    /// Files and directories left to delete in the `due` entries: one for
    /// each entry but a tree, and what is left of each tree of known size.
    /// nil when a piece of a tree of unknown size is among them.
    func remainingWork(_ due: [(id: String, isPiece: Bool)]) -> Int? {
        let sizes = treeSizes.withLock { $0 }
        let (origins, pieces) = tallies.withLock { ($0.freedByOrigin, $0.pieces) }
        var work: UInt64 = 0
        var trees = Set<String>()
        for (id, isPiece) in due {
            if isPiece {
                guard let origin = pieces[id], sizes[origin] != nil else { return nil }
                trees.insert(origin)
            } else if sizes[id] != nil {
                trees.insert(id)
            } else {
                work += 1
            }
        }
        for tree in trees {
            let total = sizes[tree] ?? 0
            let freed = origins[tree].map { $0.files &+ $0.directories } ?? 0
            work += total > freed ? total - freed : 0
        }
        return Int(work)
    }
}

/// What each deletion being reaped adds up to. A tree's subdirectories
/// become entries of their own (pieces) that any worker may take, so its
/// `reaped` report waits until the last piece is gone and then counts the
/// whole tree. In memory only: pieces left by a crash are freed without a report.
struct ReapTallies {
    private struct Tally {
        /// The entry itself (until done) plus pieces not yet freed.
        var open = 1
        var freed = Freed()
    }
    private var origins: [String: Tally] = [:]
    /// Each piece's deletion.
    private(set) var pieces: [String: String] = [:]

    /// What each deletion still open has freed so far.
    var freedByOrigin: [String: Freed] { origins.mapValues(\.freed) }

    /// The deletion `entry` belongs to: itself (counted from now), or for a
    /// piece the deletion it came from (nil for a piece left from before a restart).
    mutating func origin(of entry: String, isPiece: Bool) -> String? {
        if let origin = pieces[entry] { return origin }
        if isPiece { return nil }
        if origins[entry] == nil { origins[entry] = Tally() }
        return entry
    }

    /// `piece` was split off the deletion `origin`: it stays open until the piece is freed too.
    mutating func split(_ piece: String, from origin: String) {
        pieces[piece] = origin
        origins[origin, default: Tally()].open += 1
    }

    /// Adds what removing `entry` (`done`: all of it) freed to `origin`'s
    /// tally; returns the whole deletion's total once nothing of it is left.
    mutating func add(_ freed: Freed, to origin: String, entry: String, done: Bool) -> Freed? {
        guard var tally = origins[origin] else { return nil }
        tally.freed += freed
        if done {
            tally.open -= 1
            pieces.removeValue(forKey: entry)
        }
        if tally.open > 0 {
            origins[origin] = tally
            return nil
        }
        origins.removeValue(forKey: origin)
        return tally.freed
    }
}
