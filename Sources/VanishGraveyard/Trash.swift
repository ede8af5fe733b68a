import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// What Vanish remembers of a deleted entry while its undo window lasts,
/// kept beside it in the graveyard as `.<entry name>` (a "sidecar"), so a
/// restart or a crash loses none of it.
public struct TrashRecord: Sendable, Equatable {
    /// Where it was, relative to the mount root, as raw bytes (any name a
    /// filesystem allows, valid UTF-8 or not).
    public var path: [UInt8]
    /// Who deleted it: only they (or root) may list or restore it.
    public var uid: UInt32
    public var gid: UInt32
    /// Bytes its data takes on disk; nil when unknown (a whole tree).
    public var bytes: UInt64?
    public var kind: Kind
    /// How long (ns) it is kept from its deletion: the window in force when
    /// it was deleted, whatever later mounts' windows are. nil in records
    /// from before windows were written down (see `keptUntil`).
    public var window: UInt64?
    /// Why it is kept until restored, whatever the window: nil for an
    /// ordinary deletion. Set for a tree its deleter could not have removed
    /// whole whose place was gone or taken when it was to be put back: the
    /// reaper would free only the deleter's part and strand the rest.
    public var held: Held?
    /// The directory it was deleted from, for a directory: a restore "in
    /// place" of one its restorer does not own (undoing their rmdir, as
    /// the kernel would let them) goes only into that same directory, not
    /// into another made at the same path.
    public var from: Origin?

    /// A backing directory's identity: inode number and birth time (ns,
    /// 0 where the filesystem keeps none), so a reused number is no match.
    public struct Origin: Sendable, Equatable {
        public var inode: UInt64
        public var birth: UInt64
        public init(inode: UInt64, birth: UInt64) {
            self.inode = inode
            self.birth = birth
        }
        /// Whether `st` (with birth time `birth`) is that directory.
        public func matches(_ st: stat, birth: UInt64) -> Bool {
            UInt64(st.st_ino) == inode && (self.birth == 0 || birth == 0 || self.birth == birth)
        }
    }

    public enum Held: String, Sendable {
        /// Another entry had its name.
        case taken
        /// Its directory was gone.
        case gone
        /// It could not be put back for another reason.
        case failed
        /// The reaper, acting as its deleter, could not remove all of it
        /// (something moved in through a descriptor held inside it, or made
        /// immutable meanwhile).
        case stuck
        /// It holds a directory that may have come in after it was deleted,
        /// moved by someone else through a descriptor held inside it
        /// (`TreeRemover.cameInLater`): not its deleter's to free.
        case later

        public var explanation: String {
            switch self {
            case .taken: "holds what its deleter could not remove, and its name was taken: restore it elsewhere with --to"
            case .gone: "holds what its deleter could not remove, and its directory was gone: restore it elsewhere with --to"
            case .failed: "holds what its deleter could not remove, and could not be put back: restore it with --to"
            case .stuck: "holds what its deleter could not remove when it was to be freed: restore it with --to"
            case .later: "holds a directory moved into it after it was deleted, not its deleter's to free: restore it with --to"
            }
        }
    }

    public enum Kind: UInt8, Sendable {
        case file = 0x66, directory = 0x64, symlink = 0x6C, other = 0x6F
        public var name: String {
            switch self { case .file: "file"; case .directory: "directory"; case .symlink: "symlink"; case .other: "other" }
        }
        public init(mode: mode_t) {
            switch mode & S_IFMT {
            case S_IFREG: self = .file
            case S_IFDIR: self = .directory
            case S_IFLNK: self = .symlink
            default: self = .other
            }
        }
    }

    public init(path: [UInt8], uid: UInt32, gid: UInt32, bytes: UInt64?, kind: Kind, window: UInt64? = nil,
                held: Held? = nil, from: Origin? = nil) {
        self.path = path
        self.uid = uid
        self.gid = gid
        self.bytes = bytes
        self.kind = kind
        self.window = window
        self.held = held
        self.from = from
    }

    static let originMagic = "vanish-trash 4\n"
    static let heldMagic = "vanish-trash 3\n"
    static let magic = "vanish-trash 2\n"
    static let firstMagic = "vanish-trash 1\n"

