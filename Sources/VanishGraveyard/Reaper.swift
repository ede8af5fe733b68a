import CFuse
import Dispatch
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Empties the graveyard in the background: a bounded number of worker
/// threads at idle I/O priority and the lowest CPU priority, so work
/// through the mount is not starved. Each worker owns a slice of the
/// shards. Whatever is left when the process ends (a crash, SIGKILL,
/// SIGTERM) stays on disk and is reaped at the next start.
public final class Reaper: @unchecked Sendable {
    public struct Statistics: Sendable, Equatable {
        /// Graveyard entries (files or whole trees) removed.
        public var entries: UInt64
        /// Files and directories deleted (a directory counts once, when it goes).
        public var files: UInt64
        /// Bytes given back to the filesystem.
        public var bytes: UInt64
        /// Entries moved into the graveyard since start.
        public var buried: UInt64

        public static let zero = Statistics(entries: 0, files: 0, bytes: 0, buried: 0)
    }

    public enum Stop: Int {
        case running = 0
        /// Stop once the graveyard is empty.
        case whenEmpty = 1
        /// Stop as soon as each worker finishes the entry it is on.
        case now = 2
    }

    private let graveyard: Graveyard
    public let workerCount: Int
    private let entries = Atomic<UInt64>(0)
    private let files = Atomic<UInt64>(0)
    private let bytes = Atomic<UInt64>(0)
    private let buried = Atomic<UInt64>(0)
    /// Directories a worker handed back to the graveyard for others to take.
    private let splits = Atomic<UInt64>(0)
    private let stopState = Atomic<Int>(0)
    /// Bit w is set while worker w sleeps.
    private let idleMask = Atomic<UInt64>(0)
    /// One per worker: a wakeup must reach the worker that owns the shard.
    private let wakeups: [DispatchSemaphore]
    private let finished = DispatchSemaphore(value: 0)
    private let started = Atomic<Bool>(false)

    public init(graveyard: Graveyard, workers: Int) {
        self.graveyard = graveyard
        workerCount = max(1, min(workers, Graveyard.shardCount))
        wakeups = (0..<workerCount).map { _ in DispatchSemaphore(value: 0) }
    }

    public var statistics: Statistics {
        Statistics(entries: entries.load(ordering: .relaxed), files: files.load(ordering: .relaxed),
                   bytes: bytes.load(ordering: .relaxed), buried: buried.load(ordering: .relaxed))
    }

    /// Starts the workers. Call after any fork (daemonizing): threads don't survive it.
    public func start() {
        guard !started.exchange(true, ordering: .relaxed) else { return }
        for w in 0..<workerCount { spawnThread { [self] in work(w) } }
    }

    /// Something was buried in `shard`: wake its worker if it sleeps (one
    /// atomic load when it does not).
    @inline(__always)
    public func noteBuried(shard: Int) {
        buried.wrappingAdd(1, ordering: .sequentiallyConsistent)
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
        let all: UInt64 = workerCount >= 64 ? ~0 : (1 << UInt64(workerCount)) - 1
        return idleMask.load(ordering: .sequentiallyConsistent) == all
    }

    /// Entries in the graveyard now (a directory scan: for status, not the hot path).
    public func pendingEntries() -> Int {
        var n = 0
        for shard in graveyard.shardFDs {
            guard let fd = try? Sys.openat(shard, ".", O_RDONLY | O_DIRECTORY), let dp = fdopendir(fd) else { continue }
            while let d = readdir(dp) {
                let name = vanish_dirent_name(d)!
                if name[0] != 0x2E { n += 1 }
            }
            closedir(dp)
        }
        return n
    }

    /// Changes whenever anything lands in the graveyard.
    private var generation: UInt64 {
        buried.load(ordering: .sequentiallyConsistent) &+ splits.load(ordering: .sequentiallyConsistent)
    }

    private func work(_ index: Int) {
        // Idle I/O class: the disk serves this thread only when nobody else wants it.
        _ = vanish_ioprio_set_thread(3, 0)
        _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), id_t(vanish_gettid()), 19)
        let mine = stride(from: index, to: Graveyard.shardCount, by: workerCount).map { graveyard.shardFDs[$0] }
        defer { finished.signal() }
        while true {
            let state = stopState.load(ordering: .relaxed)
            if state == Stop.now.rawValue { return }
            let seen = generation
            var found = 0
            // When finishing, every worker sweeps every shard: others may still
            // hand subdirectories into any of them, and the last one out must see them.
            let shards = state == Stop.whenEmpty.rawValue ? graveyard.shardFDs : mine
            for shard in shards {
                found += reap(shard)
                if stopState.load(ordering: .relaxed) == Stop.now.rawValue { return }
            }
            if found > 0 { continue }
            if stopState.load(ordering: .relaxed) == Stop.whenEmpty.rawValue { return }
            // Announce being idle, then look once more: whoever buries after this
            // sees the bit and signals; whoever buried before, we see here.
            let bit: UInt64 = 1 << UInt64(index)
            idleMask.bitwiseOr(bit, ordering: .sequentiallyConsistent)
            if generation == seen {
                // The timeout only guards against the unforeseen; wakeups come from noteBuried.
                _ = wakeups[index].wait(timeout: .now() + .seconds(2))
            }
            idleMask.bitwiseAnd(~bit, ordering: .sequentiallyConsistent)
        }
    }

    /// One pass over a shard; returns how many entries it found.
    private func reap(_ shard: Int32) -> Int {
        guard let fd = try? Sys.openat(shard, ".", O_RDONLY | O_DIRECTORY), let dp = fdopendir(fd) else { return 0 }
        defer { closedir(dp) }
        var found = 0
        var remover = TreeRemover(graveyard: graveyard,
                                  shouldStop: { [self] in stopState.load(ordering: .relaxed) == Stop.now.rawValue },
                                  handedBack: { [self] shard in
                                      splits.wrappingAdd(1, ordering: .sequentiallyConsistent)
                                      wake(owner(of: shard))
                                  })
        while let d = readdir(dp) {
            let name = vanish_dirent_name(d)!
            if name[0] == 0x2E { continue }
            found += 1
            let done = remover.remove(dirfd(dp), name)
            if done { entries.wrappingAdd(1, ordering: .relaxed) }
            files.wrappingAdd(remover.files, ordering: .relaxed)
            bytes.wrappingAdd(remover.bytes, ordering: .relaxed)
            remover.files = 0
            remover.bytes = 0
            if !done { break }
        }
        return found
    }
}

/// Runs `body` on a new detached pthread (no Foundation in the daemon).
func spawnThread(_ body: @escaping @Sendable () -> Void) {
    final class Box { let body: @Sendable () -> Void; init(_ b: @escaping @Sendable () -> Void) { body = b } }
    var tid = pthread_t()
    let arg = Unmanaged.passRetained(Box(body)).toOpaque()
    let rc = pthread_create(&tid, nil, { raw in
        Unmanaged<Box>.fromOpaque(raw!).takeRetainedValue().body()
        return nil
    }, arg)
    if rc == 0 { pthread_detach(tid) } else { Unmanaged<Box>.fromOpaque(arg).release() }
}
