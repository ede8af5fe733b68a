import CLinux
import Glibc
import LinuxSyscalls
import Synchronization

/// Statahead: when programs look up a directory's entries one after another
/// (`ls -l`, `du`, `find -ls`, `rsync`, `git status` where the listing came
/// without attributes), a background thread reads the directory ahead of
/// them and stats its entries, so the backing filesystem's inode reads
/// overlap the round trips instead of each waiting behind one.
///
/// As in Lustre's statahead: the pattern is detected per directory (a run
/// of lookups in it, none further than a second apart), the read-ahead
/// stays within a window of the lookups seen, and it stops when the
/// pattern breaks (no lookup in the directory for a second) or the
/// directory ends. The stats only warm the backing filesystem's caches:
/// replies are still made from the handler's own stat, so nothing a
/// program sees can be older than its request. It starts only after
/// lookups in the directory succeeded, that is after the kernel let the
/// callers search it, and any name in a directory one may search one may
/// look up; a walk that looks nothing up (`find -name`) never starts it.
///
/// Lock order: `jobs` is a leaf. The per-directory counters live on the
/// `Inode` under `InodeTable`'s lock.
final class Statahead: @unchecked Sendable {
    /// Entries read ahead of the lookups seen in a directory, at most.
    static let window: UInt32 = 128
    /// Lookups in a row that make a pattern.
    static let trigger: UInt32 = 4
    /// A pattern ends when a directory sees no lookup for this long (ms).
    static let idleMilliseconds: UInt32 = 1000
    /// Directories waiting for a thread, at most; more are not read ahead.
    static let queueLimit = 16
    static let threads = 2

    private let table: InodeTable
    private let namespace: BackingNamespace
    /// Names never stat'ed ahead (the state directory); set before serving.
    var skip: (Inode, UnsafePointer<CChar>) -> Bool = { _, _ in false }
    private let jobs = Condition()
    private var queue: [Inode] = []
    private var started = false
    /// Entries stat'ed ahead so far (`vanish status`, tests).
    let prefetched = Atomic<UInt64>(0)

    init(table: InodeTable, namespace: BackingNamespace) {
        self.table = table
        self.namespace = namespace
    }

    /// A LOOKUP found an entry in `dir`: counts it, and starts reading ahead
    /// in `dir` once the lookups there make a pattern.
    func lookedUp(in dir: Inode) {
        guard table.countLookup(in: dir, now: InodeTable.coarseMilliseconds(), trigger: Self.trigger,
                                idle: Self.idleMilliseconds) else { return }
        jobs.lock()
        defer { jobs.unlock() }
        guard queue.count < Self.queueLimit else {
            table.endReadAhead(dir)
            return
        }
        queue.append(dir)
        if !started {
            started = true
            for _ in 0..<Self.threads { spawnThread("vanish-ahead") { [self] in serve() } }
        }
        jobs.broadcast()
    }

    private func serve() {
        while true {
            jobs.lock()
            while queue.isEmpty { jobs.wait() }
            let dir = queue.removeFirst()
            jobs.unlock()
            readAhead(in: dir)
            table.endReadAhead(dir)
        }
    }

    /// Reads `dir` from its start and stats each entry, staying at most
    /// `window` entries ahead of the lookups in it, until the directory
    /// ends or the lookups stop.
    private func readAhead(in dir: Inode) {
        guard let fd = namespace.withFDIfPossible(dir, { Glibc.openat($0, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) }),
              fd >= 0 else { return }
        guard let stream = fdopendir(fd) else { Glibc.close(fd); return }
        defer { closedir(stream) }
        let dfd = dirfd(stream)
        var done: UInt32 = 0
        while let d = Glibc.readdir(stream) {
            let name = vanish_dirent_name(d)!
            if isDotOrDotDot(name) || skip(dir, name) { continue }
            // Ahead by a window at most: wait for the lookups to catch up,
            // and stop when they stopped.
            while true {
                let (seen, last) = table.lookupsCounted(in: dir)
                if InodeTable.coarseMilliseconds() &- last > Self.idleMilliseconds { return }
                if done < seen &+ Self.window { break }
                usleep(1000)
            }
            var st = stat()
            _ = fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW)
            done &+= 1
            prefetched.add(1, ordering: .relaxed)
        }
    }
}
