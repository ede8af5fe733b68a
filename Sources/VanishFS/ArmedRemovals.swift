import CFuse
import Glibc
import Synchronization

/// Directories a thread asked, with `VANISH_IOC_REMOVE_ON_RMDIR` on an
/// open handle, to remove in one step at its next rmdir. `vanish rm -r`
/// removes a tree this way so that the kernel drops the entry itself and
/// tells inotify and fanotify watchers (IN_DELETE on the parent), as for
/// rm's own rmdir; the delete trigger's notice to the kernel tells them
/// nothing. One per thread (the request's pid), only while the handle
/// that asked is open, and only for that thread's next rmdir.
final class ArmedRemovals: Sendable {
    private struct Armed {
        let ino: fuse_ino_t
        let handle: UInt64
    }
    private let armed = Mutex<[pid_t: Armed]>([:])
    /// How many are armed: rmdir and releasedir look only when some are.
    private let count = Atomic<Int>(0)

    init() {}

    func arm(pid: pid_t, ino: fuse_ino_t, handle: UInt64) {
        armed.withLock { a in
            a[pid] = Armed(ino: ino, handle: handle)
            count.store(a.count, ordering: .releasing)
        }
    }

    /// The handle closed: what it armed is off.
    @inline(__always)
    func released(handle: UInt64) {
        guard count.load(ordering: .acquiring) > 0 else { return }
        armed.withLock { a in
            guard let pid = a.first(where: { $0.value.handle == handle })?.key else { return }
            a[pid] = nil
            count.store(a.count, ordering: .releasing)
        }
    }

    /// The directory `pid` armed, taken off: nil when none.
    @inline(__always)
    func take(pid: pid_t) -> fuse_ino_t? {
        guard count.load(ordering: .acquiring) > 0 else { return nil }
        return armed.withLock { a in
            guard let ino = a.removeValue(forKey: pid)?.ino else { return nil }
            count.store(a.count, ordering: .releasing)
            return ino
        }
    }
}
