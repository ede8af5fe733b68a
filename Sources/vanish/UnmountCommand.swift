import ArgumentParser
import CLinux
import Glibc
import LinuxSyscalls
import VanishClient

struct UnmountCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "unmount",
        abstract: "Unmount a Vanish filesystem (also a dead one).",
        discussion: """
            Runs `fusermount3 -u`, then waits until the daemon has let go of the source, so the \
            source's filesystem can be unmounted next. What the reaper had not freed yet is freed \
            at the next mount or by `vanish reap`; with --reap it is freed first.
            """
    )

    @Flag(name: [.customShort("z"), .long], help: "Detach now even if the mount is busy; it goes away when no longer used.")
    var lazy = false

    @Flag(help: "Wait for the reaper to free what is left before the daemon exits.")
    var reap = false

    @OptionGroup var target: MountpointArgument
    var mountpoint: String { target.mountpoint }

    /// realpath fails on a dead mount; the path as given stands in for it.
    var path: String { (try? MountPaths.resolve(mountpoint, what: "mountpoint")) ?? mountpoint }

    func validate() throws {
        guard let type = MountPaths.mountType(at: path) else {
            throw ValidationError("\(mountpoint) is not a mountpoint")
        }
        guard type == "fuse.vanish" else {
            throw ValidationError("\(mountpoint) is a \(type) mount, not Vanish; use umount or fusermount3 for it")
        }
    }

    func run() throws {
        let path = self.path
        // The daemon, held by a pidfd from before the unmount: never a later process with its pid.
        let daemon = Self.daemonPID(path).map(vanish_pidfd_open) ?? -1
        defer { if daemon >= 0 { close(daemon) } }
        var args = ["fusermount3", "-u"]
        if lazy { args.append("-z") }
        args.append(path)
        // fusermount3's own complaint is said only where Vanish has none clearer.
        var complaint = ""
        let status = try spawnAndWait(args, stderr: &complaint)
        if status == 0 {
            // A lazy detach lets go only once the mount is no longer used: nothing to wait for now.
            if daemon >= 0 && !lazy { Self.waitForExit(daemon, stopReaping: !reap) }
            return
        }
        // Busy: say who holds it, and how to detach it anyway.
        if !lazy, MountPaths.mountType(at: path) == "fuse.vanish" {
            let users = Self.processes(using: path)
            let who = users.isEmpty ? "" : ": in use by " + users.prefix(8).joined(separator: ", ")
                + (users.count > 8 ? " and \(users.count - 8) more" : "")
            throw RuntimeError("\(path) is busy\(who); close those, or detach it now with vanish unmount --lazy \(path)")
        }
        FileHandleStderr.write(complaint)
        throw RuntimeError("fusermount3 -u \(path) failed (exit \(status))")
    }

    /// The daemon's pid, from the mount's status attribute; nil for a dead mount.
    /// The daemon serving the mount at `mountpoint`, found without a request
    /// to the mount (one to a daemon that does not answer, stopped or held
    /// up below it, would hold the unmount up and keep the mount busy): the
    /// vanish process holding /dev/fuse open and the source's directory,
    /// which mountinfo names. nil if there is none (a dead mount) or it is
    /// another user's process this one may not look into.
    static func daemonPID(_ mountpoint: String) -> pid_t? {
        guard let source = MountPaths.mounts().last(where: { $0.point == mountpoint && $0.type == "fuse.vanish" })?.source,
              let proc = opendir("/proc") else { return nil }
        defer { closedir(proc) }
        while let d = readdir(proc) {
            guard let pid = pid_t(String(cString: vanish_dirent_name(d)!)), pid != getpid(),
                  Sys.readLink("/proc/\(pid)/exe")?.hasSuffix("/vanish") == true,
                  let fds = opendir("/proc/\(pid)/fd") else { continue }
            var (fuse, holdsSource) = (false, false)
            while let f = readdir(fds), !(fuse && holdsSource) {
                let name = String(cString: vanish_dirent_name(f)!)
                guard name.first?.isNumber == true, let target = Sys.readLink("/proc/\(pid)/fd/\(name)") else { continue }
                if target == "/dev/fuse" { fuse = true } else if target == source { holdsSource = true }
            }
            closedir(fds)
            if fuse && holdsSource { return pid }
        }
        return nil
    }

    /// Waits until the process `pidfd` exits (it has closed everything in the
    /// source then). `stopReaping`: it is asked first (SIGTERM) to leave
    /// what its reaper has not freed for the next mount.
    static func waitForExit(_ pidfd: Int32, stopReaping: Bool) {
        if stopReaping { _ = vanish_pidfd_send_signal(pidfd, SIGTERM) }
        // A stopped daemon (SIGSTOP, a debugger let go) would hold the source for ever.
        _ = vanish_pidfd_send_signal(pidfd, SIGCONT)
        var p = pollfd(fd: pidfd, events: Int16(POLLIN), revents: 0)
        var told = false
        while true {
            let r = poll(&p, 1, told ? -1 : 2000)
            if r > 0 || (r < 0 && errno != EINTR) { return }
            if r == 0 {
                FileHandleStderr.write("vanish unmount: waiting for the daemon to let go of the source\n")
                told = true
            }
        }
    }

    /// "comm[pid]" of each process (this user's; all for root) whose working
    /// directory, root, or an open file is at or below `mountpoint`.
    static func processes(using mountpoint: String) -> [String] {
        func inside(_ link: String) -> Bool {
            guard let target = Sys.readLink(link) else { return false }
            return target == mountpoint || MountPaths.isBelow(target, mountpoint)
        }
        var found: [String] = []
        guard let proc = opendir("/proc") else { return [] }
        defer { closedir(proc) }
        while let d = readdir(proc) {
            guard let pid = pid_t(String(cString: vanish_dirent_name(d)!)), pid != getpid() else { continue }
            // A daemon of an in-place mount holds its source, at the same path, beneath the mount.
            if Sys.readLink("/proc/\(pid)/exe")?.hasSuffix("/vanish") == true { continue }
            var uses = inside("/proc/\(pid)/cwd") || inside("/proc/\(pid)/root")
            if !uses, let fds = opendir("/proc/\(pid)/fd") {
                while let f = readdir(fds) {
                    let name = String(cString: vanish_dirent_name(f)!)
                    if name.first?.isNumber == true && inside("/proc/\(pid)/fd/\(name)") { uses = true; break }
                }
                closedir(fds)
            }
            guard uses else { continue }
            let comm = Sys.fileBytes("/proc/\(pid)/comm").map { String(decoding: $0, as: UTF8.self) }?.trimmingSuffix("\n") ?? "?"
            found.append(TerminalText.escaped("\(comm)[\(pid)]"))
        }
        return found
    }
}

