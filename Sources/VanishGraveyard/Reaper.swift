import CLinux
import Dispatch
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Empties the graveyard in the background: a bounded number of worker
/// threads in the idle I/O and CPU classes while the mount serves (nice 19
/// once it does not, space runs short, or the idle class starves them), so
/// work through the mount is not starved. Each worker owns a slice of the
/// shards. Whatever is left when the process ends (a crash, SIGKILL,
/// SIGTERM) stays on disk and is reaped at the next start.
public final class Reaper: @unchecked Sendable {
    public struct Statistics: Sendable, Equatable {
        /// Graveyard entries (files or whole trees) removed.
        public var entries: UInt64
        /// What they held.
        public var freed: Freed
        /// Entries moved into the graveyard since start.
        public var buried: UInt64

        public static let zero = Statistics(entries: 0, freed: Freed(), buried: 0)
    }

    /// How long deleted entries stay restorable, and what cuts that short.
    public struct Policy: Sendable {
        /// The undo window in ns; 0 reaps as soon as possible.
        public var keep: UInt64 = 0
        /// Most bytes the restorable entries may hold; the oldest go first beyond it.
        public var keepMaxBytes: UInt64?
        /// Files younger than this (ns since their birth) when deleted are not
        /// kept: journals, swap and lock files, placeholders a program made
        /// and removed moments later. 0 keeps them too.
        public var keepMinAge: UInt64 = 5_000_000_000
        /// Names (fnmatch patterns on the last component) never kept.
        public var keepExclude: [String] = []
        /// Percent of the backing filesystem to keep free: below it the
        /// oldest entries are reaped whatever their window.
        public var keepMinFreePercent: Double = 10
        /// Most files and directories deleted per second (all workers together).
        public var rate: Double?
        /// While requests keep arriving through the mount, a worker waits
        /// before its next deletion until a pause of 1-8 ms without one; failing
        /// that, the workers delete one file per this many ns among them all;
        /// 0 never waits. Idle priorities alone are not enough: a deletion
        /// holds the directory's and the journal's locks and a CPU that a
        /// request then waits for.
        public var yieldToForeground: UInt64 = 20_000_000
        /// Free kept entries too, whatever their windows (`vanish reap`:
        /// emptying the graveyard is what was asked for).
        public var freesKeptEntries = false

        public init() {}
    }

    public enum Stop: Int {
        case running = 0
        /// Stop once the graveyard is empty.
        case whenEmpty = 1
        /// Stop as soon as each worker finishes the entry it is on.
        case now = 2
    }

    public let graveyard: Graveyard
    public let workerCount: Int
    private let progress = ReapProgress()
    private let buried = Atomic<UInt64>(0)
    /// Directories a worker handed back to the graveyard for others to take.
    private let splits = Atomic<UInt64>(0)
    private let stopState = Atomic<Int>(0)
    /// Bit w is set while worker w sleeps.
    private let idleMask = Atomic<UInt64>(0)
    /// Bit s is set when shard s got an entry since its owner last looked:
    /// a worker woken for one burial scans one shard, not all of its own
    /// (a pass over 32 shards per unlink cost a fifth of the daemon's CPU).
    /// All set at start, so leftovers of a crash are found.
    private let dirty = Atomic<UInt64>(~0)
    /// One per worker: a wakeup must reach the worker that owns the shard.
    private let wakeups: [DispatchSemaphore]
    private let threads: [WorkerThread]
    private let watchdogWakeup = DispatchSemaphore(value: 0)
    private let finished = DispatchSemaphore(value: 0)
    private let started = Atomic<Bool>(false)
    public let policy: Policy
    /// Entries deleted at or before this time (ns) are due now, inside
    /// their window or not: space ran short or the byte limit was passed.
    private let wardenWakeup = DispatchSemaphore(value: 0)
    private let limiter: RateLimiter?
    /// Called after each graveyard entry is freed, with what it held.
    /// Set before `start`.
    public var onReaped: (@Sendable (String, Freed) -> Void)?
    /// Called the first time an entry cannot be deleted: (entry id, error).
    /// Set before `start`.
    public var onStuck: (@Sendable (String, Errno) -> Void)?
    /// Called for an entry its deleter could not wholly remove, now kept in
    /// their trash until restored (`Graveyard.hold`).
    public var onHeld: (@Sendable (String, Errno) -> Void)?
    /// Called each time the window's limits give kept entries up early.
    public var onShortened: (@Sendable (Shortening) -> Void)?

    /// Kept entries given up before their windows ended, and why.
    public struct Shortening: Sendable {
        public var entries: Int
        public var bytes: UInt64
        /// Wall clock (ns) of the latest.
        public var at: UInt64
        /// "free space under keep_min_free (10%)" or "keep_max_bytes (20.0 GiB) reached".
        public var because: String
    }
    /// Since the mount: every shortening's entries and bytes, the latest's time and reason.
    private let shortenings = Mutex<Shortening?>(nil)
    public var shortened: Shortening? { shortenings.withLock { $0 } }

