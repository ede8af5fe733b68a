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
/// pattern breaks (no lookup in the directory for a second), when the
/// lookups are mostly of names it has not read (another order than the
/// listing's), or when the directory ends. The stats only warm the backing
/// filesystem's caches: replies are still made from the handler's own
/// stat, so nothing a program sees can be older than its request. It starts only after
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
/// Lock order: `jobs` and `counters` are leaves. The per-directory state
/// lives on the `Inode` (`Inode.ahead`) under `counters`; nothing but
/// Statahead reads or writes it.
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
    /// Names never stat'ed ahead (the state directory).
    private let skip: @Sendable (Inode, UnsafePointer<CChar>) -> Bool
    /// Guards every directory's `Inode.ahead`.
    private let counters = Mutex<Void>(())
    private let jobs = Condition()
    private var queue: [Job] = []
    private var started = false
    /// Entries stat'ed ahead so far (`vanish status`, tests).
    let prefetched = Atomic<UInt64>(0)

    init(table: InodeTable, namespace: BackingNamespace, skip: @escaping @Sendable (Inode, UnsafePointer<CChar>) -> Bool) {
        self.table = table
        self.namespace = namespace
        self.skip = skip
    }

    /// A LOOKUP found `name` in `dir`: counts it, and starts reading ahead
    /// in `dir` once the lookups there make a pattern.
    func lookedUp(_ name: UnsafePointer<CChar>, in dir: Inode) {
        guard countLookup(name, in: dir, now: InodeTable.coarseMilliseconds(), trigger: Self.trigger,
                          idle: Self.idleMilliseconds) else { return }
        jobs.lock()
        defer { jobs.unlock() }
        guard queue.count < Self.queueLimit else {
            endReadAhead(dir)
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
        listedSubdirectories(of: dir, names, restart: restart, limit: Self.walkLimit)
    }

    /// A walk opened `dir`; if it stats what it lists, warms the siblings
    /// listed after it, for `caller`.
    func opened(_ dir: Inode, statWalk: Bool, caller: Caller) {
        guard statWalk, let (parent, names) = walkOpened(dir, window: Self.walkWindow) else { return }
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
                endReadAhead(dir)
            case .warm(let parent, let name, let caller):
                warm(name, in: parent, for: caller)
            }
        }
    }

    /// Reads the directory `name` in `parent` and stats each of its entries,
    /// if `caller` may read and search it.
    private func warm(_ name: ContiguousArray<CChar>, in parent: Inode, for caller: Caller) {
        let opened = namespace.warming(parent) { pfd in
            name.withUnsafeBufferPointer {
                Glibc.openat(pfd, $0.baseAddress!, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
            }
        }
        guard let fd = opened, fd >= 0 else { return }
        var st = stat()
        // Not one the walk listed with attributes lately (a warm walk, a
        // repeated `du`): reading it again would only take a core from the walk.
        guard fstat(fd, &st) == 0, Self.mayList(st, caller),
              !table.listedLately(dev: st.st_dev, ino: st.st_ino, window: Self.warmForgetMilliseconds) else {
            Glibc.close(fd)
            return
        }
        guard let stream = try? Sys.directoryStream(adopting: fd) else { return }
        defer { closedir(stream) }
        let dfd = dirfd(stream)
        while let d = Glibc.readdir(stream) {
            let entry = vanish_dirent_name(d)!
            if isDotOrDotDot(entry) { continue }
            _ = fstatat(dfd, entry, &st, AT_SYMLINK_NOFOLLOW)
            prefetched.add(1, ordering: .relaxed)
        }
    }

    // MARK: Per-directory state (under `counters`)

    /// Lookups not among the names read ahead, at least, before reading
    /// ahead gives up on a directory (`countLookup`).
    static let missesToStop: UInt32 = 64

    /// Counts a lookup of `name`, a file in `dir`, for statahead; true when
    /// the lookups there now make a run of `trigger` (none `idle` ms apart)
    /// and reading ahead should begin (once per run). While it reads, it
    /// stops when the lookups are mostly of names it has not reached: they
    /// go in another order than the listing's (names sorted in a hashed
    /// directory, a program's own list), and the stats would only take a
    /// core from them.
    private func countLookup(_ name: UnsafePointer<CChar>, in dir: Inode, now: UInt32, trigger: UInt32,
                             idle: UInt32) -> Bool {
        counters.withLock { _ in
            if now &- dir.ahead.last > idle {
                dir.ahead.lookups = 0
                if dir.ahead.state == .finished { dir.ahead.state = .watching }
            }
            dir.ahead.lookups &+= 1
            dir.ahead.last = now
            if dir.ahead.state == .reading, let stated = dir.ahead.stated {
                if stated.contains(name) { dir.ahead.hits &+= 1 } else { dir.ahead.misses &+= 1 }
                if dir.ahead.misses >= Self.missesToStop && dir.ahead.misses > 4 &* dir.ahead.hits {
                    dir.ahead.state = .finished
                }
            }
            guard dir.ahead.state == .watching, dir.ahead.lookups >= trigger else { return false }
            dir.ahead.state = .reading
            return true
        }
    }

    /// Reading ahead in `dir` is about to stat `name`: records it, and
    /// returns the lookups counted in the current run, when the last came,
    /// and whether reading ahead should go on.
    private func readingAhead(_ name: UnsafePointer<CChar>, in dir: Inode) -> (count: UInt32, last: UInt32, goOn: Bool) {
        counters.withLock { _ in
            dir.ahead.stated?.insert(name)
            return (dir.ahead.lookups, dir.ahead.last, dir.ahead.state == .reading)
        }
    }

    /// Reading ahead in `dir` begins: no names stat'ed yet.
    private func beginReadAhead(_ dir: Inode) {
        let stated = StatedNames()
        counters.withLock { _ in
            dir.ahead.stated = stated
            dir.ahead.hits = 0
            dir.ahead.misses = 0
        }
    }

    /// Reading ahead in `dir` ended: not again until a new run begins.
    private func endReadAhead(_ dir: Inode) {
        counters.withLock { _ in
            dir.ahead.state = .finished
            dir.ahead.stated = nil
        }
    }

    /// A listing of `dir` found the subdirectories named in `names` (each
    /// NUL-terminated; from its start when `restart`). Keeps `limit` bytes at most.
    private func listedSubdirectories(of dir: Inode, _ names: ContiguousArray<CChar>, restart: Bool, limit: Int) {
        counters.withLock { _ in
            if restart {
                dir.ahead.subdirectoryNames.removeAll(keepingCapacity: false)
                dir.ahead.walkAt = 0
                dir.ahead.warmedTo = 0
            }
            if dir.ahead.subdirectoryNames.count + names.count <= limit { dir.ahead.subdirectoryNames.append(contentsOf: names) }
        }
    }

    /// How many recorded names `walkOpened` looks through for the opened one.
    static let walkSearch = 64

    /// A walk opened the directory `child`: finds it among its parent's
    /// listed subdirectories (walks go in listing order: from the last one
    /// found) and returns the parent and the names of the `window` after it
    /// not handed out before, taking them.
    private func walkOpened(_ child: Inode, window: Int) -> (parent: Inode, names: [ContiguousArray<CChar>])? {
        guard let (parent, childName) = table.location(of: child) else { return nil }
        return counters.withLock { _ -> (parent: Inode, names: [ContiguousArray<CChar>])? in
            guard !parent.ahead.subdirectoryNames.isEmpty else { return nil }
            // Read from a copy (no allocation) and written back after: the
            // list is not to be accessed while its neighbours are changed.
            let listed = parent.ahead.subdirectoryNames
            var walkAt = parent.ahead.walkAt, warmedTo = parent.ahead.warmedTo
            defer {
                // All handed out: the names are not needed any more.
                if warmedTo >= listed.count {
                    parent.ahead.subdirectoryNames = []
                    parent.ahead.walkAt = 0
                    parent.ahead.warmedTo = 0
                } else {
                    parent.ahead.walkAt = walkAt
                    parent.ahead.warmedTo = warmedTo
                }
            }
            return listed.withUnsafeBufferPointer { all -> (parent: Inode, names: [ContiguousArray<CChar>])? in
                let base = all.baseAddress!
                // A few names on at most: a walk in another order (`ls -R`
                // sorts) gets no warming rather than a scan of a long list
                // under this lock at every opendir.
                var at = walkAt
                var found: Int? = nil
                for _ in 0..<Self.walkSearch {
                    guard at < all.count else { break }
                    let length = strlen(base + at)
                    if childName.withUnsafeBufferPointer({ strcmp($0.baseAddress!, base + at) }) == 0 { found = at; break }
                    at += length + 1
                }
                guard let here = found else { return nil }
                walkAt = here
                var next = here + strlen(base + here) + 1
                var due: [ContiguousArray<CChar>] = []
                for _ in 0..<window {
                    guard next < all.count else { break }
                    let length = strlen(base + next)
                    if next >= warmedTo {
                        due.append(ContiguousArray(UnsafeBufferPointer(start: base + next, count: length + 1)))
                    }
                    next += length + 1
                }
                warmedTo = max(warmedTo, next)
                return due.isEmpty ? nil : (parent, due)
            }
        }
    }

    /// Reads `dir` from its start and stats each entry, staying at most
    /// `window` entries ahead of the lookups in it, until the directory
    /// ends or the lookups stop.
    private func readAhead(in dir: Inode) {
        guard let fd = namespace.warming(dir, { Glibc.openat($0, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) }),
              fd >= 0 else { return }
        guard let stream = try? Sys.directoryStream(adopting: fd) else { return }
        defer { closedir(stream) }
        beginReadAhead(dir)
        let dfd = dirfd(stream)
        var done: UInt32 = 0
        while let d = Glibc.readdir(stream) {
            let name = vanish_dirent_name(d)!
            if isDotOrDotDot(name) || skip(dir, name) { continue }
            // Ahead by a window at most: wait for the lookups to catch up,
            // and stop when they stopped or went another way.
            while true {
                let (seen, last, goOn) = readingAhead(name, in: dir)
                if !goOn || InodeTable.coarseMilliseconds() &- last > Self.idleMilliseconds { return }
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

/// The names reading ahead stat'ed in one directory, as a 4,096-bit set of
/// their hashes: enough to tell lookups that follow the listing (nearly all
/// found) from lookups in another order (nearly none: a few hundred names
/// are set when it decides), without keeping the names. Guarded by
/// Statahead's `counters`.
final class StatedNames {
    private var bits = [UInt64](repeating: 0, count: 64)

    private static func bit(_ name: UnsafePointer<CChar>) -> Int {
        // FNV-1a.
        var h: UInt32 = 2_166_136_261
        var p = name
        while p.pointee != 0 {
            h = (h ^ UInt32(UInt8(bitPattern: p.pointee))) &* 16_777_619
            p += 1
        }
        return Int(h & 4095)
    }

    func insert(_ name: UnsafePointer<CChar>) {
        let b = Self.bit(name)
        bits[b >> 6] |= 1 << UInt64(b & 63)
    }

    func contains(_ name: UnsafePointer<CChar>) -> Bool {
        let b = Self.bit(name)
        return bits[b >> 6] & (1 << UInt64(b & 63)) != 0
    }
}
