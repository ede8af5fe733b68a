import CFuse
import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Lets inotify watchers of a trash folder (a file manager's trash view,
/// `gio monitor`) see what a deletion adds to it. FUSE has no notice that
/// raises IN_CREATE, and the kernel raises it only for what it creates
/// itself: so this thread creates each new name through the mount
/// (`mknod`, `mkdir` or `symlink` in `files/`, `mknod` in `info/`), and the
/// trash handlers, telling its requests apart by its thread id, answer its
/// lookup of the name "absent" and its create with the entry already there.
/// Nothing is made anywhere.
///
/// Only for users who listed their folder since the mount (a watcher lists
/// before it watches), so nothing is spent for anyone else; the thread
/// starts with the first of them.
final class TrashAnnouncer: Sendable {
    private struct State {
        /// Watched users, and the names already in their folder as last seen.
        var known: [UInt32: Set<[UInt8]>] = [:]
        /// The name in a `files` or `info` node being announced now.
        var now: (parent: fuse_ino_t, name: [UInt8])?
        var started = false
    }
    private let state = Mutex(State())
    /// The announcing thread's id: requests from it are its announcements.
    let thread = Atomic<Int32>(0)
    private let mountpoint: String

    /// At most this many names per look (two requests each): beyond, during
    /// an `rm -rf` of thousands, a watcher sees the rest at its next listing.
    static let batch = 256
    static let interval = Duration.milliseconds(100)

    init(mountpoint: String) { self.mountpoint = mountpoint }

    /// `uid` listed their folder: from now on, what comes into it is announced.
    func watch(_ uid: UInt32, _ folders: TrashFolders) {
        let start = state.withLock { s -> Bool in
            if s.known[uid] == nil { s.known[uid] = Set(folders.listing(uid).names) }
            defer { s.started = true }
            return !s.started
        }
        if start { spawnThread("vanish-trashnew") { [self] in run(folders) } }
    }

    /// Whether `name` in `parent` is being announced by the request's caller
    /// `pid` (its lookup is answered "absent", its create with the entry).
    @inline(__always)
    func isAnnouncing(_ pid: pid_t, _ parent: fuse_ino_t, _ name: UnsafePointer<CChar>) -> Bool {
        guard pid == thread.load(ordering: .relaxed) else { return false }
        let n = Array(UnsafeRawBufferPointer(start: name, count: strlen(name)))
        return state.withLock { $0.now.map { $0.parent == parent && $0.name == n } ?? false }
    }

    private func run(_ folders: TrashFolders) {
        thread.store(vanish_gettid(), ordering: .relaxed)
        var seen = UInt64.max
        while true {
            Sys.sleep(Self.interval)
            let version = folders.version
            guard version != seen else { continue }
            seen = version
            for uid in state.withLock({ Array($0.known.keys) }) { announce(uid, folders) }
        }
    }

    /// Announces what came into `uid`'s folder since the last look.
    private func announce(_ uid: UInt32, _ folders: TrashFolders) {
        let listing = folders.listing(uid)
        let names = Set(listing.names)
        let known = state.withLock { s -> Set<[UInt8]> in
            defer { s.known[uid] = names }
            return s.known[uid] ?? names
        }
        let new = listing.names.filter { !known.contains($0) }.prefix(Self.batch)
        guard !new.isEmpty else { return }
        // The mount's own root, or nothing: never the directory under it.
        let root = open(mountpoint, VANISH_O_PATH | O_DIRECTORY | O_CLOEXEC)
        guard root >= 0 else { return }
        defer { Sys.close(root) }
        guard vanish_filesystem_type(root) == VANISH_FUSE_SUPER_MAGIC else { return }
        let folder = ".Trash-\(uid)/"
        let filesNode = fuse_ino_t(folders.node(uid, .files, lookedUp: false))
        let infoNode = fuse_ino_t(folders.node(uid, .info, lookedUp: false))
        // As the folder's user: should the name lead anywhere else (a real
        // .Trash-<uid> of theirs on the source), the kernel checks it as them.
        let who = Credentials.canSwitch ? Credentials.ofUser(uid, fallbackGID: gid_t(uid)) : nil
        _ = try? Credentials.acting(who) { () throws(Errno) in announce(new, listing, root, folder, filesNode, infoNode) }
    }

    private func announce(_ new: ArraySlice<[UInt8]>, _ listing: TrashFolders.Listing, _ root: Int32, _ folder: String,
                          _ filesNode: fuse_ino_t, _ infoNode: fuse_ino_t) {
        for name in new {
            guard let kind = listing.entries[name]?.record.kind else { continue }
            make(root, folder + "files/", name, in: filesNode) { path in
                switch kind {
                case .directory: mkdirat(root, path, 0o700)
                case .symlink: symlinkat("?", root, path)
                case .file: mknodat(root, path, S_IFREG | 0o600, 0)
                case .other: -1
                }
            }
            make(root, folder + "info/", name + TrashFolders.suffix, in: infoNode) { path in
                mknodat(root, path, S_IFREG | 0o600, 0)
            }
        }
    }

    /// Runs `create` on `directory` + `name` (relative to the mount's root)
    /// while that name in `node` is announced.
    private func make(_ root: Int32, _ directory: String, _ name: [UInt8], in node: fuse_ino_t,
                      _ create: (UnsafePointer<CChar>) -> Int32) {
        state.withLock { $0.now = (node, name) }
        defer { state.withLock { $0.now = nil } }
        let path = Array(directory.utf8).map { CChar(bitPattern: $0) } + name.map { CChar(bitPattern: $0) } + [0]
        _ = path.withUnsafeBufferPointer { create($0.baseAddress!) }
    }
}