private extension String {
    func trimmingSuffix(_ suffix: String) -> String { hasSuffix(suffix) ? String(dropLast(suffix.count)) : self }
}

/// Runs a program from PATH and returns its exit status.
func spawnAndWait(_ args: [String]) throws -> Int32 {
    var pid: pid_t = 0
    let argv = args.map { strdup($0) } + [nil]
    defer { argv.forEach { free($0) } }
    let rc = posix_spawnp(&pid, args[0], nil, nil, argv, environ)
    guard rc == 0 else { throw RuntimeError("cannot run \(args[0]): \(String(cString: strerror(rc)))") }
    return waitForExitStatus(pid)
}

/// Runs a program from PATH with its stderr kept in `stderr`; its exit status.
func spawnAndWait(_ args: [String], stderr: inout String) throws -> Int32 {
    var fds: [Int32] = [-1, -1]
    guard pipe(&fds) == 0 else { return try spawnAndWait(args) }
    _ = fcntl(fds[0], F_SETFD, FD_CLOEXEC)
    _ = fcntl(fds[1], F_SETFD, FD_CLOEXEC)
    var actions = posix_spawn_file_actions_t()
    posix_spawn_file_actions_init(&actions)
    defer { posix_spawn_file_actions_destroy(&actions) }
    posix_spawn_file_actions_adddup2(&actions, fds[1], 2)
    var pid: pid_t = 0
    let argv = args.map { strdup($0) } + [nil]
    defer { argv.forEach { free($0) } }
    let rc = posix_spawnp(&pid, args[0], &actions, nil, argv, environ)
    close(fds[1])
    defer { close(fds[0]) }
    guard rc == 0 else { throw RuntimeError("cannot run \(args[0]): \(String(cString: strerror(rc)))") }
    // Read to the end before waiting: a long complaint must not block the child.
    var bytes: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 4096)
    while true {
        let n = read(fds[0], &buffer, buffer.count)
        if n > 0 { bytes += buffer[..<n]; continue }
        if n < 0 && errno == EINTR { continue }
        break
    }
    stderr = String(decoding: bytes, as: UTF8.self)
    return waitForExitStatus(pid)
}

private func waitForExitStatus(_ pid: pid_t) -> Int32 {
    var status: Int32 = 0
    while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
    return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
}
