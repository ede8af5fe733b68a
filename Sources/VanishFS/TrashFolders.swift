import CFuse
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import SystemPackage
import VanishGraveyard

/// The undo window as the freedesktop.org Trash specification lays a trash
/// out, so trash-cli, `gio trash` and file managers use it as it is:
/// `MOUNT/.Trash-$uid/files/NAME` is each entry `uid` deleted, still in the
/// graveyard (the very file, no copy), and `info/NAME.trashinfo` says where
/// it was and when it went. Nothing of it is on the backing filesystem: the
/// folders are made up here (node ids of their own, see `owns`), are never
/// listed in the root (`ls -a` and `git status` do not see them), and exist
/// for a user with kept entries, or once they made theirs. A real
/// `.Trash-$uid` in the source wins over this one.
///
/// Restoring is renaming `files/NAME` out; emptying is deleting it; moving
/// a file into `files/` (what `trash-put` and `gio trash` do after writing
/// its `.trashinfo`) deletes it into the window. An info file a client
/// writes is held here, loose, until its file comes, and one whose entry
/// went stays until the client removes it (as it does next), for five
/// minutes at most. See docs/design.md, "The desktop trash".
///
/// Lock order: its lock before the graveyard's trash index's; never held
/// across a system call.
final class TrashFolders: @unchecked Sendable {
    /// Node ids here have bit 63 and bit 31 set: an id carrying a backing
    /// handle has bit 31 clear, and a counted one would need 2^62 files
    /// before its bit 63 is set (`NodeID`).
    static let idBits: UInt64 = 1 << 63 | NodeID.countedBit
    static let prefix = Array(".Trash-".utf8)
    static let suffix = Array(".trashinfo".utf8)
    /// How long an info file with no entry is kept (s).
    static let looseLifetime: UInt32 = 300
    /// The largest info file a client may write, and how many, and how many
    /// bytes of them, an account may have (its subordinate uids with it:
    /// they live in the daemon's memory). A `.trashinfo` is a few hundred bytes.
    static let looseLimit = 16 * 1024
    static let looseCount = 1024
    static let looseBytes = 1 << 20

    @inline(__always)
    static func owns(_ id: fuse_ino_t) -> Bool { UInt64(id) & idBits == idBits }

    enum Kind: Hashable {
        /// `expunged`: where gvfs moves an entry it deletes from the trash,
        /// to delete it there; here, moving an entry in empties it, and the
        /// directory stays empty.
        case folder, files, info, expunged
        /// `info/NAME.trashinfo` (the name as given, suffix included).
        case infoFile([UInt8])
    }

    struct Node {
        let uid: UInt32
        let kind: Kind
        var lookups: UInt64 = 0
    }

    /// One user's entries as named in `files/` (see `name`), oldest first.
    struct Listing {
        var version: UInt64 = .max
        var names: [[UInt8]] = []
        var entries: [[UInt8]: TrashEntry] = [:]
    }

    /// An info file with no entry behind it: written by a client before its
    /// rename, or left by an entry restored or emptied.
    struct Loose {
        var bytes: [UInt8]
        var since: UInt32
    }

    private struct State {
        var nodes: [UInt64: Node] = [:]
        var ids: [NodeKey: UInt64] = [:]
        var next: UInt64 = 1
        /// Users who made their folder (mkdir) in this mount's life: the
        /// group they made it with, and which of `files` and `info` they made
        /// in it (a folder with entries has both).
        var made: [UInt32: Made] = [:]
        var loose: [UInt32: [[UInt8]: Loose]] = [:]
        /// What each account's loose files hold, all its uids' together.
        var looseUse: [UInt32: LooseUse] = [:]
        var listings: [UInt32: Listing] = [:]
        /// Each user's entries' names in `files/` (by entry id), once given:
        /// by a client that put it in the trash, or by a listing.
        var chosen: [UInt32: [String: [UInt8]]] = [:]
    }

