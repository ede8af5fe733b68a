import ArgumentParser
import CLinux
import Glibc
import LinuxSyscalls
import Logging
import VanishClient
import VanishControl
import VanishGraveyard

/// Facts about paths and mounts the mount and unmount commands check first.
enum MountPaths {
    /// Takes the one lock a source has: one mount or `vanish reap` per
    /// source at a time, since two would share its graveyard and the second
    /// would delete the first's event journal. The lock is a flock on a file
    /// named after the source's device and inode in the daemon user's own
    /// lock directory (`lockPath`), which no other user can open: a flock on
    /// the source itself could be taken by anyone who can read it, and held
    /// to keep root's mount out. Returns the fd that holds it (closing it
    /// lets go; so does exiting), or -1 for a source that cannot be opened
    /// for reading (not locked).
    ///
    /// A daemon lets go a moment after its unmount returns (it first joins
    /// its workers): while no Vanish mount of the source is left, the lock
    /// is waited for, up to `patience` seconds, saying so once a wait passes
    /// a second (a mount is otherwise silent when it succeeds). An unmounted
    /// daemon may also go on reaping its graveyard for minutes: with
    /// `takeOver` (a new mount) it is asked to stop (SIGTERM, which leaves
    /// the rest of the graveyard where it is), and the new mount's reaper
    /// carries on, instead of two reapers slowing each other down.
    @discardableResult
    static func lockSource(_ source: String, patience: Double = 5, takeOver: Bool = false,
                           log: Logger? = nil) throws -> Int32 {
        let sourceFD = open(source, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard sourceFD >= 0 else { return -1 }
        var st = stat()
        let known = fstat(sourceFD, &st) == 0
        close(sourceFD)
        guard known, let path = lockPath(device: st.st_dev, inode: st.st_ino) else {
            throw RuntimeError("cannot make the lock for \(source) in \(lockDirectory()): \(String(cString: strerror(errno)))")
        }
        let fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw RuntimeError("cannot open the lock \(path) for \(source): \(String(cString: strerror(errno)))") }
        var said = false
        var asked = false
        let start = monotonicSeconds()
        let deadline = start + patience
        while flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK {
            if let m = vanishMount(of: source) {
                close(fd)
                // A second mount's daemon would keep a graveyard and events of its own over the same tree.
                let elsewhere = takeOver ? ", or show that mount in a second place too (mount --bind \(m) DIR)" : ""
                throw RuntimeError("\(source) is already mounted by Vanish at \(m): unmount it first (vanish unmount \(m))\(elsewhere)")
            }
            if monotonicSeconds() >= deadline {
                close(fd)
                throw RuntimeError("""
                    \(source) is in use by another vanish process (vanish reap, or a daemon that is \
                    still finishing): try again once it is done
                    """)
            }
            if takeOver && !asked {
                asked = true
                if let pid = leavingDaemon(holding: fd) {
                    // The usual course of a remount: logged, not put on the terminal.
                    log?.notice("the daemon that served the source is still reaping its graveyard: asked it to stop; this mount's reaper carries on from there",
                                metadata: ["source": "\(source)", "pid": "\(pid)"])
                    kill(pid, SIGTERM)
                }
            }
            // A mount is silent when it succeeds; only a wait one would notice is explained.
            if !said && monotonicSeconds() - start >= 1 {
                FileHandleStderr.write("vanish: waiting for the vanish process leaving \(source) to let go of it\n")
                said = true
            }
            usleep(5_000)
        }
        // A daemon that forks into the background keeps the fd, and the lock.
        return fd
    }

    /// Where this user's source locks are: `locks/` in the control socket
    /// directory (/run/vanish for root), private to the user.
    static func lockDirectory() -> String { ControlServer.socketDirectory() + "/locks" }

    /// The lock file of the source with this device and inode, its
    /// directory made if needed; nil if the directory is not this user's
    /// alone (someone planted it).
    static func lockPath(device: dev_t, inode: ino_t) -> String? {
        let dir = lockDirectory()
        mkdir(dir, 0o700)
        var st = stat()
        guard lstat(dir, &st) == 0, st.st_mode & S_IFMT == S_IFDIR, st.st_uid == geteuid(), st.st_mode & 0o077 == 0 else {
            errno = EPERM
            return nil
        }
        return dir + "/\(device)-\(inode)"
    }

