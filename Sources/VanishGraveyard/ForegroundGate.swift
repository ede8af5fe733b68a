import Glibc
import LinuxSyscalls
import Synchronization

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
    /// A pause this long is being held up, not letting one request pass;
    /// no single wait is longer.
    static let heldUp = Duration.milliseconds(8).nanoseconds

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
        var step = Duration.milliseconds(1).nanoseconds
        repeat {
            if shouldStop() { return false }
            seen = now
            usleep(UInt32(step / 1000))
            paused += step
            // Held up, not merely let a request pass (a status poll every 20 ms costs a 1 ms wait).
            if paused >= Self.heldUp { turns.lastWaited.store(Condition.now(), ordering: .relaxed) }
            step = min(step * 2, Self.heldUp)
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