    struct LooseUse {
        var count = 0
        var bytes = 0
    }

    struct Made {
        var gid: gid_t
        var parts: Set<Kind> = []
    }

    private struct NodeKey: Hashable {
        let uid: UInt32
        let kind: Kind
    }

    private let state = Mutex(State())
    /// The graveyard's shard directories as inodes of no node id: the
    /// parents through which an entry's inode is reopened (see `anchor`).
    private let anchors: [Inode]
    private let graveyard: Graveyard
    private let table: InodeTable
    /// Whether an entry was handed to the kernel yet: until then the table
    /// need not look for buried trees (`InodeTable.isBuried`, one load).
    private let anchored = Atomic(false)
    /// When the mount began (s since the epoch): the folders' times.
    private let born = UInt64(Sys.wallClockSeconds())
    /// Tells watchers of a listed folder what comes into it (nil: the mountpoint is not known).
    let announcer: TrashAnnouncer?

    init(graveyard: Graveyard, table: InodeTable, mountpoint: String? = nil, log: Logger? = nil) {
        self.graveyard = graveyard
        self.table = table
        announcer = mountpoint.map { TrashAnnouncer(mountpoint: $0, log: log) }
        anchors = graveyard.shardFDs.map { fd in
            let st = (try? Sys.fstat(fd)) ?? stat()
            let anchor = Inode(key: InodeKey(dev: st.st_dev, ino: st.st_ino), type: S_IFDIR, id: 0, generation: 0,
                               parent: nil, name: "")
            // Never listed in the fd cache, so never evicted nor closed there.
            anchor.cache.fd = fd
            return anchor
        }
    }

    /// The parent of the entries of `shard`, as the inode table links them.
    func anchor(_ shard: Int) -> Inode {
        if !anchored.load(ordering: .acquiring) {
            // Nothing may be made in an entry, nor an entry deleted into the window again.
            anchors.forEach(table.markBuried)
            anchored.store(true, ordering: .releasing)
        }
        return anchors[shard]
    }

    /// The uid `name` names a folder for (`.Trash-<decimal uid>`, no leading zero), if it does.
    static func uid(ofFolder name: UnsafePointer<CChar>) -> UInt32? {
        for (i, c) in prefix.enumerated() where UInt8(bitPattern: name[i]) != c { return nil }
        var p = name + prefix.count
        guard p[0] != 0, p[0] != 0x30 || p[1] == 0 else { return nil }
        var v: UInt64 = 0
        while p[0] != 0 {
            guard p[0] >= 0x30 && p[0] <= 0x39 else { return nil }
            v = v * 10 + UInt64(p[0] - 0x30)
            if v > UInt64(UInt32.max) { return nil }
            p += 1
        }
        return UInt32(v)
    }

    // MARK: Nodes

    /// The node id for `kind` of `uid`'s folder, counting a lookup if `lookedUp`.
    func node(_ uid: UInt32, _ kind: Kind, lookedUp: Bool = true) -> UInt64 {
        state.withLock { s in
            let key = NodeKey(uid: uid, kind: kind)
            let id = s.ids[key] ?? {
                let id = Self.idBits | (s.next & 0x7FFF_FFFF) | (s.next >> 31) << 32
                s.next += 1
                s.ids[key] = id
                s.nodes[id] = Node(uid: uid, kind: kind)
                return id
            }()
            if lookedUp { s.nodes[id]!.lookups += 1 }
            return id
        }
    }

    func node(_ id: fuse_ino_t) -> Node? { state.withLock { $0.nodes[UInt64(id)] } }

    /// Changes whenever an entry comes or goes.
    var version: UInt64 { graveyard.restorableVersion }

    func forget(_ id: fuse_ino_t, count: UInt64) {
        state.withLock { s in
            guard var n = s.nodes[UInt64(id)] else { return }
            n.lookups = n.lookups > count ? n.lookups - count : 0
            if n.lookups == 0 {
                s.nodes[UInt64(id)] = nil
                s.ids[NodeKey(uid: n.uid, kind: n.kind)] = nil
            } else {
                s.nodes[UInt64(id)] = n
            }
        }
    }

