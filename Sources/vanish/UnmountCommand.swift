import ArgumentParser
import CLinux
import Glibc
import LinuxSyscalls

struct UnmountCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "unmount",
        abstract: "Unmount a Vanish filesystem (also a dead one).",
        discussion: "Runs `fusermount3 -u`; the daemon then finishes and exits 0."
    )

    @Flag(name: [.customShort("z"), .long], help: "Detach now even if the mount is busy; it goes away when no longer used.")
    var lazy = false

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
        var args = ["fusermount3", "-u"]
        if lazy { args.append("-z") }
        args.append(path)
        let status = try spawnAndWait(args)
        guard status != 0 else { return }
        // Busy: say who holds it, and how to detach it anyway.
        if !lazy, MountPaths.mountType(at: path) == "fuse.vanish" {
            let users = Self.processes(using: path)
            let who = users.isEmpty ? "" : ": in use by " + users.prefix(8).joined(separator: ", ")
                + (users.count > 8 ? " and \(users.count - 8) more" : "")
            throw RuntimeError("\(path) is busy\(who); close those, or detach it now with vanish unmount --lazy \(path)")
        }
        throw RuntimeError("fusermount3 -u \(path) failed (exit \(status))")
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
    var status: Int32 = 0
    while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
    return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
}