    /// `vanish-trash 2\n<uid> <gid> <bytes|-> <kind> <window ns|->\n<path bytes>`:
    /// the path last, so it may hold any byte, newlines included. Version 1
    /// had no window; version 3 adds why it is held, version 4 also where a
    /// directory was deleted from (`<held|-> <inode>:<birth>`); each is
    /// written only when it has those, so ordinary records stay readable
    /// by older daemons.
    func encoded() -> [UInt8] {
        var fields = "\(uid) \(gid) \(bytes.map(String.init) ?? "-") \(Character(Unicode.Scalar(kind.rawValue))) "
            + "\(window.map(String.init) ?? "-")"
        let magic: String
        if let from {
            magic = TrashRecord.originMagic
            fields += " \(held?.rawValue ?? "-") \(from.inode):\(from.birth)"
        } else if let held {
            magic = TrashRecord.heldMagic
            fields += " " + held.rawValue
        } else {
            magic = TrashRecord.magic
        }
        return Array(magic.utf8) + Array((fields + "\n").utf8) + path
    }

    /// Writes the record as the file `name` in `dirFD` (`mode`: O_EXCL for a
    /// new one, O_TRUNC to replace one), removed again if that fails.
    func write(to dirFD: Int32, _ name: UnsafePointer<CChar>, _ mode: Int32) throws(Errno) {
        let fd = FileDescriptor(rawValue: try Sys.openat(dirFD, name, O_WRONLY | O_CREAT | mode | O_NOFOLLOW, 0o600))
        do {
            _ = try fd.closeAfter { try fd.writeAll(encoded()) }
        } catch {
            _ = try? Sys.unlinkat(dirFD, name, 0)
            throw (error as? Errno) ?? .noSpace
        }
    }

    init?(decoding data: [UInt8]) {
        let versions = [TrashRecord.firstMagic, TrashRecord.magic, TrashRecord.heldMagic, TrashRecord.originMagic]
            .map { Array($0.utf8) }
        let length = versions[0].count
        guard data.count > length, let version = versions.firstIndex(of: Array(data[..<length])),
              let nl = data[length...].firstIndex(of: 0x0A) else { return nil }
        let fields = String(decoding: data[length..<nl], as: UTF8.self).split(separator: " ")
        guard fields.count == 4 + version, let uid = UInt32(fields[0]), let gid = UInt32(fields[1]),
              let k = fields[3].utf8.first, let kind = Kind(rawValue: k) else { return nil }
        var held: Held?
        if version >= 2, fields[5] != "-" {
            guard let h = Held(rawValue: String(fields[5])) else { return nil }
            held = h
        }
        var from: Origin?
        if version == 3 {
            let parts = fields[6].split(separator: ":")
            guard parts.count == 2, let inode = UInt64(parts[0]), let birth = UInt64(parts[1]) else { return nil }
            from = Origin(inode: inode, birth: birth)
        }
        self.init(path: Array(data[(nl + 1)...]), uid: uid, gid: gid, bytes: UInt64(fields[2]), kind: kind,
                  window: version > 0 ? UInt64(fields[4]) : nil, held: held, from: from)
    }
}

/// A graveyard entry that can still be restored.
public struct TrashEntry: Sendable {
    /// The entry's name in the graveyard; stable until it is reaped or restored.
    public var id: String
    public var shard: Int
    /// When it was deleted, in ns since the epoch (from its name).
    public var deleted: UInt64
    public var record: TrashRecord

    public init(id: String, shard: Int, deleted: UInt64, record: TrashRecord) {
        self.id = id
        self.shard = shard
        self.deleted = deleted
        self.record = record
    }
}

/// What a kept directory holds below it, as the reaper will meet it: the
/// files' apparent bytes, the disk bytes of everything (the directory's own
/// blocks included), and how many files and directories.
public struct TreeExtent: Sendable, Equatable {
    public var apparent: UInt64 = 0
    public var disk: UInt64 = 0
    public var files = 0
    public var directories = 0
    public init() {}
}

/// The restorable entries, in memory: loaded from the sidecars at start,
/// added to by `bury`, and taken out by whoever gets an entry first, the
/// reaper or a restore, so the two never act on the same entry.
final class TrashIndex: Sendable {
    private struct State {
        var entries: [String: TrashEntry] = [:]
        /// The ids of each user's entries, so one user's listing or restore
        /// costs in proportion to their own trash, not everyone's.
        var byUser: [UInt32: Set<String>] = [:]
        /// Entries a restore has taken and not finished with.
        var restoring: Set<String> = []
        /// Entries the window's limits gave up (see `FairEviction`): due at once.
        var evicted: Set<String> = []
        /// What the directory entries walked so far hold (`Graveyard.extent`).
        var extents: [String: TreeExtent] = [:]
        /// Where directories without a record of their own on disk were
        /// deleted from (let go by `trash empty`, or buried by a one-step
        /// delete with no window), by entry, in the order remembered: for the
        /// reaper, should it hold what their deleters cannot free
        /// (`Graveyard.hold`). The oldest are forgotten beyond
        /// `TrashIndex.remembered`. In memory only.
        var remembered: [String: TrashRecord] = [:]
        var rememberedOrder: [String] = []

