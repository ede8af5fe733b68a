import CFuse
import CFuseTransport
import Glibc
import SystemPackage

/// How libfuse's multi-threaded loop runs (`fuse_loop_config`).
public struct LoopConfig: Sendable, Equatable {
    /// Upper bound on worker threads (libfuse's default is 10).
    public var maxThreads: Int
    /// Idle workers beyond which one that finishes a request ends; nil:
    /// none ends (libfuse's default since 3.12). With spinning, idle workers
    /// wait in the daemon, and one that ended as the receiver would leave
    /// requests to the watchdog.
    public var idleThreads: Int?
    /// Give each worker its own /dev/fuse fd (`clone_fd`), which spreads
    /// requests across threads without contention on one fd.
    public var cloneFD: Bool
    /// How long the worker that just replied reads on without sleeping
    /// while requests come that close together (µs). A program making one
    /// call after another then finds a worker awake instead of waiting for
    /// one to be woken. With it, one worker at a time receives and the
    /// others wait in the daemon (workers.c); with 0, every idle worker
    /// waits in the kernel, as libfuse has them. nil: the caller decides.
    public var spinMicroseconds: Int?
    /// The same over io_uring, where the watching worker yields its CPU to
    /// the program between looks. nil: `spinMicroseconds`.
    public var ringSpinMicroseconds: Int?
    /// Whether requests may come over io_uring instead (`RequestChannel`).
    public var ring: RingMode
    /// The EEVDF slice request threads take (µs); nil: the kernel's.
    public var sliceMicroseconds: Int?

    public init(maxThreads: Int = 10, idleThreads: Int? = nil, cloneFD: Bool = false, spinMicroseconds: Int? = nil,
                ring: RingMode = .auto) {
        self.maxThreads = maxThreads
        self.idleThreads = idleThreads
        self.cloneFD = cloneFD
        self.spinMicroseconds = spinMicroseconds
        self.ring = ring
    }
}

/// The workers serving requests.
public enum Workers {
    /// Call from a request handler before anything that may take long (a
    /// wait for another thread, a disk flush): with spinning on, one worker
    /// at a time receives, and this lets another take its place now instead
    /// of after the watchdog's half millisecond.
    @inline(__always)
    public static func mayBlock() { vanish_workers_may_block() }
}

public enum SessionError: Error, CustomStringConvertible {
    case badOptions(String)
    case mountFailed(String)
    case transport(Errno)

    public var description: String {
        switch self {
        case .badOptions(let s): return "libfuse refused the options: \(s)"
        case .mountFailed(let s): return "mounting on \(s) failed (libfuse printed why above)"
        case .transport(let e): return "cannot install the FUSE transport: \(e)"
        }
    }
}

/// A libfuse low-level session: create, mount, run, unmount.
///
/// Lives for the whole life of the daemon, so the C strings it hands to
/// libfuse are allocated once and intentionally never freed.
public final class Session {
    private let raw: OpaquePointer
    private let box: Unmanaged<SessionBox>
    /// What libfuse 3.14 does not negotiate or know, and the request channel.
    public let transport: Transport
    private var ops: UnsafeMutablePointer<fuse_lowlevel_ops>
    private var mounted = false
    /// Ends `run` from another thread (a signal watcher).
    public let stopper: LoopStopper

    /// `fuse_session_new` with `options` passed as `-o` to libfuse (comma
    /// lists as mount(8) writes them) plus `-d` when `debug` is set.
    public init(filesystem: any LowLevelFilesystem, options: [String], debug: Bool) throws {
        var argv: [String] = ["vanish"]
        if !options.isEmpty { argv += ["-o", options.joined(separator: ",")] }
        if debug { argv.append("-d") }
        let cargs = UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>.allocate(capacity: argv.count + 1)
        for (i, a) in argv.enumerated() { cargs[i] = strdup(a) }
        cargs[argv.count] = nil
        var args = fuse_args(argc: Int32(argv.count), argv: cargs, allocated: 0)

        let sessionBox = SessionBox(filesystem)
        box = Unmanaged.passRetained(sessionBox)
        transport = Transport(owner: box.toOpaque())
        sessionBox.transport = transport
        ops = .allocate(capacity: 1)
        ops.initialize(to: makeOperationTable())
        guard let se = vanish_transport_session_new(transport.raw, &args, ops, tmpfileOperation) else {
            sessionBox.transport = nil
            box.release()
            throw SessionError.badOptions(options.joined(separator: ","))
        }
        raw = se
        stopper = LoopStopper(session: se)
    }

    /// Whether libfuse takes `options` (as `init` passes them): nil if it
    /// does, else the list it refused (libfuse's own message is kept off stderr). No
    /// session is mounted.
    public static func rejectedOptions(_ options: [String]) -> String? {
        guard !options.isEmpty else { return nil }
        let argv = ["vanish", "-o", options.joined(separator: ",")]
        let cargs = argv.map { strdup($0) } + [nil]
        defer { cargs.forEach { free($0) } }
        // libfuse prints its own complaint; the caller words the answer. (Run
        // while parsing arguments, before any other thread writes to stderr.)
        let saved = dup(2), null = open("/dev/null", O_WRONLY | O_CLOEXEC)
        if saved >= 0 && null >= 0 { dup2(null, 2) }
        defer {
            if saved >= 0 && null >= 0 { dup2(saved, 2) }
            if saved >= 0 { close(saved) }
            if null >= 0 { close(null) }
        }
        return cargs.withUnsafeBufferPointer { p -> String? in
            var args = fuse_args(argc: Int32(argv.count), argv: UnsafeMutablePointer(mutating: p.baseAddress), allocated: 0)
            var ops = fuse_lowlevel_ops()
            guard let se = vanish_session_new(&args, &ops, nil) else { return options.joined(separator: ",") }
            fuse_session_destroy(se)
            fuse_opt_free_args(&args)
            return nil
        }
    }

