import CLinux
import Dispatch
import Glibc
import LinuxSyscalls
import Synchronization

extension Reaper {
    /// Kept entries given up before their windows ended, and why.
    public struct Shortening: Sendable {
        public var entries: Int
        public var bytes: UInt64
        /// Wall clock (ns) of the latest.
        public var at: UInt64
        /// "free space under keep_min_free (10%)" or "keep_max_bytes (20.0 GiB) reached".
        public var because: String
    }
}

/// Keeps the undo window within its limits: gives entries up, the largest
/// users' oldest first (`FairEviction`), until the restorable bytes fit
/// under keepMaxBytes and the filesystem has keepMinFreePercent free. Free
/// space is looked at every 5 to 50 ms while anything is kept (one
/// statvfs), the rest every second or when woken; when space is short the
/// entries given up are freed at once: a writer through passthrough gets
/// ENOSPC from the backing filesystem, which no retry of the daemon's can
/// take back.
final class SpaceWarden: Sendable {
    private let graveyard: Graveyard
    private let maxBytes: UInt64?
    private let minFreePercent: Double
    private let wakeup = DispatchSemaphore(value: 0)
    /// Set while the backing filesystem is short of space: no stepping aside then.
    private let short = Atomic<Bool>(false)
    private let checkedAt = Atomic<UInt64>(0)
    /// A request met ENOSPC while entries are kept (see `makeRoom`).
    private let roomWanted = Atomic<Bool>(false)
    /// What the last look saw: free bytes, the floor in bytes, and when
    /// (CLOCK_MONOTONIC ns).
    private let lastFree = Atomic<UInt64>(.max)
    private let floorBytes = Atomic<UInt64>(0)
    private let lastLook = Atomic<UInt64>(0)
    /// The warden looks at free space once a second only (nothing kept):
    /// the first entry kept wakes it to look every few milliseconds.
    private let resting = Atomic<Bool>(true)
    /// Since the mount: every shortening's entries and bytes, the latest's time and reason.
    private let shortenings = Mutex<Reaper.Shortening?>(nil)

    init(graveyard: Graveyard, policy: Reaper.Policy) {
        self.graveyard = graveyard
        maxBytes = policy.keepMaxBytes
        minFreePercent = policy.keepMinFreePercent
    }

    /// What the reaper's threads ask of each other around the warden's loop.
    struct Hooks {
        /// Whether the reaper still runs.
        var running: () -> Bool
        /// Entries were given up: the workers look again.
        var gaveUp: () -> Void
        /// Frees what was given up in `shard` now (space is short).
        var freeNow: (Int) -> Void
        var shortened: (Reaper.Shortening) -> Void
    }

    var shortened: Reaper.Shortening? { shortenings.withLock { $0 } }

    func wake() { wakeup.signal() }

    /// An entry was kept (`sizeUnknown`: a tree): the warden looks at the limits.
    @inline(__always)
    func kept(sizeUnknown: Bool) {
        if let max = maxBytes, graveyard.restorableBytes > max { wakeup.signal() }
        if maxBytes != nil && sizeUnknown { wakeup.signal() }
        // The first entry kept: the warden starts watching free space closely.
        if resting.load(ordering: .relaxed) && resting.exchange(false, ordering: .relaxed) { wakeup.signal() }
    }

    /// Whether free space is under keepMinFreePercent: fstatvfs at most
    /// once a second, or now when `fresh`.
    func isSpaceShort(fresh: Bool = false) -> Bool {
        let now = Sys.wallClockNow()
        let last = checkedAt.load(ordering: .relaxed)
        if fresh || now &- last > Duration.seconds(1).nanoseconds,
           checkedAt.compareExchange(expected: last, desired: now, ordering: .relaxed).exchanged {
            var isShort = false
            if minFreePercent > 0, let fs = try? Sys.fstatvfs(graveyard.stateFD) {
                isShort = Double(fs.f_bavail) < Double(fs.f_blocks) * minFreePercent / 100
            }
            short.store(isShort, ordering: .relaxed)
        }
        return short.load(ordering: .relaxed)
    }

    /// Whether writers may need the space kept entries hold: free space
    /// (as the warden saw it a few milliseconds ago) is less than what is
    /// kept plus the floor. A writer the daemon does not see (passthrough)
    /// would meet ENOSPC before the warden could free anything; one whose
    /// writes come through the daemon is given room first (`makeRoom`).
    /// `pending`: bytes deletions answered but not yet in the trash will keep.
    func spaceIsTight(pending: UInt64) -> Bool {
        guard !graveyard.trash.isEmpty || pending > 0 else { return false }
        var free = lastFree.load(ordering: .relaxed)
        var floor = floorBytes.load(ordering: .relaxed)
        // The warden's look may be older than the deletion that filled the
        // trash (it wakes for it, but may not have run yet): look again.
        if Condition.now() &- lastLook.load(ordering: .relaxed) > Duration.milliseconds(10).nanoseconds,
           let fs = try? Sys.fstatvfs(graveyard.stateFD) {
            free = UInt64(fs.f_bavail) * UInt64(fs.f_frsize)
            floor = UInt64(Double(fs.f_blocks) * Double(fs.f_frsize) * minFreePercent / 100)
        }
        return free < graveyard.trash.bytes &+ pending &+ floor
    }

