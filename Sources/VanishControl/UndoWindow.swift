import Glibc
import LinuxSyscalls
import SystemPackage
import VanishFS
import VanishGraveyard

/// Why a restore did not happen.
public enum RestoreError: Error, CustomStringConvertible {
    // Said after "cannot restore ENTRY: " (the CLI's and the client's prefix).
    case noSuchEntry(String)
    case taken(String)
    case invalidDestination(String)
    case failed(String, Errno)
    /// The directory `path` was in (`directory`) is not there.
    case directoryGone(String, String)
    /// The mount keeps nothing: read-only, or a source it may not write.
    case noTrash

    public var description: String {
        switch self {
        case .noTrash:
            "this mount keeps no deleted entries (it is read-only, or its source could not hold a graveyard): nothing can be restored"
        case .directoryGone(_, let directory):
            "its directory \(directory) no longer exists (restore \(directory) first, or give another place with --to)"
        case .noSuchEntry(let what): "nothing restorable is known as \(what)"
        case .taken(let path): "\(path) exists; nothing was changed (restore it elsewhere with --to)"
        case .invalidDestination(let why): why
        case .failed(let path, let errno): "\(path): \(errno)"
        }
    }

    public var errno: Int32 {
        switch self {
        case .noSuchEntry: ENOENT
        case .taken: EEXIST
        case .invalidDestination: EINVAL
        case .failed(_, let e): e.rawValue
        case .directoryGone, .noTrash: ENOENT
        }
    }
}

/// The undo window as a peer of the control socket sees it: what they
/// deleted (everything, for root), and putting it back where they could
/// make it themselves.
struct UndoWindow {
    let mount: MountControl

    /// The restorable entries `who` may see (their own; everything for root), oldest first.
    func trash(for who: Credentials) -> [TrashEntry] {
        mount.restorable(for: who.uid)
    }

    /// The kept entries `who` may let go: those with the given ids, at or
    /// inside the given paths (every deletion of them), and, of those (or of
    /// all when neither is given), the ones deleted at least `olderThan` ns
    /// ago. Also the ids and paths that named none of `who`'s entries: another
    /// user's entry gets the answer for one that never was.
    func choose(ids: [String], paths: [[UInt8]], olderThan: UInt64?,
                for who: Credentials) -> (entries: [TrashEntry], unknown: [[UInt8]]) {
        let visible = trash(for: who)
        var chosen: [TrashEntry]
        var unknown: [[UInt8]] = []
        if ids.isEmpty && paths.isEmpty {
            chosen = visible
        } else {
            var picked = Set<String>()
            for id in ids {
                if visible.contains(where: { $0.id == id }) { picked.insert(id) } else { unknown.append(Array(id.utf8)) }
            }
            for path in paths {
                let matching = visible.filter { $0.record.path == path || Self.isInside($0.record.path, path) }
                if matching.isEmpty { unknown.append(path) }
                picked.formUnion(matching.map(\.id))
            }
            chosen = visible.filter { picked.contains($0.id) }
        }
        if let olderThan {
            let cutoff = Sys.wallClockNow() &- olderThan
            chosen = chosen.filter { $0.deleted <= cutoff }
        }
        // A held entry goes only when named by its id: emptying it frees
        // what its deleter may remove and leaves the rest in the graveyard.
        chosen = chosen.filter { $0.record.held == nil || ids.contains($0.id) }
        return (chosen, unknown)
    }