    /// `fuse_session_mount`, then the transport layer on its /dev/fuse fd
    /// (see `KernelFeatures`).
    public func mount(at mountpoint: String) throws {
        guard fuse_session_mount(raw, mountpoint) == 0 else { throw SessionError.mountFailed(mountpoint) }
        mounted = true
        let r = vanish_transport_install(transport.raw, fuse_session_fd(raw))
        guard r == 0 else { throw SessionError.transport(Errno(rawValue: -r)) }
    }

    /// `fuse_daemonize(0)`: fork into the background once the mount is up;
    /// the parent exits only after the child is ready.
    public func daemonize() { _ = fuse_daemonize(0) }

    /// Requests this session has begun to serve (forgets not counted).
    public var requests: RequestCounter { box.takeUnretainedValue().requests }

    /// Runs the multi-threaded loop until unmount or a signal;
    /// returns 0 on a clean end (an unmount or `stopper.stop()`), else a negative errno.
    public func run(_ config: LoopConfig) -> Int32 {
        let cfg = fuse_loop_cfg_create()!
        defer { fuse_loop_cfg_destroy(cfg) }
        fuse_loop_cfg_set_max_threads(cfg, UInt32(config.maxThreads))
        if let idle = config.idleThreads { fuse_loop_cfg_set_idle_threads(cfg, UInt32(idle)) }
        fuse_loop_cfg_set_clone_fd(cfg, config.cloneFD ? 1 : 0)
        vanish_transport_set_spin(transport.raw, UInt32(config.spinMicroseconds ?? 0))
        vanish_transport_set_ring_spin(transport.raw, UInt32(config.ringSpinMicroseconds ?? config.spinMicroseconds ?? 0))
        vanish_transport_set_slice(transport.raw, UInt32(config.sliceMicroseconds ?? 0))
        vanish_transport_set_ring(transport.raw, Int32(config.ring == .off ? VANISH_RING_OFF : VANISH_RING_AUTO))
        stopper.loopStarts()
        defer { stopper.end() }
        return fuse_session_loop_mt(raw, cfg)
    }

    /// Runs the single-threaded loop (for debugging races).
    public func runSingleThreaded() -> Int32 {
        vanish_transport_set_spin(transport.raw, 0)
        vanish_transport_set_ring(transport.raw, Int32(VANISH_RING_OFF))
        stopper.loopStarts()
        defer { stopper.end() }
        return fuse_session_loop(raw)
    }

    /// `fuse_session_unmount`, if still mounted.
    public func unmount() {
        if mounted { fuse_session_unmount(raw); mounted = false }
    }

    /// Cache invalidation towards the kernel; see `Notifier`.
    public var notifier: Notifier { Notifier(session: raw) }

    deinit {
        unmount()
        stopper.end()
        vanish_transport_close(transport.raw)
        fuse_session_destroy(raw)
        // The transport is freed with its last reference, after the session.
        box.takeUnretainedValue().transport = nil
        box.release()
        ops.deallocate()
    }
}

/// Tells the kernel to drop cached entries and data. Never call it from a
/// request handler of the same session (libfuse may deadlock): call it
/// from another thread.
public struct Notifier: @unchecked Sendable {
    let session: OpaquePointer

    /// `fuse_lowlevel_notify_inval_entry`.
    @discardableResult
    public func invalidateEntry(parent: fuse_ino_t, name: UnsafePointer<CChar>, length: Int) -> Int32 {
        fuse_lowlevel_notify_inval_entry(session, parent, name, length)
    }

    /// `fuse_lowlevel_notify_expire_entry` with FUSE_LL_EXPIRE_ONLY: the
    /// entry stays cached but expired, so the next lookup of it comes here,
    /// and nothing below it is pruned now (kernel 6.2+; older kernels drop it).
    @discardableResult
    public func expireEntry(parent: fuse_ino_t, name: UnsafePointer<CChar>, length: Int) -> Int32 {
        fuse_lowlevel_notify_expire_entry(session, parent, name, length, FUSE_LL_EXPIRE_ONLY)
    }

    /// `fuse_lowlevel_notify_delete`: the entry is gone, as after an unlink
    /// or rmdir, and inotify watchers see it deleted. Fails (ENOTEMPTY) for
    /// a directory something still holds open inside, ENOENT when the kernel
    /// knows the name as another node.
    @discardableResult
    public func deleteEntry(parent: fuse_ino_t, child: fuse_ino_t, name: UnsafePointer<CChar>, length: Int) -> Int32 {
        fuse_lowlevel_notify_delete(session, parent, child, name, length)
    }

    /// `fuse_lowlevel_notify_inval_inode`.
    @discardableResult
    public func invalidateInode(_ ino: fuse_ino_t, offset: off_t = 0, length: off_t = 0) -> Int32 {
        fuse_lowlevel_notify_inval_inode(session, ino, offset, length)
    }
}
