import CLinux
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import SystemPackage
import VanishEvents
import VanishGraveyard

/// What the control plane (VanishControl) reaches the mount through: the
/// backing root, the undo window's entries, putting one back, letting
/// entries go, and the event journal. Who may do what is decided there,
/// with the peer's credentials; this side only does it, as the mount would.
package final class MountControl: Sendable {
    /// The backing root (O_PATH), for opening directories one name at a time as a peer would.
    package let backingRoot: Int32
    /// The event journal, for event streams (nil with events off).
    package let journal: Journal?
    private let graveyard: Graveyard?
    private let reaper: Reaper?
    private let namespace: BackingNamespace
    private let oneStep: OneStepBurials
    private let invalidations: EntryInvalidations
    private let changes: any ChangeObserver
    private let log: Logger
    /// What the status attribute shows besides the mount's facts.
    let status: StatusAttribute
    /// The undo window as desktop trash folders (nil without one).
    let trashFolders: TrashFolders?
    /// Entries the reaper held that went back where they were deleted from (`putBackHeld`).
    private let heldPutBack = Atomic<Int>(0)
    private var table: InodeTable { namespace.table }

    init(backingRoot: Int32, journal: Journal?, graveyard: Graveyard?, reaper: Reaper?, namespace: BackingNamespace,
         oneStep: OneStepBurials, invalidations: EntryInvalidations, changes: any ChangeObserver,
         log: Logger, status: StatusAttribute, trashFolders: TrashFolders?) {
        self.backingRoot = backingRoot
        self.journal = journal
        self.graveyard = graveyard
        self.reaper = reaper
        self.namespace = namespace
        self.oneStep = oneStep
        self.invalidations = invalidations
        self.changes = changes
        self.log = log
        self.status = status
        self.trashFolders = trashFolders
    }

    /// This client's id in the source's state directory (nil without a graveyard).
    package var clientName: String? { graveyard?.client.name }

    /// Whether `name` in the mount root is a desktop trash folder the mount
    /// shows (see `ReservedNames.trashFolderUID`): nothing is restored there.
    package func showsTrashFolder(named name: [UInt8]) -> Bool {
        guard graveyard != nil, (reaper?.policy.keep ?? 0) > 0 else { return false }
        return (name + [0]).withUnsafeBufferPointer { b in
            let n = UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self)
            guard let uid = TrashFolders.uid(ofFolder: n) else { return false }
            guard let st = try? Sys.lstatat(backingRoot, n) else { return true }
            return st.st_mode & S_IFMT != S_IFDIR || st.st_uid != uid
        }
    }

    /// Whether deletes go to a graveyard (and the root holds its state directory).
    package var hasGraveyard: Bool { graveyard != nil }

    /// Lets the pending burials `uid` sees land: a listing or a restore
    /// must see each answered unlink in place (and a name whose burial is
    /// pending is free, not taken), and each one-step delete of `uid`'s in
    /// the trash once sorted (up to 30 s: `vanish rm -r` then `vanish
    /// restore` finds the tree; the sorting thread runs at nice 10, and on
    /// a busy machine 5 s were too few). Root sees everyone's deletions;
    /// another user lands only their own: a `trash list` in a loop must not
    /// land other users' `rm -rf` file by file. Other users' one-step
    /// deletes are not waited for.
    package func settle(for uid: uid_t) {
        if uid == 0 { namespace.settle() } else { namespace.landQueued(keptFor: uid, answered: true) }
        awaitOneStepSorted(for: uid)
    }

    /// Waits (up to 30 s) until `uid`'s one-step deletes are sorted: each
    /// in the trash, or put back where it was.
    package func awaitOneStepSorted(for uid: uid_t) {
        oneStep.awaitSorted(of: uid, timeout: .seconds(30))
    }

    /// Whether `name` in the backing directory (`dev`, `ino`) is an answered
    /// unlink whose rename into the graveyard is still to come.
    package func isPendingBurial(dev: dev_t, ino: ino_t, _ name: UnsafePointer<CChar>) -> Bool {
        namespace.isPendingBurial(InodeKey(dev: dev, ino: ino), name)
    }

    /// The restorable entries `uid` may see (root: all), oldest first.
    package func restorable(for uid: uid_t) -> [TrashEntry] {
        guard let graveyard else { return [] }
        settle(for: uid)
        return uid == 0 ? graveyard.restorable : graveyard.restorable(of: uid)
    }

    /// The apparent size (st_size) of a kept file, symlink or other non-directory
    /// entry, read from the graveyard: the record holds the disk usage the
    /// window's byte limit counts, which says 4 KiB of a 6-byte file.
    package func apparentSize(of e: TrashEntry) -> UInt64? {
        guard let graveyard, graveyard.shardFDs.indices.contains(e.shard) else { return nil }
        if e.record.kind == .directory { return graveyard.extent(of: e, walking: true)?.apparent }
        return (try? e.id.withCString { id throws(Errno) in try Sys.lstatat(graveyard.shardFDs[e.shard], id) })
            .map { UInt64($0.st_size) }
    }

    /// The owner of the kept entry `e` as it is in the graveyard now.
    package func owner(of e: TrashEntry) -> uid_t? {
        guard let graveyard, graveyard.shardFDs.indices.contains(e.shard) else { return nil }
        return (try? e.id.withCString { id throws(Errno) in try Sys.lstatat(graveyard.shardFDs[e.shard], id) })?.st_uid
    }

    /// What the kept directory `e` holds (a tree `vanish rm` took whole, or
    /// one `rm -rf` emptied and removed, which goes with its files), walked
    /// once per mount; nil for a file.
    package func contents(of e: TrashEntry) -> TreeExtent? {
        guard let graveyard, e.record.kind == .directory, graveyard.shardFDs.indices.contains(e.shard) else { return nil }
        return graveyard.extent(of: e, walking: true)
    }

    /// The ids of those `entries` whose path a kept directory of the same
    /// user, deleted after them at one of their ancestors' paths, holds now
    /// (a file deleted, made again and then deleted with its directory).
    /// Restoring that directory brings its own back, so the earlier
    /// deletion stays in the trash: a line of its own in `trash list`.
    ///
    /// Linear in the paths' bytes and the pairs of an entry and a later kept
    /// directory above it: prefixes are hashed as a path is scanned, and
    /// each such directory's own names are read once, so a pair costs a
    /// lookup unless the directory holds the next name on the path. (Copying
    /// every prefix and walking into every directory made a 800-deep chain
    /// of one user's kept directories a minute of `trash list`, every user's
    /// list behind it, and a 5,000-deep one hours of the daemon's CPU.)
    package func shadowed(_ entries: [TrashEntry]) -> Set<String> {
        guard let graveyard else { return [] }
        var directories: [PathKey: [TrashEntry]] = [:]
        for e in entries where e.record.kind == .directory {
            var h = PathKey(uid: e.record.uid)
            for b in e.record.path { h.add(b) }
            directories[h, default: []].append(e)
        }
        guard !directories.isEmpty else { return [] }
        var names: [String: Set<Int>] = [:]
        var found = Set<String>()
        for e in entries {
            let path = e.record.path
            var h = PathKey(uid: e.record.uid)
            search: for (i, b) in path.enumerated() {
                defer { h.add(b) }
                guard b == 0x2F, i > 0, let later = directories[h] else { continue }
                var end = i + 1
                while end < path.count && path[end] != 0x2F { end += 1 }
                let next = path.withUnsafeBytes { Self.nameHash(UnsafeRawBufferPointer(rebasing: $0[(i + 1)..<end])) }
                for d in later where d.deleted > e.deleted && graveyard.shardFDs.indices.contains(d.shard) {
                    let sfd = graveyard.shardFDs[d.shard]
                    let own = names[d.id] ?? {
                        let read = Self.nameHashes(sfd, d.id)
                        names[d.id] = read
                        return read
                    }()
                    guard own.contains(next), Self.holds(sfd, d.id, Array(path[(i + 1)...])) else { continue }
                    found.insert(e.id)
                    break search
                }
            }
        }
        return found
    }

    /// A user and a path, hashed a byte at a time (two 64-bit hashes and the
    /// length), so every prefix of a path is a key as it is scanned.
    private struct PathKey: Hashable {
        let uid: UInt32
        var a: UInt64 = 0xcbf29ce484222325
        var b: UInt64 = 0x84222325cbf29ce4
        var length = 0

        init(uid: UInt32) { self.uid = uid }

        @inline(__always)
        mutating func add(_ byte: UInt8) {
            a = (a ^ UInt64(byte)) &* 0x100000001b3
            b = (b &+ UInt64(byte) &+ 1) &* 0x9e3779b97f4a7c15
            b ^= b >> 29
            length += 1
        }
    }

    private static func nameHash(_ bytes: UnsafeRawBufferPointer) -> Int {
        var hasher = Hasher()
        hasher.combine(bytes: bytes)
        return hasher.finalize()
    }

    /// The hashes of the names directly in the entry `id` of the shard `sfd` (none for a file).
    private static func nameHashes(_ sfd: Int32, _ id: String) -> Set<Int> {
        let fd = id.withCString { Glibc.openat(sfd, $0, O_RDONLY | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC) }
        guard fd >= 0, let dir = fdopendir(fd) else {
            if fd >= 0 { Glibc.close(fd) }
            return []
        }
        defer { closedir(dir) }
        var out = Set<Int>()
        while let d = readdir(dir) {
            let name = vanish_dirent_name(d)!
            let count = strlen(name)
            if name[0] == 0x2E && (count == 1 || (count == 2 && name[1] == 0x2E)) { continue }
            out.insert(nameHash(UnsafeRawBufferPointer(start: name, count: count)))
        }
        return out
    }

    /// Whether the entry `id` of the shard `sfd` holds the relative path
    /// `inside`, walked a component at a time without following a symlink.
    private static func holds(_ sfd: Int32, _ id: String, _ inside: [UInt8]) -> Bool {
        let parts = inside.split(separator: 0x2F, omittingEmptySubsequences: true).map { Array($0) + [0] }
        // A record's path names entries, never `.` or `..`: one that did could leave the entry.
        guard let last = parts.last, !parts.contains(where: { $0 == [0x2E, 0] || $0 == [0x2E, 0x2E, 0] }) else { return false }
        let flags = VANISH_O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC
        var dir = OwnedDescriptor(id.withCString { Glibc.openat(sfd, $0, flags) })
        for part in parts.dropLast() {
            guard dir.raw >= 0 else { return false }
            dir = OwnedDescriptor(part.withUnsafeBufferPointer { p in
                Glibc.openat(dir.raw, UnsafeRawPointer(p.baseAddress!).assumingMemoryBound(to: CChar.self), flags)
            })
        }
        guard dir.raw >= 0 else { return false }
        return last.withUnsafeBufferPointer { p in
            (try? Sys.lstatat(dir.raw, UnsafeRawPointer(p.baseAddress!).assumingMemoryBound(to: CChar.self))) != nil
        }
    }

    /// Lets `entries` go before their window ends (`vanish trash empty`): the
    /// reaper frees them now. Returns how many went and the disk bytes they
    /// held (as far as known); an entry reaped or restored meanwhile is skipped.
    package func letGo(_ entries: [TrashEntry]) -> (count: Int, bytes: UInt64) {
        guard let graveyard else { return (0, 0) }
        var count = 0
        var bytes: UInt64 = 0
        var shards = Set<Int>()
        for e in entries {
            guard let gone = graveyard.letGo(e.id) else { continue }
            // Renamed: the reaper meets it under another name, of unknown size.
            reaper?.forgetTree(e.id)
            count += 1
            bytes += gone.record.bytes ?? 0
            shards.insert(gone.shard)
        }
        for shard in shards { reaper?.dueNow(shard: shard) }
        return (count, bytes)
    }

    /// Whether `path` (directory `dirFD`) is where the entry was deleted
    /// from: the same path, and the same directory there if the record
    /// knows it (a new one made at that path is elsewhere). Only a
    /// directory's record knows it: an entry recorded as anything else is
    /// never in place, so a directory exchanged onto a file's name before
    /// its burial cannot come back "in place" into another directory.
    /// (Directory records from before version 4 go by the path.)
    static func isInPlace(_ record: TrashRecord, _ dirFD: Int32, _ path: [UInt8]) -> Bool {
        guard path == record.path else { return false }
        guard let from = record.from else { return record.kind == .directory }
        guard let (st, birth) = try? Sys.fstatWithBirth(dirFD) else { return false }
        return from.matches(st, birth: birth)
    }

    /// Why an entry could not be put back.
    package enum PutBackFailure: Error {
        /// It is no longer in the graveyard (restored or reaped meanwhile).
        case gone
        /// The name is taken.
        case taken
        case failed(Errno)
    }

    /// Puts the graveyard entry `e` back as `leaf` in `dirFD`, a directory
    /// the caller opened with the peer's rights; `path` is where that is in
    /// the mount (for the event), `who` who asked: the move is theirs. The
    /// kernel is told the name exists before this returns.
    /// `byRename`: a rename out of the desktop trash asked it, and the
    /// kernel, which holds the directory locked, moves the name itself.
    /// `kept`: the daemon puts back what its deleter could not remove (the event says so).
    package func putBack(_ e: TrashEntry, into dirFD: Int32, leaf: UnsafePointer<CChar>, path: [UInt8],
                         as who: Credentials, byRename: Bool = false, kept: Bool = false) throws(PutBackFailure) {
        let uid = who.uid
        guard let graveyard, let claimed = graveyard.claim(e.id) else { throw .gone }
        let parent: Inode? = dirFD == backingRoot ? table.root : (try? Sys.fstat(dirFD)).flatMap(table.known)
        parent?.willChangeEntries()
        do throws(Errno) {
            try graveyard.restore(claimed, to: dirFD, leaf, as: who, inPlace: Self.isInPlace(claimed.record, dirFD, path))
        } catch {
            graveyard.release(claimed)
            if error == .fileExists || error == .directoryNotEmpty { throw .taken }
            throw .failed(error)
        }
        reaper?.forgetTree(claimed.id)
        changes.restored(into: dirFD, leaf, path: path, kind: claimed.record.kind.name, entry: claimed.id, uid: uid, kept: kept)
        guard let parent else { return }
        // A process still inside the tree may make entries in it again.
        if let st = try? Sys.lstatat(dirFD, leaf) { table.moved(st, to: parent, name: leaf) }
        if byRename { return }
        // The kernel may remember the name as absent: tell it, from outside
        // any handler, before the caller looks for the name.
        let name = Inode.copyName(leaf)
        if !invalidations.send(parent: table.nodeID(parent), name: name, by: uid, timeout: .seconds(1)) {
            log.debug("answering a restore before the kernel forgot the name's absence (its parent stayed locked)")
        }
    }

    /// Entries the reaper held that went back where they were deleted from, since the mount.
    var heldEntriesPutBack: Int { heldPutBack.load(ordering: .relaxed) }

    /// The reaper's hook for the directory entry `id` it held because its
    /// deleter could not remove all of it (another user's tree moved in
    /// through a descriptor held inside it): puts what is left back where it
    /// was deleted from, as its deleter, so the tree ends as their `rm -r`
    /// would have left it. Each directory on the way is opened as them and
    /// the move is theirs, so the kernel decides it. False, and it stays held
    /// in their trash, where that is not known (a piece split off a tree, or
    /// no undo window: no record of the path), no longer the directory it
    /// left, or taken.
    func putBackHeld(_ id: String) -> Bool {
        guard let graveyard, let e = graveyard.restorable(id: id), e.record.kind == .directory, e.record.held != nil,
              let who = id.withCString({ graveyard.credentials(ofEntry: $0) }) else { return false }
        let parts = e.record.path.split(separator: 0x2F).map { Array($0) }
        guard let leaf = parts.last, !parts.contains(where: { $0 == [0x2E] || $0 == [0x2E, 0x2E] || $0.contains(0) }) else {
            return false
        }
        var dirFD = backingRoot
        defer { if dirFD != backingRoot { Sys.close(dirFD) } }
        do throws(Errno) {
            for name in parts.dropLast() {
                let next = try who.acting { () throws(Errno) in
                    try (name + [0]).withUnsafeBufferPointer { b throws(Errno) in
                        try Sys.openat(dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                                       VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                    }
                }
                if dirFD != backingRoot { Sys.close(dirFD) }
                dirFD = next
            }
        } catch {
            return false
        }
        guard Self.isInPlace(e.record, dirFD, e.record.path) else { return false }
        do throws(PutBackFailure) {
            try (leaf + [0]).withUnsafeBufferPointer { b throws(PutBackFailure) in
                try putBack(e, into: dirFD, leaf: UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                            path: e.record.path, as: who, kept: true)
            }
        } catch {
            return false
        }
        heldPutBack.add(1, ordering: .relaxed)
        log.notice("put back what its deleter could not remove with rm -r, where it was",
                   metadata: ["path": "\(String(decoding: e.record.path, as: UTF8.self))", "uid": "\(who.uid)"])
        return true
    }

    /// Puts `part` (names below the top of the directory entry `e`) back as
    /// `leaf` in `dirFD` without the rest of the entry: one file or subtree
    /// of a tree `vanish rm -r` removed. The entry is held from the reaper
    /// meanwhile; the directories inside it are opened and the part moved
    /// as `who`, so the kernel decides, as for their `mv` out of the tree.
    /// Never over an existing name (`.taken`).
    package func putBackPart(_ e: TrashEntry, _ part: [[UInt8]], into dirFD: Int32, leaf: UnsafePointer<CChar>,
                             path: [UInt8], as who: Credentials) throws(PutBackFailure) {
        guard let graveyard, e.record.kind == .directory, let name = part.last,
              !part.contains(where: { $0.isEmpty || $0 == [0x2E] || $0 == [0x2E, 0x2E] || $0.contains(0) }),
              let claimed = graveyard.claim(e.id) else { throw .gone }
        defer {
            graveyard.release(claimed)
            // What it holds changed: measured again when asked.
            graveyard.forgetExtent(claimed.id)
            reaper?.forgetTree(claimed.id)
        }
        let parent: Inode? = dirFD == backingRoot ? table.root : (try? Sys.fstat(dirFD)).flatMap(table.known)
        parent?.willChangeEntries()
        let moved: stat
        do throws(Errno) {
            var from = try Sys.opened(graveyard.shardFDs[claimed.shard], claimed.id, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            moved = try who.acting { () throws(Errno) -> stat in
                for component in part.dropLast() {
                    let next = try (component + [0]).withUnsafeBufferPointer { b throws(Errno) in
                        try Sys.openat(from.raw, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                                       VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                    }
                    from = OwnedDescriptor(next)
                }
                return try (name + [0]).withUnsafeBufferPointer { b throws(Errno) -> stat in
                    let n = UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self)
                    let st = try Sys.lstatat(from.raw, n)
                    try Sys.renameNoReplace(from.raw, n, dirFD, leaf)
                    return st
                }
            }
        } catch .fileExists {
            throw .taken
        } catch .noSuchFileOrDirectory {
            throw .gone
        } catch {
            throw .failed(error)
        }
        changes.restored(into: dirFD, leaf, path: path, kind: TrashRecord.Kind(mode: moved.st_mode).name,
                         entry: claimed.id, uid: who.uid, kept: false)
        guard let parent else { return }
        table.moved(moved, to: parent, name: leaf)
        let leafName = Inode.copyName(leaf)
        if !invalidations.send(parent: table.nodeID(parent), name: leafName, by: who.uid, timeout: .seconds(1)) {
            log.debug("answering a restore before the kernel forgot the name's absence (its parent stayed locked)")
        }
    }
}