    /// Whether a worker waited for the mount to go quiet in the last second:
    /// the pace then says how busy the mount is, not how fast the reaper
    /// frees, and no estimate of the time left can be made from it.
    public var yieldsToForeground: Bool {
        let last = foregroundTurns.lastWaited.load(ordering: .relaxed)
        return last != 0 && Condition.now() &- last < Duration.seconds(1).nanoseconds
    }
    /// Entries the reaper could not delete (an immutable file inside, a
    /// directory the daemon may not write), by name: when each is tried
    /// again, and its shard. Without this, a pass that found only such an
    /// entry counted as work done, and after an unmount the workers spun
    /// on it at full CPU and the daemon never exited.
    private let stuck = Mutex<[String: (shard: Int32, retryAt: UInt64)]>([:])
    /// `stuck.count`, read without the lock by every pass.
    private let stuckCount = Atomic<Int>(0)
    /// How long a stuck entry waits before it is tried again while the mount serves.
    static let stuckRetry = Duration.seconds(60).nanoseconds
    /// How often a worker without an undo window looks through all of its
    /// shards, burials or not: a guard against the unforeseen. What it
    /// knows to look at again (an entry a restore held, a stuck entry's
    /// retry) sets an earlier time, so an idle mount's workers rarely read
    /// their shards (docs/decisions.md).
    static let rescanInterval = Duration.seconds(60).nanoseconds
    /// How soon an entry a restore held is looked at again.
    static let heldRetry = Duration.seconds(1).nanoseconds
    /// Set while the watchdog sleeps because every worker does: the first
    /// worker to wake wakes it.
    private let watchParked = Atomic<Bool>(false)
    /// How many requests the mount has begun to serve (any number that
    /// changes with each request); the workers step aside while it moves.
    /// Set before `start`; nil when nothing is mounted (`vanish reap`).
    public var foregroundRequests: (@Sendable () -> UInt64)?
    /// When a worker last deleted while the mount stayed busy (shared).
    private let foregroundTurns = ForegroundTurns()
    /// What each deletion being reaped adds up to (see `ReapTallies`).
    private let tallies = Mutex(ReapTallies())
    /// How many files and directories each tree buried whole (`vanish rm`)
    /// holds, counted by the walk that checked it could go: the work left in
    /// it is that less what its tally freed. In memory only.
    private let treeSizes = Mutex<[String: UInt64]>([:])
    private let treesKnown = Atomic<Int>(0)
    /// Disk bytes buried since the start (files' blocks, trees' as their walk
    /// counted them): less what was freed, the space the graveyard holds.
    private let heldBytes = Atomic<UInt64>(0)
    /// Set while the backing filesystem is short of space: no stepping aside then.
    private let spaceShort = Atomic<Bool>(false)
    /// A request met ENOSPC while entries are kept (see `makeRoom`).
    private let roomWanted = Atomic<Bool>(false)
    /// Free bytes and the floor in bytes, as the warden last saw them.
    private let lastFree = Atomic<UInt64>(.max)
    private let floorBytes = Atomic<UInt64>(0)
    /// When (CLOCK_MONOTONIC ns) the warden last looked.
    private let lastLook = Atomic<UInt64>(0)
    /// The warden looks at free space once a second only (nothing kept):
    /// the first entry kept wakes it to look every few milliseconds.
    private let wardenResting = Atomic<Bool>(true)
    private let spaceCheckedAt = Atomic<UInt64>(0)

    public init(graveyard: Graveyard, workers: Int, policy: Policy = Policy()) {
        self.graveyard = graveyard
        self.policy = policy
        graveyard.window.store(policy.keep, ordering: .relaxed)
        workerCount = max(1, min(workers, Graveyard.shardCount))
        wakeups = (0..<workerCount).map { _ in DispatchSemaphore(value: 0) }
        threads = (0..<workerCount).map { _ in WorkerThread() }
        limiter = policy.rate.map(RateLimiter.init(perSecond:))
    }

    /// Workers for a graveyard when none are asked for: one per core on a
    /// local disk. On a network (or FUSE) backend each deletion waits on a
    /// round trip, and workers on different directories overlap them; within
    /// one directory they do not (GlusterFS serializes a directory's entry
    /// changes): 8 workers drained 3,000 files in 30 directories of a
    /// replica-2 volume in 3.05 s against 4.09 s with 2 (native rm -rf: 4.85 s).
    public static func defaultWorkers(for graveyard: Graveyard) -> Int {
        let cores = Int(sysconf(Int32(_SC_NPROCESSORS_ONLN)))
        return FilesystemKind.isRemote(graveyard.stateFD) ? max(cores, remoteWorkers) : cores
    }
    public static let remoteWorkers = 8

    /// Whether entries wait out an undo window.
    @inline(__always)
    var keeps: Bool { policy.keep > 0 }

    /// Files and entries freed per second over the last few seconds.
    public struct Pace: Sendable {
        public var filesPerSecond: Double
        public var entriesPerSecond: Double
        public static let zero = Pace(filesPerSecond: 0, entriesPerSecond: 0)
    }

    /// The pace over the last few seconds.
    public var pace: Pace { progress.pace(notBefore: foregroundTurns.lastWaited.load(ordering: .relaxed)) }

    public var statistics: Statistics {
        Statistics(entries: progress.entries.load(ordering: .relaxed), freed: progress.total,
                   buried: buried.load(ordering: .relaxed))
    }

    /// Starts the workers. Call after any fork (daemonizing): threads don't survive it.
    public func start() {
        guard !started.exchange(true, ordering: .relaxed) else { return }
        for w in 0..<workerCount { spawnThread("vanish-reaper") { [self] in work(w) } }
        // Entries kept under an earlier mount's window are held to the limits too.
        if keeps || !graveyard.trash.isEmpty { spawnThread("vanish-keep") { [self] in ward() } }
        // Only a serving mount puts workers in the idle class.
        if foregroundRequests != nil { spawnThread("vanish-watch") { [self] in watch() } }
    }

    /// Something was buried in `shard`: wake its worker if it sleeps (one
    /// atomic load when it does not). `dueNow`: buried without a trash
    /// record (the disk was full), so not held by the undo window.
    @inline(__always)
    public func noteBuried(shard: Int, dueNow: Bool = false, sizeUnknown: Bool = false, bytes: UInt64 = 0) {
        buried.wrappingAdd(1, ordering: .sequentiallyConsistent)
        if bytes != 0 { heldBytes.wrappingAdd(bytes, ordering: .relaxed) }
        // Inside an undo window nothing new is due yet; only the limits may be.
        if keeps && !dueNow {
            if let max = policy.keepMaxBytes, graveyard.restorableBytes > max { wardenWakeup.signal() }
            if policy.keepMaxBytes != nil && sizeUnknown { wardenWakeup.signal() }
            // The first entry kept: the warden starts watching free space closely.
            if wardenResting.load(ordering: .relaxed) && wardenResting.exchange(false, ordering: .relaxed) {
                wardenWakeup.signal()
            }
        } else {
            dirty.bitwiseOr(1 << UInt64(shard), ordering: .sequentiallyConsistent)
            wake(owner(of: shard))
        }
    }