    // MARK: Entries

    /// `uid`'s entries as `files/` names them. Named outside the lock, so
    /// one user's big trash never holds up another's folder; a user with no
    /// entries leaves nothing behind (any uid can be looked up).
    func listing(_ uid: UInt32) -> Listing {
        let version = graveyard.restorableVersion
        if let known = state.withLock({ s in s.listings[uid].flatMap { $0.version == version ? $0 : nil } }) {
            return known
        }
        // Pieces of a held tree have no path, hence no name: `vanish trash` shows them.
        let entries = graveyard.restorable(of: uid).filter { $0.record.uid == uid && !$0.record.path.isEmpty }
        guard !entries.isEmpty else {
            state.withLock { s in
                s.listings[uid] = nil
                s.chosen[uid] = nil
            }
            return Listing(version: version)
        }
        var chosen = state.withLock { $0.chosen[uid] ?? [:] }
        var listing = Self.name(entries, chosen: &chosen)
        listing.version = version
        if chosen.count > 2 * entries.count + 64 {
            let ids = Set(entries.map(\.id))
            chosen = chosen.filter { ids.contains($0.key) }
        }
        state.withLock { s in
            // A name a client chose meanwhile (`chose`) stands.
            if let newer = s.chosen[uid] { chosen.merge(newer) { _, theirs in theirs } }
            s.chosen[uid] = chosen
            s.listings[uid] = listing
        }
        return listing
    }

    /// How many users' listings are kept (for tests).
    var cachedListings: Int { state.withLock { $0.listings.count + $0.chosen.count } }

    /// The longest name in `files/`: its info file's name must fit in 255 bytes.
    static let nameLimit = 255 - suffix.count

    /// Names `entries` (oldest first): each keeps the name it has in
    /// `chosen` (given by a client, or by an earlier listing), so no name
    /// changes while the mount lasts, whatever comes and goes; a new entry
    /// gets its last name (cut to `nameLimit`), or `.2`, `.3`, … after it
    /// when that is taken, counted on per name so that many entries of one
    /// name cost linear time.
    static func name(_ entries: [TrashEntry], chosen: inout [String: [UInt8]]) -> Listing {
        var listing = Listing()
        listing.names.reserveCapacity(entries.count)
        var fresh: [TrashEntry] = []
        for e in entries {
            if let name = chosen[e.id], name.count <= nameLimit, listing.entries[name] == nil {
                listing.entries[name] = e
            } else {
                fresh.append(e)
            }
        }
        var next: [[UInt8]: Int] = [:]
        for e in fresh {
            let base = lastName(e.record.path)
            var name = fitted(base, [])
            var n = next[base] ?? 2
            while listing.entries[name] != nil {
                name = fitted(base, Array(".\(n)".utf8))
                n += 1
            }
            next[base] = n
            listing.entries[name] = e
            chosen[e.id] = name
        }
        listing.names = listing.entries.sorted { $0.value.id < $1.value.id }.map(\.key)
        return listing
    }

    /// `base` then `suffix`, `base` cut so the whole fits in `nameLimit`.
    private static func fitted(_ base: [UInt8], _ suffix: [UInt8]) -> [UInt8] {
        base.count + suffix.count <= nameLimit ? base + suffix : Array(base.prefix(nameLimit - suffix.count)) + suffix
    }

    static func lastName(_ path: [UInt8]) -> [UInt8] {
        Array(path.split(separator: 0x2F, omittingEmptySubsequences: true).last ?? ArraySlice(path))
    }

