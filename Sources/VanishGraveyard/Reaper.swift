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
///
/// A coordinator: its parts keep their own state. `ReaperWorkers` (the
/// threads, their sleep and wakeups), `ReapAccounting` (what was buried,
/// freed and is left), `StuckEntries`, `SpaceWarden` (the undo window's
/// limits and free space), `ForegroundGate` and `RateLimiter` (pacing);
/// `TreeRemover` frees one entry.
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
        public var keepMinAge = Duration.seconds(5).nanoseconds
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
        public var yieldToForeground = Duration.milliseconds(20).nanoseconds
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
    public let policy: Policy
    /// Set before `start`.
    public var hooks = Hooks()
    private let workers: ReaperWorkers
    private let accounting = ReapAccounting()
    private let stuck = StuckEntries()
    private let warden: SpaceWarden
    private let limiter: RateLimiter?
    /// When a worker last deleted while the mount stayed busy (shared).
    private let foregroundTurns = ForegroundTurns()
    /// Where the pieces of deleters' directories came from (see `PieceFamilies`).
    private let families = PieceFamilies()

    /// What the reaper tells its owner, and asks of it. Set before `start`.
    public struct Hooks: Sendable {
        /// Called after each graveyard entry is freed, with what it held.
        public var onReaped: (@Sendable (String, Freed) -> Void)?
        /// Called the first time an entry cannot be deleted: (entry id, error).
        public var onStuck: (@Sendable (String, Errno) -> Void)?
        /// Called for an entry its deleter could not wholly remove, now kept in
        /// their trash until restored (`Graveyard.hold`).
        public var onHeld: (@Sendable (String, Errno) -> Void)?
        /// Called each time the window's limits give kept entries up early.
        public var onShortened: (@Sendable (Shortening) -> Void)?
        /// Called with the lstat of each file with other links the reaper
        /// unlinked: their link count dropped, which the kernel caches.
        public var onLinkDropped: (@Sendable (stat) -> Void)?
        /// How many requests the mount has begun to serve (any number that
        /// changes with each request); the workers step aside while it moves.
        /// nil when nothing is mounted (`vanish reap`).
        public var foregroundRequests: (@Sendable () -> UInt64)?
        public init() {}
    }

    public var workerCount: Int { workers.count }

    /// Since the mount: every shortening's entries and bytes, the latest's time and reason.
    public var shortened: Shortening? { warden.shortened }

    /// Whether a worker waited for the mount to go quiet in the last second:
    /// the pace then says how busy the mount is, not how fast the reaper
    /// frees, and no estimate of the time left can be made from it.
    public var yieldsToForeground: Bool {
        let last = foregroundTurns.lastWaited.load(ordering: .relaxed)
        return last != 0 && Condition.now() &- last < Duration.seconds(1).nanoseconds
    }
    /// How often a worker without an undo window looks through all of its
    /// shards, burials or not: a guard against the unforeseen. What it
    /// knows to look at again (an entry a restore held, a stuck entry's
    /// retry) sets an earlier time, so an idle mount's workers rarely read
    /// their shards (docs/decisions.md).
    static let rescanInterval = Duration.seconds(60).nanoseconds
    /// How soon an entry a restore held is looked at again.
    static let heldRetry = Duration.seconds(1).nanoseconds

    public init(graveyard: Graveyard, workers: Int, policy: Policy = Policy()) {
        self.graveyard = graveyard
        self.policy = policy
        graveyard.window.store(policy.keep, ordering: .relaxed)
        self.workers = ReaperWorkers(count: max(1, min(workers, Graveyard.shardCount)))
        warden = SpaceWarden(graveyard: graveyard, policy: policy)
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
    public var pace: Pace { accounting.progress.pace(notBefore: foregroundTurns.lastWaited.load(ordering: .relaxed)) }

    public var statistics: Statistics { accounting.statistics }

    /// Starts the workers. Call after any fork (daemonizing): threads don't survive it.
    public func start() {
        guard workers.start({ [self] w in work(w) }) else { return }
        // Entries kept under an earlier mount's window are held to the limits too.
        if keeps || !graveyard.trash.isEmpty {
            spawnThread("vanish-keep") { [self] in
                warden.run(SpaceWarden.Hooks(
                    running: { [workers] in workers.isRunning },
                    gaveUp: { [workers] in workers.wakeAll() },
                    freeNow: { [self] shard in
                        var ignored = UInt64.max
                        _ = reap(graveyard.shardFDs[shard], nextDue: &ignored)
                    },
                    shortened: { [hooks] s in hooks.onShortened?(s) }))
            }
        }
        // Only a serving mount puts workers in the idle class.
        if hooks.foregroundRequests != nil {
            spawnThread("vanish-watch") { [self] in workers.watch(isSpaceShort: { warden.isSpaceShort() }) }
        }
    }

    /// Something was buried in `shard`: wake its worker if it sleeps (one
    /// atomic load when it does not). `dueNow`: buried without a trash
    /// record (the disk was full), so not held by the undo window.
    @inline(__always)
    public func noteBuried(shard: Int, dueNow: Bool = false, sizeUnknown: Bool = false, bytes: UInt64 = 0) {
        accounting.buried(bytes: bytes)
        // Inside an undo window nothing new is due yet; only the limits may be.
        if keeps && !dueNow {
            warden.kept(sizeUnknown: sizeUnknown)
        } else {
            workers.markDirty(shard)
        }
    }

    /// Entries in `shard` became due outside a burial (`Graveyard.letGo`): its worker looks again now.
    public func dueNow(shard: Int) { workers.markDirty(shard) }

    /// Asks the workers to stop (now, or once the graveyard is empty) and waits for them.
    public func stop(_ how: Stop) {
        workers.requestStop(how)
        warden.wake()
    }

    /// Waits until every worker has stopped.
    public func join() { workers.join() }

    /// Every worker is asleep: the graveyard was empty at each one's last
    /// pass and nothing landed since. (A scan alone can miss an entry a
    /// worker is moving from one shard to another.)
    public var isIdle: Bool { workers.isIdle }

    /// Deletions in the graveyard now (a directory scan: for status, not the
    /// hot path). A tree being taken apart counts once (`ReapAccounting.deletions`).
    public func pendingEntries() -> Int {
        var names: [(id: String, isPiece: Bool)] = []
        forEachPending { name, isPiece in names.append((String(cString: name), isPiece)) }
        return accounting.deletions(names)
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
    public func forgetTree(_ entry: String) { accounting.forgetTree(entry) }

    /// A tree buried whole holds `bytes` more than its own directory's blocks.
    public func noteHeld(bytes: UInt64) { accounting.held(bytes: bytes) }

    /// Disk space the graveyard holds, kept entries included, as far as known:
    /// what was buried since the start less what was freed (entries left
    /// from before the start are not in it, nor trees of unknown size).
    public var holdingBytes: UInt64 { accounting.holdingBytes }

    /// The tree `entry` just buried holds `count` files and directories, itself included.
    public func expectTree(_ entry: String, count: Int) { accounting.expectTree(entry, count: count) }

    /// Files and directories left to delete in the entries that are due (not
    /// kept by the undo window, not stuck): one for each entry but a tree,
    /// and what is left of each tree of known size. nil when a piece of a
    /// tree of unknown size (left from before a restart, or adopted) is
    /// waiting: the work in it cannot be told without walking it.
    public func remainingWork() -> Int? {
        let stuckNow = Set(stuck.current())
        let judging = keeps || !graveyard.trash.isEmpty
        var due: [(id: String, isPiece: Bool)] = []
        forEachPending { name, isPiece in
            let id = String(cString: name)
            if stuckNow.contains(id) || (!isPiece && judging && !isDue(kept: name)) { return }
            due.append((id, isPiece))
        }
        return accounting.remainingWork(due)
    }

    /// Whether the kept entry `name` has reached the end of its window (or was given up for the limits).
    private func isDue(kept name: UnsafePointer<CChar>) -> Bool {
        var ignored = UInt64.max
        return isDue(name, Graveyard.deletionTime(name) ?? 0, now: Sys.wallClockNow(), nextDue: &ignored)
    }

    /// One worker's life: passes over its shards (all of them when finishing
    /// or inside an undo window, else those marked dirty), sleeping between.
    private func work(_ index: Int) {
        let me = workers.threads[index]
        func reschedule() {
            // Fresh: a worker gets here once per wakeup or pass over its shards.
            let idle = hooks.foregroundRequests != nil && workers.isRunning
                && !warden.isSpaceShort(fresh: true) && !me.lifted.load(ordering: .relaxed)
            me.set(idle ? .idle : .background)
        }
        me.set(.background)
        reschedule()
        let mineMask = workers.shards(of: index)
        var nextFullScan = Sys.wallClockNow() &+ Self.rescanInterval
        while true {
            let state = workers.stop
            if state == .now { return }
            reschedule()
            let seen = accounting.generation
            var found = 0
            var nextDue = UInt64.max
            // When finishing, every worker sweeps every shard: others may still
            // hand subdirectories into any of them, and the last one out must see them.
            // Inside an undo window entries come due by time, not by burial: scan all.
            var shards: UInt64
            if state == .whenEmpty {
                shards = ~0
            } else if keeps {
                // All of them anyway; the marks only keep the worker from sleeping past new work.
                _ = workers.takeDirty(mineMask)
                shards = mineMask
            } else {
                shards = workers.takeDirty(mineMask)
                // Checked even when burials never let this worker sleep out its timeout.
                let now = Sys.wallClockNow()
                if now >= nextFullScan { shards = mineMask; nextFullScan = now &+ Self.rescanInterval }
            }
            // Each worker starts its sweep at its own place among the shards:
            // sweeping all of them from shard 0, as finishing workers did, put
            // every worker on the same entry, and on GlusterFS (which serializes
            // a directory's changes) a reaper finishing after an unmount freed
            // 4,000 files in 40 directories in 21.6 s against 3.9 s while mounted.
            let start = index * Graveyard.shardCount / workers.count
            for k in 0..<Graveyard.shardCount where shards != 0 {
                let shard = (start + k) % Graveyard.shardCount
                guard shards & (1 << UInt64(shard)) != 0 else { continue }
                shards &= ~(1 << UInt64(shard))
                found += reap(graveyard.shardFDs[shard], nextDue: &nextDue)
                if workers.stop == .now { return }
            }
            // Held and stuck entries set nextDue to when to look at them again.
            if !keeps { nextFullScan = min(nextFullScan, nextDue) }
            if found > 0 { continue }
            if workers.stop == .whenEmpty { return }
            // Out of work: the next busy spell starts in the idle class again
            // (set now: the worker may sleep for many seconds).
            me.lifted.store(false, ordering: .relaxed)
            reschedule()
            // A shard marked since this pass began (a piece done, an entry let
            // go) is looked at now, not when the sleep times out.
            let woken = workers.sleep(index, until: sleepUntil(keeps ? nextDue : nextFullScan)) {
                accounting.generation == seen && !workers.hasDirty(mineMask)
            }
            if woken && !keeps && workers.isRunning {
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
        var remover = TreeRemover(graveyard: graveyard, progress: accounting.progress, limiter: limiter, gate: gate(),
                                  shouldStop: { [workers] in workers.stop == .now },
                                  handedBack: { [workers, accounting] shard, piece, origin in
                                      accounting.split(piece, from: origin)
                                      workers.markDirty(shard)
                                  }, families: families, shardFD: shard,
                                  shardIndex: graveyard.shardFDs.firstIndex(of: shard),
                                  linkDropped: hooks.onLinkDropped)
        let judging = (keeps || !graveyard.trash.isEmpty) && !policy.freesKeptEntries
        let now = judging ? Sys.wallClockNow() : 0
        while let d = readdir(dp) {
            let name = vanish_dirent_name(d)!
            if name[0] == 0x2E { continue }
            if judging && !isDue(name, Graveyard.deletionTime(name) ?? 0, now: now, nextDue: &nextDue) { continue }
            if !stuck.isEmpty && stuck.holds(name, finishing: !workers.isRunning, nextDue: &nextDue) { continue }
            // Its pieces are out: it is looked at again once they are done.
            if !families.isEmpty && families.isWaiting(name) { continue }
            var restorable = false
            // A restore holds it: leave it alone, and look again soon (a
            // failed restore puts it back without a burial to wake anyone).
            guard graveyard.trash.claimForReaping(name, had: &restorable) else {
                nextDue = min(nextDue, Sys.wallClockNow() &+ Self.heldRetry)
                continue
            }
            found += 1
            let entry = hooks.onReaped == nil && !accounting.knowsTrees ? nil : String(cString: name)
            remover.origin = entry.flatMap { accounting.origin(of: $0, isPiece: Graveyard.isPiece(name)) }
            let done = remover.remove(dirfd(dp), name)
            remover.report()
            // Another worker took it first (see TreeRemover.removedEntry):
            // its deletion is that worker's to count and report.
            let gone = done && remover.removedEntry
            if let entry, let origin = remover.origin, !remover.vanished,
               let finished = accounting.tally(origin, entry: entry, freed: remover.freed, done: gone) {
                hooks.onReaped?(origin, finished)
            }
            if gone {
                // A deletion is done once; its pieces are not deletions of their own.
                if !Graveyard.isPiece(name) { accounting.progress.entryDone() }
                stuck.unstick(name)
                if !families.isEmpty { familyDone(name, cameBack: false) }
            } else if done, !remover.vanished, let failure = remover.failure, StuckEntries.isThere(dirfd(dp), name) {
                // Not work done: a pass that found only this must let its worker rest.
                found -= 1
                // Refused to its deleter, or left holding what was (ENOTEMPTY).
                if failure == .permissionDenied || failure == .notPermitted || failure == .directoryNotEmpty {
                    if let origin = families.origin(of: String(cString: name)), graveyard.returnPiece(shard, name, to: origin) {
                        // Back in the directory it was split from, which stays with it, as after rm -r.
                        restorable = false
                        stuck.unstick(name)
                        familyDone(name, cameBack: true)
                    } else if let index = graveyard.shardFDs.firstIndex(of: shard), graveyard.hold(shard: index, name, because: remover.keptLater ? .later : .stuck) {
                        // What its deleter may not remove: kept for them to restore, never retried.
                        restorable = false
                        stuck.unstick(name)
                        if !families.isEmpty { familyDone(name, cameBack: false) }
                        hooks.onHeld?(String(cString: name), failure)
                    } else {
                        if stuck.stick(name, shard: shard) { hooks.onStuck?(String(cString: name), failure) }
                        nextDue = min(nextDue, Sys.wallClockNow() &+ StuckEntries.retry)
                    }
                } else {
                    if stuck.stick(name, shard: shard) { hooks.onStuck?(String(cString: name), failure) }
                    nextDue = min(nextDue, Sys.wallClockNow() &+ StuckEntries.retry)
                }
            }
            // A directory waiting for its pieces keeps its record: where it was, should it be held.
            if done && restorable && (gone || families.isEmpty || !families.isWaiting(name)) {
                graveyard.removeSidecar(dirfd(dp), name)
            }
            remover.freed = Freed()
            if !done { break }
        }
        return found
    }

    /// The entry `name` is done with (gone, held, or back in the directory
    /// it was split from): its parent, waiting for no other piece, is looked at again.
    private func familyDone(_ name: UnsafePointer<CChar>, cameBack: Bool) {
        let id = String(cString: name)
        if let parentFD = families.pieceDone(id, cameBack: cameBack), let index = graveyard.shardFDs.firstIndex(of: parentFD) {
            workers.markDirty(index)
        }
        families.forget(id)
    }

    /// The entries that could not be deleted and are still in the graveyard
    /// (for status: a scan of the stuck ones; those gone meanwhile are forgotten).
    public func stuckEntries() -> [String] { stuck.current() }

    /// What makes a worker step aside for requests through the mount, if anything.
    private func gate() -> ForegroundGate? {
        guard let requests = hooks.foregroundRequests, policy.yieldToForeground > 0 else { return nil }
        return ForegroundGate(requests: requests, maxPause: policy.yieldToForeground,
                              turns: foregroundTurns, urgent: { [warden] in warden.isSpaceShort() })
    }

    /// Whether writers may need the space kept entries hold (`SpaceWarden.spaceIsTight`).
    /// `pending`: bytes of deletions answered but not yet in the trash, which the window will keep.
    public func spaceIsTight(pending: UInt64) -> Bool { warden.spaceIsTight(pending: pending) }

    /// Whether a deletion giving back `bytes` should free them now (`SpaceWarden.freesAtOnce`).
    @inline(__always)
    public func freesAtOnce(bytes: UInt64, keeping: Bool) -> Bool { warden.freesAtOnce(bytes: bytes, keeping: keeping) }

    /// For a request the backing filesystem answered ENOSPC while entries
    /// are kept: has the warden free the oldest now, and waits (up to
    /// `timeout`) until there is more free space than before. True if
    /// there is: the request is worth trying again.
    public func makeRoom(timeout: Duration = .seconds(2)) -> Bool {
        warden.makeRoom(timeout: timeout, idle: { [workers] in workers.isIdle })
    }
}
