import Dispatch
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage
import VanishClient

/// The mount's event journal: every event gets the next sequence number and
/// goes to an append-only file under `.vanish/events/<instance>/`, split in
/// segments named by their first sequence number. Request handlers only
/// copy each event's fields to a memory buffer (one lock, no I/O, no
/// formatting); a writer thread turns them into JSON lines and moves them
/// to disk, and subscribers read the files at their own pace, so a slow or
/// stopped subscriber never holds anything up and memory stays bounded.
/// Old segments go when the journal passes its size or age limit.
public final class Journal: @unchecked Sendable {
    public struct Limits: Sendable {
        /// Most bytes kept on disk; the oldest segments go first.
        public var maxBytes: UInt64 = 256 << 20
        /// Segments older than this go (ns).
        public var maxAge: UInt64 = Duration.seconds(7 * 86_400).nanoseconds
        public var segmentBytes: UInt64 = 16 << 20
        /// Below this share of free space on the backing filesystem (percent)
        /// the journal keeps only its newest segment: it never grows into
        /// the space users need (keep_min_free, as the undo window).
        public var minFreePercent: Double = 0
        public init() {}
    }

    public let instance: String
    public let limits: Limits
    private let directoryFD: Int32

    private struct Pending: ~Copyable {
        var seq: UInt64 = 0
        /// Events numbered and waiting for the writer: each a `RecordHeader`, then its `EventRecord`.
        var records = ByteBuffer(capacity: 64 << 10)
        /// The number of the first event in `records`.
        var firstSeq: UInt64 = 0
        /// Events dropped while the writer could not write and not yet reported.
        var dropped: ClosedRange<UInt64>?
    }

    /// At most this much waits in memory while the writer cannot write;
    /// past it what waits is dropped (and reported), not kept without bound.
    private static let stalledBufferLimit = 4 << 20
    private struct RecordHeader {
        var seq: UInt64
        var time: UInt64
        var length: UInt32
        var type: UInt8
    }
    private let pending = Lock(Pending())
    /// The writer cannot write (a full disk) and is retrying.
    private let stalled = Atomic<Bool>(false)
    private let wakeWriter = DispatchSemaphore(value: 0)
    /// Guards the segment list and `durable`; readers wait on it for news.
    private let state = Condition()
    fileprivate struct Segment { var first: UInt64; var name: String; var bytes: UInt64; var created: UInt64 }
    private var segments: [Segment] = []
    /// Every event up to this one is in the files.
    private var durable: UInt64 = 0
    private var currentFD: Int32 = -1
    private var closed = false
    private var writerDone = DispatchSemaphore(value: 0)

