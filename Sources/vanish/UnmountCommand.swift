import ArgumentParser
import Glibc

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
        if status != 0 { throw RuntimeError("fusermount3 -u \(path) failed (exit \(status))") }
    }
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
