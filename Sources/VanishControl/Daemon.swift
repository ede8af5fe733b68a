import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import VanishEvents
import VanishFS

/// One Vanish mount and everything that serves it: the filesystem over the
/// source, its event journal, its control socket and the FUSE session.
///
/// `init` builds the parts from the configuration, in one place, mounting
/// nothing; `run` mounts, serves until an unmount or a stop signal, and
/// stops the parts in the reverse order of their start:
///
///     start: control socket (listening), filesystem (naming it in its
///            status), journal, control server, session (built by init)
///            → mount → after-mount hook → daemonize → signal watch
///            → journal writer → memory return → control socket → `mounted`
///            → request loop
///     stop:  `unmounting` → kernel notifications off → unmount → source lock
///            → reaping (finished after an unmount, stopped after a signal)
///            → journal → control socket
public final class Daemon {
    public struct Configuration {
        public var source: String
        public var mountpoint: String
        public var filesystem: FilesystemOptions
        /// libfuse's and the kernel's options (`fsname=`, `allow_other`, ...).
        public var fuseOptions: [String]
        public var events = true
        public var journalLimits = Journal.Limits()
        /// The control socket is open to every local user (allow_other mounts).
        public var sharedControlSocket = false
        public var foreground = false
        public var debug = false
        public var loop = LoopConfig()
        public var singleThreaded = false
        /// An fd holding the one-mount-per-source lock (or -1): released
        /// once unmounted, so the source may be mounted again while this
        /// process still empties the graveyard.
        public var sourceLock: Int32 = -1
        /// Where the log goes, for `status`: "stderr", "syslog" or a path.
        public var logDestination = ""
        /// Runs between the mount and the kernel's INIT (the mount command
        /// sets the readahead there, which INIT can only lower).
        public var afterMount: ((String) -> Void)?

        public init(source: String, mountpoint: String, filesystem: FilesystemOptions, fuseOptions: [String]) {
            self.source = source
            self.mountpoint = mountpoint
            self.filesystem = filesystem
            self.fuseOptions = fuseOptions
        }
    }

    /// A part that could not be built, said in a sentence for the user.
    public struct Failure: Error, CustomStringConvertible {
        public let description: String
    }

    private let configuration: Configuration
    private let log: Logger
    private let filesystem: VanishFilesystem
    private let journal: Journal?
    private let control: ControlServer?
    private let session: Session

    /// The composition root: builds the control socket, the filesystem's
    /// parts (`MountParts.assemble`: source, deleting, namespace, events,
    /// control, caches) and the filesystem over them, the control server and
    /// the session, each from the ones before. Nothing is mounted yet.
    public init(_ configuration: Configuration, log: Logger) throws(Failure) {
        self.configuration = configuration
        self.log = log
        let src = configuration.source
        let instance = Daemon.newInstanceID()
        let socket = Daemon.openControlSocket(configuration, instance: instance, log: log)
        do {
            var options = configuration.filesystem
            options.mountpoint = realpath(configuration.mountpoint, nil).map { p in defer { free(p) }; return String(cString: p) }
            filesystem = VanishFilesystem(try MountParts.assemble(
                source: src, options: options, logger: log,
                journal: Daemon.journalOpener(configuration, instance: instance, log: log),
                status: .init(socket: socket?.path ?? "", log: configuration.logDestination)))
        } catch {
            socket?.discard()
            throw Failure(description: "cannot open source \(src): \(error)")
        }
        journal = filesystem.journal
        let mount = filesystem.control
        do {
            control = try socket.map { s throws(ControlServer.Failure) in
                try ControlServer(socket: s, mount: mount, logger: log)
            }
        } catch {
            // The mount works without it; only trash, restore and events need it.
            log.error("no control socket: \(error)")
            control = nil
        }
        do {
            session = try Session(filesystem: RequestRouter(filesystem), options: configuration.fuseOptions, debug: configuration.debug)
        } catch {
            // (The journal's writer has not started: there is nothing to close.)
            control?.stop()
            throw Failure(description: "\(error)")
        }
    }

    /// Opens the event journal in the state directory's `events`, when events are on.
    private static func journalOpener(_ c: Configuration, instance: String,
                                      log: Logger) -> ((_ eventsFD: Int32) -> Journal?)? {
        guard c.events else { return nil }
        return { eventsFD in
            do {
                var limits = c.journalLimits
                limits.minFreePercent = c.filesystem.deleting.reaping.keepMinFreePercent
                return try Journal(eventsFD: eventsFD, instance: instance, limits: limits)
            } catch {
                log.error("no event journal: \(error)")
                return nil
            }
        }
    }

    /// The control socket, listening, at its place for this instance.
    private static func openControlSocket(_ c: Configuration, instance: String, log: Logger) -> ControlSocket? {
        do throws(ControlServer.Failure) {
            let directory = ControlServer.socketDirectory()
            let stale = ControlServer.removeStaleSockets(in: directory)
            if stale > 0 { log.info("removed control sockets of daemons that are gone", metadata: ["count": "\(stale)"]) }
            return try ControlSocket.listen(at: directory + "/\(instance).sock", shared: c.sharedControlSocket)
        } catch {
            // The mount works without it; only trash, restore and events need it.
            log.error("no control socket: \(error)")
            return nil
        }
    }