    /// Restores one entry by id, or by original path (its latest deletion,
    /// and, for a directory, everything deleted inside it since then that is
    /// still in the trash). Returns the paths put back. `destination`
    /// (relative to the mount root) is allowed only for one entry.
    func restore(id: String?, path: [UInt8]?, to destination: [UInt8]?,
                 as who: Credentials) throws(RestoreError) -> [[UInt8]] {
        guard mount.hasGraveyard else { throw .noTrash }
        let visible = mount.restorable(for: who.uid)
        var plan: [TrashEntry] = []
        if let id {
            // Another user's entry gets the answer for one that never was.
            guard let e = visible.first(where: { $0.id == id }) else { throw .noSuchEntry(id) }
            plan = [e]
        } else if let path {
            let shown = String(decoding: path, as: UTF8.self)
            let exact = visible.filter { $0.record.path == path }
            guard let top = exact.last else {
                // The directory itself is not in the trash (it never went, or
                // an interrupted restore brought it back): what was deleted
                // inside it goes back.
                plan = Self.newest(inside: path, of: visible)
                // Or it is inside a tree removed whole (`vanish rm -r`): that part alone goes back.
                if plan.isEmpty, let (tree, part) = Self.container(of: path, among: visible) {
                    try restorePart(part, of: tree, to: destination ?? path, as: who)
                    return [destination ?? path]
                }
                guard !plan.isEmpty, destination == nil else { throw .noSuchEntry(shown) }
                return try restoreAll(plan, to: nil, as: who, insideOnly: true)
            }
            // Deleted again later inside a directory kept whole (rm -rf took it with its files):
            // that is its latest deletion.
            if let (tree, part) = Self.container(of: path, among: visible), tree.deleted > top.deleted,
               mount.shadowed([top, tree]).contains(top.id) {
                try restorePart(part, of: tree, to: destination ?? path, as: who)
                return [destination ?? path]
            }
            plan = [top]
            if top.record.kind == .directory && destination == nil {
                // rm -rf removes children first: they were deleted before the
                // directory, after any earlier deletion of the same path.
                let since = exact.dropLast().last?.deleted ?? 0
                plan += Self.newest(inside: path, of: visible.filter { $0.deleted > since && $0.deleted <= top.deleted })
            }
        } else {
            throw .invalidDestination("name an entry by id or by path")
        }
        return try restoreAll(plan, to: destination, as: who, insideOnly: false)
    }

