import CFuse
import Glibc
import LinuxSyscalls
import Synchronization

/// The kernel's view of which backing files exist: (st_dev, st_ino) → Inode,
/// with lookup counts, as in libfuse's passthrough_hp.
///
/// The lock is held only for table and name bookkeeping, never across a
/// system call. Lock order: a leaf (see `BackingNamespace`); it also guards
/// the `Inode` fields marked so. Unchecked: it hands out `Inode`s, whose
/// mutable fields are guarded by this lock, FDCache's and Statahead's.
final class InodeTable: @unchecked Sendable {
    let root: Inode
    /// The backing filesystem's handle layout when node ids carry backing
    /// handles (see `NodeID`): the daemon can open files by handle and the
    /// source's filesystem has handles of a known shape. Nil otherwise.
    let codec: HandleCodec?
    /// The FUSE generation of counted ids: drawn at random per mount, so
    /// that a handle from an earlier mount, whose counted id this mount may
    /// have given to another file, is refused (ESTALE) rather than honoured.
    let countedGeneration = UInt64(UInt32.random(in: 1...UInt32.max))
    /// The inode a node id the table does not hold stands for: it has no
    /// fd and cannot get one, so whatever a request does with it fails ESTALE.
    let stale = Inode(key: InodeKey(dev: 0, ino: 0), type: 0, id: 0, generation: 0, parent: nil, name: "")

    struct Maps {
        /// The inode the kernel knows by each backing (st_dev, st_ino).
        var byKey: [InodeKey: Inode]
        /// Every inode the kernel holds, by node id; it holds them alive.
        var byID: [UInt64: Inode]
    }
    // Storage is allocated here, at mount, for this and the other maps the
    // request path fills: the first allocation of a dictionary type makes
    // Swift instantiate its storage's metadata, which finds the key's
    // Hashable conformance by scanning every conformance in the binary.
    // Left to the first requests, that took a fresh mount's first unlink
    // from about 0.2 to 0.4 ms.
    private let lock = Lock(Maps(byKey: Dictionary(minimumCapacity: 1024), byID: Dictionary(minimumCapacity: 1024)))
    private let countedIDs = Atomic<UInt64>(0)
    /// Whether any inode was ever marked buried: until then, `isBuried` is one load.
    private let anyBuried = Atomic<Bool>(false)
    /// The most inodes held at once since the last `compact`.
    private let highWater = Atomic<Int>(0)

    init(root: Inode, codec: HandleCodec?) {
        self.root = root
        self.codec = codec
    }

    /// The FUSE node id for `inode`.
    @inline(__always)
    func nodeID(_ inode: Inode) -> fuse_ino_t { fuse_ino_t(inode.id) }

    /// The inode behind a node id the kernel sent; `stale` for one the table
    /// does not hold (the kernel sends only ids it holds a lookup on, but a
    /// miscount must not take the mount down).
    @inline(__always)
    func inode(_ id: fuse_ino_t) -> Inode {
        if id == fuse_ino_t(FUSE_ROOT_ID) { return root }
        return lock.withLock { $0.byID[UInt64(id)] } ?? stale
    }

    /// The inode the kernel holds under node id `id`, if any.
    func held(_ id: UInt64) -> Inode? {
        if id == UInt64(FUSE_ROOT_ID) { return root }
        return lock.withLock { $0.byID[id] }
    }

    /// Whether a new node for the file `st` describes would carry its
    /// backing handle (see `NodeID`), so its generation is wanted: node ids
    /// carry handles, the file is on the source's filesystem, its number fits,
    /// and the kernel does not hold it already.
    func wantsGeneration(_ st: stat, birth: UInt64) -> Bool {
        guard codec != nil, st.st_dev == root.key.dev, UInt64(st.st_ino) < NodeID.countedBit else { return false }
        let key = InodeKey(dev: st.st_dev, ino: st.st_ino)
        if key == root.key { return false }
        return lock.withLock { maps in
            guard let known = maps.byKey[key] else { return true }
            return !Self.same(known, type: st.st_mode & S_IFMT, birth: birth, generation: nil)
        }
    }

    /// Whether `known` is the file of type `type` born at `birth` (0: unknown)
    /// of backing generation `generation` (nil: unknown).
    private static func same(_ known: Inode, type: mode_t, birth: UInt64, generation: UInt32?) -> Bool {
        guard known.type == type, known.birth == birth || known.birth == 0 || birth == 0 else { return false }
        guard let generation, let carried = NodeID.decoded(known.id) else { return true }
        return carried.generation == generation
    }

