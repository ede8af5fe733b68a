import CLinux
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

/// Who asks, as the kernel vouches for it (SO_PEERCRED on the control
/// socket): permission checks for listing and restoring use these, never
/// the daemon's own rights.
public struct Credentials: Sendable {
    public var uid: uid_t
    public var gid: gid_t
    public var groups: [gid_t]

    public init(uid: uid_t, gid: gid_t, groups: [gid_t]) {
        self.uid = uid
        self.gid = gid
        self.groups = groups
    }

    /// Whether the mode bits of `st` grant all of `mask` (R=4, W=2, X=1),
    /// as the kernel's generic_permission decides (root passes, except that
    /// execute needs some x bit).
    func permits(_ st: stat, _ mask: mode_t) -> Bool {
        if uid == 0 { return mask & 1 == 0 || st.st_mode & 0o111 != 0 || st.st_mode & S_IFMT == S_IFDIR }
        let bits: mode_t
        if st.st_uid == uid {
            bits = (st.st_mode >> 6) & 7
        } else if st.st_gid == gid || groups.contains(st.st_gid) {
            bits = (st.st_mode >> 3) & 7
        } else {
            bits = st.st_mode & 7
        }
        return bits & mask == mask
    }
}

extension PassthroughFilesystem {
    /// Opens the directory `components` below the root as `who` would reach
    /// it: one name at a time, never following a symlink, with search
    /// permission on every directory on the way and `needing` (R=4, W=2,
    /// X=1) on the last. Close the result unless it is `rootFD`.
    func openDirectory(_ components: [[UInt8]], as who: Credentials, needing: mode_t) throws(Errno) -> Int32 {
        var dirFD = rootFD
        do throws(Errno) {
            for p in components {
                guard who.permits(try Sys.fstat(dirFD), 1) else { throw Errno.permissionDenied }
                let next = try (p + [0]).withUnsafeBufferPointer { b throws(Errno) in
                    try Sys.openat(dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                                   VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                }
                if dirFD != rootFD { Sys.close(dirFD) }
                dirFD = next
            }
            guard who.permits(try Sys.fstat(dirFD), needing) else { throw Errno.permissionDenied }
            return dirFD
        } catch {
            if dirFD != rootFD { Sys.close(dirFD) }
            throw error
        }
    }
}

/// Why a restore did not happen.
public enum RestoreError: Error, CustomStringConvertible {
    case noSuchEntry(String)
    case notYours(String)
    case taken(String)
    case invalidDestination(String)
    case failed(String, Errno)

    public var description: String {
        switch self {
        case .noSuchEntry(let what): "nothing restorable is known as \(what)"
        case .notYours(let what): "\(what) was deleted by another user; only they or root may restore it"
        case .taken(let path): "\(path) exists; nothing was changed (restore it elsewhere with --to)"
        case .invalidDestination(let why): why
        case .failed(let path, let errno): "cannot restore to \(path): \(errno)"
        }
    }

    public var errno: Int32 {
        switch self {
        case .noSuchEntry: ENOENT
        case .notYours: EPERM
        case .taken: EEXIST
        case .invalidDestination: EINVAL
        case .failed(_, let e): e.rawValue
        }
    }
}

/// The undo window seen from outside: list what a user deleted, put it back.
extension PassthroughFilesystem {
    /// Why `who` may not restore another user's entry: they are told whose
    /// it is only if they could see its path; otherwise the answer is the
    /// one for a name never deleted, so no guessed name can be tested.
    private func refusal(_ what: String, path: [UInt8], as who: Credentials) -> RestoreError {
        mayObserve(path, as: who) ? .notYours(what) : .noSuchEntry(what)
    }

    /// The restorable entries `who` may see (their own; everything for root), oldest first.
    public func trash(for who: Credentials) -> [TrashEntry] {
        guard let graveyard else { return [] }
        // Entries unlinked a moment ago are listed too.
        namespace.settle()
        return graveyard.restorable.filter { who.uid == 0 || $0.record.uid == who.uid }
    }

    /// Restores one entry by id, or by original path (its latest deletion,
    /// and, for a directory, everything deleted inside it since then that is
    /// still in the trash). Returns the paths put back. `destination`
    /// (relative to the mount root) is allowed only for one entry.
    public func restore(id: String?, path: [UInt8]?, to destination: [UInt8]?,
                        as who: Credentials) throws(RestoreError) -> [[UInt8]] {
        guard let graveyard else { throw .noSuchEntry("anything (this mount has no graveyard)") }
        // A name whose burial is pending is free, not taken.
        namespace.settle()
        let visible = trash(for: who)
        var plan: [TrashEntry] = []
        if let id {
            guard let e = graveyard.restorable.first(where: { $0.id == id }) else { throw .noSuchEntry(id) }
            guard who.uid == 0 || e.record.uid == who.uid else { throw refusal(id, path: e.record.path, as: who) }
            plan = [e]
        } else if let path {
            let shown = String(decoding: path, as: UTF8.self)
            let exact = graveyard.restorable.filter { $0.record.path == path }
            guard let top = exact.last else {
                // The directory itself is not in the trash (it never went, or
                // an interrupted restore brought it back): what was deleted
                // inside it goes back.
                plan = newest(inside: path, of: visible)
                guard !plan.isEmpty, destination == nil else { throw .noSuchEntry(shown) }
                return try restoreAll(plan, to: nil, as: who, graveyard: graveyard, insideOnly: true)
            }
            guard who.uid == 0 || top.record.uid == who.uid else { throw refusal(shown, path: path, as: who) }
            plan = [top]
            if top.record.kind == .directory && destination == nil {
                // rm -rf removes children first: they were deleted before the
                // directory, after any earlier deletion of the same path.
                let since = exact.dropLast().last?.deleted ?? 0
                plan += newest(inside: path, of: visible.filter { $0.deleted > since && $0.deleted <= top.deleted })
            }
        } else {
            throw .invalidDestination("name an entry by id or by path")
        }
        return try restoreAll(plan, to: destination, as: who, graveyard: graveyard, insideOnly: false)
    }