        mutating func add(_ e: TrashEntry) -> Bool {
            byUser[e.record.uid, default: []].insert(e.id)
            return entries.updateValue(e, forKey: e.id) == nil
        }

        mutating func remove(_ id: String) -> TrashEntry? {
            guard let e = entries.removeValue(forKey: id) else { return nil }
            if !evicted.isEmpty { evicted.remove(id) }
            if !extents.isEmpty { extents.removeValue(forKey: id) }
            byUser[e.record.uid]?.remove(id)
            if byUser[e.record.uid]?.isEmpty == true { byUser[e.record.uid] = nil }
            return e
        }
    }
    private let state = Mutex(State())
    private let knownBytes = Atomic<UInt64>(0)
    /// Entries plus restores in flight: lets the reaper skip the lock when zero.
    private let population = Atomic<Int>(0)
    /// Changes whenever an entry comes or goes, so a view of the entries
    /// (the desktop trash folders) is rebuilt only when it is out of date.
    let version = Atomic<UInt64>(0)

    func insert(_ e: TrashEntry) {
        let fresh = state.withLock { s in s.add(e) }
        version.wrappingAdd(1, ordering: .releasing)
        if fresh {
            population.wrappingAdd(1, ordering: .relaxed)
            knownBytes.wrappingAdd(e.record.bytes ?? 0, ordering: .relaxed)
        }
    }

    private func removed(_ e: TrashEntry) {
        population.wrappingSubtract(1, ordering: .relaxed)
        knownBytes.wrappingSubtract(e.record.bytes ?? 0, ordering: .relaxed)
    }

    /// Sets the size of an entry whose size was not known (a tree, once
    /// measured); false if the entry is no longer in the index.
    func setBytes(_ id: String, _ bytes: UInt64) -> TrashEntry? {
        state.withLock { s -> TrashEntry? in
            guard var e = s.entries[id] else { return nil }
            let old = e.record.bytes ?? 0
            e.record.bytes = bytes
            s.entries[id] = e
            knownBytes.wrappingAdd(bytes &- old, ordering: .relaxed)
            return e
        }
    }

    /// For the reaper: false if a restore holds the entry; otherwise the
    /// entry is out of the index (if it was in) and the reaper owns it.
    /// Returns the record it had, if any, through `had`.
    func claimForReaping(_ name: UnsafePointer<CChar>, had: inout Bool) -> Bool {
        had = false
        guard population.load(ordering: .relaxed) > 0 else { return true }
        let id = String(cString: name)
        let (ok, taken): (Bool, TrashEntry?) = state.withLock { s in
            if s.restoring.contains(id) { return (false, nil) }
            return (true, s.remove(id))
        }
        if let taken { removed(taken); had = true; version.wrappingAdd(1, ordering: .releasing) }
        return ok
    }

    /// For a restore: takes the entry so the reaper leaves it alone.
    func claimForRestore(_ id: String) -> TrashEntry? {
        let claimed = state.withLock { s -> TrashEntry? in
            guard let e = s.remove(id) else { return nil }
            s.restoring.insert(id)
            knownBytes.wrappingSubtract(e.record.bytes ?? 0, ordering: .relaxed)
            return e
        }
        if claimed != nil { version.wrappingAdd(1, ordering: .releasing) }
        return claimed
    }

    /// Ends a restore: the entry is back in place (`restored`) or back in the index.
    func finishRestore(_ e: TrashEntry, restored: Bool) {
        state.withLock { s in
            s.restoring.remove(e.id)
            if !restored { _ = s.add(e) }
        }
        if !restored { version.wrappingAdd(1, ordering: .releasing) }
        if restored {
            population.wrappingSubtract(1, ordering: .relaxed)
        } else {
            knownBytes.wrappingAdd(e.record.bytes ?? 0, ordering: .relaxed)
        }
    }

    var all: [TrashEntry] { state.withLock { Array($0.entries.values) } }