    /// Entries in `shard` became due outside a burial (`Graveyard.letGo`): its worker looks again now.
    public func dueNow(shard: Int) {
        dirty.bitwiseOr(1 << UInt64(shard), ordering: .sequentiallyConsistent)
        wake(owner(of: shard))
    }

    @inline(__always)
    private func owner(of shard: Int) -> Int { shard % workerCount }

    @inline(__always)
    private func wake(_ worker: Int) {
        if idleMask.load(ordering: .sequentiallyConsistent) & (1 << UInt64(worker)) != 0 { wakeups[worker].signal() }
    }

    /// Asks the workers to stop (now, or once the graveyard is empty) and waits for them.
    public func stop(_ how: Stop) {
        stopState.store(max(stopState.load(ordering: .relaxed), how.rawValue), ordering: .relaxed)
        guard started.load(ordering: .relaxed) else { return }
        wakeups.forEach { $0.signal() }
        wardenWakeup.signal()
        watchdogWakeup.signal()
    }

    /// Waits until every worker has stopped.
    public func join() {
        guard started.load(ordering: .relaxed) else { return }
        for _ in 0..<workerCount { finished.wait() }
        started.store(false, ordering: .relaxed)
    }

    /// Every worker is asleep: the graveyard was empty at each one's last
    /// pass and nothing landed since. (A scan alone can miss an entry a
    /// worker is moving from one shard to another.)
    public var isIdle: Bool {
        guard started.load(ordering: .relaxed) else { return true }
        return idleMask.load(ordering: .sequentiallyConsistent) == allWorkers
    }

    /// `idleMask` with every worker asleep.
    private var allWorkers: UInt64 { workerCount >= 64 ? ~0 : (1 << UInt64(workerCount)) - 1 }