    /// Mounts and serves until unmounted or stopped by a signal. Returns
    /// false when the request loop failed (not for a requested stop).
    public func run() throws(Failure) -> Bool {
        let c = configuration
        let (fs, requests) = (filesystem, session.requests)
        defer { control?.stop() }
        fs.yieldReaping(to: { requests.count })
        do {
            try session.mount(at: c.mountpoint)
        } catch {
            var why = "mounting \(c.source) on \(c.mountpoint) failed; see libfuse's message above"
            if geteuid() != 0 && access("/dev/fuse", R_OK | W_OK) != 0 {
                // The usual first failure of an ordinary user: the device, not Vanish.
                why += ". /dev/fuse is not open to you: an administrator can make it mode 0666 "
                    + "(the fuse3 package's default) or give you its group"
            }
            throw Failure(description: why)
        }
        c.afterMount?(c.mountpoint)
        // Under systemd (Type=notify), the unit is started once the mount is up.
        Daemon.notifySystemd("READY=1\nSTATUS=mounted \(c.mountpoint)")
        fs.notifyKernel(through: session.notifier)
        if !c.foreground { session.daemonize() }
        // Threads only from here on: the fork keeps none. A stop signal ends
        // the loop, or after it the reaping; one that came since the mount
        // became visible is pending and is taken now.
        let stopSignal = Atomic<Int32>(0)
        let stopper = session.stopper
        let log = self.log
        StopSignals.watch { sig in
            // A second one: the orderly end is stuck (a handler or the journal
            // waiting on a filesystem below the mount that does not answer).
            // Leave as SIGKILL would: answered unlinks are in their log for
            // the next mount, and the kernel ends the connection.
            if stopSignal.exchange(sig, ordering: .sequentiallyConsistent) != 0 {
                log.warning("a second stop signal: leaving without finishing", metadata: ["signal": "\(sig)"])
                _exit(128 + sig)
            }
            log.info("stopping on a signal", metadata: ["signal": "\(sig)"])
            // On a thread of its own: ending the loop waits for it to return,
            // and this one must stay free to take a second signal.
            spawnThread("vanish-stop") {
                stopper.stop()
                fs.stopReapingNow()
            }
        }
        journal?.start()
        fs.startMemoryReturn { requests.count }
        journal?.append(.mounted) { e in
            e.string("source", c.source)
            e.string("mountpoint", c.mountpoint)
            e.int("pid", getpid())
        }
        control?.start()
        log.info("mounted", metadata: ["source": "\(c.source)", "mountpoint": "\(c.mountpoint)", "pid": "\(getpid())"])

        var loop = c.loop
        // A network filesystem's requests take a round trip each: there
        // workers wait in the kernel as libfuse has them (see `LoopConfig`).
        // A ring worker watches longer: it yields its CPU to the program
        // meanwhile (200 against 50 µs: creates, metadata and warm walks
        // 4-12% faster, its CPU still below /dev/fuse's; docs/decisions.md).
        if loop.spinMicroseconds == nil {
            loop.spinMicroseconds = fs.sourceIsLocalDisk ? 50 : 0
            loop.ringSpinMicroseconds = fs.sourceIsLocalDisk ? 200 : 0
        }
        let status = c.singleThreaded ? session.runSingleThreaded() : session.run(loop)

        Daemon.notifySystemd("STOPPING=1")
        journal?.append(.unmounting) { e in e.string("mountpoint", c.mountpoint) }
        // No notification may reach libfuse once the session is gone.
        fs.stopNotifyingKernel()
        session.unmount()
        let signal = stopSignal.load(ordering: .sequentiallyConsistent)
        log.info("unmounted", metadata: ["mountpoint": "\(c.mountpoint)", "status": "\(status)", "signal": "\(signal)"])
        // After an unmount the process stays to empty the graveyard (a stop
        // signal stops it promptly, the rest waits for the next start); after
        // a signal it stops at once.
        fs.stopReaping(finish: status == 0 && signal == 0)
        journal?.close()
        // Held until the reaping is over: a new mount of the source meanwhile
        // asks this process to stop (see MountPaths.lockSource) rather than
        // reaping the same graveyard beside it.
        if c.sourceLock >= 0 { close(c.sourceLock) }
        // A signal is a requested, clean stop.
        return status >= 0
    }

    /// Sends `state` to the service manager's notification socket
    /// (`NOTIFY_SOCKET`, sd_notify(3)'s protocol: one datagram), if there is one.
    static func notifySystemd(_ state: String) {
        guard let env = getenv("NOTIFY_SOCKET") else { return }
        var path = Array(String(cString: env).utf8)
        guard !path.isEmpty, path[0] == 0x2F || path[0] == 0x40 else { return }
        if path[0] == 0x40 { path[0] = 0 }  // "@name": the abstract namespace
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        guard path.count < MemoryLayout.size(ofValue: addr.sun_path) else { return }
        withUnsafeMutableBytes(of: &addr.sun_path) { $0.copyBytes(from: path) }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + path.count)
        _ = state.withCString { text in
            withUnsafePointer(to: &addr) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, text, strlen(text), Int32(MSG_NOSIGNAL), $0, length) }
            }
        }
    }

    /// 16 random hex digits naming a mount instance (its socket, its events).
    static func newInstanceID() -> String {
        var g = SystemRandomNumberGenerator()
        let v = g.next() as UInt64
        let s = String(v, radix: 16)
        return String(repeating: "0", count: 16 - s.count) + s
    }
}
