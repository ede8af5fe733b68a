import CFuse
import CLinux
import Glibc
import LinuxSyscalls
import Logging
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
///
/// Lock order: `state` is a leaf.
final class TrashAnnouncer: Sendable {
    private struct State {
        /// Watched users, and the names already in their folder as last seen.
        var known: [UInt32: Set<[UInt8]>] = [:]
        /// The name in a `files` or `info` node being announced (or probed) now.
        var now: (parent: fuse_ino_t, name: [UInt8])?
        /// Whether a request for `now` reached this mount's handlers.
        var reached = false
        var started = false
        /// Users whose folder the mountpoint's path did not lead to (said once each).
        var misled: Set<UInt32> = []
    }
    private let state = Mutex(State())
    /// The announcing thread's id: requests from it are its announcements.
    let thread = Atomic<Int32>(0)
    private let mountpoint: String
    private let log: Logger?

    /// At most this many names per look (two requests each): beyond, during
    /// an `rm -rf` of thousands, a watcher sees the rest at its next listing.
    static let batch = 256
    static let interval = Duration.milliseconds(100)

    init(mountpoint: String, log: Logger?) {
        self.mountpoint = mountpoint
        self.log = log
    }

    /// `uid` listed their folder: from now on, what comes into it is announced.
    func watch(_ uid: UInt32, _ folders: TrashFolders) {
        // Listed outside the lock, which stays a leaf.
        let names = state.withLock { $0.known[uid] == nil } ? Set(folders.listing(uid).names) : nil
        let start = state.withLock { s -> Bool in
            if s.known[uid] == nil, let names { s.known[uid] = names }
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
        return state.withLock { s in
            guard let now = s.now, now.parent == parent, now.name == n else { return false }
            s.reached = true
            return true
        }
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
        let filesNode = fuse_ino_t(folders.node(uid, .files, lookedUp: false))
        let infoNode = fuse_ino_t(folders.node(uid, .info, lookedUp: false))
        // As the folder's user, so the kernel checks every step as theirs.
        let who = Credentials.canSwitch ? Credentials.ofUser(uid, fallbackGID: gid_t(uid)) : nil
        _ = try? Credentials.acting(who) { () throws(Errno) in
            guard let filesFD = folder(uid, "files", filesNode), let infoFD = folder(uid, "info", infoNode) else { return }
            let files = filesFD.raw, info = infoFD.raw
            for name in new {
                guard let kind = listing.entries[name]?.record.kind else { continue }
                make(name, in: filesNode) { path in
                    switch kind {
                    case .directory: mkdirat(files, path, 0o700)
                    case .symlink: symlinkat("?", files, path)
                    case .file: mknodat(files, path, S_IFREG | 0o600, 0)
                    case .other: -1
                    }
                }
                make(name + TrashFolders.suffix, in: infoNode) { mknodat(info, $0, S_IFREG | 0o600, 0) }
            }
        }
    }

    /// `part` (`files` or `info`) of `uid`'s folder, opened through the
    /// mountpoint's path, if it is this mount's `node`: a made-up name looked
    /// up in it must reach these handlers. Anyone who may write a directory
    /// on the path could otherwise lead it to a directory, or a FUSE
    /// filesystem, of their own, and learn the names or have them made there.
    private func folder(_ uid: UInt32, _ part: String, _ node: fuse_ino_t) -> OwnedDescriptor? {
        guard let root = try? Sys.opened(mountpoint, VANISH_O_PATH | O_DIRECTORY),
              let fd = try? Sys.opened(root.raw, ".Trash-\(uid)/" + part, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        else { return nil }
        let probe = Array(".vanish-probe-\(UInt64.random(in: 1...UInt64.max))".utf8)
        let reached = make(probe, in: node) { _ = try? Sys.lstatat(fd.raw, $0); return 0 }
        if reached { return fd }
        if state.withLock({ $0.misled.insert(uid).inserted }) {
            log?.warning("the mountpoint's path leads elsewhere (a directory on it replaced?): new trash entries are not announced there",
                         metadata: ["mountpoint": "\(mountpoint)", "uid": "\(uid)"])
        }
        return nil
    }

    /// Runs `create` on `name` while that name in `node` is announced;
    /// whether a request for it reached this mount's handlers.
    @discardableResult
    private func make(_ name: [UInt8], in node: fuse_ino_t, _ create: (UnsafePointer<CChar>) -> Int32) -> Bool {
        state.withLock { s in
            s.now = (node, name)
            s.reached = false
        }
        let path = name.map { CChar(bitPattern: $0) } + [0]
        _ = path.withUnsafeBufferPointer { create($0.baseAddress!) }
        return state.withLock { s in
            s.now = nil
            return s.reached
        }
    }
}