    /// A new node's id and FUSE generation: the encoded id when `generation`
    /// (the backing file's) is given and fits, else a counted one.
    private func newID(_ st: stat, generation: UInt32?) -> (UInt64, UInt64) {
        if let generation, let id = NodeID.encoded(ino: UInt64(st.st_ino), generation: generation) { return (id, 0) }
        return (NodeID.counted(countedIDs.wrappingAdd(1, ordering: .relaxed).newValue), countedGeneration)
    }

    /// Records one more kernel lookup of the file `st` describes (born at
    /// `birth`, see `Sys.lstatatWithBirth`), found as `name` in `parent`;
    /// returns its inode (new or known).
    /// `lookedUp`: a LOOKUP found it, which for a file stamps `parent` (see
    /// `stamp`) under the same lock.
    /// `generation`: the backing file's, when `wantsGeneration` asked for it.
    func remember(_ st: stat, birth: UInt64, parent: Inode, name: UnsafePointer<CChar>,
                  lookedUp: Bool = false, generation: UInt32? = nil) -> Inode {
        let key = InodeKey(dev: st.st_dev, ino: st.st_ino)
        let type = st.st_mode & S_IFMT
        if key == root.key { return root }
        let stamp = lookedUp && type != S_IFDIR ? Self.coarseSeconds() : 0
        return lock.withLock { maps in
            if stamp != 0 { Self.stamp(parent, stamp) }
            // A known inode of another type or birth time means the number
            // was reused: start a new node, the old one lives until forgotten.
            // The kernel may hold an old node long after its file was freed
            // (a tree `vanish rm` took, an unlinked file's other link, or
            // just until its forget comes), and a file made meanwhile often
            // gets the same number at once; given the old node, the kernel
            // took it for the old file and kept its attributes (a link count
            // of 0 made link(2) of the new file fail with ENOENT).
            // A generation is given only for a file the table did not know
            // (or knew as another file): with it, the node is the one its id names.
            var found = maps.byKey[key].flatMap { Self.same($0, type: type, birth: birth, generation: generation) ? $0 : nil }
            let (id, fuseGeneration) = found == nil ? newID(st, generation: generation) : (0, 0)
            if found == nil, let holder = maps.byID[id] {
                // The kernel holds this very file by handle (a LOOKUP of "."), nameless till now.
                found = holder
                maps.byKey[key] = holder
            }
            if let known = found {
                known.place.lookups += 1
                if known.place.parent !== parent || !known.nameEquals(name) {
                    known.place.parent = parent
                    known.place.name = Inode.copyName(name)
                }
                return known
            }
            let fresh = Inode(key: key, type: type, id: id, generation: fuseGeneration,
                              birth: birth, parent: parent, name: name)
            fresh.place.lookups = 1
            maps.byKey[key] = fresh
            maps.byID[id] = fresh
            if maps.byID.count > highWater.load(ordering: .relaxed) { highWater.store(maps.byID.count, ordering: .relaxed) }
            return fresh
        }
    }

    /// A LOOKUP of "." or ".." (the kernel met a handle of a file it no
    /// longer holds, or looks for a directory's parent) found the file `st`
    /// describes, of backing generation `generation` (nil: unknown): counts
    /// the lookup on the node the table holds for it, or makes one with no
    /// known name (a lookup by name gives it one later, see `remember`).
    func foundByHandle(_ st: stat, birth: UInt64, generation: UInt32?) -> Inode {
        let key = InodeKey(dev: st.st_dev, ino: st.st_ino)
        let type = st.st_mode & S_IFMT
        if key == root.key { return root }
        return lock.withLock { maps in
            if let known = maps.byKey[key], Self.same(known, type: type, birth: birth, generation: generation) {
                known.place.lookups += 1
                return known
            }
            let (id, fuseGeneration) = newID(st, generation: generation)
            if let held = maps.byID[id] {
                held.place.lookups += 1
                maps.byKey[key] = held
                return held
            }
            let fresh = Inode(key: key, type: type, id: id, generation: fuseGeneration, birth: birth,
                              parent: nil, name: "")
            fresh.place.lookups = 1
            // The live file of that number: another node under the key is an older file's.
            maps.byKey[key] = fresh
            maps.byID[id] = fresh
            return fresh
        }
    }