    /// Whether any entry is kept (no lock).
    var isEmpty: Bool { population.load(ordering: .relaxed) == 0 }

    /// When the kept entry `id` may go (ns since the epoch): its deletion
    /// and its own window; `legacyWindow` for a record that wrote down none.
    /// nil if it is not a kept entry.
    func keptUntil(_ id: UnsafePointer<CChar>, legacyWindow: UInt64) -> UInt64? {
        let key = String(cString: id)
        return state.withLock { s in
            if !s.evicted.isEmpty && s.evicted.contains(key) { return s.entries[key] == nil ? nil : 0 }
            return s.entries[key].map { $0.record.held != nil ? UInt64.max : $0.deleted &+ ($0.record.window ?? legacyWindow) }
        }
    }

    /// Gives the entries `ids` up before their windows end.
    func evict(_ ids: [String]) {
        state.withLock { s in
            for id in ids where s.entries[id] != nil { s.evicted.insert(id) }
        }
    }

    /// The entries given up and not freed yet.
    var evicted: Set<String> { state.withLock { $0.evicted } }

    /// The kept entry `id`, if it is one.
    func entry(_ id: String) -> TrashEntry? { state.withLock { $0.entries[id] } }

    /// How many directories' records are remembered for the reaper.
    static let remembered = 4096

    /// Remembers where the directory entry `id` was deleted from.
    func remember(_ id: String, _ record: TrashRecord) {
        state.withLock { s in
            if s.rememberedOrder.count >= Self.remembered {
                let oldest = s.rememberedOrder.prefix(Self.remembered / 4)
                for old in oldest { s.remembered.removeValue(forKey: old) }
                s.rememberedOrder.removeFirst(oldest.count)
            }
            s.remembered[id] = record
            s.rememberedOrder.append(id)
        }
    }

    /// The remembered record of the directory entry `id`, forgotten here (nil if none is).
    func takeRemembered(_ id: String) -> TrashRecord? {
        state.withLock { s in
            guard !s.remembered.isEmpty, let r = s.remembered.removeValue(forKey: id) else { return nil }
            s.rememberedOrder.removeAll { $0 == id }
            return r
        }
    }

    func extent(_ id: String) -> TreeExtent? { state.withLock { $0.extents[id] } }
    func forgetExtent(_ id: String) { state.withLock { _ = $0.extents.removeValue(forKey: id) } }
    func setExtent(_ id: String, _ extent: TreeExtent) {
        state.withLock { s in if s.entries[id] != nil { s.extents[id] = extent } }
    }

    /// One user's entries.
    func entries(of uid: UInt32) -> [TrashEntry] {
        state.withLock { s in (s.byUser[uid] ?? []).compactMap { s.entries[$0] } }
    }
    var count: Int { state.withLock { $0.entries.count } }
    /// Bytes of the entries whose size is known.
    var bytes: UInt64 { knownBytes.load(ordering: .relaxed) }
}

extension Graveyard {
    /// When a buried entry counts as deleted, which its name carries: names
    /// sort by it, and the undo window judges by it.
    public enum Deletion: Sendable, Equatable {
        /// Now.
        case now
        /// At this wall-clock time (ns since the epoch): an unlink answered
        /// before its burial landed.
        case at(UInt64)
        /// A piece of a tree the reaper is taking apart: due at once, and
        /// not a deletion of its own. Its name carries when the tree was
        /// buried (`burialTime`), if known.
        case piece(of: UInt64?)
        /// Due at once, outside every undo window: kept without a trash
        /// record when the disk had no room for one, or let go from the
        /// trash (`vanish trash empty`). Its name carries when it was
        /// deleted (now if not given).
        case unheld(since: UInt64?)

        /// The high bits of a name's time that mark a piece and an unheld
        /// entry: free until 2116 (2^62 ns after the epoch).
        static let pieceMark: UInt64 = 1 << 63
        static let unheldMark: UInt64 = 1 << 62

        var nameTime: UInt64 { nameTime(clock: nil) }

        /// The time its name carries; now is `clock`'s if given, else the wall clock's.
        func nameTime(clock: ChangeClock?) -> UInt64 {
            switch self {
            case .now: clock?.now() ?? Sys.wallClockNow()
            case .at(let ns): ns
            case .piece(let of): of.map { $0 | Self.pieceMark } ?? 0
            case .unheld(let since): (since ?? clock?.now() ?? Sys.wallClockNow()) | Self.unheldMark
            }
        }

