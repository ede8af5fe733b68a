import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Entries the reaper could not delete (an immutable file inside, a
/// directory the daemon may not write), by name: when each is tried again,
/// and its shard. Without this, a pass that found only such an entry
/// counted as work done, and after an unmount the workers spun on it at
/// full CPU and the daemon never exited.
final class StuckEntries: Sendable {
    private let entries = Mutex<[String: (shard: Int32, retryAt: UInt64)]>([:])
    /// `entries.count`, read without the lock by every pass.
    private let count = Atomic<Int>(0)
    /// How long a stuck entry waits before it is tried again while the mount serves.
    static let retry = Duration.seconds(60).nanoseconds

    /// Whether there are none: one atomic load, for the reaper's every entry.
    @inline(__always)
    var isEmpty: Bool { count.load(ordering: .relaxed) == 0 }

    /// Whether `name` is to be left alone for now: until its retry time
    /// (which then bounds `nextDue`, wall clock), and for good once the
    /// reaper is `finishing` (it waits for the next mount or `vanish reap`).
    func holds(_ name: UnsafePointer<CChar>, finishing: Bool, nextDue: inout UInt64) -> Bool {
        let retryAt: UInt64? = entries.withLock { m in m[String(cString: name)]?.retryAt }
        guard let retryAt else { return false }
        if finishing { return true }
        let now = Condition.now()
        guard now < retryAt else { return false }
        nextDue = min(nextDue, Sys.wallClockNow() &+ (retryAt &- now))
        return true
    }

    /// Records `name` (in `shard`) as stuck until its retry; true the first time.
    func stick(_ name: UnsafePointer<CChar>, shard: Int32) -> Bool {
        let id = String(cString: name)
        return entries.withLock { m in
            let first = m.updateValue((shard, Condition.now() &+ Self.retry), forKey: id) == nil
            count.store(m.count, ordering: .relaxed)
            return first
        }
    }

    /// `name` is gone or held: no longer stuck.
    func unstick(_ name: UnsafePointer<CChar>) {
        guard !isEmpty else { return }
        entries.withLock { m in
            if m.removeValue(forKey: String(cString: name)) != nil { count.store(m.count, ordering: .relaxed) }
        }
    }

    /// The stuck entries still in the graveyard, sorted (for status: a look
    /// at each; those gone meanwhile are forgotten).
    func current() -> [String] {
        entries.withLock { m in
            for (id, e) in m where !Self.isThere(e.shard, id) { m[id] = nil }
            count.store(m.count, ordering: .relaxed)
            return m.keys.sorted()
        }
    }

    /// Whether `name` may still be in `dirFD`: anything but ENOENT says so
    /// (an entry lstat fails on is no more deletable than one it finds).
    static func isThere(_ dirFD: Int32, _ name: UnsafePointer<CChar>) -> Bool {
        do { _ = try Sys.lstatat(dirFD, name) } catch { return error != .noSuchFileOrDirectory }
        return true
    }
}
