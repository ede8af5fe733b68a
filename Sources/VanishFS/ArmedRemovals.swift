import CFuse
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Directories a thread asked, with `VANISH_IOC_REMOVE_ON_RMDIR` on an
/// open handle, to remove in one step at its next rmdir. `vanish rm -r`
/// removes a tree this way so that the kernel drops the entry itself and
/// tells inotify and fanotify watchers (IN_DELETE on the parent), as for
/// rm's own rmdir; the delete trigger's notice to the kernel tells them
/// nothing.
///
/// An arm is that one thread's: its id, when it started (an id alone is
/// reused: a stale arm turned another user's rmdir of a non-empty
/// directory into a delete of the tree) and its uid; it ends at that
/// thread's next rmdir, or when the handle that asked is closed. An
/// account holds at most `perAccount`.
final class ArmedRemovals: Sendable {
    static let perAccount = 16

    private struct Armed {
        let ino: fuse_ino_t
        let handle: UInt64
        let uid: uid_t
        let account: uid_t
        let started: UInt64
    }
    private struct State {
        var armed: [pid_t: Armed] = [:]
        var perAccount: [uid_t: Int] = [:]

        mutating func remove(_ pid: pid_t) -> Armed? {
            guard let gone = armed.removeValue(forKey: pid) else { return nil }
            let left = perAccount[gone.account, default: 1] - 1
            perAccount[gone.account] = left > 0 ? left : nil
            return gone
        }
    }
    private let state = Mutex(State())
    /// How many are armed: rmdir and releasedir look only when some are.
    private let count = Atomic<Int>(0)

    init() {}

    /// Arms `ino` for thread `pid` of `uid` through `handle`; EAGAIN past the
    /// account's arms, ESRCH if the thread is gone.
    func arm(pid: pid_t, uid: uid_t, ino: fuse_ino_t, handle: UInt64) throws(Errno) {
        guard let started = Sys.startTime(of: pid) else { throw .noSuchProcess }
        let account = SubordinateIDs.shared.owner(of: uid)
        try state.withLock { s throws(Errno) in
            _ = s.remove(pid)
            guard s.perAccount[account, default: 0] < Self.perAccount else { throw .resourceTemporarilyUnavailable }
            s.armed[pid] = Armed(ino: ino, handle: handle, uid: uid, account: account, started: started)
            s.perAccount[account, default: 0] += 1
            count.store(s.armed.count, ordering: .releasing)
        }
    }

    /// The handle closed: every arm made through it is off.
    @inline(__always)
    func released(handle: UInt64) {
        guard count.load(ordering: .acquiring) > 0 else { return }
        state.withLock { s in
            for (pid, a) in s.armed where a.handle == handle { _ = s.remove(pid) }
            count.store(s.armed.count, ordering: .releasing)
        }
    }

    /// The directory thread `pid` of `uid` armed, taken off: nil when none,
    /// or when the arm was another thread's that had the same id.
    @inline(__always)
    func take(pid: pid_t, uid: uid_t) -> fuse_ino_t? {
        guard count.load(ordering: .acquiring) > 0 else { return nil }
        guard let a = state.withLock({ s -> Armed? in
            defer { count.store(s.armed.count, ordering: .releasing) }
            return s.remove(pid)
        }) else { return nil }
        guard a.uid == uid, Sys.startTime(of: pid) == a.started else { return nil }
        return a.ino
    }
}
