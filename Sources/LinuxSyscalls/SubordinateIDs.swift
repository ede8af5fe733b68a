import Glibc
import Synchronization

/// Which account a uid belongs to for the daemon's per-user limits. One
/// account may act as every uid of its ranges in /etc/subuid (`useradd`
/// gives 65,536; the setuid `newuidmap` maps them into a user namespace),
/// so a limit per uid would give it 65,536 shares. The account a range
/// names is charged for all of it. The file is read again when it changes
/// (looked at no more than once a second); a uid in no range is its own.
public final class SubordinateIDs: Sendable {
    public static let shared = SubordinateIDs()

    /// A range of uids, and the account that owns it.
    public struct Range: Sendable, Equatable {
        public var first: UInt32
        public var count: UInt32
        public var owner: uid_t
    }

    private struct Snapshot {
        /// Sorted by `first`.
        var ranges: [Range] = []
        var modified = timespec()
        var size: off_t = -1
    }
    private let path: String
    private let passwd: String
    private let snapshot = Mutex(Snapshot())
    /// The lowest uid any range holds (`UInt32.max` if none): the common
    /// case, a uid below it, takes no lock.
    private let lowest = Atomic<UInt32>(UInt32.max)
    /// When the file was last looked at (CLOCK_MONOTONIC_COARSE, ms).
    private let lookedAt = Atomic<Int64>(Int64.min / 2)

    public init(path: String = "/etc/subuid", passwd: String = "/etc/passwd") {
        self.path = path
        self.passwd = passwd
        refresh()
    }

    /// The account `uid` counts as.
    public func owner(of uid: uid_t) -> uid_t {
        if uid < lowest.load(ordering: .relaxed) && !due() { return uid }
        refreshIfDue()
        return snapshot.withLock { s in Self.owner(of: uid, in: s.ranges) }
    }

    /// `uid`'s owner in `ranges` (sorted by `first`), or `uid` itself.
    static func owner(of uid: uid_t, in ranges: [Range]) -> uid_t {
        var low = 0, high = ranges.count
        while low < high {
            let mid = (low + high) / 2
            if ranges[mid].first <= uid { low = mid + 1 } else { high = mid }
        }
        guard low > 0 else { return uid }
        let r = ranges[low - 1]
        return UInt64(uid) < UInt64(r.first) + UInt64(r.count) ? r.owner : uid
    }

    /// Parses subuid lines (`owner:first:count`, the owner a name or a uid).
    /// Ranges of root's are left out: charging them to root would exempt
    /// them from every limit, where the mapping may only ever narrow one.
    public static func parse(_ records: [[String]], uidOf: (String) -> uid_t?) -> [Range] {
        var ranges: [Range] = []
        for f in records where f.count >= 3 {
            guard let first = UInt32(f[1]), let count = UInt32(f[2]), count > 0,
                  let owner = UInt32(f[0]) ?? uidOf(f[0]), owner != 0 else { continue }
            ranges.append(Range(first: first, count: count, owner: owner))
        }
        return ranges.sorted { $0.first < $1.first }
    }

    private static func nowMilliseconds() -> Int64 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts)
        return Int64(ts.tv_sec) * 1000 + Int64(ts.tv_nsec) / 1_000_000
    }

    private func due() -> Bool {
        Self.nowMilliseconds() - lookedAt.load(ordering: .relaxed) >= 1000
    }

    private func refreshIfDue() {
        if due() { refresh() }
    }

    private func refresh() {
        var st = stat()
        let found = stat(path, &st) == 0
        lookedAt.store(Self.nowMilliseconds(), ordering: .relaxed)
        let unchanged = snapshot.withLock { s -> Bool in
            found ? (s.size == st.st_size && s.modified.tv_sec == st.st_mtim.tv_sec
                            && s.modified.tv_nsec == st.st_mtim.tv_nsec) : s.size == -1
        }
        if unchanged { return }
        let users = UserDatabase.records(passwd)
        let ranges = found ? Self.parse(UserDatabase.records(path)) { name in
            users.first { $0.count >= 3 && $0[0] == name }.flatMap { UInt32($0[2]) }
        } : []
        snapshot.withLock { s in
            s.ranges = ranges
            s.size = found ? st.st_size : -1
            s.modified = found ? st.st_mtim : timespec()
        }
        lowest.store(ranges.first?.first ?? UInt32.max, ordering: .relaxed)
    }
}
