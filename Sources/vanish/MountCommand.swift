import ArgumentParser
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import VanishControl
import VanishFS

struct MountCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "mount",
        abstract: "Mount SOURCE on MOUNTPOINT, or a directory over itself.",
        discussion: """
            With one path the directory is mounted in place: Vanish opens it first, then \
            mounts on top, so existing paths keep working and every access goes through Vanish.

            -o takes libfuse/kernel options (allow_other, default_permissions, ro, fsname=, ...) \
            and Vanish's own: \(MountOptionList.usage). \
            allow_other always turns default_permissions on, so other users get only what \
            the file modes grant them.

            A source several machines share (a network volume) may be mounted by each of them: \
            every mount keeps its state in SOURCE/.vanish/clients/ID/, renews a lease there, \
            and adopts the graveyard of a client silent for a whole lease (default 60s).

            Unmount with `fusermount3 -u MOUNTPOINT`, `vanish unmount MOUNTPOINT`, SIGINT or SIGTERM.
            """
    )

    @Flag(name: .shortAndLong, help: "Stay in the foreground and log to stderr.")
    var foreground = false

    @Flag(name: .shortAndLong, help: "Print every FUSE request (implies --foreground).")
    var debug = false

    @Option(name: .short, help: ArgumentHelp("Mount options, comma-separated; may repeat.", valueName: "opt[,opt...]"))
    var options: [String] = []

    @Option(help: "How the kernel caches entries, attributes and data.")
    var cache: CacheMode?

    @Option(help: "Most worker threads serving requests.")
    var threads: Int?

    @Flag(help: "Give each worker thread its own /dev/fuse fd.")
    var cloneFD = false

    @Flag(help: "Serve requests on one thread (for debugging).")
    var singleThreaded = false

    // Parsed unconditionally, so that `--keep -5m` gets the duration's own
    // message rather than the parser's "missing value".
    @Option(parsing: .unconditional, help: ArgumentHelp("""
        How long deleted entries stay restorable (vanish trash, vanish restore) before the reaper \
        frees them: 0 (default, free at once), or e.g. 90s, 30m, 12h, 7d.
        """, valueName: "duration"))
    var keep: String?

    @Option(help: ArgumentHelp("""
        Most bytes restorable entries may hold; beyond it the largest users' oldest are freed early. \
        They also go early whenever the source filesystem has less than keep_min_free (default 10%) free.
        """, valueName: "size"))
    var keepMaxBytes: String?

    @Option(help: ArgumentHelp("Never keep a deleted file whose name matches this pattern (shell wildcards; repeatable).",
                               valueName: "pattern"))
    var keepExclude: [String] = []

    @Option(help: "Write the log here when running in the background (default: syslog; without a syslog socket, /var/log/vanish.log for root, ~/.local/state/vanish/vanish.log for others).")
    var logFile: String?

    @Argument(help: "The directory whose contents the mount shows.")
    var source: String

    @Argument(help: "Where to mount it (default: over SOURCE itself).")
    var mountpoint: String?

    func validate() throws {
        if let threads, !(1...256).contains(threads) {
            throw ValidationError("--threads takes a number from 1 to 256")
        }
        if let keep, Quantity.duration(keep) == nil {
            throw ValidationError("--keep takes a duration with a unit: 0, or e.g. 90s, 30m, 12h, 7d (not \(keep))")
        }
        if let keepMaxBytes, Quantity.bytes(keepMaxBytes) == nil {
            throw ValidationError("--keep-max-bytes takes a size such as 500M, 20G or 1T")
        }
        // Before anything is mounted: a log that cannot be written would leave a daemon saying nothing.
        if let logFile {
            let fd = open(logFile, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0o640)
            guard fd >= 0 else {
                throw ValidationError("--log-file \(logFile): \(String(cString: strerror(errno)))")
            }
            close(fd)
        }
        // libfuse's options: an unknown one is bad input (64), found before the source is touched.
        let parsed = try MountOptionList(options)
        if Session.rejectedOptions(parsed.fuseOptions(source: "/")) != nil {
            // Named one by one: the list libfuse saw holds options the user never typed.
            let unknown = parsed.fuse.filter { Session.rejectedOptions([$0]) != nil }
            throw ValidationError("unknown mount option(s): \(unknown.joined(separator: ",")) (see vanish mount --help)")
        }
    }

    func run() throws {
        // First, before any thread exists, so every thread inherits the block.
        StopSignals.block()
        // A caller's umask is applied only while making that caller's file
        // (`withCallersUmask`); the daemon's own (022) would strip group and
        // other bits from modes the kernel or a default ACL already decided.
        // What the daemon makes for itself carries explicit modes.
        umask(0)
        // A fixed mmap threshold, so a burst's memory comes back (docs/decisions.md).
        Heap.setMapThreshold(1 << 20)
        var parsed = try MountOptionList(options)
        if let cache { parsed.filesystem.cache = cache }
        if let keep { parsed.filesystem.deleting.reaping.keep = Quantity.duration(keep)! }
        if let keepMaxBytes { parsed.filesystem.deleting.reaping.keepMaxBytes = Quantity.bytes(keepMaxBytes)! }
        parsed.filesystem.deleting.reaping.keepExclude += keepExclude
        // A read-only mount deletes nothing and must not write .vanish into the source.
        if parsed.fuse.contains("ro") { parsed.filesystem.deleting.graveyard = false }
        parsed.filesystem.posixACLs = parsed.allowsOthers || parsed.fuse.contains("default_permissions")
        let src = try MountPaths.resolve(source, what: "source")
        let mnt = try MountPaths.resolve(mountpoint ?? source, what: "mountpoint")
        try MountPaths.requireDirectory(src, what: "source")
        try MountPaths.requireDirectory(mnt, what: "mountpoint")
        // Vanish over Vanish: a second graveyard and journal inside the first
        // mount, or a second in-place mount stacked on the first.
        if let m = MountPaths.mount(containing: src), m.type == "fuse.vanish" {
            if m.point == src && m.source == src {
                throw ValidationError("\(src) is already mounted in place by Vanish: unmount it first (vanish unmount \(src))")
            }
            throw ValidationError("""
                source \(src) is inside the Vanish mount at \(m.point) (of \(m.source)): mount \(m.source) \
                itself, or unmount \(m.point) first
                """)
        }
        if MountPaths.mountType(at: mnt) == "fuse.vanish" {
            throw ValidationError("mountpoint \(mnt) already has a Vanish mount: unmount it first (vanish unmount \(mnt))")
        }
        if MountPaths.isBelow(mnt, src) {
            throw ValidationError("""
                mountpoint \(mnt) is inside source \(src): the mount would contain itself. \
                Mount in place (vanish mount \(src)) or choose a mountpoint outside the source.
                """)
        }

        // An in-place mount keeps its state outside the directory people work in (see StateLocation);
        // a network source keeps it in the tree, where every client of it looks.
        parsed.filesystem.deleting.stateBases = MountPaths.stateBases(for: src)
        parsed.filesystem.deleting.stateOutside = mnt == src && MountPaths.isLocalDisk(src)
        // The atime options' private copy of the source's mount holds no mount inside it.
        parsed.filesystem.atimeCopyAllowed = !MountPaths.mounts().contains { MountPaths.isBelow($0.point, src) }
        let foreground = self.foreground || debug
        FileLimits.raise()
        let logDestination = bootstrapLogging(foreground: foreground, logFile: logFile)
        let log = Logger(label: "vanish")

        var config = Daemon.Configuration(source: src, mountpoint: mnt, filesystem: parsed.filesystem,
                                          fuseOptions: parsed.fuseOptions(source: src))
        config.events = parsed.events
        config.journalLimits = parsed.journalLimits
        config.sharedControlSocket = parsed.allowsOthers
        config.foreground = foreground
        config.logDestination = logDestination
        config.debug = debug
        config.loop = LoopConfig(maxThreads: threads ?? parsed.threads ?? 10, cloneFD: cloneFD || parsed.cloneFD)
        if let spin = parsed.spinMicroseconds { config.loop.spinMicroseconds = spin }
        // A short slice wins the CPU at wake-up beside busy loops in the
        // daemon's scheduling group, without a larger share (docs/decisions.md).
        let slice = parsed.sliceMicroseconds ?? 100
        if slice > 0 { config.loop.sliceMicroseconds = slice }
        config.loop.ring = parsed.ring
        if parsed.ring == .on && RequestChannel.kernelSwitchOn == false {
            // The switch only lets the kernel offer io_uring: mounts that do not ask are unaffected.
            let e = RequestChannel.turnKernelSwitchOn()
            guard e == 0 else {
                throw RuntimeError("-o io_uring=on: cannot turn on \(RequestChannel.kernelSwitch): \(String(cString: strerror(e)))"
                                   + (getuid() != 0 ? " (only root can; or use io_uring=auto)" : ""))
            }
            log.notice("turned on the kernel's FUSE over io_uring", metadata: ["switch": "\(RequestChannel.kernelSwitch)"])
        }
        config.singleThreaded = singleThreaded
        config.sourceLock = try MountPaths.lockSource(src, patience: 30, takeOver: true, log: log)
        if mnt == src, let cwd = MountPaths.workingDirectory(), cwd == src || MountPaths.isBelow(cwd, src) {
            // A process keeps the directory it was in: this shell would go on
            // deleting underneath the mount, past Vanish, until it changes directory.
            FileHandleStderr.write("vanish: this shell is still in \(src) underneath the mount: run `cd .` to work through it\n")
        }
        let (readahead, explicit) = (parsed.filesystem.readaheadKB, parsed.readaheadGiven)
        config.afterMount = { Readahead.apply(kb: readahead, at: $0, explicit: explicit, log: log) }
        do {
            // A failed loop exits 1; a stop signal is a requested, clean stop.
            if try !Daemon(config, log: log).run() { throw ExitCode.failure }
        } catch let failure as Daemon.Failure {
            throw RuntimeError(failure.description)
        }
    }
}

extension CacheMode: ExpressibleByArgument {}

/// A failure worth one line on stderr and exit status 1.
struct RuntimeError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}