    /// Whether a deletion that would give back `bytes` should free them at
    /// once, as natively, instead of leaving them to the reaper: free space
    /// is under keep_min_free (the window would give the entry up at once)
    /// or, where nothing is kept, under `bytes`. The writer that often comes
    /// next (`rm old && cp new`, log rotation) writes through passthrough and
    /// would meet ENOSPC before the reaper got there. Looked at afresh for a
    /// MiB or more, else as seen within the last 20 ms (rm -rf of small files
    /// pays no statvfs each).
    func freesAtOnce(bytes: UInt64, keeping: Bool) -> Bool {
        let now = Condition.now()
        var free = lastFree.load(ordering: .relaxed)
        var floor = floorBytes.load(ordering: .relaxed)
        if bytes >= 1 << 20 || now &- lastLook.load(ordering: .relaxed) > Duration.milliseconds(20).nanoseconds,
           let fs = try? Sys.fstatvfs(graveyard.stateFD) {
            free = UInt64(fs.f_bavail) * UInt64(fs.f_frsize)
            floor = UInt64(Double(fs.f_blocks) * Double(fs.f_frsize) * minFreePercent / 100)
            lastFree.store(free, ordering: .relaxed)
            floorBytes.store(floor, ordering: .relaxed)
            lastLook.store(now, ordering: .relaxed)
        }
        return free < (keeping ? floor : max(floor, bytes))
    }

    /// For a request the backing filesystem answered ENOSPC while entries
    /// are kept: has the warden free the oldest now, and waits (up to
    /// `timeout`) until there is more free space than before. True if
    /// there is: the request is worth trying again. `idle`: whether the
    /// reaper's workers all sleep (then nothing more will be freed).
    func makeRoom(timeout: Duration, idle: () -> Bool) -> Bool {
        guard !graveyard.trash.isEmpty || !idle(), let before = try? Sys.fstatvfs(graveyard.stateFD) else { return false }
        let deadline = Condition.now() &+ timeout.nanoseconds
        short.store(true, ordering: .relaxed)
        roomWanted.store(true, ordering: .relaxed)
        wakeup.signal()
        while Condition.now() < deadline {
            guard let now = try? Sys.fstatvfs(graveyard.stateFD) else { return false }
            if now.f_bavail > before.f_bavail { return true }
            if graveyard.trash.isEmpty && idle() { return now.f_bavail > before.f_bavail }
            usleep(1_000)
        }
        return false
    }

    /// The warden's thread, at the ordinary priority: a look every few
    /// milliseconds costs next to nothing, and when space runs out it must
    /// not wait behind the writer.
    func run(_ hooks: Hooks) {
        var unmeasurable: Set<String> = []
        var lastFull: UInt64 = 0
        var woken = true
        var trend = SpaceTrend()
        while hooks.running() {
            let now = Condition.now()
            let runningOut = (try? Sys.fstatvfs(graveyard.stateFD)).map { fs in
                let floor = Double(fs.f_blocks) * Double(fs.f_frsize) * minFreePercent / 100
                lastFree.store(UInt64(fs.f_bavail) * UInt64(fs.f_frsize), ordering: .relaxed)
                floorBytes.store(UInt64(floor), ordering: .relaxed)
                lastLook.store(now, ordering: .relaxed)
                return trend.runsOutSoon(fs, floor: floor, at: now)
            } ?? false
            let isShort = isSpaceShort(fresh: true) || roomWanted.exchange(false, ordering: .relaxed) || runningOut
            // Deletions then step aside for no one (see ForegroundGate).
            if isShort { short.store(true, ordering: .relaxed) }
            if isShort || woken || now &- lastFull >= Duration.seconds(1).nanoseconds {
                lastFull = now
                wardOnce(short: isShort, unmeasurable: &unmeasurable, hooks)
            }
            // Nothing kept: once a second. Kept entries the space may be
            // needed for, or space falling: every 5 ms; otherwise every 50 ms.
            let kept = !graveyard.trash.isEmpty
            resting.store(!kept, ordering: .relaxed)
            let interval: DispatchTimeInterval = !kept ? .seconds(1)
                : spaceIsTight(pending: 0) || trend.wasFalling || isShort ? .milliseconds(5) : .milliseconds(50)
            woken = wakeup.wait(timeout: .now() + interval) == .success
        }
    }

    /// Free space as the warden last saw it, to tell a writer filling the
    /// filesystem before it is full: a writer through passthrough gets
    /// ENOSPC from the backing filesystem itself.
    struct SpaceTrend {
        var free: Double = -1
        var at: UInt64 = 0
        var wasFalling = false
        /// How far ahead (ns) the fall is followed.
        static let horizon = Double(Duration.milliseconds(250).nanoseconds)

