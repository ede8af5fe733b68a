import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import VanishGraveyard

/// Unlinks answered before their rename into the graveyard has landed.
///
/// An unlink through the mount checks the entry (it exists, is not a
/// directory, has one link, is not open) and replies at once; one worker
/// thread does the renames in order. The caller's round trip then costs a
/// lookup and an lstat, and the rename overlaps with the caller's next
/// request: that is what makes `rm -rf` through the mount cheaper than
/// `rm -rf` on the backing filesystem, not just than other FUSE filesystems.
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
/// filesystem had not committed yet. The queue is bounded so that window
/// stays short, and it is drained before unmount completes.
final class DeferredBurials: @unchecked Sendable {
    struct Job {
        let parent: Inode
        /// The parent's fd, pinned in the fd cache until the burial is done.
        let parentFD: Int32
        let name: ContiguousArray<CChar>
        let st: stat
        let caller: Caller
        let record: TrashRecord?
        let nameHash: UInt64
    }

    /// Burials queued or running at most; further unlinks wait for room.
    static let capacity = 1024

    private let cond = Condition()
    // Guarded by `cond`.
    private var queue: [Job] = []
    private var spare: [Job] = []
    private var names: [UInt64: Int32] = [:]
    private var directories: [InodeKey: Int32] = [:]
    private var waiters = 0
    private let started = Atomic<Bool>(false)
    /// Jobs queued or running, readable without the lock: the fast path of
    /// every check is one load of this.
    private let outstanding = Atomic<Int>(0)

    /// Whether no burial is pending (the hot paths' check).
    @inline(__always)
    var isEmpty: Bool { outstanding.load(ordering: .acquiring) == 0 }

    var count: Int { outstanding.load(ordering: .acquiring) }

    /// Starts the worker; `perform` does one burial and handles its errors.
    func start(_ perform: @escaping @Sendable (Job) -> Void) {
        guard started.compareExchange(expected: false, desired: true, ordering: .acquiringAndReleasing).exchanged else {
            return
        }
        spawnThread { [self] in run(perform) }
    }

    /// Whether unlinks may be deferred: only once the worker runs.
    @inline(__always)
    var isRunning: Bool { started.load(ordering: .relaxed) }

    /// Queues the burial of `name` in `parent`, waiting while the queue is full.
    func enqueue(parent: Inode, parentFD: Int32, name: UnsafePointer<CChar>, st: stat, caller: Caller,
                 record: TrashRecord?) {
        let job = Job(parent: parent, parentFD: parentFD, name: Inode.copyName(name), st: st, caller: caller, record: record,
                      nameHash: Self.hash(parent.key, name))
        cond.lock()
        while outstanding.load(ordering: .relaxed) >= Self.capacity { park() }
        queue.append(job)
        names[job.nameHash, default: 0] += 1
        directories[parent.key, default: 0] += 1
        outstanding.add(1, ordering: .releasing)
        cond.broadcast()
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

    /// Returns once every burial queued so far has landed.
    func drain() {
        if isEmpty { return }
        cond.lock()
        while outstanding.load(ordering: .relaxed) > 0 { park() }
        cond.unlock()
    }

    /// With the lock held: sleeps until the worker reports progress.
    private func park() {
        waiters += 1
        cond.wait()
        waiters -= 1
    }

    private func run(_ perform: (Job) -> Void) {
        while true {
            cond.lock()
            while queue.isEmpty { cond.wait() }
            // Take the whole queue; handlers keep appending to the spare.
            swap(&queue, &spare)
            cond.unlock()
            for job in spare {
                perform(job)
                cond.lock()
                Self.release(&names, job.nameHash)
                Self.release(&directories, job.parent.key)
                outstanding.subtract(1, ordering: .releasing)
                if waiters > 0 { cond.broadcast() }
                cond.unlock()
            }
            spare.removeAll(keepingCapacity: true)
        }
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