    /// Deletions in the graveyard now (a directory scan: for status, not the
    /// hot path). A tree being taken apart counts once, until its last piece
    /// is gone, however many pieces it is in; pieces left from before a
    /// restart count as one. So the count never grows while the reaper works.
    public func pendingEntries() -> Int {
        let pieces = tallies.withLock { $0.pieces }
        var originals = Set<String>()
        var split = Set<String>()
        var untracked = false
        forEachPending { name, isPiece in
            let id = String(cString: name)
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

    /// Calls `body` with each entry's name in the graveyard and whether it is a piece.
    private func forEachPending(_ body: (UnsafePointer<CChar>, Bool) -> Void) {
        for shard in graveyard.shardFDs {
            guard let dp = try? Sys.openDirectory(shard, ".") else { continue }
            while let d = readdir(dp) {
                let name = vanish_dirent_name(d)!
                if name[0] != 0x2E { body(name, Graveyard.isPiece(name)) }
            }
            closedir(dp)
        }
    }

    /// The tree `entry` left the graveyard without the reaper (restored, or
    /// renamed by `letGo`): its size no longer counts, and once no tree's
    /// does, reaping stops tracking where pieces came from.
    public func forgetTree(_ entry: String) {
        guard treesKnown.load(ordering: .relaxed) > 0, treeSizes.withLock({ $0.removeValue(forKey: entry) }) != nil else { return }
        treesKnown.wrappingSubtract(1, ordering: .relaxed)
    }

    /// A tree buried whole holds `bytes` more than its own directory's blocks.
    public func noteHeld(bytes: UInt64) { heldBytes.wrappingAdd(bytes, ordering: .relaxed) }

    /// Disk space the graveyard holds, kept entries included, as far as known:
    /// what was buried since the start less what was freed (entries left
    /// from before the start are not in it, nor trees of unknown size).
    public var holdingBytes: UInt64 {
        let buried = heldBytes.load(ordering: .relaxed), freed = progress.total.diskBytes
        return buried > freed ? buried - freed : 0
    }

    /// The tree `entry` just buried holds `count` files and directories, itself included.
    public func expectTree(_ entry: String, count: Int) {
        treeSizes.withLock { $0[entry] = UInt64(count) }
        treesKnown.wrappingAdd(1, ordering: .relaxed)
    }

    /// Files and directories left to delete in the entries that are due (not
    /// kept by the undo window, not stuck): one for each entry but a tree,
    /// and what is left of each tree of known size. nil when a piece of a
    /// tree of unknown size (left from before a restart, or adopted) is
    /// waiting: the work in it cannot be told without walking it.
    public func remainingWork() -> Int? {
        let stuckNow = Set(stuckEntries())
        let sizes = treeSizes.withLock { $0 }
        let (origins, pieces) = tallies.withLock { ($0.freedByOrigin, $0.pieces) }
        let judging = keeps || !graveyard.trash.isEmpty
        var work: UInt64 = 0
        var unknown = false
        var trees = Set<String>()
        forEachPending { name, isPiece in
            let id = String(cString: name)
            if stuckNow.contains(id) { return }
            if isPiece {
                guard let origin = pieces[id], sizes[origin] != nil else { unknown = true; return }
                trees.insert(origin)
                return
            }
            if judging && !isDue(kept: name) { return }
            if sizes[id] != nil { trees.insert(id) } else { work += 1 }
        }
        if unknown { return nil }
        for tree in trees {
            let total = sizes[tree] ?? 0
            let freed = origins[tree].map { $0.files &+ $0.directories } ?? 0
            work += total > freed ? total - freed : 0
        }
        return Int(work)
    }

    /// Whether the kept entry `name` has reached the end of its window (or was given up for the limits).
    private func isDue(kept name: UnsafePointer<CChar>) -> Bool {
        var ignored = UInt64.max
        return isDue(name, Graveyard.deletionTime(name) ?? 0, now: Sys.wallClockNow(), nextDue: &ignored)
    }

    /// Changes whenever anything lands in the graveyard.
    private var generation: UInt64 {
        buried.load(ordering: .sequentiallyConsistent) &+ splits.load(ordering: .sequentiallyConsistent)
    }

    private func work(_ index: Int) {
        let me = threads[index]
        me.attach()
        defer {
            me.detach()
            finished.signal()
        }
        func reschedule() {
            // Fresh: a worker gets here once per wakeup or pass over its shards.
            let idle = foregroundRequests != nil && stopState.load(ordering: .relaxed) == Stop.running.rawValue
                && !isSpaceShort(fresh: true) && !me.lifted.load(ordering: .relaxed)
            me.set(idle ? .idle : .background)
        }
        me.set(.background)
        reschedule()
        let mineMask = stride(from: index, to: Graveyard.shardCount, by: workerCount)
            .reduce(UInt64(0)) { $0 | 1 << UInt64($1) }
        var nextFullScan = Sys.wallClockNow() &+ Self.rescanInterval
        while true {
            let state = stopState.load(ordering: .relaxed)
            if state == Stop.now.rawValue { return }
            reschedule()
            let seen = generation
            var found = 0
            var nextDue = UInt64.max
            // When finishing, every worker sweeps every shard: others may still
            // hand subdirectories into any of them, and the last one out must see them.
            // Inside an undo window entries come due by time, not by burial: scan all.
            var shards: UInt64
            if state == Stop.whenEmpty.rawValue {
                shards = ~0
            } else if keeps {
                shards = mineMask
            } else {
                shards = dirty.bitwiseAnd(~mineMask, ordering: .sequentiallyConsistent).oldValue & mineMask
                // Checked even when burials never let this worker sleep out its timeout.
                let now = Sys.wallClockNow()
                if now >= nextFullScan { shards = mineMask; nextFullScan = now &+ Self.rescanInterval }
            }
            // Each worker starts its sweep at its own place among the shards:
            // sweeping all of them from shard 0, as finishing workers did, put
            // every worker on the same entry, and on GlusterFS (which serializes
            // a directory's changes) a reaper finishing after an unmount freed
            // 4,000 files in 40 directories in 21.6 s against 3.9 s while mounted.
            let start = index * Graveyard.shardCount / workerCount
            for k in 0..<Graveyard.shardCount where shards != 0 {
                let shard = (start + k) % Graveyard.shardCount
                guard shards & (1 << UInt64(shard)) != 0 else { continue }
                shards &= ~(1 << UInt64(shard))
                found += reap(graveyard.shardFDs[shard], nextDue: &nextDue)
                if stopState.load(ordering: .relaxed) == Stop.now.rawValue { return }
            }
            // Held and stuck entries set nextDue to when to look at them again.
            if !keeps { nextFullScan = min(nextFullScan, nextDue) }
            if found > 0 { continue }
            if stopState.load(ordering: .relaxed) == Stop.whenEmpty.rawValue { return }
            // Announce being idle, then look once more: whoever buries after this
            // sees the bit and signals; whoever buried before, we see here.
            let bit: UInt64 = 1 << UInt64(index)
            // Out of work: the next busy spell starts in the idle class again
            // (set now: the worker may sleep for many seconds).
            me.lifted.store(false, ordering: .relaxed)
            reschedule()
            idleMask.bitwiseOr(bit, ordering: .sequentiallyConsistent)
            var woken = false
            if generation == seen {
                woken = wakeups[index].wait(timeout: sleepUntil(keeps ? nextDue : nextFullScan)) == .success
            }
            idleMask.bitwiseAnd(~bit, ordering: .sequentiallyConsistent)
            if watchParked.load(ordering: .sequentiallyConsistent) { watchdogWakeup.signal() }
            if woken && !keeps && stopState.load(ordering: .relaxed) == Stop.running.rawValue {
                // Let deletions gather: a program unlinking one file after another
                // then costs one wakeup and one shard scan per 10 ms, not per file.
                usleep(10_000)
            }
        }
    }

    /// Until `nextDue` (wall clock, ns). Without a window, wakeups come from
    /// noteBuried, and `nextDue` is the next full scan; with one, the next
    /// entry's window end.
    private func sleepUntil(_ nextDue: UInt64) -> DispatchTime {
        // Nothing waiting: whatever is buried from now on is due a window later at the earliest.
        let now = Sys.wallClockNow()
        let due = nextDue == .max ? now &+ policy.keep : nextDue
        let wait = due > now ? min(due - now, Duration.seconds(30).nanoseconds) : 0
        return .now() + .nanoseconds(Int(max(wait, Duration.milliseconds(50).nanoseconds)))
    }

    /// A record from before windows were written down is kept this long
    /// when the mount has no window (it was deleted under one, unknown).
    static let legacyWindow = Duration.seconds(3600).nanoseconds

    /// Whether the entry `name`, deleted at `time`, may be reaped now: a
    /// kept entry at the end of its own window (whatever this mount's), one
    /// not (yet) in the index a window after its deletion, and any entry
    /// given up for the window's limits (`FairEviction`) at once.
    @inline(__always)
    private func isDue(_ name: UnsafePointer<CChar>, _ time: UInt64, now: UInt64, nextDue: inout UInt64) -> Bool {
        guard time > 1, !policy.freesKeptEntries else { return true }
        let legacy = keeps ? policy.keep : Self.legacyWindow
        let end: UInt64
        if !graveyard.trash.isEmpty, let until = graveyard.trash.keptUntil(name, legacyWindow: legacy) {
            end = until
        } else if keeps {
            // Buried under this window, its record not indexed yet.
            end = time &+ policy.keep
        } else {
            return true
        }
        if end <= now { return true }
        nextDue = min(nextDue, end)
        return false
    }

    /// One pass over a shard; returns how many entries it took.
    private func reap(_ shard: Int32, nextDue: inout UInt64) -> Int {
        guard let dp = try? Sys.openDirectory(shard, ".") else { return 0 }
        defer { closedir(dp) }
        var found = 0
        var remover = TreeRemover(graveyard: graveyard, progress: progress, limiter: limiter, gate: gate(),
                                  shouldStop: { [self] in stopState.load(ordering: .relaxed) == Stop.now.rawValue },
                                  handedBack: { [self] shard, piece, origin in
                                      if let origin { tallies.withLock { $0.split(piece, from: origin) } }
                                      dirty.bitwiseOr(1 << UInt64(shard), ordering: .sequentiallyConsistent)
                                      splits.wrappingAdd(1, ordering: .sequentiallyConsistent)
                                      wake(owner(of: shard))
                                  })
        let judging = (keeps || !graveyard.trash.isEmpty) && !policy.freesKeptEntries
        let now = judging ? Sys.wallClockNow() : 0
        while let d = readdir(dp) {
            let name = vanish_dirent_name(d)!
            if name[0] == 0x2E { continue }
            if judging && !isDue(name, Graveyard.deletionTime(name) ?? 0, now: now, nextDue: &nextDue) { continue }
            if stuckCount.load(ordering: .relaxed) > 0 && isStuck(name, nextDue: &nextDue) { continue }
            var restorable = false
            // A restore holds it: leave it alone, and look again soon (a
            // failed restore puts it back without a burial to wake anyone).
            guard graveyard.trash.claimForReaping(name, had: &restorable) else {
                nextDue = min(nextDue, Sys.wallClockNow() &+ Self.heldRetry)
                continue
            }
            found += 1
            let entry = onReaped == nil && treesKnown.load(ordering: .relaxed) == 0 ? nil : String(cString: name)
            remover.origin = entry.flatMap { origin(of: $0, isPiece: Graveyard.isPiece(name)) }
            let done = remover.remove(dirfd(dp), name)
            remover.report()
            // Another worker took it first (see TreeRemover.removedEntry):
            // its deletion is that worker's to count and report.
            let gone = done && remover.removedEntry
            if let entry, let origin = remover.origin, !remover.vanished {
                tally(origin, entry: entry, freed: remover.freed, done: gone)
            }
            if gone {
                // A deletion is done once; its pieces are not deletions of their own.
                if !Graveyard.isPiece(name) { progress.entryDone() }
                if stuckCount.load(ordering: .relaxed) > 0 { unstick(name) }
            } else if done, !remover.vanished, let failure = remover.failure, stillThere(dirfd(dp), name) {
                // Not work done: a pass that found only this must let its worker rest.
                found -= 1
                // Refused to its deleter, or left holding what was (ENOTEMPTY).
                if failure == .permissionDenied || failure == .notPermitted || failure == .directoryNotEmpty,
                   let index = graveyard.shardFDs.firstIndex(of: shard), graveyard.hold(shard: index, name, because: .stuck) {
                    // What its deleter may not remove: kept for them to restore, never retried.
                    restorable = false
                    if stuckCount.load(ordering: .relaxed) > 0 { unstick(name) }
                    onHeld?(String(cString: name), failure)
                } else {
                    stick(name, shard: shard, failure)
                    nextDue = min(nextDue, Sys.wallClockNow() &+ Self.stuckRetry)
                }
            }
            if done && restorable { graveyard.removeSidecar(dirfd(dp), name) }
            remover.freed = Freed()
            if !done { break }
        }
        return found
    }

    /// Whether `name` is a stuck entry to leave alone for now: until its
    /// retry time (which then bounds `nextDue`, wall clock), and for good
    /// once the reaper is finishing (it waits for the next mount or `vanish reap`).
    private func isStuck(_ name: UnsafePointer<CChar>, nextDue: inout UInt64) -> Bool {
        let retryAt: UInt64? = stuck.withLock { m in m[String(cString: name)]?.retryAt }
        guard let retryAt else { return false }
        if stopState.load(ordering: .relaxed) != Stop.running.rawValue { return true }
        let now = Condition.now()
        guard now < retryAt else { return false }
        nextDue = min(nextDue, Sys.wallClockNow() &+ (retryAt &- now))
        return true
    }

    /// Whether `name` may still be in `dirFD`: anything but ENOENT says so
    /// (an entry lstat fails on is no more deletable than one it finds).
    private func stillThere(_ dirFD: Int32, _ name: UnsafePointer<CChar>) -> Bool {
        do { _ = try Sys.lstatat(dirFD, name) } catch { return error != .noSuchFileOrDirectory }
        return true
    }

    private func stick(_ name: UnsafePointer<CChar>, shard: Int32, _ failure: Errno) {
        let id = String(cString: name)
        let first: Bool = stuck.withLock { m in
            let first = m.updateValue((shard, Condition.now() &+ Self.stuckRetry), forKey: id) == nil
            stuckCount.store(m.count, ordering: .relaxed)
            return first
        }
        if first { onStuck?(id, failure) }
    }

    private func unstick(_ name: UnsafePointer<CChar>) {
        stuck.withLock { m in
            if m.removeValue(forKey: String(cString: name)) != nil { stuckCount.store(m.count, ordering: .relaxed) }
        }
    }

    /// The entries that could not be deleted and are still in the graveyard
    /// (for status: a scan of the stuck ones; those gone meanwhile are forgotten).
    public func stuckEntries() -> [String] {
        stuck.withLock { m in
            for (id, e) in m where !stillThere(e.shard, id) { m[id] = nil }
            stuckCount.store(m.count, ordering: .relaxed)
            return m.keys.sorted()
        }
    }

    /// The deletion `entry` belongs to: itself, or for a piece the entry it
    /// came from (nil for a piece left from before a restart).
    private func origin(of entry: String, isPiece: Bool) -> String? {
        tallies.withLock { $0.origin(of: entry, isPiece: isPiece) }
    }

    /// Adds what removing `entry` freed to its deletion's tally; reports the
    /// deletion once nothing of it is left.
    private func tally(_ origin: String, entry: String, freed: Freed, done: Bool) {
        guard let finished = tallies.withLock({ $0.add(freed, to: origin, entry: entry, done: done) }) else { return }
        if treesKnown.load(ordering: .relaxed) > 0, treeSizes.withLock({ $0.removeValue(forKey: origin) }) != nil {
            treesKnown.wrappingSubtract(1, ordering: .relaxed)
        }
        onReaped?(origin, finished)
    }

    /// What makes a worker step aside for requests through the mount, if anything.
    private func gate() -> ForegroundGate? {
        guard let foregroundRequests, policy.yieldToForeground > 0 else { return nil }
        return ForegroundGate(requests: foregroundRequests, maxPause: policy.yieldToForeground,
                              turns: foregroundTurns, urgent: { [self] in isSpaceShort() })
    }

    /// Whether free space is under keepMinFreePercent: fstatvfs at most
    /// once a second, or now when `fresh`.
    private func isSpaceShort(fresh: Bool = false) -> Bool {
        let now = Sys.wallClockNow()
        let last = spaceCheckedAt.load(ordering: .relaxed)
        if fresh || now &- last > Duration.seconds(1).nanoseconds,
           spaceCheckedAt.compareExchange(expected: last, desired: now, ordering: .relaxed).exchanged {
            var short = false
            if policy.keepMinFreePercent > 0, let fs = try? Sys.fstatvfs(graveyard.stateFD) {
                short = Double(fs.f_bavail) < Double(fs.f_blocks) * policy.keepMinFreePercent / 100
            }
            spaceShort.store(short, ordering: .relaxed)
        }
        return spaceShort.load(ordering: .relaxed)
    }

    /// Lifts a worker out of the idle class once it starves there: runnable
    /// but kept off the CPU for most of a second. The idle class is meant to
    /// let a request handler take the CPU at once, not to stop the reaper
    /// while CPU-bound work shares the daemon's scheduling group (a `vanish
    /// mount -f` in a busy shell): next to four busy loops there, freeing
    /// 20,000 files had not finished after 120 s (39 s lifted; see
    /// benchmarks/reaper_drain.py). At nice 19
    /// the worker still yields to everything at normal priority, and the
    /// foreground gate still spaces its deletions while the mount is busy.
    /// When space runs short or the mount stops serving, every worker
    /// leaves the idle class at once, not when it next finishes an entry.
    private func watch() {
        var last = [UInt64?](repeating: nil, count: workerCount)
        var lastTime = Condition.now()
        while stopState.load(ordering: .relaxed) == Stop.running.rawValue {
            // Nothing to watch while every worker sleeps: sleep too, until one
            // wakes (it sees the flag) or the reaper stops. Flag first, then
            // look, as the workers clear their bit, then look at the flag.
            watchParked.store(true, ordering: .sequentiallyConsistent)
            if idleMask.load(ordering: .sequentiallyConsistent) == allWorkers {
                watchdogWakeup.wait()
                watchParked.store(false, ordering: .sequentiallyConsistent)
                last = last.map { _ in nil }
                lastTime = Condition.now()
                continue
            }
            watchParked.store(false, ordering: .sequentiallyConsistent)
            _ = watchdogWakeup.wait(timeout: .now() + .seconds(1))
            let now = Condition.now()
            let elapsed = now &- lastTime
            lastTime = now
            let short = isSpaceShort()
            let sleeping = idleMask.load(ordering: .relaxed)
            for (w, thread) in threads.enumerated() {
                if short { thread.set(.background) }
                // A sleeping worker is not starving (and costs no look at /proc).
                guard sleeping & (1 << UInt64(w)) == 0, thread.priority == .idle,
                      let waited = thread.runQueueWait() else { last[w] = nil; continue }
                if let before = last[w], waited &- before >= elapsed / 4 * 3 {
                    thread.lifted.store(true, ordering: .relaxed)
                    thread.set(.background)
                    last[w] = nil
                } else {
                    last[w] = waited
                }
            }
        }
        for thread in threads { thread.set(.background) }
    }

    /// Keeps the undo window within its limits: gives entries up, the
    /// largest users' oldest first (`FairEviction`), until the restorable bytes fit under
    /// keepMaxBytes and the filesystem has keepMinFreePercent free. Free
    /// space is looked at every 5 to 50 ms while anything is kept (one
    /// statvfs), the rest every second or when woken; when space is short the warden
    /// frees the entries given up itself, at once: a writer
    /// through passthrough gets ENOSPC from the backing filesystem, which no
    /// retry of the daemon's can take back.
    private func ward() {
        // At the ordinary priority: a look every few milliseconds costs next
        // to nothing, and when space runs out it must not wait behind the writer.
        var unmeasurable: Set<String> = []
        var lastFull: UInt64 = 0
        var woken = true
        var trend = SpaceTrend()
        while stopState.load(ordering: .relaxed) == Stop.running.rawValue {
            let now = Condition.now()
            let runningOut = (try? Sys.fstatvfs(graveyard.stateFD)).map { fs in
                let floor = Double(fs.f_blocks) * Double(fs.f_frsize) * policy.keepMinFreePercent / 100
                lastFree.store(UInt64(fs.f_bavail) * UInt64(fs.f_frsize), ordering: .relaxed)
                floorBytes.store(UInt64(floor), ordering: .relaxed)
                lastLook.store(now, ordering: .relaxed)
                return trend.runsOutSoon(fs, floor: floor, at: now)
            } ?? false
            let short = isSpaceShort(fresh: true) || roomWanted.exchange(false, ordering: .relaxed) || runningOut
            // Deletions then step aside for no one (see ForegroundGate).
            if short { spaceShort.store(true, ordering: .relaxed) }
            if short || woken || now &- lastFull >= Duration.seconds(1).nanoseconds {
                lastFull = now
                wardOnce(short: short, unmeasurable: &unmeasurable)
            }
            // Nothing kept: once a second. Kept entries the space may be
            // needed for, or space falling: every 5 ms; otherwise every 50 ms.
            let kept = !graveyard.trash.isEmpty
            wardenResting.store(!kept, ordering: .relaxed)
            let interval: DispatchTimeInterval = !kept ? .seconds(1)
                : spaceIsTight || trend.wasFalling || short ? .milliseconds(5) : .milliseconds(50)
            woken = wardenWakeup.wait(timeout: .now() + interval) == .success
        }
    }

    /// Free space as the warden last saw it, to tell a writer filling the
    /// filesystem before it is full: a writer through passthrough gets
    /// ENOSPC from the backing filesystem itself.
    struct SpaceTrend {
        var free: Double = -1
        var at: UInt64 = 0
        var wasFalling = false
        /// How far ahead (ns) the fall is followed.
        static let horizon: Double = 250_000_000

        /// Whether free space, falling since the look before last at the
        /// pace of the last, would pass below `floor` bytes within `horizon`.
        /// A burst that stopped (one fall, then none) does not count.
        mutating func runsOutSoon(_ fs: statvfs, floor: Double, at now: UInt64) -> Bool {
            let current = Double(fs.f_bavail) * Double(fs.f_frsize)
            defer { (free, at) = (current, now) }
            guard free >= 0, now > at, current < free else { wasFalling = false; return false }
            defer { wasFalling = true }
            guard wasFalling else { return false }
            let pace = (free - current) / Double(now - at)  // bytes per ns
            return current - pace * Self.horizon < floor
        }
    }

    private func wardOnce(short: Bool, unmeasurable: inout Set<String>) {
        // Trees are buried with their size unknown (measuring them in the
        // request would walk them there): measure them here, so the byte
        // limit counts what they hold. Not while space is short: freeing first.
        // Background work: at nice 19, as the warden used to run whole.
        if !short {
            let unmeasured = graveyard.restorable.filter { $0.record.bytes == nil && !unmeasurable.contains($0.id) }
            if !unmeasured.isEmpty {
                let tid = id_t(vanish_gettid())
                _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), tid, 19)
                defer { _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), tid, 0) }
                for e in unmeasured {
                    if stopState.load(ordering: .relaxed) != Stop.running.rawValue { break }
                    if graveyard.measure(e) == nil { unmeasurable.insert(e.id) }
                }
            }
        }
        // Entries already given up are on their way out, though still
        // restorable until a worker takes them: counted as kept, a burst of
        // deletions gave up more each second than the limit needed.
        let restorable = graveyard.restorable
        let given = graveyard.trash.evicted
        let leaving = given.isEmpty ? 0 : restorable.reduce(0) { given.contains($1.id) ? $0 + ($1.record.bytes ?? 0) : $0 }
        // Counted from the same snapshot, not the index's running total:
        // an entry a worker is taking right now is out of the snapshot
        // but may still be in the total, which then counted it as kept
        // and gave up an entry the limit had room for.
        let all = restorable.reduce(0) { $0 + ($1.record.bytes ?? 0) }
        // Short of space (or a request met ENOSPC): at least one goes.
        let wanted = max(bytesToFree(kept: all - leaving, leaving: short ? 0 : leaving), short ? 1 : 0)
        if wanted > 0 {
            // Held entries go only by a restore: freeing one would strand what its deleter could not remove.
            let candidates = restorable.filter { $0.record.held == nil && (given.isEmpty || !given.contains($0.id)) }
            let chosen = FairEviction.choose(candidates.map { (uid: $0.record.uid, bytes: $0.record.bytes ?? 0) },
                                             wanted: wanted)
            if !chosen.isEmpty {
                graveyard.trash.evict(chosen.map { candidates[$0].id })
                for w in 0..<workerCount { wakeups[w].signal() }
                let bytes = chosen.reduce(0) { $0 + (candidates[$1].record.bytes ?? 0) }
                let overLimit = policy.keepMaxBytes.map { all - leaving > $0 } ?? false
                let because = overLimit && !short ? "keep_max_bytes (\(policy.keepMaxBytes ?? 0) bytes) reached"
                    : "free space under keep_min_free (\(policy.keepMinFreePercent)%)"
                let now = Shortening(entries: chosen.count, bytes: bytes, at: Sys.wallClockNow(), because: because)
                shortenings.withLock { s in
                    s = Shortening(entries: (s?.entries ?? 0) + now.entries, bytes: (s?.bytes ?? 0) + now.bytes,
                                   at: now.at, because: because)
                }
                onShortened?(now)
            }
        }
        guard short else { return }
        // Short of space: the entries given up go now, from here.
        let now = graveyard.trash.evicted
        let shards = Set(restorable.filter { now.contains($0.id) }.map(\.shard))
        for shard in shards.sorted() {
            var ignored = UInt64.max
            _ = reap(graveyard.shardFDs[shard], nextDue: &ignored)
        }
    }

    /// Whether writers may need the space kept entries hold: free space
    /// (as the warden saw it a few milliseconds ago) is less than what is
    /// kept plus the floor. A writer the daemon does not see (passthrough)
    /// would meet ENOSPC before the warden could free anything; one whose
    /// writes come through the daemon is given room first (`makeRoom`).
    public var spaceIsTight: Bool {
        guard !graveyard.trash.isEmpty else { return false }
        var free = lastFree.load(ordering: .relaxed)
        var floor = floorBytes.load(ordering: .relaxed)
        // The warden's look may be older than the deletion that filled the
        // trash (it wakes for it, but may not have run yet): look again.
        if Condition.now() &- lastLook.load(ordering: .relaxed) > 10_000_000, let fs = try? Sys.fstatvfs(graveyard.stateFD) {
            free = UInt64(fs.f_bavail) * UInt64(fs.f_frsize)
            floor = UInt64(Double(fs.f_blocks) * Double(fs.f_frsize) * policy.keepMinFreePercent / 100)
        }
        return free < graveyard.trash.bytes &+ floor
    }

    /// For a request the backing filesystem answered ENOSPC while entries
    /// are kept: has the warden free the oldest now, and waits (up to
    /// `timeout`) until there is more free space than before. True if
    /// there is: the request is worth trying again.
    public func makeRoom(timeout: Duration = .seconds(2)) -> Bool {
        guard !graveyard.trash.isEmpty || !isIdle, let before = try? Sys.fstatvfs(graveyard.stateFD) else { return false }
        let deadline = Condition.now() &+ timeout.nanoseconds
        spaceShort.store(true, ordering: .relaxed)
        roomWanted.store(true, ordering: .relaxed)
        wardenWakeup.signal()
        while Condition.now() < deadline {
            guard let now = try? Sys.fstatvfs(graveyard.stateFD) else { return false }
            if now.f_bavail > before.f_bavail { return true }
            if graveyard.trash.isEmpty && isIdle { return now.f_bavail > before.f_bavail }
            usleep(1_000)
        }
        return false
    }

    /// How many bytes must go, beyond the `leaving` already chosen, before
    /// the window's limits hold again; `kept` is what the window holds besides.
    private func bytesToFree(kept: UInt64, leaving: UInt64) -> UInt64 {
        var need: UInt64 = 0
        if let max = policy.keepMaxBytes, kept > max { need = kept - max }
        if policy.keepMinFreePercent > 0, let fs = try? Sys.fstatvfs(graveyard.stateFD) {
            let total = Double(fs.f_blocks) * Double(fs.f_frsize)
            let free = Double(fs.f_bavail) * Double(fs.f_frsize) + Double(leaving)
            let floor = total * policy.keepMinFreePercent / 100
            // Entries of unknown size (whole trees) count as nothing, so
            // everything up to the newest may be taken: under pressure,
            // freeing too much beats running out.
            if free < floor { need = Swift.max(need, UInt64(floor - free)) }
        }
        return need
    }
}

