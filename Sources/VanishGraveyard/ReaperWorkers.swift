import Dispatch
import LinuxSyscalls
import Synchronization

/// The reaper's threads and how they sleep, wake and stop. Each worker
/// owns the shards `s` with `s % count == w`; a burial wakes that worker
/// only, and only if it sleeps (one atomic load when it does not).
final class ReaperWorkers: Sendable {
    let count: Int
    let threads: [WorkerThread]
    /// One per worker: a wakeup must reach the worker that owns the shard.
    private let wakeups: [DispatchSemaphore]
    /// Bit w is set while worker w sleeps.
    private let idleMask = Atomic<UInt64>(0)
    /// Bit s is set when shard s got an entry since its owner last looked:
    /// a worker woken for one burial scans one shard, not all of its own
    /// (a pass over 32 shards per unlink cost a fifth of the daemon's CPU).
    /// All set at start, so leftovers of a crash are found.
    private let dirty = Atomic<UInt64>(~0)
    private let stopState = Atomic<Int>(0)
    private let started = Atomic<Bool>(false)
    private let finished = DispatchSemaphore(value: 0)
    private let watchdogWakeup = DispatchSemaphore(value: 0)
    /// Set while the watchdog sleeps because every worker does: the first
    /// worker to wake wakes it.
    private let watchParked = Atomic<Bool>(false)

    init(count: Int) {
        self.count = count
        wakeups = (0..<count).map { _ in DispatchSemaphore(value: 0) }
        threads = (0..<count).map { _ in WorkerThread() }
    }

    /// Starts `body(w)` on each worker's thread; false if already started.
    /// Call after any fork (daemonizing): threads don't survive it.
    func start(_ body: @escaping @Sendable (Int) -> Void) -> Bool {
        guard !started.exchange(true, ordering: .relaxed) else { return false }
        for w in 0..<count {
            spawnThread("vanish-reaper") { [self] in
                let me = threads[w]
                me.attach()
                defer {
                    me.detach()
                    finished.signal()
                }
                body(w)
            }
        }
        return true
    }

    var stop: Reaper.Stop { Reaper.Stop(rawValue: stopState.load(ordering: .relaxed)) ?? .now }
    var isRunning: Bool { stopState.load(ordering: .relaxed) == Reaper.Stop.running.rawValue }
    var isStarted: Bool { started.load(ordering: .relaxed) }

    /// Asks the workers (and the watchdog) to stop as `how` says; a stop
    /// never weakens an earlier one.
    func requestStop(_ how: Reaper.Stop) {
        stopState.store(max(stopState.load(ordering: .relaxed), how.rawValue), ordering: .relaxed)
        guard isStarted else { return }
        wakeAll()
        watchdogWakeup.signal()
    }

    /// Waits until every worker has stopped.
    func join() {
        guard isStarted else { return }
        for _ in 0..<count { finished.wait() }
        started.store(false, ordering: .relaxed)
    }

    @inline(__always)
    func owner(of shard: Int) -> Int { shard % count }

    /// The shards worker `w` owns, as a mask.
    func shards(of w: Int) -> UInt64 {
        stride(from: w, to: Graveyard.shardCount, by: count).reduce(UInt64(0)) { $0 | 1 << UInt64($1) }
    }

    /// `shard` has work: its owner looks at it next, woken if it sleeps.
    @inline(__always)
    func markDirty(_ shard: Int) {
        dirty.bitwiseOr(1 << UInt64(shard), ordering: .sequentiallyConsistent)
        wake(owner(of: shard))
    }

    /// Whether a shard in `mine` was marked since its marks were last taken.
    func hasDirty(_ mine: UInt64) -> Bool { dirty.load(ordering: .sequentiallyConsistent) & mine != 0 }

    /// Takes the dirty marks of the shards in `mine`.
    func takeDirty(_ mine: UInt64) -> UInt64 {
        dirty.bitwiseAnd(~mine, ordering: .sequentiallyConsistent).oldValue & mine
    }

    @inline(__always)
    private func wake(_ worker: Int) {
        if idleMask.load(ordering: .sequentiallyConsistent) & (1 << UInt64(worker)) != 0 { wakeups[worker].signal() }
    }

    func wakeAll() { wakeups.forEach { $0.signal() } }

    /// Every worker is asleep: the graveyard was empty at each one's last
    /// pass and nothing landed since.
    var isIdle: Bool {
        guard isStarted else { return true }
        return idleMask.load(ordering: .sequentiallyConsistent) == all
    }

    /// `idleMask` with every worker asleep.
    private var all: UInt64 { count >= 64 ? ~0 : (1 << UInt64(count)) - 1 }

    /// Worker `w` sleeps until woken or `deadline`, unless `nothingNew`
    /// says otherwise once it is marked asleep: whoever buries after the
    /// mark sees it and signals; whoever buried before, `nothingNew` sees.
    /// True if woken.
    func sleep(_ w: Int, until deadline: DispatchTime, unless nothingNew: () -> Bool) -> Bool {
        let bit: UInt64 = 1 << UInt64(w)
        idleMask.bitwiseOr(bit, ordering: .sequentiallyConsistent)
        var woken = false
        if nothingNew() { woken = wakeups[w].wait(timeout: deadline) == .success }
        idleMask.bitwiseAnd(~bit, ordering: .sequentiallyConsistent)
        if watchParked.load(ordering: .sequentiallyConsistent) { watchdogWakeup.signal() }
        return woken
    }

    /// Lifts a worker out of the idle class once it starves there: runnable
    /// but kept off the CPU for most of a second. The idle class is meant to
    /// let a request handler take the CPU at once, not to stop the reaper
    /// while CPU-bound work shares the daemon's scheduling group (a `vanish
    /// mount -f` in a busy shell): next to four busy loops there, freeing
    /// 20,000 files had not finished after 120 s (39 s lifted; see
    /// benchmarks/reaper_drain.py). At nice 19 the worker still yields to
    /// everything at normal priority, and the foreground gate still spaces
    /// its deletions while the mount is busy. When space runs short
    /// (`isSpaceShort`) or the mount stops serving, every worker leaves the
    /// idle class at once, not when it next finishes an entry.
    func watch(isSpaceShort: () -> Bool) {
        var last = [UInt64?](repeating: nil, count: count)
        var lastTime = Condition.now()
        while isRunning {
            // Nothing to watch while every worker sleeps: sleep too, until one
            // wakes (it sees the flag) or the reaper stops. Flag first, then
            // look, as the workers clear their bit, then look at the flag.
            watchParked.store(true, ordering: .sequentiallyConsistent)
            if idleMask.load(ordering: .sequentiallyConsistent) == all {
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
}