    /// The entry `uid`'s `files/name` is. Names never change while an
    /// entry lasts, so a listing out of date still names one rightly while
    /// it is kept: `trash-list` beside a user's `rm -rf` reads each info
    /// file without a new listing per read.
    func entry(_ uid: UInt32, named name: [UInt8]) -> TrashEntry? {
        if let e = state.withLock({ $0.listings[uid]?.entries[name] }), let kept = graveyard.restorable(id: e.id) {
            return kept
        }
        return listing(uid).entries[name]
    }

    /// Whether `uid`'s folder exists: they made it, or it holds something.
    func exists(_ uid: UInt32) -> Bool {
        if state.withLock({ s in s.made[uid] != nil || !(s.loose[uid]?.isEmpty ?? true) }) { return true }
        return hasEntries(uid)
    }

    /// Whether `uid` has an entry: one of the last listing's still kept
    /// answers without a new listing.
    private func hasEntries(_ uid: UInt32) -> Bool {
        let known = state.withLock { s in s.listings[uid].map { l in l.names.prefix(8).map { l.entries[$0]!.id } } ?? [] }
        if known.contains(where: { graveyard.restorable(id: $0) != nil }) { return true }
        return !listing(uid).names.isEmpty
    }

    func make(_ uid: UInt32, gid: gid_t) -> Bool {
        if exists(uid) { return false }
        state.withLock { $0.made[uid] = Made(gid: gid) }
        return true
    }

    /// Whether `files` or `info` (`part`) is in `uid`'s folder: it holds
    /// something, or its user made the part.
    func has(_ uid: UInt32, _ part: Kind) -> Bool {
        if part == .expunged { return state.withLock { $0.made[uid]?.parts.contains(part) == true } }
        if state.withLock({ s in s.made[uid]?.parts.contains(part) == true || !(s.loose[uid]?.isEmpty ?? true) }) {
            return true
        }
        return hasEntries(uid)
    }

    /// mkdir of `files` or `info` in `uid`'s folder: false if it is there.
    func make(_ uid: UInt32, _ part: Kind, gid: gid_t) -> Bool {
        if has(uid, part) { return false }
        return state.withLock { s in s.made[uid, default: Made(gid: gid)].parts.insert(part).inserted }
    }

    /// Removes `uid`'s folder if empty (rmdir).
    func remove(_ uid: UInt32) throws(Errno) {
        guard listing(uid).names.isEmpty, state.withLock({ $0.loose[uid]?.isEmpty ?? true }) else {
            throw .directoryNotEmpty
        }
        state.withLock { _ = $0.made.removeValue(forKey: uid) }
    }

    /// The group the folder shows: the one it was made with, else its newest entry's deleter's.
    func group(_ uid: UInt32) -> gid_t {
        if let gid = state.withLock({ s in
            s.made[uid]?.gid ?? s.listings[uid].flatMap { l in l.names.last.flatMap { l.entries[$0]?.record.gid } }
        }) { return gid }
        let l = listing(uid)
        return l.names.last.flatMap { l.entries[$0]?.record.gid } ?? 0
    }

    /// `name` is what a client calls entry `id` (it put it in the trash under that name).
    func chose(_ name: [UInt8], for id: String, of uid: UInt32) {
        state.withLock { s in
            s.chosen[uid, default: [:]][id] = name
            s.listings[uid] = nil
        }
    }

    // MARK: Info files

    /// The info files in `uid`'s `info/`: one per entry, and the loose ones.
    func infoNames(_ uid: UInt32) -> [[UInt8]] {
        var names = listing(uid).names.map { $0 + Self.suffix }
        let loose = state.withLock { s in Self.prune(&s, uid).keys.sorted { $0.lexicographicallyPrecedes($1) } }
        let known = Set(names)
        names += loose.filter { !known.contains($0) }
        return names
    }

    /// What `info/name` holds: the loose file of that name, or its entry's
    /// record; nil if there is none.
    func infoContents(_ uid: UInt32, _ name: [UInt8]) -> [UInt8]? {
        if let loose = state.withLock({ s in Self.prune(&s, uid)[name] }) { return loose.bytes }
        guard name.count > Self.suffix.count, name.suffix(Self.suffix.count).elementsEqual(Self.suffix),
              let e = entry(uid, named: Array(name.dropLast(Self.suffix.count))) else { return nil }
        return Self.trashInfo(path: e.record.path, deleted: e.deleted)
    }