/// Makes one worker wait before a deletion while requests arrive through the
/// mount: until a pause passes without a new one (1 ms, growing to 8 ms
/// while the mount stays busy); if none comes within
/// `maxPause`, the workers take turns, one deletion per `maxPause` among
/// them all. So a foreground burst meets one deletion per `maxPause`
/// whatever the number of workers (each worker on its own clock made the
/// busy mount's create p99 grow with the workers: 1.47× idle with two), and
/// a quiet mount is reaped at full speed (one atomic load per deletion).
struct ForegroundGate {
    let requests: @Sendable () -> UInt64
    let maxPause: UInt64
    let turns: ForegroundTurns
    let urgent: () -> Bool
    private var seen: UInt64

    init(requests: @escaping @Sendable () -> UInt64, maxPause: UInt64, turns: ForegroundTurns,
         urgent: @escaping () -> Bool) {
        self.requests = requests
        self.maxPause = maxPause
        self.turns = turns
        self.urgent = urgent
        seen = requests()
    }

    /// Whether requests arrived since the worker last looked (`wait` would pause).
    var mayWait: Bool { requests() != seen }

    /// Returns false if `shouldStop` turned true while waiting: a stop
    /// must never wait for the mount to go quiet.
    mutating func wait(unless shouldStop: () -> Bool) -> Bool {
        var now = requests()
        guard now != seen, !urgent() else { return true }
        var paused: UInt64 = 0
        // The longer the mount stays busy, the less often a worker looks:
        // 1, 2, 4, then every 8 ms. Looking every millisecond woke each
        // worker a thousand times a second under steady load.
        var step: UInt64 = 1_000_000
        repeat {
            if shouldStop() { return false }
            seen = now
            usleep(UInt32(step / 1000))
            paused += step
            // Held up, not merely let a request pass (a status poll every 20 ms costs a 1 ms wait).
            if paused >= 8_000_000 { turns.lastWaited.store(Condition.now(), ordering: .relaxed) }
            step = min(step * 2, 8_000_000)
            now = requests()
        } while now != seen && !(paused >= maxPause && turns.take(every: maxPause))
        seen = now
        return true
    }
}

