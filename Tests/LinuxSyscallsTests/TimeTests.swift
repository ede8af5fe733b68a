import Glibc
import LinuxSyscalls
import Testing

/// Time.swift: the one place nanosecond counts and `Duration` meet.
@Suite("time conversions")
struct TimeTests {
    @Test("a duration in nanoseconds is whole and never negative; in seconds it keeps its fraction")
    func nanosecondsAndSeconds() {
        #expect(Duration.seconds(90).nanoseconds == 90_000_000_000)
        #expect(Duration.milliseconds(1).nanoseconds == 1_000_000)
        #expect(Duration.nanoseconds(7).nanoseconds == 7)
        #expect(Duration.seconds(-1).nanoseconds == 0)
        #expect(Duration.seconds(0.1).nanoseconds == 100_000_000, "a duration option such as 100ms keeps its value")
        #expect(Duration.milliseconds(1500).inSeconds == 1.5)
        #expect(Duration.nanoseconds(UInt64(3_600_000_000_000)).inSeconds == 3600)
    }

    @Test("a poll timeout in milliseconds rounds up, so a wait never ends before its deadline")
    func roundedUpMilliseconds() {
        #expect(Duration.nanoseconds(1).roundedUpMilliseconds == 1)
        #expect(Duration.milliseconds(2).roundedUpMilliseconds == 2)
        #expect(Duration.nanoseconds(2_000_001).roundedUpMilliseconds == 3)
        #expect(Duration.zero.roundedUpMilliseconds == 0)
        #expect(Duration.seconds(-5).roundedUpMilliseconds == 0)
    }

    @Test("the time between two clock readings is never negative")
    func between() {
        #expect(Duration.between(10, 25) == .nanoseconds(15))
        #expect(Duration.between(25, 10) == .zero)
        let start = Condition.now()
        #expect(Duration.between(start, Condition.now()) >= .zero)
    }

    @Test("wall-clock seconds and local time agree with the C library")
    func wallClock() {
        let before = time(nil)
        let seconds = Sys.wallClockSeconds()
        #expect(seconds >= before && seconds <= time(nil))
        // A day after the epoch in local time, as localtime_r and strftime give it.
        var t = time_t(86_400)
        var parts = tm()
        localtime_r(&t, &parts)
        var buffer = [CChar](repeating: 0, count: 64)
        let n = strftime(&buffer, buffer.count, "%Y-%m-%d %H:%M:%S", &parts)
        let expected = buffer[..<n].map { UInt8(bitPattern: $0) }
        #expect(Sys.localTime(nanoseconds: 86_400 * 1_000_000_000 + 999, format: "%Y-%m-%d %H:%M:%S") == expected)
    }
}