    /// Makes the loose file `name` (create with O_EXCL): false if it exists.
    func makeLoose(_ uid: UInt32, _ name: [UInt8]) throws(Errno) -> Bool {
        guard infoContents(uid, name) == nil else { return false }
        try state.withLock { s throws(Errno) in
            guard Self.fits(s, uid, count: 1, bytes: 0) else { throw .diskQuotaExceeded }
            s.loose[uid, default: [:]][name] = Loose(bytes: [], since: Self.now())
            Self.use(&s, uid, count: 1, bytes: 0)
        }
        return true
    }

    /// Writes into the loose file `name`; false if it is not one.
    func writeLoose(_ uid: UInt32, _ name: [UInt8], _ bytes: UnsafeRawBufferPointer, at offset: Int) throws(Errno) {
        try state.withLock { s throws(Errno) in
            guard var loose = s.loose[uid]?[name] else { throw .permissionDenied }
            guard offset >= 0, offset + bytes.count <= Self.looseLimit else { throw .fileTooLarge }
            let growth = max(0, offset + bytes.count - loose.bytes.count)
            guard Self.fits(s, uid, count: 0, bytes: growth) else { throw .diskQuotaExceeded }
            Self.use(&s, uid, count: 0, bytes: growth)
            if loose.bytes.count < offset + bytes.count {
                loose.bytes += [UInt8](repeating: 0, count: offset + bytes.count - loose.bytes.count)
            }
            loose.bytes.withUnsafeMutableBytes { UnsafeMutableRawBufferPointer(rebasing: $0[offset...]).copyMemory(from: bytes) }
            s.loose[uid]![name] = loose
        }
    }

    func truncateLoose(_ uid: UInt32, _ name: [UInt8], to size: Int) throws(Errno) {
        try state.withLock { s throws(Errno) in
            guard var loose = s.loose[uid]?[name] else { throw .permissionDenied }
            guard size >= 0, size <= Self.looseLimit else { throw .fileTooLarge }
            guard Self.fits(s, uid, count: 0, bytes: size - loose.bytes.count) else { throw .diskQuotaExceeded }
            Self.use(&s, uid, count: 0, bytes: size - loose.bytes.count)
            if size < loose.bytes.count { loose.bytes.removeLast(loose.bytes.count - size) }
            else { loose.bytes += [UInt8](repeating: 0, count: size - loose.bytes.count) }
            s.loose[uid]![name] = loose
        }
    }

    func isLoose(_ uid: UInt32, _ name: [UInt8]) -> Bool { state.withLock { $0.loose[uid]?[name] != nil } }

    /// Removes the loose file `name`; false if there is none.
    func removeLoose(_ uid: UInt32, _ name: [UInt8]) -> Bool {
        state.withLock { s in
            guard let gone = s.loose[uid]?.removeValue(forKey: name) else { return false }
            Self.use(&s, uid, count: -1, bytes: -gone.bytes.count)
            return true
        }
    }

    /// Keeps entry `e`'s info file, loose, after the entry went (restored or
    /// emptied), for the client that removes it next.
    func leaveInfo(_ uid: UInt32, _ name: [UInt8], of e: TrashEntry) {
        let bytes = Self.trashInfo(path: e.record.path, deleted: e.deleted)
        state.withLock { s in
            let old = s.loose[uid]?[name + Self.suffix]
            let (count, growth) = (old == nil ? 1 : 0, bytes.count - (old?.bytes.count ?? 0))
            if Self.fits(s, uid, count: count, bytes: growth) {
                s.loose[uid, default: [:]][name + Self.suffix] = Loose(bytes: bytes, since: Self.now())
                Self.use(&s, uid, count: count, bytes: growth)
            }
        }
    }

