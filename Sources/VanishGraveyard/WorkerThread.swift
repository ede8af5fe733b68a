import CLinux
import Glibc
import LinuxSyscalls
import Synchronization

/// How a reaper worker's thread is scheduled.
enum WorkerPriority {
    /// Idle CPU and I/O classes: while the mount serves requests.
    case idle
    /// Nice 19 and the lowest best-effort I/O level: when nothing is
    /// served through the mount (after an unmount, or `vanish reap`), space
    /// is short, or the idle class starved the worker. The idle classes
    /// leave a worker almost no CPU while other work in its scheduling group
    /// keeps the cores busy: freeing a 20,000-file tree after an unmount
    /// took 199 s next to four CPU hogs (21.6 s at nice 19), and the daemon,
    /// whose fds keep the backing filesystem busy, lingered as long.
    case background
}

/// One reaper worker's thread as the other threads see it. Its class is
/// changed under one lock, by the worker itself or by the reaper's watchdog
/// (a starved thread cannot lift itself), so neither undoes the other
/// unseen, and never after the thread has ended: its id could by then name
/// a request handler.
final class WorkerThread: Sendable {
    private struct State {
        var tid: pid_t = 0
        var priority: WorkerPriority?
    }
    private let state = Mutex(State())
    /// Set by the watchdog when the idle class starved the worker; the
    /// worker clears it once it runs out of work, and its next busy spell
    /// starts in the idle class again.
    let lifted = Atomic<Bool>(false)

    /// Called by the worker's thread when it starts.
    func attach() { state.withLock { $0.tid = vanish_gettid() } }

    /// Called by the worker's thread before it ends.
    func detach() { state.withLock { $0 = State() } }

    var priority: WorkerPriority? { state.withLock { $0.priority } }

    /// Puts the thread in `priority`'s classes unless it is there already.
    func set(_ priority: WorkerPriority) {
        state.withLock { s in
            guard s.tid != 0, s.priority != priority else { return }
            Self.apply(priority, to: s.tid)
            s.priority = priority
        }
    }

    private static func apply(_ priority: WorkerPriority, to tid: pid_t) {
        let nice = { _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), id_t(tid), 19) }
        var param = sched_param(sched_priority: 0)
        switch priority {
        case .idle:
            // The disk serves this thread only when nobody else wants it.
            _ = vanish_ioprio_set_thread(tid, VANISH_IOPRIO_CLASS_IDLE, 0)
            // And a request handler that wakes preempts it at once. At nice 19
            // the scheduler let a running worker finish its slice first (EEVDF
            // runs to parity), and one create in a thousand waited 3-4 ms while
            // the reaper freed a tree (ext4 on a RAM disk).
            if sched_setscheduler(tid, VANISH_SCHED_IDLE, &param) != 0 { nice() }
        case .background:
            _ = vanish_ioprio_set_thread(tid, VANISH_IOPRIO_CLASS_BE, VANISH_IOPRIO_BE_LOWEST)
            nice()
            // Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that
            // allows nice 19; without them the worker stays idle, and slower.
            _ = sched_setscheduler(tid, VANISH_SCHED_OTHER, &param)
        }
    }

    /// Nanoseconds the thread has spent runnable but waiting for a CPU
    /// (the second field of /proc/self/task/TID/schedstat); nil if unknown.
    func runQueueWait() -> UInt64? {
        let tid = state.withLock { $0.tid }
        guard tid != 0 else { return nil }
        // Once a second from the watchdog: a String is fine here.
        let fd = open("/proc/self/task/\(tid)/schedstat", O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buf = [UInt8](repeating: 0, count: 96)
        let n = read(fd, &buf, buf.count)
        guard n > 0 else { return nil }
        // "<on-cpu ns> <waiting ns> <timeslices>\n"
        var field = 0, value: UInt64 = 0
        for byte in buf.prefix(n) {
            if byte == 0x20 {
                if field == 1 { return value }
                field += 1
                value = 0
            } else if byte >= 0x30 && byte <= 0x39 {
                value = value &* 10 &+ UInt64(byte - 0x30)
            } else {
                break
            }
        }
        return nil
    }
}