    /// Restores `plan` in order (the first to `destination` if given). The
    /// first entry failing is the answer, unless `insideOnly` (the entries
    /// are what was deleted inside a directory): then only all failing is.
    /// An entry that cannot go back (its name taken) stays restorable.
    private func restoreAll(_ plan: [TrashEntry], to destination: [UInt8]?, as who: Credentials,
                            graveyard: Graveyard, insideOnly: Bool) throws(RestoreError) -> [[UInt8]] {
        var restored: [[UInt8]] = []
        var firstError: RestoreError?
        for (i, e) in plan.enumerated() {
            let target = i == 0 ? (destination ?? e.record.path) : e.record.path
            do {
                try restore(e, to: target, as: who, graveyard: graveyard)
                restored.append(target)
            } catch {
                if i == 0 && !insideOnly { throw error }
                firstError = firstError ?? error
            }
        }
        if restored.isEmpty, let firstError { throw firstError }
        return restored
    }

    /// The latest deletion of each path inside `dir` among `entries` (oldest
    /// first), parents before children.
    private func newest(inside dir: [UInt8], of entries: [TrashEntry]) -> [TrashEntry] {
        var latest: [[UInt8]: TrashEntry] = [:]
        for e in entries where isInside(e.record.path, dir) { latest[e.record.path] = e }
        return latest.values.sorted { $0.record.path.count < $1.record.path.count }
    }

    private func isInside(_ path: [UInt8], _ dir: [UInt8]) -> Bool {
        path.count > dir.count + 1 && path[dir.count] == 0x2F && Array(path[..<dir.count]) == dir
    }

    private func restore(_ e: TrashEntry, to target: [UInt8], as who: Credentials,
                         graveyard: Graveyard) throws(RestoreError) {
        let shown = String(decoding: target, as: UTF8.self)
        var parts = target.split(separator: 0x2F, omittingEmptySubsequences: true).map { Array($0) }
        guard let leaf = parts.popLast() else { throw .invalidDestination("cannot restore onto the mount root") }
        for p in parts + [leaf] where p == [0x2E] || p == [0x2E, 0x2E] {
            throw .invalidDestination("\(shown): paths may not contain . or ..")
        }
        if let first = parts.first ?? Optional(leaf), first == Array(Graveyard.stateDirectoryName.utf8) {
            throw .invalidDestination("\(shown) is Vanish's reserved state directory")
        }
        let dirFD: Int32
        do throws(Errno) {
            // Creating a name needs write and search permission on the directory.
            dirFD = try openDirectory(parts, as: who, needing: 3)
        } catch {
            throw .failed(shown, error)
        }
        defer { if dirFD != rootFD { Sys.close(dirFD) } }
        guard let claimed = graveyard.claim(e.id) else { throw .noSuchEntry(e.id) }
        do throws(Errno) {
            try (leaf + [0]).withUnsafeBufferPointer { b throws(Errno) in
                try graveyard.restore(claimed, to: dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self))
                if observing {
                    let id = fileID(dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self))
                    emit(.restored, nil) { ev in
                        ev.path("path", target)
                        ev.string("kind", claimed.record.kind.name)
                        ev.string("id", id)
                        ev.string("entry", claimed.id)
                        ev.int("uid", who.uid)
                    }
                }
            }
        } catch {
            graveyard.release(claimed)
            if error == .fileExists || error == .directoryNotEmpty { throw .taken(shown) }
            throw .failed(shown, error)
        }
        let parent: Inode? = dirFD == rootFD ? table.root : (try? Sys.fstat(dirFD)).flatMap(table.known)
        guard let parent else { return }
        let name = ContiguousArray(leaf.map { CChar(bitPattern: $0) } + [0])
        name.withUnsafeBufferPointer { n in
            // A process still inside the tree may make entries in it again.
            if let st = try? Sys.lstatat(dirFD, n.baseAddress!) { table.moved(st, to: parent, name: n.baseAddress!) }
        }
        // The kernel may remember the name as absent: tell it, from outside
        // any handler, before the caller looks for the name.
        if !invalidations.send(parent: table.nodeID(parent), name: name, timeout: 1_000_000_000) {
            log.debug("answering a restore before the kernel forgot the name's absence (its parent stayed locked)")
        }
    }
}