    private static func prune(_ s: inout State, _ uid: UInt32) -> [[UInt8]: Loose] {
        guard let all = s.loose[uid] else { return [:] }
        let now = now()
        let loose = all.filter { now &- $0.value.since < looseLifetime }
        if loose.count < all.count {
            let freed = all.values.reduce(0) { $0 + $1.bytes.count } - loose.values.reduce(0) { $0 + $1.bytes.count }
            use(&s, uid, count: loose.count - all.count, bytes: -freed)
        }
        s.loose[uid] = loose.isEmpty ? nil : loose
        return loose
    }

    /// Whether `uid`'s account may hold `count` more loose files and `bytes` more bytes in them.
    private static func fits(_ s: State, _ uid: UInt32, count: Int, bytes: Int) -> Bool {
        let use = s.looseUse[SubordinateIDs.shared.owner(of: uid)] ?? LooseUse()
        return use.count + count <= looseCount && use.bytes + bytes <= looseBytes
    }

    private static func use(_ s: inout State, _ uid: UInt32, count: Int, bytes: Int) {
        let account = SubordinateIDs.shared.owner(of: uid)
        var use = s.looseUse[account] ?? LooseUse()
        use.count += count
        use.bytes += bytes
        s.looseUse[account] = use.count <= 0 ? nil : use
    }

    private static func now() -> UInt32 { UInt32(truncatingIfNeeded: Sys.wallClockSeconds()) }

    // MARK: Attributes

    /// The attributes of a node here.
    func attributes(_ id: fuse_ino_t, _ node: Node) -> stat {
        var st = stat()
        st.st_ino = ino_t(UInt64(id) & ~Self.idBits)
        st.st_uid = node.uid
        st.st_gid = group(node.uid)
        st.st_blksize = 4096
        st.st_mtim.tv_sec = Int(born)
        switch node.kind {
        case .folder, .files, .info, .expunged:
            st.st_mode = S_IFDIR | 0o700
            st.st_nlink = node.kind == .folder ? 4 : 2
            st.st_size = 4096
        case .infoFile(let name):
            st.st_mode = S_IFREG | 0o600
            st.st_nlink = 1
            st.st_size = off_t(infoContents(node.uid, name)?.count ?? 0)
            if let e = entry(node.uid, named: Array(name.dropLast(Self.suffix.count))) {
                st.st_mtim.tv_sec = Int(Duration.nanoseconds(e.deleted).components.seconds)
            }
        }
        st.st_atim = st.st_mtim
        st.st_ctim = st.st_mtim
        return st
    }

    // MARK: The .trashinfo format

    /// An info file as the specification writes it: the path relative to
    /// the mount root (the specification's form for a trash in a top
    /// directory: it stays right wherever the mount goes), escaped as a URL
    /// path, and the local time of the deletion.
    static func trashInfo(path: [UInt8], deleted ns: UInt64) -> [UInt8] {
        var out = Array("[Trash Info]\nPath=".utf8)
        out += escaped(path)
        out += Array("\nDeletionDate=".utf8)
        out += Sys.localTime(nanoseconds: ns, format: "%Y-%m-%dT%H:%M:%S")
        out.append(0x0A)
        return out
    }

    /// `path` escaped as RFC 3986 asks of a URL path: every byte but
    /// letters, digits, `-._~` and `/` as `%XX`.
    static func escaped(_ path: [UInt8]) -> [UInt8] {
        let hex = Array("0123456789ABCDEF".utf8)
        var out: [UInt8] = []
        out.reserveCapacity(path.count)
        for b in path {
            switch b {
            case 0x30...0x39, 0x41...0x5A, 0x61...0x7A, 0x2D, 0x2E, 0x5F, 0x7E, 0x2F: out.append(b)
            default: out += [0x25, hex[Int(b >> 4)], hex[Int(b & 15)]]
            }
        }
        return out
    }
}
