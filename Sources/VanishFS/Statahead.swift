import CLinux
import FUSEKit
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
/// A stat walk of a tree (`find -ls`, `du`, `rm -rf`) gets the same ahead of
/// it one level up: every listing records its subdirectories in order, and
/// as a walk that stats what it lists (the `readdirplus=walk` stamps) opens
/// each of them, the next `walkWindow` are read and their entries stat'ed on
/// these threads while the walk is still busy in the one before, so the
/// walk finds the backing caches warm. Walks in another order than the listing's
/// (`ls -R` sorts) get none. Only subdirectories the walk's caller may read
/// and search by their mode bits are warmed.
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
    /// Subdirectories warmed ahead of a walk's place among its siblings.
    static let walkWindow = 3
    /// A directory listed with attributes this recently is not warmed.
    static let warmForgetMilliseconds: UInt32 = 30_000
    /// Bytes of subdirectory names recorded for one directory, at most.
    static let walkLimit = 256 << 10

    private enum Job {
        /// Read a directory ahead of the lookups in it.
        case readAhead(Inode)
        /// Read the directory `name` in a parent a walk enters soon, and
        /// stat its entries, if its caller may.
        case warm(Inode, ContiguousArray<CChar>, Caller)
    }

    private let table: InodeTable
    private let namespace: BackingNamespace
    /// Names never stat'ed ahead (the state directory); set before serving.
    var skip: (Inode, UnsafePointer<CChar>) -> Bool = { _, _ in false }
    private let jobs = Condition()
    private var queue: [Job] = []
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
        enqueue(.readAhead(dir))
    }

    /// A listing of `dir` found the subdirectories named in `names` (each
    /// NUL-terminated; `restart`: from its start). Recorded for every
    /// listing, since a walk shows itself a stat walk only later, in the
    /// subdirectories: a names-only walk pays a copy of each directory's name.
    func listed(_ dir: Inode, subdirectories names: ContiguousArray<CChar>, restart: Bool) {
        guard !names.isEmpty || restart else { return }
        table.listedSubdirectories(of: dir, names, restart: restart, limit: Self.walkLimit)
    }

    /// A walk opened `dir`; if it stats what it lists, warms the siblings
    /// listed after it, for `caller`.
    func opened(_ dir: Inode, statWalk: Bool, caller: Caller) {
        guard statWalk, let (parent, names) = table.walkOpened(dir, window: Self.walkWindow) else { return }
        jobs.lock()
        defer { jobs.unlock() }
        for name in names where queue.count < Self.queueLimit {
            enqueue(.warm(parent, name, caller))
        }
    }

    /// Whether `caller` may read and search the directory `st` describes,
    /// by its mode bits (supplementary groups are not known here: no
    /// warming for them).
    private static func mayList(_ st: stat, _ caller: Caller) -> Bool {
        Credentials(uid: caller.uid, gid: caller.gid, groups: []).modeBitsGrant(st, 5)
    }

    /// With `jobs` locked.
    private func enqueue(_ job: Job) {
        queue.append(job)
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
            let job = queue.removeFirst()
            jobs.unlock()
            switch job {
            case .readAhead(let dir):
                readAhead(in: dir)
                table.endReadAhead(dir)
            case .warm(let parent, let name, let caller):
                warm(name, in: parent, for: caller)
            }
        }
    }

    /// Reads the directory `name` in `parent` and stats each of its entries,
    /// if `caller` may read and search it.
    private func warm(_ name: ContiguousArray<CChar>, in parent: Inode, for caller: Caller) {
        let opened = namespace.withFDIfPossible(parent) { pfd in
            name.withUnsafeBufferPointer {
                Glibc.openat(pfd, $0.baseAddress!, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
            }
        }
        guard let fd = opened, fd >= 0 else { return }
        var st = stat()
        // Not one the walk listed with attributes lately (a warm walk, a
        // repeated `du`): reading it again would only take a core from the walk.
        guard fstat(fd, &st) == 0, Self.mayList(st, caller),
              !table.listedLately(dev: st.st_dev, ino: st.st_ino, window: Self.warmForgetMilliseconds),
              let stream = fdopendir(fd) else {
            Glibc.close(fd)
            return
        }
        defer { closedir(stream) }
        let dfd = dirfd(stream)
        while let d = Glibc.readdir(stream) {
            let entry = vanish_dirent_name(d)!
            if isDotOrDotDot(entry) { continue }
            _ = fstatat(dfd, entry, &st, AT_SYMLINK_NOFOLLOW)
            prefetched.add(1, ordering: .relaxed)
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
