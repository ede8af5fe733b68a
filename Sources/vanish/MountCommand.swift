import ArgumentParser
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import VanishControl
import VanishEvents
import VanishFS

struct MountCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "mount",
        abstract: "Mount SOURCE on MOUNTPOINT, or a directory over itself.",
        discussion: """
            With one path the directory is mounted in place: Vanish opens it first, then \
            mounts on top, so existing paths keep working and every access goes through Vanish.

            -o takes libfuse/kernel options (allow_other, default_permissions, ro, fsname=, ...) \
            and Vanish's own: cache=auto|always|never, threads=N, clone_fd, writeback, fd_cache=N, reapers=N, sync_unlink, readdirplus=always|auto|never, \
            keep=DURATION, keep_max_bytes=SIZE, keep_min_free=PERCENT, reap_rate=FILES_PER_SECOND, reap_yield=DURATION, \
            passthrough=auto|off. \
            allow_other always turns default_permissions on, so other users get only what \
            the file modes grant them.

            Unmount with `fusermount3 -u MOUNTPOINT`, `vanish unmount MOUNTPOINT`, SIGINT or SIGTERM.
            """
    )

    @Flag(name: .shortAndLong, help: "Stay in the foreground and log to stderr.")
    var foreground = false

    @Flag(name: .shortAndLong, help: "Print every FUSE request (implies --foreground).")
    var debug = false

    @Option(name: .short, help: ArgumentHelp("Mount options, comma-separated; may repeat.", valueName: "opt[,opt...]"))
    var options: [String] = []

    @Option(help: "How the kernel caches entries, attributes and data: auto, always or never.")
    var cache: String?

    @Option(help: "Most worker threads serving requests.")
    var threads: Int?

    @Flag(help: "Give each worker thread its own /dev/fuse fd.")
    var cloneFD = false

    @Flag(help: "Serve requests on one thread (for debugging).")
    var singleThreaded = false

    @Option(help: ArgumentHelp("""
        How long deleted entries stay restorable (vanish trash, vanish restore) before the reaper \
        frees them: 0 (default, free at once), or e.g. 90s, 30m, 12h, 7d.
        """, valueName: "duration"))
    var keep: String?

    @Option(help: ArgumentHelp("""
        Most bytes restorable entries may hold; beyond it the oldest are freed early. The oldest \
        also go early whenever the source filesystem has less than keep_min_free (default 10%) free.
        """, valueName: "size"))
    var keepMaxBytes: String?

    @Option(help: "Write the log here when running in the background (default: syslog).")
    var logFile: String?

    @Argument(help: "The directory whose contents the mount shows.")
    var source: String

    @Argument(help: "Where to mount it (default: over SOURCE itself).")
    var mountpoint: String?

    func validate() throws {
        if let cache, CacheMode(rawValue: cache) == nil {
            throw ValidationError("--cache takes one of: auto, always, never")
        }
        if let threads, !(1...256).contains(threads) {
            throw ValidationError("--threads takes a number from 1 to 256")
        }
        if let keep, Quantity.duration(keep) == nil {
            throw ValidationError("--keep takes a duration such as 0, 90s, 30m, 12h or 7d")
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
        if let why = Session.rejectedOptions(parsed.fuseOptions(source: "/")) {
            throw ValidationError("libfuse does not know the option(s) in: \(why) (see vanish mount --help)")
        }
    }

    func run() throws {
        // First, before any thread exists, so every thread inherits the block.
        StopSignals.block()
        // The kernel already applied the caller's umask to every mode it sends;
        // the daemon's own (022) would strip group and other bits a second time.
        // What the daemon makes for itself carries explicit modes.
        umask(0)
        // A fixed 1 MiB: measured no slower on create, metadata, tar, git
        // and sequential I/O (interleaved A/B), and a burst's memory comes back.
        Heap.setMapThreshold(1 << 20)
        var parsed = try MountOptionList(options)
        if let cache { parsed.filesystem.cache = CacheMode(rawValue: cache)! }
        if let keep { parsed.filesystem.reaping.keep = Quantity.duration(keep)! }
        if let keepMaxBytes { parsed.filesystem.reaping.keepMaxBytes = Quantity.bytes(keepMaxBytes)! }
        // A read-only mount deletes nothing and must not write .vanish into the source.
        if parsed.fuse.contains("ro") { parsed.filesystem.graveyard = false }
        parsed.filesystem.posixACLs = parsed.allowsOthers || parsed.fuse.contains("default_permissions")
        let src = try MountPaths.resolve(source, what: "source")
        let mnt = try MountPaths.resolve(mountpoint ?? source, what: "mountpoint")
        try MountPaths.requireDirectory(src, what: "source")
        try MountPaths.requireDirectory(mnt, what: "mountpoint")
        if mnt != src && mnt.hasPrefix(src == "/" ? "/" : src + "/") {
            throw ValidationError("""
                mountpoint \(mnt) is inside source \(src): the mount would contain itself. \
                Mount in place (vanish mount \(src)) or choose a mountpoint outside the source.
                """)
        }

        let foreground = self.foreground || debug
        FileLimits.raise()
        bootstrapLogging(foreground: foreground, logFile: logFile)
        let log = Logger(label: "vanish")

        let sourceLock = try MountPaths.lockSource(src)
        // Opened before mounting, so an in-place mount still reaches what it covers.
        let fs: PassthroughFilesystem
        do {
            fs = try PassthroughFilesystem(source: src, options: parsed.filesystem, logger: log)
        } catch {
            throw RuntimeError("cannot open source \(src): \(error)")
        }
        let instance = MountCommand.newInstanceID()
        var journal: Journal?
        if parsed.events, let eventsFD = fs.openEventsDirectory() {
            defer { close(eventsFD) }
            do {
                var limits = parsed.journalLimits
                limits.minFreePercent = parsed.filesystem.reaping.keepMinFreePercent
                journal = try Journal(eventsFD: eventsFD, instance: instance, limits: limits)
                fs.attach(journal: journal!)
            } catch {
                log.error("no event journal: \(error)")
            }
        }
        let control: ControlServer?
        do {
            let directory = ControlServer.socketDirectory()
            let stale = ControlServer.removeStaleSockets(in: directory)
            if stale > 0 { log.info("removed control sockets of daemons that are gone", metadata: ["count": "\(stale)"]) }
            let path = directory + "/\(instance).sock"
            control = try ControlServer(path: path, shared: parsed.allowsOthers, filesystem: fs, logger: log)
            fs.controlSocket = path
        } catch {
            // The mount works without it; only trash, restore and events need it.
            log.error("no control socket: \(error)")
            control = nil
        }
        defer { control?.stop() }
        let session: Session
        do {
            session = try Session(filesystem: fs, options: parsed.fuseOptions(source: src), debug: debug)
        } catch {
            throw RuntimeError("\(error)")
        }
        let requests = session.requests
        fs.reaper?.foregroundRequests = { requests.count }
        do {
            try session.mount(at: mnt)
        } catch {
            throw RuntimeError("mounting \(src) on \(mnt) failed; see libfuse's message above")
        }
        fs.backingFiles = session.backingFiles
        Readahead.apply(kb: parsed.filesystem.readaheadKB, at: mnt, explicit: parsed.readaheadGiven, log: log)
        let notifier = session.notifier
        fs.setEntryInvalidator { parent, name, expireOnly in
            name.withUnsafeBufferPointer {
                if expireOnly {
                    _ = notifier.expireEntry(parent: parent, name: $0.baseAddress!, length: $0.count - 1)
                } else {
                    _ = notifier.invalidateEntry(parent: parent, name: $0.baseAddress!, length: $0.count - 1)
                }
            }
        }
        if !foreground { session.daemonize() }
        // A stop signal ends the loop, or after it the reaping; one that came
        // since the mount became visible is pending and is taken now.
        let stopSignal = Atomic<Int32>(0)
        let stopper = session.stopper
        StopSignals.watch { sig in
            stopSignal.store(sig, ordering: .sequentiallyConsistent)
            stopper.stop()
            fs.allReapers.forEach { $0.stop(.now) }
        }
        journal?.start()
        fs.startMemoryReturn { requests.count }
        journal?.append(.mounted) { e in
            e.string("source", src)
            e.string("mountpoint", mnt)
            e.int("pid", getpid())
        }
        control?.start()
        log.info("mounted", metadata: ["source": "\(src)", "mountpoint": "\(mnt)", "pid": "\(getpid())"])

        let config = LoopConfig(maxThreads: threads ?? parsed.threads ?? 10, cloneFD: cloneFD || parsed.cloneFD)
        let status = singleThreaded ? session.runSingleThreaded() : session.run(config)
        journal?.append(.unmounting) { e in e.string("mountpoint", mnt) }
        // No notification may reach libfuse once the session is gone.
        fs.setEntryInvalidator(nil)
        session.unmount()
        // The source may be mounted again while this process empties the
        // graveyard (a reaper passes over what another already removed).
        if sourceLock >= 0 { close(sourceLock) }
        let signal = stopSignal.load(ordering: .sequentiallyConsistent)
        log.info("unmounted", metadata: ["mountpoint": "\(mnt)", "status": "\(status)", "signal": "\(signal)"])
        // After an unmount the process stays to empty the graveyard (a stop
        // signal stops it promptly, the rest waits for the next start); after
        // a signal it stops at once.
        fs.stopReaping(finish: status == 0 && signal == 0)
        journal?.close()
        // A signal is a requested, clean stop.
        if status < 0 { throw ExitCode.failure }
    }
}

extension MountCommand {
    /// 16 random hex digits naming this mount instance (its socket, its events).
    static func newInstanceID() -> String {
        var g = SystemRandomNumberGenerator()
        let v = g.next() as UInt64
        let s = String(v, radix: 16)
        return String(repeating: "0", count: 16 - s.count) + s
    }
}

/// A failure worth one line on stderr and exit status 1.
struct RuntimeError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}
