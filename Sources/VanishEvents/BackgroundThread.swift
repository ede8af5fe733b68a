import CLinux
import Glibc

/// Marks the calling thread as background work: SCHED_BATCH, whose wakeups
/// do not preempt running threads (so delivering events does not interrupt
/// the request handlers that make them), at nice `nice`. Linux applies both
/// `sched_setscheduler(0, …)` and `setpriority(PRIO_PROCESS, 0, …)` to the
/// calling thread only.
public func becomeBackgroundThread(nice: Int32) {
    var param = sched_param(sched_priority: 0)
    _ = sched_setscheduler(0, VANISH_SCHED_BATCH, &param)
    _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, nice)
}