        public var isPiece: Bool { if case .piece = self { true } else { false } }
        public var isUnheld: Bool { if case .unheld = self { true } else { false } }
    }

    /// Whether the entry `name` is a piece of a tree being reaped (`Deletion.piece`).
    @inline(__always)
    public static func isPiece(_ name: UnsafePointer<CChar>) -> Bool { deletionTime(name) == 0 }

    /// When the entry `name` counts as deleted, for the undo window (ns since
    /// the epoch): 0 for a piece, 1 for an entry due at once (names before
    /// the marks carry those as they are); nil for a name Vanish did not make.
    @inline(__always)
    public static func deletionTime(_ name: UnsafePointer<CChar>) -> UInt64? {
        guard let v = nameTime(name) else { return nil }
        if v & Deletion.pieceMark != 0 { return 0 }
        if v & Deletion.unheldMark != 0 { return 1 }
        return v
    }

    /// When the tree the entry `name` is (or is a piece of) left its place:
    /// nothing moved in after that was its deleter's to free (see
    /// `TreeRemover.cameInLater`). Nil where a name does not say (pieces
    /// and unheld entries of names before the marks).
    public static func burialTime(_ name: UnsafePointer<CChar>) -> UInt64? {
        guard let v = nameTime(name) else { return nil }
        let t = v & ~(Deletion.pieceMark | Deletion.unheldMark)
        return t > 1 ? t : nil
    }

    /// The 16 hex digits a name starts with, marks included.
    static func nameTime(_ name: UnsafePointer<CChar>) -> UInt64? {
        var v: UInt64 = 0
        for i in 0..<16 {
            let c = UInt8(bitPattern: name[i])
            switch c {
            case 0x30...0x39: v = v << 4 | UInt64(c - 0x30)
            case 0x61...0x66: v = v << 4 | UInt64(c - 0x61 + 10)
            default: return nil
            }
        }
        return name[16] == 0x2D ? v : nil
    }

    /// The deletion time a trash entry shows: for a held piece or entry let go
    /// (`deletionTime` 0 or 1), when its tree was deleted. Held entries
    /// stay whatever the time, so it is only shown.
    static func shownTime(_ id: String, _ time: UInt64) -> UInt64 {
        time > 1 ? time : id.withCString { Graveyard.burialTime($0) } ?? time
    }

    /// Reads every sidecar into the index; sidecars whose entry is gone
    /// (a crash between writing one and the rename) are removed.
    func loadTrash() {
        for (shard, sfd) in shardFDs.enumerated() {
            guard let dp = try? Sys.openDirectory(sfd, ".") else { continue }
            var sidecars: [String] = []
            while let d = readdir(dp) {
                let name = vanish_dirent_name(d)!
                if name[0] == 0x2E && name[1] != 0 && !(name[1] == 0x2E && name[2] == 0) {
                    sidecars.append(String(cString: name + 1))
                }
            }
            closedir(dp)
            for id in sidecars {
                guard (try? Sys.lstatat(sfd, id)) != nil else {
                    _ = try? Sys.unlinkat(sfd, "." + id, 0)
                    continue
                }
                guard let record = readSidecar(sfd, id), let time = Graveyard.deletionTime(id) else { continue }
                trash.insert(TrashEntry(id: id, shard: shard, deleted: record.held == nil ? time : Self.shownTime(id, time), record: record))
            }
        }
    }

    func readSidecar(_ shardFD: Int32, _ id: String) -> TrashRecord? { Self.readSidecar(shardFD, id) }

    static func readSidecar(_ shardFD: Int32, _ id: String) -> TrashRecord? {
        guard let fd = try? Sys.opened(shardFD, "." + id, O_RDONLY | O_NOFOLLOW) else { return nil }
        return TrashRecord(decoding: Sys.readAll(fd.raw))
    }

    /// Writes the sidecar for `id` before the entry moves in, so every kept
    /// entry can be listed even after a crash (an orphan sidecar is removed at start).
    func writeSidecar(_ shardFD: Int32, _ id: UnsafePointer<CChar>, _ record: TrashRecord) throws(Errno) {
        var name: [CChar] = [0x2E]
        name.append(contentsOf: UnsafeBufferPointer(start: id, count: strlen(id) + 1))
        try record.write(to: shardFD, name, O_EXCL)
    }

    /// Removes the sidecar of an entry that was reaped or restored.
    func removeSidecar(_ shardFD: Int32, _ id: UnsafePointer<CChar>) {
        var name: [CChar] = [0x2E]
        name.append(contentsOf: UnsafeBufferPointer(start: id, count: strlen(id) + 1))
        _ = try? Sys.unlinkat(shardFD, name, 0)
    }

