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
        /// Files and directories deleted.
        public var files: UInt64
        /// Bytes given back to the filesystem.
        public var bytes: UInt64
        /// Entries moved into the graveyard since start.
        public var buried: UInt64
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
    private let stopState = Atomic<Int>(0)
    private let idleWorkers = Atomic<Int>(0)
    /// Workers found nothing to do on their last pass.
    private let emptyPasses = Atomic<Int>(0)
    private let wakeup = DispatchSemaphore(value: 0)
    private let finished = DispatchSemaphore(value: 0)
    private let started = Atomic<Bool>(false)

    public init(graveyard: Graveyard, workers: Int) {
        self.graveyard = graveyard
        workerCount = max(1, min(workers, Graveyard.shardCount))
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

    /// Something was buried: wake an idle worker (cheap when none is idle).
    @inline(__always)
    public func noteBuried() {
        buried.wrappingAdd(1, ordering: .relaxed)
        if idleWorkers.load(ordering: .relaxed) > 0 { wakeup.signal() }
    }

    /// Asks the workers to stop (now, or once the graveyard is empty) and waits for them.
    public func stop(_ how: Stop) {
        stopState.store(max(stopState.load(ordering: .relaxed), how.rawValue), ordering: .relaxed)
        guard started.load(ordering: .relaxed) else { return }
        for _ in 0..<workerCount { wakeup.signal() }
    }

    /// Waits until every worker has stopped.
    public func join() {
        guard started.load(ordering: .relaxed) else { return }
        for _ in 0..<workerCount { finished.wait() }
        started.store(false, ordering: .relaxed)
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

    private func work(_ index: Int) {
        // Idle I/O class: the disk serves this thread only when nobody else wants it.
        _ = vanish_ioprio_set_thread(3, 0)
        _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), id_t(vanish_gettid()), 19)
        let mine = stride(from: index, to: Graveyard.shardCount, by: workerCount).map { graveyard.shardFDs[$0] }
        defer { finished.signal() }
        while true {
            let state = stopState.load(ordering: .relaxed)
            if state == Stop.now.rawValue { return }
            var found = 0
            for shard in mine {
                found += reap(shard)
                if stopState.load(ordering: .relaxed) == Stop.now.rawValue { return }
            }
            if found > 0 { continue }
            if stopState.load(ordering: .relaxed) == Stop.whenEmpty.rawValue { return }
            idleWorkers.wrappingAdd(1, ordering: .relaxed)
            // The timeout is a safety net for a lost wakeup, not the pacing.
            _ = wakeup.wait(timeout: .now() + .seconds(2))
            idleWorkers.wrappingSubtract(1, ordering: .relaxed)
        }
    }

    /// One pass over a shard; returns how many entries it found.
    private func reap(_ shard: Int32) -> Int {
        guard let fd = try? Sys.openat(shard, ".", O_RDONLY | O_DIRECTORY), let dp = fdopendir(fd) else { return 0 }
        defer { closedir(dp) }
        var found = 0
        var remover = TreeRemover(shouldStop: { [self] in stopState.load(ordering: .relaxed) == Stop.now.rawValue })
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
