import Glibc
import LinuxSyscalls
import Synchronization
import Testing
import VanishClient
@testable import VanishEvents

/// The journal on its own, without a mount: what its segment rotation must
/// guarantee is easiest to provoke with tiny segments and many writers.
@Suite("journal")
struct JournalTests {
    @Test("a reader sees every event once, in order, across many segment rotations under concurrent appends")
    func rotationUnderConcurrentAppends() throws {
        var template = Array("/tmp/vanish-journal.XXXXXX".utf8CString)
        let dir = try #require(mkdtemp(&template).map { String(cString: $0) })
        defer { _ = system("rm -rf '\(dir)'") }
        let eventsFD = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        try #require(eventsFD >= 0)
        defer { close(eventsFD) }

        var limits = Journal.Limits()
        limits.segmentBytes = 4 << 10  // a few dozen events a segment
        let journal = try Journal(eventsFD: eventsFD, instance: "0123456789abcdef", limits: limits)
        journal.start()
        let reader = try #require(journal.reader(after: nil))

        let writers = 4, perWriter = 5_000
        let progress = ReaderProgress()
        for w in 0..<writers {
            spawnThread("test-appender") {
                for i in 0..<perWriter {
                    journal.append(.created) { $0.string("path", "w\(w)/f\(i)") }
                }
                progress.writersDone.add(1, ordering: .releasing)
            }
        }

        // The reader runs on a thread of its own, so that a reader stuck
        // inside the journal fails this test at the deadline instead of
        // hanging the whole run.
        let total = UInt64(writers * perWriter)
        nonisolated(unsafe) let unsafeReader = reader
        spawnThread("test-reader") {
            defer { progress.done.store(true, ordering: .releasing) }
            while progress.next.load(ordering: .relaxed) <= total {
                guard let lines = unsafeReader.read(timeout: 1) else {
                    progress.failure.withLock { $0 = "the reader lost its place at seq \(progress.next.load(ordering: .relaxed))" }
                    return
                }
                for line in lines {
                    let expected = progress.next.load(ordering: .relaxed)
                    let seq = line.withUnsafeBytes { EventLine.seq(of: $0) }
                    guard seq == expected else {
                        progress.failure.withLock { $0 = "expected seq \(expected), read \(seq.map(String.init) ?? "none")" }
                        return
                    }
                    progress.next.store(expected + 1, ordering: .relaxed)
                }
            }
        }
        var waited = 0
        while !progress.done.load(ordering: .acquiring) && waited < 60_000 {
            usleep(10_000)
            waited += 10
        }
        let finished = progress.done.load(ordering: .acquiring)
        try #require(finished,
                     "the reader stalled at seq \(progress.next.load(ordering: .relaxed)) of \(total); writers done: \(progress.writersDone.load(ordering: .acquiring))")
        #expect(progress.failure.withLock { $0 } == nil, "\(progress.failure.withLock { $0 } ?? "")")
        let read = progress.next.load(ordering: .relaxed)
        #expect(read == total + 1)
        journal.close()
        #expect(reader.read(timeout: 0.1) == nil, "a closed journal ends its readers")
    }

    @Test("records become lines that escape what JSON needs escaped and keep every number's digits and every path's bytes")
    func lineEscaping() throws {
        let path: [UInt8] = Array("plain/\"q\"\\b\nl\u{1}\u{7F}é-end".utf8)
        var record = EventRecord()
        record.path("path", path)
        record.string("comm", "tab\there")
        record.int("size", Int64.max)
        record.int("neg", -42)
        record.int("zero", 0)
        record.bool("tree", true)
        record.path("from", [0x61, 0xFF, 0x2F, 0x62])
        var line = EventLine(seq: 0, type: .created, time: 1_700_000_000_123_456_789, instance: "abc")
        EventRecord.format(record.bytes, into: &line)
        line.finish()
        let text = String(decoding: line.bytes, as: UTF8.self)
        #expect(text == #"{"seq":0,"type":"created","time_ns":1700000000123456789,"instance":"abc","#
            + #""path":"plain/\"q\"\\b\nl\u0001\u007fé-end","comm":"tab\u0009here","#
            + #""size":9223372036854775807,"neg":-42,"zero":0,"tree":true,"#
            + #""from":"a\#u{FFFD}/b","from_b64":"Yf8vYg=="}"# + "\n")
        #expect(EventType.allCases.allSatisfy { EventType(code: $0.code) == $0 })
        // Through the journal: numbered, turned into lines by the writer, read back.
        var template = Array("/tmp/vanish-journal.XXXXXX".utf8CString)
        let dir = try #require(mkdtemp(&template).map { String(cString: $0) })
        defer { _ = system("rm -rf '\(dir)'") }
        let eventsFD = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        defer { close(eventsFD) }
        let journal = try Journal(eventsFD: eventsFD, instance: "abc")
        journal.start()
        let reader = try #require(journal.reader(after: nil))
        for _ in 0..<12 { journal.append(.created) { $0.path("path", path) } }
        var lines: [[UInt8]] = []
        while lines.count < 12, let got = reader.read(timeout: 10), !got.isEmpty { lines += got }
        journal.close()
        try #require(lines.count == 12)
        let last = String(decoding: lines[11], as: UTF8.self)
        #expect(last.hasPrefix(#"{"seq":12,"type":"created","time_ns":"#))
        #expect(last.hasSuffix(#","instance":"abc","path":"plain/\"q\"\\b\nl\u0001\u007fé-end"}"# + "\n"))
    }
}

private final class ReaderProgress: Sendable {
    let next = Atomic<UInt64>(1)
    let done = Atomic(false)
    let writersDone = Atomic(0)
    let failure = Mutex<String?>(nil)
}