/// The busy mount's deletion turns, shared by the workers.
final class ForegroundTurns: Sendable {
    private let last = Atomic<UInt64>(0)
    /// When (CLOCK_MONOTONIC ns) a worker last waited 8 ms or more for the mount to go quiet.
    let lastWaited = Atomic<UInt64>(0)

    /// Whether the caller may delete now: true at most once per `interval`.
    func take(every interval: UInt64) -> Bool {
        let now = Condition.now()
        let previous = last.load(ordering: .relaxed)
        return now &- previous >= interval
            && last.compareExchange(expected: previous, desired: now, ordering: .relaxed).exchanged
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

/// Spaces deletions out to at most `perSecond`, shared by all workers.
final class RateLimiter: Sendable {
    private let interval: UInt64
    private let next = Atomic<UInt64>(0)

    init(perSecond: Double) { interval = UInt64(1e9 / max(perSecond, 0.001)) }

    /// Waits for this caller's slot; returns false if `shouldStop` turned
    /// true first. At a low rate a slot can be minutes away, and SIGTERM
    /// must still stop the reaper at once: the wait is checked every 50 ms.
    func take(unless shouldStop: () -> Bool) -> Bool {
        let now = Condition.now()
        // No credit for idle time beyond one interval: a burst stays a burst of one.
        var slot = next.load(ordering: .relaxed)
        while true {
            let start = max(slot, now)
            let (exchanged, original) = next.compareExchange(expected: slot, desired: start + interval, ordering: .relaxed)
            if exchanged { slot = start; break }
            slot = original
        }
        var left = slot > now ? slot - now : 0
        while left > 0 {
            if shouldStop() { return false }
            let step = min(left, 50_000_000)
            var wait = timespec(tv_sec: 0, tv_nsec: Int(step))
            var rest = timespec()
            while nanosleep(&wait, &rest) != 0 && errno == EINTR { wait = rest }
            left -= step
        }
        return true
    }
}