    /// The unmounted `vanish mount` daemon holding the source lock on the
    /// lock file `fd` is open on, if one is: a process of this user (any,
    /// for root) running a binary named vanish as `vanish mount`, whose
    /// /proc fdinfo shows the flock on that very inode. Nothing else is ever
    /// signalled: not `vanish reap`, not a process another user started.
    static func leavingDaemon(holding fd: Int32) -> pid_t? {
        var st = stat()
        guard fstat(fd, &st) == 0 else { return nil }
        let inode = ":\(st.st_ino) "
        // /proc shows the device as major:minor in hex, at least two digits each.
        func hex(_ v: UInt32) -> String { let s = String(v, radix: 16); return s.count < 2 ? "0" + s : s }
        let device = hex(vanish_major(st.st_dev)) + ":" + hex(vanish_minor(st.st_dev))
        guard let proc = opendir("/proc") else { return nil }
        defer { closedir(proc) }
        while let d = readdir(proc) {
            guard let pid = pid_t(String(cString: vanish_dirent_name(d)!)), pid != getpid() else { continue }
            var owner = stat()
            guard stat("/proc/\(pid)", &owner) == 0, getuid() == 0 || owner.st_uid == getuid() else { continue }
            // Any copy of the program (vanish, a build renamed for a trial): only this user's
            // processes can hold their private lock file at all.
            guard let exe = Sys.readLink("/proc/\(pid)/exe"), exe.split(separator: "/").last?.contains("vanish") == true,
                  let argv = Sys.fileBytes("/proc/\(pid)/cmdline")?.split(separator: 0),
                  argv.count > 1, argv[1].elementsEqual("mount".utf8) else { continue }
            guard let fds = opendir("/proc/\(pid)/fdinfo") else { continue }
            defer { closedir(fds) }
            while let f = readdir(fds) {
                let name = String(cString: vanish_dirent_name(f)!)
                guard name.first?.isNumber == true,
                      let info = Sys.fileBytes("/proc/\(pid)/fdinfo/\(name)").map({ String(decoding: $0, as: UTF8.self) }) else { continue }
                for line in info.split(separator: "\n") where line.hasPrefix("lock:") && line.contains("FLOCK")
                    && line.contains(" \(device)\(inode)") {
                    return pid
                }
            }
        }
        return nil
    }

    private static func monotonicSeconds() -> Double { Duration.nanoseconds(Condition.now()).inSeconds }

    /// Where an in-place mount's state may live outside the source, in order
    /// (see StateLocation): for root /var/lib/vanish/in-place, then the top of
    /// the source's own filesystem; for other users their state directory
    /// ($XDG_STATE_HOME, or ~/.local/state). Never inside the source.
    static func stateBases(for source: String) -> [String] {
        var bases = StateLocation.localBase.map { [$0 + "/in-place"] } ?? []
        if geteuid() == 0, let top = mount(containing: source)?.point {
            bases.append((top == "/" ? "" : top) + "/.vanish-in-place")
        }
        return bases.filter { !isBelow($0, source) }
    }

    /// Whether `path` is strictly below the directory `dir` (both absolute, resolved).
    static func isBelow(_ path: String, _ dir: String) -> Bool {
        path.hasPrefix(dir == "/" ? "/" : dir + "/") && path != dir
    }

    /// Whether `path` is a directory on a local disk filesystem (ext4, XFS, btrfs, tmpfs).
    static func isLocalDisk(_ path: String) -> Bool {
        let fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        return FilesystemKind.isLocalDisk(fd)
    }

    /// The mountpoint of a Vanish mount serving `source` (its device field), if any.
    static func vanishMount(of source: String) -> String? {
        mounts().last { $0.type == "fuse.vanish" && $0.source == source }?.point
    }

    /// realpath(3), or a validation error naming the path.
    static func resolve(_ path: String, what: String) throws -> String {
        guard let r = RawArguments.withCString(path, { realpath($0, nil) }) else {
            throw pathError(RawArguments.display(path), what: what, errno: errno)
        }
        defer { free(r) }
        return RawArguments.string(UnsafeBufferPointer(start: UnsafeRawPointer(r).assumingMemoryBound(to: UInt8.self), count: strlen(r)))
    }

    /// Checks `path` is a usable directory; a dead FUSE mount gets its own explanation.
    static func requireDirectory(_ path: String, what: String) throws {
        var st = stat()
        guard RawArguments.withCString(path, { stat($0, &st) }) == 0 else { throw pathError(path, what: what, errno: errno) }
        guard st.st_mode & S_IFMT == S_IFDIR else { throw ValidationError("\(what) \(path) is not a directory") }
    }

    /// A path that does not name what it must is a bad argument (64, with
    /// the usage); a dead mount is the machine's state, not the arguments' (1).
    static func pathError(_ path: String, what: String, errno e: Int32) -> any Error {
        if e == ENOTCONN {
            return DeadMount(message: """
                \(what) \(path) is a dead FUSE mount (Transport endpoint is not connected): \
                its daemon is gone. Clear it with `vanish unmount \(path)` (or `fusermount3 -u \(path)`) \
                and mount again.
                """)
        }
        return ValidationError("\(what) \(path): \(String(cString: strerror(e)))")
    }

