import Glibc
import LinuxSyscalls
import Synchronization

/// Unlinks answered before their rename into the graveyard has landed.
///
/// An unlink through the mount checks the entry (it exists, is not a
/// directory, has one link, is not open), replies, and only then renames it
/// into the graveyard, on the same handler thread. The caller's next request
/// is meanwhile served by another handler thread, so the rename overlaps
/// with it instead of adding to the caller's wait: that is what makes
/// `rm -rf` through the mount cheaper than `rm -rf` on the backing
/// filesystem, not just than other FUSE filesystems. (A queue and a worker
/// thread did the same at the price of a wakeup per unlink, which cost more
/// than it saved on two cores when unlinks came one at a time.)
///
/// Nobody may see a name whose burial is pending. Every request that could
/// observe one waits for it first:
/// - by name (`waitForName`): lookup, and every request that makes,
///   links or renames a name (the kernel looks names up before unlink, rmdir
///   and rename, so a pending name answers ENOENT as it should);
/// - by directory (`waitForDirectory`): readdir, getattr and fsyncdir of
///   the directory, rmdir of it (it must be empty), and a rename onto it.
/// Waiting is always correct, so names are tracked by a 64-bit hash of
/// (directory, name): a collision only makes someone wait for nothing.
///
/// A crash between the reply and the rename leaves the file where it was:
/// the unlink is lost, not any data, as with an unlink a journaling
/// filesystem had not committed yet. At most one burial per handler thread
/// is pending, and libfuse lets every handler finish before the session ends.
final class DeferredBurials: @unchecked Sendable {
    struct Ticket {
        let nameHash: UInt64
        let directory: InodeKey
    }

    private let cond = Condition()
    // Guarded by `cond`.
    private var names: [UInt64: Int32] = [:]
    private var directories: [InodeKey: Int32] = [:]
    private var waiters = 0
    /// Burials pending, readable without the lock: the fast path of every
    /// check is one load of this.
    private let outstanding = Atomic<Int>(0)

    /// Whether no burial is pending (the hot paths' check).
    @inline(__always)
    var isEmpty: Bool { outstanding.load(ordering: .acquiring) == 0 }

    var count: Int { outstanding.load(ordering: .acquiring) }

    /// Marks `name` in `dir` as on its way to the graveyard; call before
    /// replying to the unlink, and `end` once the rename is done.
    func begin(_ dir: Inode, _ name: UnsafePointer<CChar>) -> Ticket {
        let ticket = Ticket(nameHash: Self.hash(dir.key, name), directory: dir.key)
        cond.lock()
        names[ticket.nameHash, default: 0] += 1
        directories[ticket.directory, default: 0] += 1
        outstanding.add(1, ordering: .releasing)
        cond.unlock()
        return ticket
    }

    func end(_ ticket: Ticket) {
        cond.lock()
        Self.release(&names, ticket.nameHash)
        Self.release(&directories, ticket.directory)
        outstanding.subtract(1, ordering: .releasing)
        if waiters > 0 { cond.broadcast() }
        cond.unlock()
    }

    /// Returns once `name` in `dir` has no burial pending.
    @inline(__always)
    func waitForName(_ dir: Inode, _ name: UnsafePointer<CChar>) {
        if isEmpty { return }
        let h = Self.hash(dir.key, name)
        cond.lock()
        while names[h] != nil { park() }
        cond.unlock()
    }

    /// Returns once no entry of the directory `key` has a burial pending.
    @inline(__always)
    func waitForDirectory(_ key: InodeKey) {
        if isEmpty { return }
        cond.lock()
        while directories[key] != nil { park() }
        cond.unlock()
    }

    /// Returns once every burial begun so far has landed.
    func drain() {
        if isEmpty { return }
        cond.lock()
        while outstanding.load(ordering: .relaxed) > 0 { park() }
        cond.unlock()
    }

    /// With the lock held: sleeps until a burial ends.
    private func park() {
        waiters += 1
        cond.wait()
        waiters -= 1
    }

    private static func release<K: Hashable>(_ counts: inout [K: Int32], _ key: K) {
        guard let n = counts[key] else { return }
        if n <= 1 { counts[key] = nil } else { counts[key] = n - 1 }
    }

    /// FNV-1a over the directory's identity and the name.
    @inline(__always)
    static func hash(_ dir: InodeKey, _ name: UnsafePointer<CChar>) -> UInt64 {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        @inline(__always) func mix(_ v: UInt64) {
            var v = v
            for _ in 0..<8 {
                h = (h ^ (v & 0xFF)) &* 0x100_0000_01b3
                v >>= 8
            }
        }
        mix(UInt64(dir.dev))
        mix(UInt64(dir.ino))
        var p = name
        while p.pointee != 0 {
            h = (h ^ UInt64(UInt8(bitPattern: p.pointee))) &* 0x100_0000_01b3
            p += 1
        }
        return h
    }
}
