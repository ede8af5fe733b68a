import CLinux
import Glibc

// Time has two forms here: nanosecond counts (`UInt64`) where the kernel's
// clocks and the graveyard's names give them (`Condition.now()`,
// `Sys.wallClockNow()`), and `Duration` for everything measured or
// configured. Every conversion between them, and to seconds for people, is
// here, so no other module writes 1e9.

extension Duration {
    /// Whole nanoseconds (0 for a negative duration): what `Condition.now()`
    /// deadlines and the graveyard's times count in.
    @inlinable
    public var nanoseconds: UInt64 {
        let (seconds, attoseconds) = components
        guard seconds >= 0 else { return 0 }
        return UInt64(seconds) &* 1_000_000_000 &+ UInt64(attoseconds / 1_000_000_000)
    }

    /// Seconds, with their fraction: for status lines and JSON.
    @inlinable
    public var inSeconds: Double {
        let (seconds, attoseconds) = components
        return Double(seconds) + Double(attoseconds) / 1e18
    }

    /// Whole milliseconds, rounded up (0 for a negative duration): a poll(2) timeout
    /// that does not wake before its deadline.
    @inlinable
    public var roundedUpMilliseconds: Int64 {
        let (seconds, attoseconds) = components
        guard seconds >= 0 else { return 0 }
        return seconds &* 1000 &+ (attoseconds + 999_999_999_999_999) / 1_000_000_000_000_000
    }

    /// The time between two readings of one nanosecond clock (0 if `later` is earlier).
    @inlinable
    public static func between(_ earlier: UInt64, _ later: UInt64) -> Duration {
        .nanoseconds(later > earlier ? later - earlier : 0)
    }
}

extension Sys {
    /// Sleeps for `d` (nanosleep, resumed after a signal).
    public static func sleep(_ d: Duration) {
        let ns = d.nanoseconds
        var wait = timespec(tv_sec: Int(ns / 1_000_000_000), tv_nsec: Int(ns % 1_000_000_000))
        var rest = timespec()
        while nanosleep(&wait, &rest) != 0 && errno == EINTR { wait = rest }
    }

    /// CLOCK_REALTIME in whole seconds since the epoch.
    @inlinable
    public static func wallClockSeconds() -> Int {
        Int(wallClockNow() / 1_000_000_000)
    }

    /// A time in nanoseconds since the epoch (`wallClockNow`) as local time, in
    /// strftime's `format`: no Foundation.
    public static func localTime(nanoseconds ns: UInt64, format: String) -> [UInt8] {
        var t = time_t(ns / 1_000_000_000)
        var parts = tm()
        localtime_r(&t, &parts)
        var buffer = [CChar](repeating: 0, count: 64)
        let n = strftime(&buffer, buffer.count, format, &parts)
        return buffer[..<n].map { UInt8(bitPattern: $0) }
    }

    /// Milliseconds since boot, cheaply (CLOCK_MONOTONIC_COARSE), wrapping after 49 days.
    @inlinable
    public static func coarseMilliseconds() -> UInt32 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts)
        return UInt32(truncatingIfNeeded: ts.tv_sec &* 1000 &+ ts.tv_nsec / 1_000_000)
    }

    /// How far behind the wall clock a filesystem's timestamps may be (ns):
    /// the kernel stamps changes with the coarse clock, which moves once a
    /// tick. At least a millisecond.
    public static let coarseClockResolution: UInt64 = {
        var ts = timespec()
        guard clock_getres(CLOCK_REALTIME_COARSE, &ts) == 0 else { return Duration.milliseconds(10).nanoseconds }
        return max(Sys.nanoseconds(ts), Duration.milliseconds(1).nanoseconds)
    }()
}