    /// A LOOKUP of "." found a node the kernel holds already: counts the lookup.
    func lookedUpAgain(_ inode: Inode) {
        if inode === root || inode === stale { return }
        lock.withLock { _ in inode.place.lookups += 1 }
    }

    /// How long a directory's files being looked up keeps listings near it
    /// carrying attributes: long enough for a walk to reach its next
    /// directories, short enough that a later names-only walk is not charged.
    static let walkHintSeconds: UInt32 = 30

    /// With the lock held. A LOOKUP found a file (not a directory) in `dir`:
    /// programs stat what they listed there, so listings of `dir` and of the
    /// directories near it carry attributes for a while (see
    /// `ReaddirPlusMode.walk`). Marks `dir`, its parent and grandparent;
    /// `listingWantsAttributes` looks as far up.
    private static func stamp(_ dir: Inode, _ now: UInt32) {
        guard dir.place.filesLookedUp != now else { return }
        dir.place.filesLookedUp = now
        dir.place.parent?.place.filesLookedUp = now
        dir.place.parent?.place.parent?.place.filesLookedUp = now
    }

    /// Whether a listing of `dir` should carry attributes: a file of it, or
    /// of a directory near it (sharing its parent or grandparent), was
    /// looked up lately, so the walk that did it is likely stat'ing here next.
    func listingWantsAttributes(_ dir: Inode) -> Bool {
        let now = Self.coarseSeconds()
        return lock.withLock { _ in
            var d: Inode? = dir
            for _ in 0..<3 {
                guard let here = d else { return false }
                if here.place.filesLookedUp != 0 && now &- here.place.filesLookedUp < Self.walkHintSeconds { return true }
                d = here.place.parent
            }
            return false
        }
    }

