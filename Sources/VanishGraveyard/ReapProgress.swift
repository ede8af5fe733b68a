import LinuxSyscalls
import Synchronization

/// What deleting something freed: files (anything not a directory) and
/// directories apart, the data the files held (their sizes) and the disk
/// space given back (their blocks; only a last link frees any).
public struct Freed: Sendable, Equatable {
    public var files: UInt64 = 0
    public var directories: UInt64 = 0
    public var dataBytes: UInt64 = 0
    public var diskBytes: UInt64 = 0

    public init(files: UInt64 = 0, directories: UInt64 = 0, dataBytes: UInt64 = 0, diskBytes: UInt64 = 0) {
        self.files = files
        self.directories = directories
        self.dataBytes = dataBytes
        self.diskBytes = diskBytes
    }

    /// Files and directories together: what the reaper's pace counts.
    public var entries: UInt64 { files &+ directories }
    public var isEmpty: Bool { entries == 0 }

    public static func += (a: inout Freed, b: Freed) {
        a.files &+= b.files
        a.directories &+= b.directories
        a.dataBytes &+= b.dataBytes
        a.diskBytes &+= b.diskBytes
    }
}

/// What the reaper has freed, counted as it goes, and its recent pace.
///
/// Files are counted as they are unlinked (a few dozen at a time), not
/// when the entry they belong to is gone: a 1,000-file directory takes a rate-limited or
/// starved worker seconds, and counting it at the end made the pace read 0
/// for that long and then jump past any rate limit.
final class ReapProgress: Sendable {
    /// Graveyard entries (files or whole trees) removed.
    let entries = Atomic<UInt64>(0)
    /// Files and directories deleted: the pace counts both.
    let files = Atomic<UInt64>(0)
    let directories = Atomic<UInt64>(0)
    let dataBytes = Atomic<UInt64>(0)
    /// Bytes given back to the filesystem.
    let diskBytes = Atomic<UInt64>(0)
    /// Checkpoints of the counters, a few a second while reaping: a
    /// whole-life average would hide a reaper that slowed down or stopped.
    private let log = Mutex<[(time: UInt64, files: UInt64, entries: UInt64)]>([])
    private let lastCheckpoint = Atomic<UInt64>(0)

    func freed(_ f: Freed) {
        if f.files != 0 { files.wrappingAdd(f.files, ordering: .relaxed) }
        if f.directories != 0 { directories.wrappingAdd(f.directories, ordering: .relaxed) }
        if f.dataBytes != 0 { dataBytes.wrappingAdd(f.dataBytes, ordering: .relaxed) }
        if f.diskBytes != 0 { diskBytes.wrappingAdd(f.diskBytes, ordering: .relaxed) }
        checkpoint()
    }

    var total: Freed {
        Freed(files: files.load(ordering: .relaxed), directories: directories.load(ordering: .relaxed),
              dataBytes: dataBytes.load(ordering: .relaxed), diskBytes: diskBytes.load(ordering: .relaxed))
    }

    /// One graveyard entry entirely gone.
    func entryDone() {
        entries.wrappingAdd(1, ordering: .relaxed)
        checkpoint()
    }

    /// Files and entries freed per second since the oldest checkpoint of
    /// the last 2 s, and not before `notBefore` (CLOCK_MONOTONIC ns: when
    /// the reaper last stepped aside for requests, whose pace says nothing
    /// of its own); zero if the reaper freed nothing in that time, or has
    /// reaped for less than a second. A tree's first second is spent
    /// splitting it among the workers: counting from less, or over a longer
    /// window, made the first estimate after `vanish rm -r` of 100,000 files
    /// five times the truth.
    func pace(notBefore: UInt64 = 0) -> Reaper.Pace {
        let now = Condition.now()
        let files = files.load(ordering: .relaxed) &+ directories.load(ordering: .relaxed)
        let entries = entries.load(ordering: .relaxed)
        return log.withLock { log in
            guard let first = log.first(where: { now &- $0.time <= Duration.seconds(2).nanoseconds && $0.time >= notBefore })
            else { return .zero }
            let seconds = Duration.between(first.time, now).inSeconds
            guard seconds >= 1 else { return .zero }
            return Reaper.Pace(filesPerSecond: Double(files &- first.files) / seconds,
                               entriesPerSecond: Double(entries &- first.entries) / seconds)
        }
    }

    /// Records the counters at most four times a second (a clock read and
    /// one atomic load otherwise).
    @inline(__always)
    private func checkpoint() {
        let now = Condition.now()
        let last = lastCheckpoint.load(ordering: .relaxed)
        guard now &- last >= Duration.milliseconds(250).nanoseconds,
              lastCheckpoint.compareExchange(expected: last, desired: now, ordering: .relaxed).exchanged else { return }
        let point = (now, files.load(ordering: .relaxed) &+ directories.load(ordering: .relaxed), entries.load(ordering: .relaxed))
        log.withLock { log in
            if log.isEmpty || now &- log[log.count - 1].time > Duration.seconds(5).nanoseconds {
                // The first deletion after a rest: count from here, not
                // from a checkpoint made before the rest.
                log.removeAll(keepingCapacity: true)
                log.append((now &- 1, point.1, point.2))
            }
            log.append(point)
            if log.count > 24 { log.removeFirst(log.count - 24) }
        }
    }
}