    /// Opens a fresh journal for `instance` in `eventsFD` (`.vanish/events`),
    /// removing those of earlier instances: their cursors get a reset.
    public init(eventsFD: Int32, instance: String, limits: Limits = Limits()) throws {
        self.instance = instance
        // Only whole segments go: a limit under a few segments' size would
        // not hold (events_max_bytes=1M kept 16 MiB).
        var limits = limits
        limits.segmentBytes = min(limits.segmentBytes, max(64 << 10, limits.maxBytes / 4))
        self.limits = limits
        Journal.removeAll(in: eventsFD, except: instance)
        guard mkdirat(eventsFD, instance, 0o700) == 0 || errno == EEXIST else {
            throw JournalError("cannot create the event journal: \(String(cString: strerror(errno)))")
        }
        directoryFD = openat(eventsFD, instance, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard directoryFD >= 0 else { throw JournalError("cannot open the event journal: \(String(cString: strerror(errno)))") }
        try startSegment(first: 1)
    }

    deinit {
        if currentFD >= 0 { Glibc.close(currentFD) }
        Glibc.close(directoryFD)
    }

    /// Starts the writer thread (after any fork).
    public func start() {
        spawnThread("vanish-journal") { [self] in writer() }
    }

    private var isClosing: Bool {
        state.lock()
        defer { state.unlock() }
        return closed
    }

    /// Writes what is buffered and stops the writer.
    public func close() {
        state.lock()
        closed = true
        state.unlock()
        wakeWriter.signal()
        writerDone.wait()
        state.lock()
        state.broadcast()
        state.unlock()
    }

    /// Appends one event: `fill` adds its fields. Returns its sequence number.
    @discardableResult
    public func append(_ type: EventType, _ fill: (inout EventRecord) -> Void) -> UInt64 {
        let time = Sys.wallClockNow()
        // Fields are copied outside the lock; only numbering and one copy are inside.
        var record = EventRecord()
        fill(&record)
        let stalledNow = stalled.load(ordering: .relaxed)
        let (seq, wasEmpty, tooBig): (UInt64, Bool, Bool) = pending.withLock { p in
            p.seq += 1
            let wasEmpty = p.records.isEmpty
            if wasEmpty { p.firstSeq = p.seq }
            let header = RecordHeader(seq: p.seq, time: time, length: UInt32(record.bytes.count), type: type.code)
            p.records.append(bytesOf: header)
            p.records.append(record.bytes)
            if stalledNow && p.records.count > Journal.stalledBufferLimit {
                p.dropped = Journal.merge(p.dropped, p.firstSeq...p.seq)
                p.records.removeAll(keepingAtMost: Journal.stalledBufferLimit)
                return (p.seq, false, false)
            }
            return (p.seq, wasEmpty, p.records.count > 8 << 20)
        }
        if wasEmpty || tooBig { wakeWriter.signal() }
        if tooBig && !stalled.load(ordering: .relaxed) {
            // The disk is behind: wait for it rather than grow without bound.
            // Not while it is full: no wait would end, and every request
            // through the mount would take seconds.
            waitDurable(seq, timeout: 5)
        }
        return seq
    }

    /// Appends the JSON lines of `records` (as `Pending` holds them) to `lines`.
    private func format(_ all: UnsafeRawBufferPointer, into lines: inout EventLine) {
        var at = 0
        while at < all.count {
            let header = all.loadUnaligned(fromByteOffset: at, as: RecordHeader.self)
            at += MemoryLayout<RecordHeader>.size
            lines.begin(seq: header.seq, type: EventType(code: header.type), time: header.time, instance: instance)
            EventRecord.format(UnsafeRawBufferPointer(rebasing: all[at..<at + Int(header.length)]), into: &lines)
            lines.finish()
            at += Int(header.length)
        }
    }

    /// The newest sequence number given out.
    public var lastSeq: UInt64 { pending.withLock { $0.seq } }

    /// A cursor naming the state after `seq`.
    public func cursor(_ seq: UInt64) -> String { EventCursor(instance: instance, sequence: seq).description }

    private func writer() {
        defer { writerDone.signal() }
        becomeBackgroundThread(nice: 5)
        var incoming = ByteBuffer(capacity: 64 << 10)
        var lines = EventLine()
        /// Events dropped and not yet reported with a reset.
        var unreported: ClosedRange<UInt64>?
        while true {
            // Appends wake the writer; the timeout only runs the age limit
            // (days), so an idle mount's writer sleeps a minute at a time.
            if wakeWriter.wait(timeout: .now() + .seconds(60)) == .success && !isClosing {
                // Let a burst gather: one write and one wakeup of the readers
                // per few milliseconds, not one per event (that cost handlers
                // a semaphore post and a context switch each).
                usleep(5_000)
            }
            // Swap buffers instead of handing over a fresh one: both keep
            // their capacity, so appends never grow a buffer from nothing
            // (page faults in the handlers) and no large block is freed per
            // batch (munmap, whose TLB shootdown interrupts the other core).
            let (last, first, droppedMeanwhile): (UInt64, UInt64, ClosedRange<UInt64>?) = pending.withLock { p in
                swap(&p.records, &incoming)
                defer { p.dropped = nil }
                return (p.seq, p.firstSeq, p.dropped)
            }
            unreported = Journal.merge(unreported, droppedMeanwhile)
            let wrote = !incoming.isEmpty
            if wrote || unreported != nil {
                // What could not be written goes first, as one reset in its
                // place (it takes the last dropped number), then the batch.
                if let gap = unreported { appendReset(gap, into: &lines) }
                if wrote { format(incoming.bytes, into: &lines) }
                if write(lines.bytes, through: last) {
                    unreported = nil
                    stalled.store(false, ordering: .relaxed)
                } else {
                    // A full disk: the batch is dropped, not kept in memory.
                    if wrote { unreported = Journal.merge(unreported, first...last) }
                    stalled.store(true, ordering: .relaxed)
                }
            }
            // Keep a burst's capacity, but not a one-off flood's.
            incoming.removeAll(keepingAtMost: 8 << 20)
            lines.removeAll(keeping: 16 << 20)
            state.lock()
            if wrote { durable = last }
            state.broadcast()
            let done = closed
            state.unlock()
            if done && pending.withLock({ $0.records.isEmpty }) { return }
            trim()
        }
    }

    /// Appends `batch`, whose last event is `last`, to the current segment;
    /// false (and nothing of it in the file) if it cannot be written.
    private func write(_ batch: UnsafeRawBufferPointer, through last: UInt64) -> Bool {
        do {
            _ = try FileDescriptor(rawValue: currentFD).writeAll(batch)
        } catch {
            // No half line may stay for readers to trip on.
            state.lock()
            let size = segments[segments.count - 1].bytes
            state.unlock()
            _ = ftruncate(currentFD, off_t(size))
            return false
        }
        state.lock()
        segments[segments.count - 1].bytes += UInt64(batch.count)
        let full = segments[segments.count - 1].bytes >= limits.segmentBytes
        state.unlock()
        // The next segment starts right after this batch. Not at the newest
        // number given out: handlers may have appended since the batch was
        // taken, and those events go to the new file, which must not claim
        // to start after them (a reader at its end would wait for ever).
        if full { try? startSegment(first: last + 1) }
        return true
    }

    /// The `reset` that stands in the journal for `gap`, with its last number.
    private func appendReset(_ gap: ClosedRange<UInt64>, into lines: inout EventLine) {
        var record = EventRecord()
        record.string("reason", "the journal could not be written (a full disk): these events were dropped")
        record.int("skipped_from", gap.lowerBound)
        record.int("skipped_to", gap.upperBound)
        record.int("skipped", gap.count)
        var one = ByteBuffer(capacity: 256)
        one.append(bytesOf: RecordHeader(seq: gap.upperBound, time: Sys.wallClockNow(), length: UInt32(record.bytes.count),
                                         type: EventType.reset.code))
        one.append(record.bytes)
        format(one.bytes, into: &lines)
    }

    static func merge(_ a: ClosedRange<UInt64>?, _ b: ClosedRange<UInt64>?) -> ClosedRange<UInt64>? {
        guard let a else { return b }
        guard let b else { return a }
        return min(a.lowerBound, b.lowerBound)...max(a.upperBound, b.upperBound)
    }

    /// Rotation: events after the batch just written go to a new file. Called
    /// only by the writer (or before it starts), so the files stay in order.
    private func startSegment(first: UInt64) throws {
        let hex = String(first, radix: 16)
        let name = String(repeating: "0", count: 16 - hex.count) + hex + ".jsonl"
        let fd = openat(directoryFD, name, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { throw JournalError("cannot create \(name): \(String(cString: strerror(errno)))") }
        state.lock()
        if currentFD >= 0 { Glibc.close(currentFD) }
        currentFD = fd
        segments.append(Segment(first: first, name: name, bytes: 0, created: Sys.wallClockNow()))
        state.unlock()
    }

    private func trim() {
        state.lock()
        defer { state.unlock() }
        let now = Sys.wallClockNow()
        let short = limits.minFreePercent > 0 && belowFreeFloor()
        while segments.count > 1 {
            let total = segments.reduce(0) { $0 + $1.bytes }
            let oldest = segments[0]
            guard short || total > limits.maxBytes || now &- oldest.created > limits.maxAge else { break }
            // Readers that have it open keep reading it; new ones get a reset.
            unlinkat(directoryFD, oldest.name, 0)
            segments.removeFirst()
        }
    }

    /// Whether the backing filesystem has less free than `minFreePercent`.
    private func belowFreeFloor() -> Bool {
        guard let fs = try? Sys.fstatvfs(directoryFD), fs.f_blocks > 0 else { return false }
        return Double(fs.f_bavail) / Double(fs.f_blocks) * 100 < limits.minFreePercent
    }

    static func removeAll(in eventsFD: Int32, except keep: String) {
        guard let dp = try? Sys.openDirectory(eventsFD, ".") else { return }
        var names: [String] = []
        while let d = readdir(dp) {
            let name = withUnsafeBytes(of: d.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if name != "." && name != ".." && name != keep { names.append(name) }
        }
        for name in names {
            if let sp = try? Sys.openDirectory(dirfd(dp), name) {
                var files: [String] = []
                while let d = readdir(sp) {
                    let f = withUnsafeBytes(of: d.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
                    if f != "." && f != ".." { files.append(f) }
                }
                for f in files { unlinkat(dirfd(sp), f, 0) }
                closedir(sp)
            }
            unlinkat(dirfd(dp), name, AT_REMOVEDIR)
        }
        closedir(dp)
    }

    /// Blocks until `seq` is in the files (or the timeout passes).
    @discardableResult
    func waitDurable(_ seq: UInt64, timeout: Double) -> Bool {
        let deadline = Condition.now() &+ Duration.seconds(max(0, timeout)).nanoseconds
        state.lock()
        defer { state.unlock() }
        while durable < seq && !closed {
            if !state.wait(until: deadline) { return false }
        }
        return durable >= seq
    }

    /// The bytes of the segment starting at `first` that were written whole
    /// (everything, for a segment trimmed since: it was finished, and
    /// whatever is left in the file of it is whole).
    func committedBytes(ofSegment first: UInt64) -> UInt64 {
        state.lock()
        defer { state.unlock() }
        return segments.last { $0.first == first }?.bytes ?? UInt64.max
    }

    /// Blocks until a segment newer than the one starting at `first` exists,
    /// the journal closes, or the timeout passes; false on timeout.
    func waitForNews(after first: UInt64, timeout: Double) -> Bool {
        let deadline = Condition.now() &+ Duration.seconds(max(0, timeout)).nanoseconds
        state.lock()
        defer { state.unlock() }
        while !closed && !segments.contains(where: { $0.first > first }) {
            if !state.wait(until: deadline) { return false }
        }
        return true
    }

    /// Where a subscriber starts: after `cursor`, or now (nil). nil result:
    /// the cursor cannot be served (another instance, or older than the
    /// journal keeps): send a reset and start from now.
    public func reader(after cursor: String?) -> Reader? {
        let head = lastSeq
        guard let cursor else { return Reader(journal: self, next: head + 1) }
        guard let place = EventCursor(cursor), place.instance == instance, case let seq = place.sequence, seq <= head else { return nil }
        state.lock()
        let oldest = segments.first?.first ?? 1
        state.unlock()
        guard seq + 1 >= oldest else { return nil }
        return Reader(journal: self, next: seq + 1)
    }

    /// Follows the journal from one sequence number on, in order, none twice.
    public final class Reader {
        let journal: Journal
        public private(set) var next: UInt64
        private var fd: Int32 = -1
        private var segmentFirst: UInt64 = 0
        /// Bytes of the open segment read so far.
        private var offset: UInt64 = 0
        private var partial: [UInt8] = []
        /// Events this reader will never see: the journal dropped them
        /// (its size or age limit) before the reader got to them.
        private var gap: ClosedRange<UInt64>?

        /// The range skipped since the last call, if any; the subscriber
        /// must be told (a `reset`), never left to find a jump in `seq`.
        public func takeGap() -> ClosedRange<UInt64>? {
            defer { gap = nil }
            return gap
        }
        /// Read into once per call: a fresh zeroed 256 KiB array per batch of
        /// a few events cost a live subscriber more than the events themselves.
        private let scratch = UnsafeMutableRawBufferPointer.allocate(byteCount: 256 << 10, alignment: 16)

        init(journal: Journal, next: UInt64) {
            self.journal = journal
            self.next = next
        }

        deinit {
            if fd >= 0 { Glibc.close(fd) }
            scratch.deallocate()
        }

        /// The next lines (each with its newline), waiting up to `timeout`
        /// seconds for some; empty on timeout; nil once the journal closed
        /// or lost what this reader needs (it fell too far behind).
        public func read(timeout: Double) -> [[UInt8]]? {
            guard let run = readRun(timeout: timeout) else { return nil }
            var out: [[UInt8]] = []
            var start = 0
            while let nl = run[start...].firstIndex(of: 0x0A) {
                out.append(Array(run[start...nl]))
                start = nl + 1
            }
            return out
        }

        /// The next complete lines as one run of bytes, in order, none
        /// before `next`: what a subscriber that sees everything is sent
        /// as is, in one write (splitting it into lines cost a live
        /// subscriber an allocation per event). Empty on timeout, and
        /// right after a jump over events the journal dropped (`takeGap`);
        /// nil as for `read`.
        public func readRun(timeout: Double) -> [UInt8]? {
            if !journal.waitDurable(next, timeout: timeout) {
                journal.state.lock()
                let closed = journal.closed
                journal.state.unlock()
                return closed ? nil : []
            }
            while true {
                if fd < 0 {
                    if !open() { return nil }
                    if gap != nil { return [] }
                }
                // Only what the writer counts as written: a write the disk
                // cut short is truncated away again, and a reader that took
                // its bytes would deliver events the journal then reports
                // dropped, and read on from the middle of a later line.
                let available = journal.committedBytes(ofSegment: segmentFirst) &- offset
                let n = available == 0 ? 0 : pread(fd, scratch.baseAddress, Int(min(UInt64(scratch.count), available)), off_t(offset))
                if n > 0 { offset += UInt64(n) }
                if n <= 0 {
                    // End of this file. The writer finishes a segment before
                    // it starts the next, so once a newer one exists this one
                    // holds nothing more: go on to it. Otherwise wait.
                    journal.state.lock()
                    let successor = journal.segments.first { $0.first > segmentFirst }
                    journal.state.unlock()
                    if let successor {
                        Glibc.close(fd)
                        fd = -1
                        partial = []
                        // Segments between were trimmed while this reader lagged.
                        if successor.first > next { skip(to: successor.first) }
                        if !open(successor) { return nil }
                        if gap != nil { return [] }
                        continue
                    }
                    if !journal.waitDurable(next, timeout: timeout) { return [] }
                    // Everything up to `next` is written, yet not in this file
                    // and no newer file exists yet: wait for the writer's next
                    // step instead of spinning.
                    if !journal.waitForNews(after: segmentFirst, timeout: timeout) { return [] }
                    continue
                }
                partial += UnsafeRawBufferPointer(rebasing: scratch[..<n])
                guard let lastNL = partial.lastIndex(of: 0x0A) else { continue }
                // Lines are in order in a segment: skip those before `next`
                // (a reader that opened the segment at its start), then take
                // everything up to the last complete line.
                var first = 0
                while first <= lastNL {
                    let seq = partial[first...].withUnsafeBytes { EventLine.seq(of: $0) } ?? 0
                    if seq >= next { break }
                    first = partial[first...lastNL].firstIndex(of: 0x0A)! + 1
                }
                var run: [UInt8] = []
                if first <= lastNL {
                    let lastStart = (partial[first..<lastNL].lastIndex(of: 0x0A) ?? (first - 1)) + 1
                    if let seq = partial[lastStart...].withUnsafeBytes({ EventLine.seq(of: $0) }) { next = seq + 1 }
                    run = Array(partial[first...lastNL])
                }
                partial.removeFirst(lastNL + 1)
                if !run.isEmpty { return run }
            }
        }

        private func open() -> Bool {
            journal.state.lock()
            let segment = journal.segments.last { $0.first <= next }
            let oldest = journal.segments.first
            journal.state.unlock()
            if let oldest, next < oldest.first {
                skip(to: oldest.first)
                return open(oldest)
            }
            guard let segment else { return false }
            return open(segment)
        }

        /// Jumps to `seq`, recording what was passed over.
        private func skip(to seq: UInt64) {
            let from = gap?.lowerBound ?? next
            gap = from...(seq - 1)
            next = seq
        }

        private func open(_ segment: Segment) -> Bool {
            fd = openat(journal.directoryFD, segment.name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
            segmentFirst = segment.first
            offset = 0
            return fd >= 0
        }
    }
}

public struct JournalError: Error, CustomStringConvertible {
    public var description: String
    init(_ d: String) { description = d }
}