    /// Restores `plan` in order (the first to `destination` if given). The
    /// first entry failing is the answer, unless `insideOnly` (the entries
    /// are what was deleted inside a directory): then only all failing is.
    /// An entry that cannot go back (its name taken) stays restorable.
    private func restoreAll(_ plan: [TrashEntry], to destination: [UInt8]?, as who: Credentials,
                            insideOnly: Bool) throws(RestoreError) -> [[UInt8]] {
        var restored: [[UInt8]] = []
        var firstError: RestoreError?
        for (i, e) in plan.enumerated() {
            let target = i == 0 ? (destination ?? e.record.path) : e.record.path
            if target.isEmpty {
                throw .invalidDestination("where \(e.id) was is not known (a part of a tree kept for what its deleter could not remove): restore it with --to")
            }
            do {
                try restore(e, to: target, as: who)
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
    static func newest(inside dir: [UInt8], of entries: [TrashEntry]) -> [TrashEntry] {
        var latest: [[UInt8]: TrashEntry] = [:]
        for e in entries where isInside(e.record.path, dir) { latest[e.record.path] = e }
        return latest.values.sorted { $0.record.path.count < $1.record.path.count }
    }

    /// The directory entry `path` is inside, with the names below its top:
    /// the deepest, and of those the latest deletion.
    static func container(of path: [UInt8], among entries: [TrashEntry]) -> (TrashEntry, [[UInt8]])? {
        let candidates = entries.filter { $0.record.kind == .directory && !$0.record.path.isEmpty && isInside(path, $0.record.path) }
        guard let tree = candidates.max(by: { ($0.record.path.count, $0.deleted) < ($1.record.path.count, $1.deleted) }) else {
            return nil
        }
        let part = path[(tree.record.path.count + 1)...].split(separator: 0x2F).map { Array($0) }
        return part.isEmpty ? nil : (tree, part)
    }

    static func isInside(_ path: [UInt8], _ dir: [UInt8]) -> Bool {
        path.count > dir.count + 1 && path[dir.count] == 0x2F && Array(path[..<dir.count]) == dir
    }

    /// Where `target` (relative to the mount root) may be restored to: its
    /// directory's components and its last name; never `.`, `..`, the root
    /// or the state directory.
    static func destination(_ target: [UInt8]) throws(RestoreError) -> (directory: [[UInt8]], leaf: [UInt8]) {
        let shown = String(decoding: target, as: UTF8.self)
        var parts = target.split(separator: 0x2F, omittingEmptySubsequences: true).map { Array($0) }
        guard let leaf = parts.popLast() else { throw .invalidDestination("that is the mount root itself") }
        for p in parts + [leaf] where p == [0x2E] || p == [0x2E, 0x2E] {
            throw .invalidDestination("\(shown): paths may not contain . or ..")
        }
        // A C string ends at a NUL: "..\0x" would pass the check above and open "..".
        if target.contains(0) { throw .invalidDestination("paths may not contain a NUL byte") }
        if (parts.first ?? leaf) == Array(Graveyard.stateDirectoryName.utf8) {
            throw .invalidDestination("\(shown) is Vanish's reserved state directory")
        }
        return (parts, leaf)
    }

    /// Restores `part` of the directory entry `tree` to `target`, the rest staying in the trash.
    private func restorePart(_ part: [[UInt8]], of tree: TrashEntry, to target: [UInt8],
                             as who: Credentials) throws(RestoreError) {
        for p in part where p == [0x2E] || p == [0x2E, 0x2E] || p.contains(0) {
            throw .invalidDestination("\(String(decoding: target, as: UTF8.self)): paths may not contain . or .. or a NUL byte")
        }
        try putBack(to: target, as: who, gone: .noSuchEntry(String(decoding: target, as: UTF8.self))) { dirFD, leaf, path
            throws(MountControl.PutBackFailure) in
            try mount.putBackPart(tree, part, into: dirFD, leaf: leaf, path: path, as: who)
        }
    }

    private func restore(_ e: TrashEntry, to target: [UInt8], as who: Credentials) throws(RestoreError) {
        try putBack(to: target, as: who, gone: .noSuchEntry(e.id)) { dirFD, leaf, path throws(MountControl.PutBackFailure) in
            try mount.putBack(e, into: dirFD, leaf: leaf, path: path, as: who)
        }
    }

    /// `move` with the directory of `target` opened as `who` would reach it
    /// (write and search needed there) and its last name; its failures said
    /// for `target` (`gone`: what to say when the entry is no longer there).
    private func putBack(to target: [UInt8], as who: Credentials, gone: RestoreError,
                         _ move: (Int32, UnsafePointer<CChar>, [UInt8]) throws(MountControl.PutBackFailure) -> Void)
        throws(RestoreError) {
        let shown = String(decoding: target, as: UTF8.self)
        let (parts, leaf) = try Self.destination(target)
        if mount.showsTrashFolder(named: parts.first ?? leaf) {
            throw .invalidDestination("\(shown) is where the mount shows a user's desktop trash")
        }
        let root = mount.backingRoot
        let dirFD: Int32
        do throws(Errno) {
            // Creating a name needs write and search permission on the directory.
            dirFD = try who.openDirectory(parts, under: root, needing: 3)
        } catch .noSuchFileOrDirectory where !parts.isEmpty {
            throw .directoryGone(shown, String(decoding: Array(parts.joined(separator: [0x2F])), as: UTF8.self))
        } catch {
            throw .failed(shown, error)
        }
        defer { if dirFD != root { Sys.close(dirFD) } }
        do throws(MountControl.PutBackFailure) {
            try (leaf + [0]).withUnsafeBufferPointer { b throws(MountControl.PutBackFailure) in
                try move(dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self), target)
            }
        } catch {
            switch error {
            case .gone: throw gone
            case .taken: throw .taken(shown)
            case .failed(let errno): throw .failed(shown, errno)
            }
        }
    }
}