    /// A mountpoint whose daemon is gone: said as is, exit status 1.
    struct DeadMount: Error, CustomStringConvertible {
        let message: String
        var description: String { message }
    }

    /// Every mount this process sees, in mount order: (mountpoint, fstype,
    /// device as major:minor, source as mountinfo names it).
    static func mounts() -> [(point: String, type: String, device: String, source: String)] {
        guard let f = fopen("/proc/self/mountinfo", "r") else { return [] }
        defer { fclose(f) }
        var out: [(String, String, String, String)] = []
        var line: UnsafeMutablePointer<CChar>?
        var cap = 0
        while getline(&line, &cap, f) > 0 {
            let fields = String(cString: line!).split(separator: " ")
            // id parent major:minor root mountpoint opts [optional...] - fstype source superopts
            guard fields.count > 7, let dash = fields.firstIndex(of: "-"), dash + 2 < fields.count else { continue }
            out.append((unescape(String(fields[4])), String(fields[dash + 1]), String(fields[2]),
                        unescape(String(fields[dash + 2]))))
        }
        free(line)
        return out
    }

    /// The filesystem type mounted exactly at `path` (the last one wins: mounts stack).
    static func mountType(at path: String) -> String? {
        mounts().last { $0.point == path }?.type
    }

    /// The innermost mount that holds `path` (the longest mountpoint that is a prefix of it).
    static func mount(containing path: String) -> (point: String, type: String, device: String, source: String)? {
        var best: (point: String, type: String, device: String, source: String)?
        for m in mounts() {
            let inside = path == m.point || m.point == "/" || path.hasPrefix(m.point + "/")
            if inside && m.point.count >= (best?.point.count ?? -1) { best = m }
        }
        return best
    }

    static func mountType(containing path: String) -> String? { mount(containing: path)?.type }

    /// This process's working directory, as the kernel names it; nil if it has none.
    static func workingDirectory() -> String? {
        guard let cwd = getcwd(nil, 0) else { return nil }
        defer { free(cwd) }
        return String(cString: cwd)
    }

    /// `path` made absolute and cleaned of `.`, `..` and double slashes
    /// without touching the filesystem (it may name something deleted).
    static func lexicallyAbsolute(_ path: String) -> String {
        var parts: [Substring] = []
        let full: String
        if path.hasPrefix("/") {
            full = path
        } else {
            let cwd = getcwd(nil, 0)
            defer { free(cwd) }
            full = (cwd.map { String(cString: $0) } ?? "/") + "/" + path
        }
        for p in full.split(separator: "/") {
            if p == "." { continue }
            if p == ".." { _ = parts.popLast(); continue }
            parts.append(p)
        }
        return "/" + parts.joined(separator: "/")
    }

    /// mountinfo writes space, tab, newline and backslash as \ooo.
    static func unescape(_ s: String) -> String {
        guard s.contains("\\") else { return s }
        var bytes: [UInt8] = []
        var u = Array(s.utf8)[...]
        while let c = u.first {
            if c == UInt8(ascii: "\\"), u.count >= 4, let v = UInt8(String(decoding: u.dropFirst().prefix(3), as: UTF8.self), radix: 8) {
                bytes.append(v); u = u.dropFirst(4)
            } else {
                bytes.append(c); u = u.dropFirst()
            }
        }
        return String(decoding: bytes, as: UTF8.self)
    }
}

/// The mountpoint argument the commands that talk to a mount share.
struct MountpointArgument: ParsableArguments {
    @Argument(help: "The mountpoint.")
    var mountpoint: String

    /// For the commands that talk to a live mount (status, events, trash):
    /// a path that is no Vanish mount's root is a bad argument, exit 64 with
    /// the subcommand's usage, the same for every one. A mount whose daemon
    /// is gone (ENOTCONN) is an operation that failed (exit 1), with the fix.
    func requireVanishRoot() throws {
        var byte: UInt8 = 0
        guard getxattr(mountpoint, ControlProtocol.statusAttribute, &byte, 0) < 0 else { return }
        switch errno {
        case ENOTCONN:
            throw RuntimeError("""
                the daemon of the Vanish mount at \(mountpoint) is gone (Transport endpoint is not connected): \
                clear the dead mount with `vanish unmount \(mountpoint)` and mount it again
                """)
        case ENODATA, ENOTSUP, EOPNOTSUPP:
            throw ValidationError("\(mountpoint) is not the root of a Vanish mount")
        case ENOENT, ENOTDIR, EACCES:
            throw ValidationError("\(mountpoint): \(String(cString: strerror(errno)))")
        default:
            return
        }
    }
}