    /// Measures a restorable tree whose size is unknown (the bytes its
    /// entries occupy, fd-relative, never following a symlink) and records
    /// it, in memory and in its sidecar, so the byte limit and `trash list`
    /// see it. nil if it could not be measured (gone, deeper than 256 levels).
    @discardableResult
    public func measure(_ e: TrashEntry) -> UInt64? {
        guard let extent = extent(of: e, walking: true) else { return nil }
        let total = extent.disk
        guard let updated = trash.setBytes(e.id, total) else { return nil }
        let sfd = shardFDs[e.shard]
        // A fresh sidecar (".ID") replaces the old one whole: a crash leaves either.
        let temporary = ".measured-" + e.id
        removeSidecar(sfd, temporary)
        if (try? writeSidecar(sfd, temporary, updated.record)) != nil, renameat(sfd, "." + temporary, sfd, "." + e.id) != 0 {
            removeSidecar(sfd, temporary)
        }
        return total
    }

    /// What the kept entry `id` holds changed (emptied in part through the desktop trash).
    public func forgetExtent(_ id: String) { trash.forgetExtent(id) }

    /// What the kept directory `e` holds: known once walked (by the
    /// warden's `measure`, or by a `trash list` since the start), else
    /// walked now with `walking`. nil for a file, or a tree that could not be walked.
    public func extent(of e: TrashEntry, walking: Bool) -> TreeExtent? {
        if let known = trash.extent(e.id) { return known }
        guard walking, let st = try? Sys.lstatat(shardFDs[e.shard], e.id) else { return nil }
        var extent = TreeExtent()
        extent.disk = Sys.diskBytes(st)
        if st.st_mode & S_IFMT == S_IFDIR {
            guard Graveyard.walk(shardFDs[e.shard], e.id, depth: 0, into: &extent) else { return nil }
        } else {
            extent.apparent = UInt64(st.st_size)
        }
        trash.setExtent(e.id, extent)
        return extent
    }

    /// Makes the entry `name` of shard `shard`, which its deleter (named in
    /// it) could not wholly remove, a trash entry of theirs held until
    /// restored, so what stays is listed and restorable rather than left
    /// stuck where no one sees it. Its record keeps the path it had (also
    /// one remembered in memory: after `trash empty` let it go, or for a
    /// one-step delete with no window, while this daemon runs); an entry
    /// without one has no path: it is restored with --to. False for an entry the
    /// daemon frees with its own rights, unless it holds what came in `later`:
    /// the daemon's user is its deleter then.
    public func hold(shard: Int, _ name: UnsafePointer<CChar>, because held: TrashRecord.Held) -> Bool {
        let by = DeletedBy(entryName: name)
        guard by != nil || held == .later, let st = try? Sys.lstatat(shardFDs[shard], name) else { return false }
        let sfd = shardFDs[shard]
        let id = String(cString: name)
        var record = readSidecar(sfd, id) ?? trash.takeRemembered(id)
            ?? TrashRecord(path: [], uid: by?.uid ?? geteuid(), gid: by?.gid ?? getegid(), bytes: nil,
                           kind: TrashRecord.Kind(mode: st.st_mode), window: 0)
        record.held = held
        let temporary = ".held-" + id
        removeSidecar(sfd, temporary)
        guard (try? writeSidecar(sfd, temporary, record)) != nil, renameat(sfd, "." + temporary, sfd, "." + id) == 0 else {
            removeSidecar(sfd, temporary)
            return false
        }
        trash.insert(TrashEntry(id: id, shard: shard, deleted: Self.shownTime(id, Graveyard.deletionTime(name) ?? 0), record: record))
        return true
    }

    /// Adds what is below the directory `name` in `dirFD` to `extent`; false
    /// if it cannot be walked (gone, deeper than 256 levels).
    private static func walk(_ dirFD: Int32, _ name: UnsafePointer<CChar>, depth: Int, into extent: inout TreeExtent) -> Bool {
        guard depth < 256, let dir = try? Sys.openDirectory(dirFD, name) else { return false }
        defer { closedir(dir) }
        while let d = readdir(dir) {
            guard let child = vanish_dirent_name(d) else { continue }
            if isDotOrDotDot(child) { continue }
            guard let st = try? Sys.lstatat(dirfd(dir), child) else { continue }
            extent.disk += Sys.diskBytes(st)
            if st.st_mode & S_IFMT == S_IFDIR {
                extent.directories += 1
                guard walk(dirfd(dir), child, depth: depth + 1, into: &extent) else { return false }
            } else {
                extent.files += 1
                extent.apparent += UInt64(st.st_size)
            }
        }
        return true
    }

