import Glibc
import LinuxSyscalls
import Synchronization

/// Spaces deletions out to at most `perSecond`, shared by all workers.
final class RateLimiter: Sendable {
    private let interval: UInt64
    private let next = Atomic<UInt64>(0)

    init(perSecond: Double) { interval = Duration.seconds(1 / max(perSecond, 0.001)).nanoseconds }

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
            let step = min(left, Duration.milliseconds(50).nanoseconds)
            Sys.sleep(.nanoseconds(step))
            left -= step
        }
        return true
    }
}