    /// Seconds since boot, as cheap as a clock gets (no system call); never 0.
    private static func coarseSeconds() -> UInt32 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts)
        return UInt32(truncatingIfNeeded: ts.tv_sec) | 1
    }

    /// Milliseconds since boot, as cheaply (wrapping after 49 days); never 0.
    static func coarseMilliseconds() -> UInt32 { Sys.coarseMilliseconds() | 1 }

    /// Whether the kernel holds the inode numbered `ino` on `dev`, of type
    /// `type` (S_IFMT bits; 0: unknown), with attributes sent less than
    /// `window` ms before `now`: listing it with attributes again tells the
    /// kernel nothing it does not have.
    func attributesFresh(dev: dev_t, ino: ino_t, type: mode_t, now: UInt32, window: UInt32) -> Bool {
        lock.withLock { maps in
            guard let known = maps.byKey[InodeKey(dev: dev, ino: ino)], known.place.lookups > 0,
                  type == 0 || known.type == type,
                  !known.attributesDropped.load(ordering: .acquiring) else { return false }
            let sent = known.attributesSent.load(ordering: .relaxed)
            return sent != 0 && now &- sent < window
        }
    }

    /// Whether the directory numbered `ino` on `dev` was listed with
    /// attributes less than `window` ms ago: its entries were stat'ed then,
    /// so the backing filesystem most likely still has them cached.
    func listedLately(dev: dev_t, ino: ino_t, window: UInt32) -> Bool {
        let now = Self.coarseMilliseconds()
        return lock.withLock { maps in
            guard let dir = maps.byKey[InodeKey(dev: dev, ino: ino)] else { return false }
            let listed = dir.listedWithAttributes.load(ordering: .relaxed)
            return listed != 0 && now &- listed < window
        }
    }

    /// Drops `count` kernel lookups; returns true when the inode is gone
    /// from the kernel (its fd should be closed).
    func forget(_ inode: Inode, count: UInt64) -> Bool {
        if inode === root || inode === stale { return false }
        return lock.withLock { maps in
            // Clamp rather than trap: a miscount must not take the mount down.
            inode.place.lookups -= min(count, inode.place.lookups)
            guard inode.place.lookups == 0 else { return false }
            if maps.byKey[inode.key] === inode { maps.byKey[inode.key] = nil }
            if maps.byID[inode.id] === inode { maps.byID[inode.id] = nil }
            return true
        }
    }

    /// After a rename through the mount or a restore: the file `st` now
    /// lives at `name` in `parent`. Returns its inode if the kernel knows it.
    @discardableResult
    func moved(_ st: stat, to parent: Inode, name: UnsafePointer<CChar>) -> Inode? {
        let key = InodeKey(dev: st.st_dev, ino: st.st_ino)
        return lock.withLock { maps in
            guard let known = maps.byKey[key] else { return nil }
            known.place.parent = parent
            known.place.name = Inode.copyName(name)
            known.place.buried = false
            return known
        }
    }

    /// After `vanish rm` moved the directory `inode` into the graveyard.
    func markBuried(_ inode: Inode) {
        lock.withLock { _ in inode.place.buried = true }
        anyBuried.store(true, ordering: .releasing)
    }

    /// Whether `dir` or a directory above it went to the graveyard with
    /// `vanish rm`: nothing may be made in it any more. The kernel cannot
    /// know (for it, the tree just went away), so a process still inside
    /// would otherwise make files in the graveyard, where they are lost.
    /// Whether `node` has never had a name: an O_TMPFILE file not yet linked.
    func isUnnamed(_ node: Inode) -> Bool {
        lock.withLock { _ in node.place.name.first == 0 && node.place.parent != nil }
    }

    func isBuried(_ dir: Inode) -> Bool {
        guard anyBuried.load(ordering: .acquiring) else { return false }
        return lock.withLock { _ in
            var next: Inode? = dir
            while let n = next, n !== root {
                if n.place.buried { return true }
                next = n.place.parent
            }
            return false
        }
    }

    /// The graveyard name of the entry `node` is in (or is), when it is seen
    /// through the desktop trash.
    func trashEntry(of node: Inode) -> String? {
        lock.withLock { _ in
            var n = node
            while let up = n.place.parent {
                if up.id == 0 { return n.place.name.withUnsafeBufferPointer { String(cString: $0.baseAddress!) } }
                n = up
            }
            return nil
        }
    }

    /// Whether `dir` is an entry of the undo window seen through the desktop
    /// trash, or inside one: its chain of parents ends at a graveyard shard
    /// (an inode of node id 0, see `TrashFolders`).
    func isInTrash(_ dir: Inode) -> Bool {
        guard anyBuried.load(ordering: .acquiring) else { return false }
        return lock.withLock { _ in
            var n = dir
            while let up = n.place.parent { n = up }
            return n.id == 0
        }
    }

    /// The file id cached on `inode`, or the one `compute` gives, cached.
    func fileID(of inode: Inode, _ compute: () -> String) -> String {
        if let id = lock.withLock({ _ in inode.place.fileID }) { return id }
        let id = compute()
        if !id.isEmpty { lock.withLock { _ in inode.place.fileID = id } }
        return id
    }

    /// The inode the kernel holds for the file numbered `ino` on the
    /// source's filesystem, of backing generation `generation`, if any.
    func held(ino: UInt64, generation: UInt32) -> Inode? {
        let key = InodeKey(dev: root.key.dev, ino: ino_t(ino))
        if key == root.key { return root }
        return lock.withLock { maps in
            guard let known = maps.byKey[key] else { return nil }
            if let carried = NodeID.decoded(known.id), carried.generation != generation { return nil }
            return known
        }
    }

    /// Every inode the kernel holds, with where it was last seen (node ids).
    func everyNode() -> [(id: UInt64, parent: UInt64?, name: ContiguousArray<CChar>)] {
        lock.withLock { maps in maps.byID.values.map { ($0.id, $0.place.parent?.id, $0.place.name) } }
    }

    /// The inode the kernel knows for `st`, if any (no lookup counted).
    func known(_ st: stat) -> Inode? {
        let key = InodeKey(dev: st.st_dev, ino: st.st_ino)
        if key == root.key { return nil }
        return lock.withLock { $0.byKey[key] }
    }

    /// Where `inode` was last seen, for reopening it.
    func location(of inode: Inode) -> (parent: Inode, name: ContiguousArray<CChar>)? {
        lock.withLock { _ in inode.place.parent.map { ($0, inode.place.name) } }
    }

    /// The path of `name` in `dir` (of `dir` itself when `name` is nil),
    /// relative to the mount root, as the kernel last saw it (for trash
    /// records and events; not for access, which stays fd-relative).
    func path(of dir: Inode, appending name: UnsafePointer<CChar>?) -> [UInt8] {
        withPath(of: dir, appending: name) { Array($0) }
    }

    /// Calls `body` with that path. Events want one or two per request: it
    /// is written backwards in one pass under the lock, on the stack unless
    /// it is longer than 1 KiB, with no array per component and no
    /// reference counting of the names while the table's lock is held.
    func withPath<R>(of dir: Inode, appending name: UnsafePointer<CChar>?,
                     _ body: (UnsafeBufferPointer<UInt8>) -> R) -> R {
        let nameLength = name.map { strlen($0) } ?? 0
        // Stack allocation up to 1 KiB needs no check of the stack's bounds.
        return withUnsafeTemporaryAllocation(of: UInt8.self, capacity: 1024) { stack in
            var heap: [UInt8] = []
            let count: Int = lock.withLock { _ in
                var total = nameLength
                var components = name == nil ? 0 : 1
                var node: Inode? = dir
                while let n = node, n !== root {
                    total += n.place.name.count - 1
                    components += 1
                    node = n.place.parent
                }
                total += max(0, components - 1)
                if total > stack.count { heap = [UInt8](repeating: 0, count: total) }
                heap.withUnsafeMutableBufferPointer { h in
                    let out = total > stack.count ? h : stack
                    var end = total
                    func put(_ bytes: UnsafeRawPointer, _ count: Int) {
                        if end < total { end -= 1; out[end] = 0x2F }
                        end -= count
                        UnsafeMutableRawPointer(out.baseAddress! + end).copyMemory(from: bytes, byteCount: count)
                    }
                    if let name { put(name, nameLength) }
                    node = dir
                    while let n = node, n !== root {
                        n.place.name.withUnsafeBufferPointer { put($0.baseAddress!, $0.count - 1) }
                        node = n.place.parent
                    }
                }
                return total
            }
            if count > stack.count { return heap.withUnsafeBufferPointer(body) }
            return body(UnsafeBufferPointer(rebasing: stack[..<count]))
        }
    }

    /// Whether any user could have seen the entry `name` in `dir` (with no
    /// name: `dir`'s own entry in its parent) as things stand: the modes last
    /// sent to the kernel grant others read and search on its directory and
    /// on every one above. Group rights and ACLs are not counted, so
    /// an entry only a group or a named user could see counts as private.
    func othersMaySee(_ dir: Inode, named: Bool) -> Bool {
        lock.withLock { _ in
            var node: Inode? = named ? dir : dir.place.parent
            guard let parent = node, parent.modeSeen.load(ordering: .relaxed) & 0o005 == 0o005 else {
                return !named && dir === root
            }
            node = parent.place.parent
            while let n = node {
                if n.modeSeen.load(ordering: .relaxed) & 0o005 != 0o005 { return false }
                if n === root { break }
                node = n.place.parent
            }
            return true
        }
    }

    /// The highest directory above `inode` (or itself) on the same device:
    /// the root of the filesystem it lives on, as mounted inside the source.
    func topmostOnDevice(from inode: Inode) -> Inode {
        lock.withLock { _ in
            var top = inode
            while top !== root, let up = top.place.parent, up.key.dev == inode.key.dev { top = up }
            return top
        }
    }

    /// Number of inodes the kernel holds (for status and tests).
    var count: Int { lock.withLock { $0.byID.count } }

    /// How many fewer inodes the kernel holds than at the peak since the last `compact`.
    var shrinkage: Int { max(0, highWater.load(ordering: .relaxed) - count) }

    /// Gives up the map's room for the peak: a dictionary never shrinks by
    /// itself, and one sized for a burst of 200,000 files kept 6 MiB.
    /// O(inodes held), under the lock: for quiet moments.
    func compact() {
        lock.withLock { maps in
            if maps.byKey.capacity > 4 * maps.byKey.count + 1024 {
                var fresh = [InodeKey: Inode](minimumCapacity: max(1024, 2 * maps.byKey.count))
                for (key, node) in maps.byKey { fresh[key] = node }
                maps.byKey = fresh
            }
            if maps.byID.capacity > 4 * maps.byID.count + 1024 {
                var fresh = [UInt64: Inode](minimumCapacity: max(1024, 2 * maps.byID.count))
                for (id, node) in maps.byID { fresh[id] = node }
                maps.byID = fresh
            }
            highWater.store(maps.byID.count, ordering: .relaxed)
        }
    }
}