    /// Entries that can be restored, oldest first.
    public var restorable: [TrashEntry] { trash.all.sorted { $0.id < $1.id } }
    /// `uid`'s restorable entries, oldest first.
    public func restorable(of uid: UInt32) -> [TrashEntry] { trash.entries(of: uid).sorted { $0.id < $1.id } }
    public var restorableCount: Int { trash.count }
    /// Changes whenever a restorable entry comes or goes.
    public var restorableVersion: UInt64 { trash.version.load(ordering: .acquiring) }
    /// The restorable entry `id`, if it is one.
    public func restorable(id: String) -> TrashEntry? { trash.entry(id) }
    /// Bytes the restorable entries hold, as far as known.
    public var restorableBytes: UInt64 { trash.bytes }

    /// Takes a restorable entry so the reaper will not touch it; end with
    /// `restore` or `release`.
    public func claim(_ id: String) -> TrashEntry? { trash.claimForRestore(id) }
    /// An entry no longer in its shard (a restore found something else in
    /// its place and left that to its user) is dropped, not kept.
    public func release(_ e: TrashEntry) {
        let there = (try? Sys.lstatat(shardFDs[e.shard], e.id)) != nil
        trash.finishRestore(e, restored: !there)
    }

    /// Lets the kept entry `id` go before its window ends (`vanish trash
    /// empty`): renamed within its shard to a name marked unheld, which no
    /// window keeps, with its deletion time (see `bury`'s `unheld`), then its sidecar goes. A crash between
    /// the two leaves an orphan sidecar, removed at the next start; the entry
    /// never comes back into the trash. Returns the entry; nil if it is no
    /// longer kept (reaped, restored or being restored meanwhile).
    public func letGo(_ id: String) -> TrashEntry? {
        guard let e = trash.claimForRestore(id) else { return nil }
        let sfd = shardFDs[e.shard]
        let n = counter.wrappingAdd(1, ordering: .relaxed).newValue
        do throws(Errno) {
            let deleter = e.id.withCString { DeletedBy(entryName: $0) }
            let since = e.id.withCString { Graveyard.burialTime($0) }
            try withUniqueName(n, time: Deletion.unheld(since: since).nameTime, by: deleter,
                               file: e.id.withCString(Graveyard.namesFile)) { grave throws(Errno) in
                try Sys.renameNoReplace(sfd, e.id, sfd, grave)
                // Another user's directory may hold what they cannot remove
                // (moved in through a descriptor held inside it): where it
                // was is kept for the reaper to put that back.
                if deleter != nil && e.record.kind == .directory {
                    var record = e.record
                    record.window = 0
                    trash.remember(String(cString: grave), record)
                }
            }
        } catch {
            trash.finishRestore(e, restored: false)
            return nil
        }
        e.id.withCString { removeSidecar(sfd, $0) }
        trash.finishRestore(e, restored: true)
        return e
    }

    /// Moves a claimed entry back to `name` in `parentFD`, never replacing
    /// what is there (EEXIST). On failure the entry stays claimed: `release` it.
    ///
    /// For `who` (another user than the daemon's) the move out is theirs:
    /// the daemon stages the entry in their room, and the rename from there
    /// is made with their credentials, so the kernel decides it as for
    /// their `mv` (write and search on the target directory, write on a
    /// directory that changes parent). If it refuses, the entry goes back.
    /// `inPlace`: `name` in `parentFD` is where the entry was deleted from.
    public func restore(_ e: TrashEntry, to parentFD: Int32, _ name: UnsafePointer<CChar>,
                        as who: Credentials? = nil, inPlace: Bool = true) throws(Errno) {
        let sfd = shardFDs[e.shard]
        if let who, who.uid != geteuid(), Credentials.canSwitch, let rooms {
            let held = try rooms.room(for: who.uid, gid: who.gid)
            let room = held.fd
            defer { withExtendedLifetime(held) {} }
            let staged = DeleterRooms.stagedName(shard: e.shard, id: e.id)
            let entry = try Sys.lstatat(sfd, e.id)
            try Sys.renameNoReplace(sfd, e.id, room, staged)
            do throws(Errno) {
                try Self.moveOut(room, staged, to: parentFD, name, as: who, inPlace: inPlace)
            } catch {
                // The room is the user's, who may have swapped something in
                // meanwhile: only the entry itself goes back, else it is
                // theirs, a leftover freed as them at the next start.
                // If this fails too, nothing frees the entry there; the next start moves it back (`returnStaged`).
                if let now = try? Sys.lstatat(room, staged), now.st_dev == entry.st_dev, now.st_ino == entry.st_ino {
                    try Sys.renameNoReplace(room, staged, sfd, e.id)
                    throw error
                }
                _ = try? Sys.renameNoReplace(room, staged, room, "returned-" + e.id)
                removeSidecar(sfd, e.id)
                throw error
            }
        } else {
            try Sys.renameNoReplace(sfd, e.id, parentFD, name)
        }
        removeSidecar(sfd, e.id)
        trash.finishRestore(e, restored: true)
    }