        /// Whether free space, falling since the look before last at the
        /// pace of the last, would pass below `floor` bytes within `horizon`.
        /// A burst that stopped (one fall, then none) does not count.
        mutating func runsOutSoon(_ fs: statvfs, floor: Double, at now: UInt64) -> Bool {
            let current = Double(fs.f_bavail) * Double(fs.f_frsize)
            defer { (free, at) = (current, now) }
            guard free >= 0, now > at, current < free else { wasFalling = false; return false }
            defer { wasFalling = true }
            guard wasFalling else { return false }
            let pace = (free - current) / Double(now - at)  // bytes per ns
            return current - pace * Self.horizon < floor
        }
    }

    private func wardOnce(short: Bool, unmeasurable: inout Set<String>, _ hooks: Hooks) {
        // Trees are buried with their size unknown (measuring them in the
        // request would walk them there): measure them here, so the byte
        // limit counts what they hold. Not while space is short: freeing first.
        // Background work: at nice 19, as the warden used to run whole.
        if !short {
            let unmeasured = graveyard.restorable.filter { $0.record.bytes == nil && !unmeasurable.contains($0.id) }
            if !unmeasured.isEmpty {
                let tid = id_t(vanish_gettid())
                _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), tid, 19)
                defer { _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), tid, 0) }
                for e in unmeasured {
                    if !hooks.running() { break }
                    if graveyard.measure(e) == nil { unmeasurable.insert(e.id) }
                }
            }
        }
        // Entries already given up are on their way out, though still
        // restorable until a worker takes them: counted as kept, a burst of
        // deletions gave up more each second than the limit needed.
        let restorable = graveyard.restorable
        let given = graveyard.trash.evicted
        let leaving = given.isEmpty ? 0 : restorable.reduce(0) { given.contains($1.id) ? $0 + ($1.record.bytes ?? 0) : $0 }
        // Counted from the same snapshot, not the index's running total:
        // an entry a worker is taking right now is out of the snapshot
        // but may still be in the total, which then counted it as kept
        // and gave up an entry the limit had room for.
        let all = restorable.reduce(0) { $0 + ($1.record.bytes ?? 0) }
        // Short of space (or a request met ENOSPC): at least one goes.
        let wanted = max(bytesToFree(kept: all - leaving, leaving: short ? 0 : leaving), short ? 1 : 0)
        if wanted > 0 {
            // Held entries go only by a restore: freeing one would strand what its deleter could not remove.
            let candidates = restorable.filter { $0.record.held == nil && (given.isEmpty || !given.contains($0.id)) }
            // By account: the uids of one subordinate range are one user here.
            let owners = candidates.map { (uid: SubordinateIDs.shared.owner(of: $0.record.uid), bytes: $0.record.bytes ?? 0) }
            let chosen = FairEviction.choose(owners, wanted: wanted)
            if !chosen.isEmpty {
                graveyard.trash.evict(chosen.map { candidates[$0].id })
                hooks.gaveUp()
                let bytes = chosen.reduce(0) { $0 + (candidates[$1].record.bytes ?? 0) }
                let overLimit = maxBytes.map { all - leaving > $0 } ?? false
                let because = overLimit && !short ? "keep_max_bytes (\(maxBytes ?? 0) bytes) reached"
                    : "free space under keep_min_free (\(minFreePercent)%)"
                let now = Reaper.Shortening(entries: chosen.count, bytes: bytes, at: Sys.wallClockNow(), because: because)
                shortenings.withLock { s in
                    s = Reaper.Shortening(entries: (s?.entries ?? 0) + now.entries, bytes: (s?.bytes ?? 0) + now.bytes,
                                          at: now.at, because: because)
                }
                hooks.shortened(now)
            }
        }
        guard short else { return }
        // Short of space: the entries given up go now, from here.
        let now = graveyard.trash.evicted
        for shard in Set(restorable.filter { now.contains($0.id) }.map(\.shard)).sorted() { hooks.freeNow(shard) }
    }

    /// How many bytes must go, beyond the `leaving` already chosen, before
    /// the window's limits hold again; `kept` is what the window holds besides.
    private func bytesToFree(kept: UInt64, leaving: UInt64) -> UInt64 {
        var need: UInt64 = 0
        if let max = maxBytes, kept > max { need = kept - max }
        if minFreePercent > 0, let fs = try? Sys.fstatvfs(graveyard.stateFD) {
            let total = Double(fs.f_blocks) * Double(fs.f_frsize)
            let free = Double(fs.f_bavail) * Double(fs.f_frsize) + Double(leaving)
            let floor = total * minFreePercent / 100
            // Entries of unknown size (whole trees) count as nothing, so
            // everything up to the newest may be taken: under pressure,
            // freeing too much beats running out.
            if free < floor { need = Swift.max(need, UInt64(floor - free)) }
        }
        return need
    }
}
