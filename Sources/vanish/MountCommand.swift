import ArgumentParser
import Dispatch
import FUSEKit
import Glibc
import Logging
import VanishFS

struct MountCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "mount",
        abstract: "Mount SOURCE on MOUNTPOINT, or a directory over itself.",
        discussion: """
            With one path the directory is mounted in place: Vanish opens it first, then \
            mounts on top, so existing paths keep working and every access goes through Vanish.

            -o takes libfuse/kernel options (allow_other, default_permissions, ro, fsname=, ...) \
            and Vanish's own: cache=auto|always|never, threads=N, clone_fd, writeback, fd_cache=N, reapers=N. \
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
    }

    func run() throws {
        var parsed = try MountOptionList(options)
        if let cache { parsed.filesystem.cache = CacheMode(rawValue: cache)! }
        // A read-only mount deletes nothing and must not write .vanish into the source.
        if parsed.fuse.contains("ro") { parsed.filesystem.graveyard = false }
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

        // Opened before mounting, so an in-place mount still reaches what it covers.
        let fs: PassthroughFilesystem
        do {
            fs = try PassthroughFilesystem(source: src, options: parsed.filesystem, logger: log)
        } catch {
            throw RuntimeError("cannot open source \(src): \(error)")
        }
        let session: Session
        do {
            session = try Session(filesystem: fs, options: parsed.fuseOptions(source: src), debug: debug)
        } catch {
            throw RuntimeError("\(error)")
        }
        do {
            try session.mount(at: mnt)
        } catch {
            throw RuntimeError("mounting \(src) on \(mnt) failed; see libfuse's message above")
        }
        try session.installSignalHandlers()
        let notifier = session.notifier
        fs.setEntryInvalidator { parent, child, name in
            name.withUnsafeBufferPointer { _ = notifier.delete(parent: parent, child: child, name: $0.baseAddress!, length: $0.count - 1) }
        }
        if !foreground { session.daemonize() }
        log.info("mounted", metadata: ["source": "\(src)", "mountpoint": "\(mnt)", "pid": "\(getpid())"])

        let config = LoopConfig(maxThreads: threads ?? parsed.threads ?? 10, cloneFD: cloneFD || parsed.cloneFD)
        let status = singleThreaded ? session.runSingleThreaded() : session.run(config)
        // No notification may reach libfuse once the session is gone.
        fs.setEntryInvalidator(nil)
        session.unmount()
        log.info("unmounted", metadata: ["mountpoint": "\(mnt)", "status": "\(status)"])
        // After an unmount the process stays to empty the graveyard (SIGTERM or
        // SIGINT stops it promptly, the rest waits for the next start); after a
        // signal it stops at once.
        let stopNow = stopOnSignals { fs.reaper?.stop(.now) }
        fs.stopReaping(finish: status == 0)
        withExtendedLifetime(stopNow) {}
        // A positive status is the signal that ended the loop: a requested, clean stop.
        if status < 0 { throw ExitCode.failure }
    }
}

/// Runs `action` on SIGTERM or SIGINT (from a dispatch source, so it need
/// not be async-signal-safe); keep the returned sources alive.
func stopOnSignals(_ action: @escaping @Sendable () -> Void) -> [any DispatchSourceSignal] {
    [SIGTERM, SIGINT].map { sig in
        signal(sig, SIG_IGN)
        let source = DispatchSource.makeSignalSource(signal: sig, queue: .global())
        source.setEventHandler(handler: action)
        source.resume()
        return source
    }
}

/// A failure worth one line on stderr and exit status 1.
struct RuntimeError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}