    /// Remembers, in memory, where the directory entry `id` (buried without
    /// a record: no undo window) was deleted from, for `hold`.
    public func remember(entry id: String, deletedFrom record: TrashRecord) { trash.remember(id, record) }

    /// Moves the piece `name` of shard `shardFD`, which its deleter could
    /// not wholly remove, back under its name in the entry it was split from
    /// (`PieceFamilies`), the move out undone as them: through their room,
    /// the last rename with their credentials, so the kernel decides it as
    /// it did the move out. False, with the piece where it was, if that fails.
    func returnPiece(_ shardFD: Int32, _ name: UnsafePointer<CChar>, to origin: PieceFamilies.Origin) -> Bool {
        guard let who = credentials(ofEntry: name), let rooms else { return false }
        let staged = "back-" + String(cString: name)
        do throws(Errno) {
            let held = try rooms.room(for: who.uid, gid: who.gid)
            let room = held.fd
            defer { withExtendedLifetime(held) {} }
            let parent = try Sys.opened(origin.shardFD, origin.parent, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            let entry = try Sys.lstatat(shardFD, name)
            try Sys.renameNoReplace(shardFD, name, room, staged)
            do throws(Errno) {
                try (origin.name + [0]).withUnsafeBufferPointer { b throws(Errno) in
                    try Self.moveOut(room, staged, to: parent.raw, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                                     as: who, inPlace: false)
                }
            } catch {
                // Only the piece itself goes back (the room is theirs; see `restore`).
                if let now = try? Sys.lstatat(room, staged), now.st_dev == entry.st_dev, now.st_ino == entry.st_ino {
                    try Sys.renameNoReplace(room, staged, shardFD, String(cString: name))
                }
                return false
            }
            return true
        } catch {
            return false
        }
    }

    /// `rename(from, fromName, to, toName)` as `who`. A directory that
    /// changes parent must be writable (its `..` changes), which the room
    /// makes every restore of a directory: one `who` owns is made writable
    /// for the move, as they could do themselves, and given its mode back;
    /// one they do not own goes back only to where they deleted it from
    /// (undoing their own rmdir), once the kernel grants them write and
    /// search on that directory. Anywhere else it stays, as for `mv`.
    static func moveOut(_ from: Int32, _ fromName: String, to: Int32, _ toName: UnsafePointer<CChar>,
                        as who: Credentials, inPlace: Bool) throws(Errno) {
        do throws(Errno) {
            try who.acting { () throws(Errno) in try Sys.renameNoReplace(from, fromName, to, toName) }
        } catch .permissionDenied {
            let st = try Sys.lstatat(from, fromName)
            guard st.st_mode & S_IFMT == S_IFDIR, st.st_mode & 0o200 == 0 || st.st_uid != who.uid else { throw .permissionDenied }
            if st.st_uid != who.uid {
                guard inPlace else { throw .permissionDenied }
                try who.acting { () throws(Errno) in try Sys.access(to, W_OK | X_OK) }
                try Sys.renameNoReplace(from, fromName, to, toName)
                return
            }
            try who.acting { () throws(Errno) in
                let fd = try Sys.opened(from, fromName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                do throws(Errno) { try Sys.chmod(pathFD: fd.raw, (st.st_mode & 0o7777) | 0o200) } catch { throw .permissionDenied }
                defer { _ = try? Sys.chmod(pathFD: fd.raw, st.st_mode & 0o7777) }
                try Sys.renameNoReplace(from, fromName, to, toName)
            }
        }
    }
}
