import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage
import VanishGraveyard

/// Graveyards on filesystems mounted inside the source.
///
/// An entry on such a filesystem cannot be renamed into the source's
/// graveyard (EXDEV), so that filesystem gets a `.vanish` of its own at its
/// root, made the first time something on it is deleted, with a reaper of
/// one worker. Where none can be made (read-only, a `.vanish` that is not
/// Vanish's) deletes on it are done in the request. Entries there carry no
/// trash record: the undo window covers the source's own filesystem only.
final class NestedGraveyards: Sendable {
    enum Site {
        /// `root` is the nested filesystem's top directory as seen in the source.
        case active(root: InodeKey, graveyard: Graveyard, reaper: Reaper)
        /// Deletes on this filesystem happen in the request.
        case unavailable(root: InodeKey)
    }

    private let sites = Mutex<[dev_t: Site]>([:])
    /// Held while a site is being set up, so two requests never make two;
    /// never taken on the hot path (only for a device with no site yet).
    private let setup = Mutex<Void>(())

    func site(_ dev: dev_t) -> Site? { sites.withLock { $0[dev] } }

    /// The site for `dev`, set up by `make` under the setup lock if there is
    /// none yet. `make` returning nil records nothing (it may be tried again).
    func site(_ dev: dev_t, orMake make: () -> Site?) -> Site? {
        if let s = site(dev) { return s }
        return setup.withLock { _ in
            if let s = site(dev) { return s }
            guard let made = make() else { return nil }
            sites.withLock { $0[dev] = made }
            return made
        }
    }

    var reapers: [Reaper] {
        sites.withLock { map in
            map.values.compactMap { if case .active(_, _, let r) = $0 { return r } else { return nil } }
        }
    }
}

extension Deleter {
    /// The graveyard for an entry in `parent`, a directory on a filesystem
    /// mounted inside the source; made at that filesystem's root if it has
    /// none. nil when deletes there must be done in the request.
    func nestedGraveyard(under parent: Inode) -> (Graveyard, Reaper)? {
        guard let main = graveyard, let reaper else { return nil }
        let dev = parent.key.dev
        let site = nested.site(dev) {
            let top = table.topmostOnDevice(from: parent)
            let place = "/" + String(decoding: table.path(of: top, appending: nil), as: UTF8.self)
            let opened: Result<Graveyard, GraveyardError>
            do throws(Errno) {
                opened = try namespace.withFD(top) { fd in Result { () throws(GraveyardError) in try Graveyard(rootFD: fd, client: main.client) } }
            } catch {
                opened = .failure(.cannotCreate(error))
            }
            switch opened {
            case .success(let g):
                log.notice("deletes on this nested filesystem go to a graveyard of its own",
                           metadata: ["at": "\(place)", "dev": "\(dev)"])
                return .active(root: top.key, graveyard: g, reaper: startNestedReaper(g, like: reaper))
            case .failure(let why):
                log.notice("deletes on this nested filesystem are done in the request: it cannot have a graveyard",
                           metadata: ["at": "\(place)", "dev": "\(dev)", "why": "\(why)"])
                return .unavailable(root: top.key)
            }
        }
        if case .active(_, let g, let r) = site { return (g, r) }
        return nil
    }

    /// Whether `.vanish` in `parent` (not the source root) is a nested
    /// filesystem's graveyard, to be hidden. The first time a nested root is
    /// asked about, a graveyard an earlier session left there is opened (never
    /// made), so its leftovers are reaped. Only called for that one name.
    func isNestedStateDirectory(in parent: Inode) -> Bool {
        guard let main = graveyard, let reaper, parent.key.dev != table.root.key.dev else { return false }
        let site = nested.site(parent.key.dev) {
            let top = table.topmostOnDevice(from: parent)
            guard top === parent else { return nil }
            let found = try? namespace.withFD(top) { fd in
                Result { () throws(GraveyardError) in try Graveyard(rootFD: fd, client: main.client, create: false) }
            }
            switch found {
            case .success(let g):
                log.notice("resuming the graveyard an earlier session left on this nested filesystem",
                           metadata: ["dev": "\(parent.key.dev)"])
                return .active(root: top.key, graveyard: g, reaper: startNestedReaper(g, like: reaper))
            case .failure(.notOurs), .failure(.untrusted):
                return .unavailable(root: top.key)
            default:
                return nil  // none yet: the first delete there makes it
            }
        }
        if case .active(let root, _, _) = site { return root == parent.key }
        return false
    }

    /// One worker, with the main reaper's pace and its reports.
    private func startNestedReaper(_ g: Graveyard, like main: Reaper) -> Reaper {
        var policy = Reaper.Policy()
        policy.rate = main.policy.rate
        policy.yieldToForeground = main.policy.yieldToForeground
        let r = Reaper(graveyard: g, workers: 1, policy: policy)
        r.hooks.onReaped = main.hooks.onReaped
        r.hooks.onStuck = main.hooks.onStuck
        r.hooks.onHeld = main.hooks.onHeld
        r.hooks.onLinkDropped = main.hooks.onLinkDropped
        r.hooks.foregroundRequests = main.hooks.foregroundRequests
        r.start()
        return r
    }
}

/// The mount points of the daemon's mount namespace, as
/// /proc/self/mountinfo prints them (octal escapes for space, tab, newline
/// and backslash). Read again only after the kernel marks the file changed
/// (POLLPRI on an open fd of it), so asking costs a poll, not a parse.
final class MountTable: Sendable {
    private struct State {
        var fd: Int32 = -1
        var points: [[UInt8]] = []
    }
    private let state = Mutex(State())

    deinit { state.withLock { if $0.fd >= 0 { Sys.close($0.fd) } } }

    /// Whether any mount point starts with `prefix` (escaped as mountinfo escapes).
    func any(startingWith prefix: [UInt8]) -> Bool {
        state.withLock { s in
            if s.fd < 0 || changed(s.fd) { reload(&s) }
            return s.points.contains { $0.starts(with: prefix) }
        }
    }

    private func changed(_ fd: Int32) -> Bool {
        var p = pollfd(fd: fd, events: Int16(POLLPRI), revents: 0)
        return poll(&p, 1, 0) != 0
    }

    private func reload(_ s: inout State) {
        if s.fd >= 0 { Sys.close(s.fd) }
        s.fd = Glibc.open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC)
        s.points = []
        guard s.fd >= 0 else { return }
        var info: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 64 << 10)
        while true {
            let got = chunk.withUnsafeMutableBytes { Glibc.read(s.fd, $0.baseAddress!, $0.count) }
            if got < 0 && errno == EINTR { continue }
            if got <= 0 { break }
            info += chunk[..<got]
        }
        // Each line: id parent major:minor root mountpoint options...
        for line in info.split(separator: 0x0A) {
            let fields = line.split(separator: 0x20, maxSplits: 5)
            if fields.count > 4 { s.points.append(Array(fields[4])) }
        }
        // Reading to the end arms the next change notice. Nothing read (every
        // namespace has a root mount): read again next time.
        if s.points.isEmpty { Sys.close(s.fd); s.fd = -1 }
    }
}
