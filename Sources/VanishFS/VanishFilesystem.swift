import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import SystemPackage
import VanishEvents
import VanishGraveyard

/// One Vanish mount: its parts, as `MountParts` built them, and what it
/// does besides answering requests: starting and ending the session (INIT,
/// the reapers, the watch), and its status. Requests go through
/// `RequestRouter` to the handler types (`handlers`), which do every
/// operation on the backing directory, through fds relative to it, with
/// its errno passed back unchanged.
public final class VanishFilesystem: Sendable {
    /// The inodes, their fds and the pending burials: every handler reaches
    /// the backing directory through it (see `BackingNamespace`).
    let namespace: BackingNamespace
    let options: FilesystemOptions
    let log: Logger
    /// The backing root and what is known of it from the start.
    let source: SourceRoot
    /// What the kernel agreed to at INIT.
    let kernel: KernelTerms
    /// The graveyard, its reapers and the burials owed: all deleting.
    let deleter: Deleter
    /// One-step deletes in their deleters' rooms, waiting for their check.
    let oneStep: OneStepBurials
    /// The source's names and attributes kept between requests, and what keeps them fresh.
    let caches: Caches
    /// Where each change made through the mount is told: the event journal's
    /// recorder, or `NoEvents`.
    let changes: any ChangeObserver
    /// What users may do to the mount and its undo window besides its files: the
    /// control requests, the status attribute, the desktop trash folders.
    package let control: MountControl
    /// The handler types the router sends each operation to.
    let handlers: RequestHandlers

    /// Descriptor shares and passthrough ids of open files.
    var openFiles: OpenFiles { handlers.files.openFiles }
    /// The inodes the kernel knows (the namespace's table).
    var table: InodeTable { namespace.table }

    /// The event journal (nil with events off, or without a state directory).
    public var journal: Journal? { control.journal }
    /// Whether requests are served in microseconds (see `SourceRoot.isLocalDisk`).
    public var sourceIsLocalDisk: Bool { source.isLocalDisk }

    /// The filesystem over `parts` (see `MountParts.assemble`, which opens and builds them).
    package init(_ parts: MountParts) {
        source = parts.source
        options = parts.options
        log = parts.log
        namespace = parts.namespace
        deleter = parts.deleter
        oneStep = parts.oneStep
        caches = parts.caches
        changes = parts.changes
        control = parts.control
        handlers = parts.handlers
        kernel = parts.kernel
    }

    deinit {
        Sys.close(source.fd)
        if let codec = table.codec { Sys.close(codec.mountFD) }
    }

    public var fdCacheLimit: Int { namespace.fdLimit }

    public func initialize(_ conn: UnsafeMutablePointer<fuse_conn_info>, transport: Transport) {
        kernel.transport.withLock { $0 = transport }
        let capable = conn.pointee.capable
        if options.writeback && capable & UInt32(FUSE_CAP_WRITEBACK_CACHE) != 0 {
            conn.pointee.want |= UInt32(FUSE_CAP_WRITEBACK_CACHE)
        }
        conn.pointee.max_readahead = UInt32(options.readaheadKB * 1024)
        // Background requests (RELEASE above all) get their request id only
        // once fewer than max_background are in flight (the kernel's 12 by
        // default): a RELEASE held back behind the limit was numbered after
        // its program's next change, and its `written` event came after that
        // change's (1 in 1,600 under CI's load). More room keeps the kernel's
        // numbering in the order programs act.
        conn.pointee.max_background = 64
        conn.pointee.congestion_threshold = 48
        // Move data between the backing file and /dev/fuse through pipes
        // instead of copying it through our memory (as passthrough_hp does).
        // Not over io_uring: requests and replies live in the ring's buffers.
        for cap in [FUSE_CAP_SPLICE_WRITE, FUSE_CAP_SPLICE_MOVE, FUSE_CAP_SPLICE_READ] where !transport.ringComing {
            if capable & UInt32(cap) != 0 { conn.pointee.want |= UInt32(cap) }
        }
        // The umask is applied by the backing filesystem as the file is made
        // (see `withCallersUmask`): where the directory has a default ACL
        // that ACL decides instead, which the kernel cannot know.
        if capable & UInt32(FUSE_CAP_DONT_MASK) != 0 {
            conn.pointee.want |= UInt32(FUSE_CAP_DONT_MASK)
            kernel.leavesUmask.store(true, ordering: .relaxed)
        }
        // Inode-flag ioctls (lsattr, chattr) on directories too, not only files.
        if capable & UInt32(FUSE_CAP_IOCTL_DIR) != 0 { conn.pointee.want |= UInt32(FUSE_CAP_IOCTL_DIR) }
        // Node ids that name their files: the kernel may then ask for a file by id (see ExportedHandles).
        if table.codec != nil && capable & UInt32(FUSE_CAP_EXPORT_SUPPORT) != 0 {
            conn.pointee.want |= UInt32(FUSE_CAP_EXPORT_SUPPORT)
        }
        // Where the kernel checks access itself (default_permissions), it
        // checks POSIX ACLs too, as the backing filesystem would, instead of
        // the mode bits alone, which let through a user an ACL shuts out.
        if options.posixACLs && capable & UInt32(FUSE_CAP_POSIX_ACL) != 0 {
            if source.keepsACLs {
                conn.pointee.want |= UInt32(FUSE_CAP_POSIX_ACL)
                kernel.checksACLs.store(true, ordering: .relaxed)
            } else {
                log.info("the source keeps no POSIX ACLs: the kernel checks the mode bits alone, as it does there")
            }
        }
        negotiateKernelFeatures(transport)
        switch options.readdirPlus {
        // The daemon decides per listing for `walk`, so the kernel always asks.
        case .always, .walk: conn.pointee.want &= ~UInt32(FUSE_CAP_READDIRPLUS_AUTO)
        case .auto: break
        case .never: conn.pointee.want &= ~UInt32(FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO)
        }
        // Threads start here, after daemonizing (a fork keeps only the forking thread).
        // The watch last: what it sees goes to the notice sender, which must run.
        oneStep.start()
        deleter.start { [table, invalidations = caches.invalidations] dir in
            invalidations.attributes(of: table.nodeID(dir), wait: false)
        }
        caches.invalidations.start()
        startWatching()
        log.info("session started", metadata: ["fd_cache": "\(namespace.fdLimit)", "cache": "\(options.cache.rawValue)",
                                                "reapers": "\(deleter.reaper?.workerCount ?? 0)", "caller_names": "\(changes.callerNames)",
                                                "passthrough": "\(openFiles.passthrough.active ? "on" : "off")",
                                                "watch": "\(caches.watch != nil ? "on" : "off")",
                                                "requests": "\(transport.ringComing ? "io_uring" : "/dev/fuse")",
                                                "file_handles": "\(table.codec != nil ? "exportable" : "while cached")"])
        if deleter.graveyard != nil, vanish_filesystem_type(source.fd) == VANISH_OVERLAYFS_SUPER_MAGIC {
            log.warning("""
                the source is on overlayfs: a file from a lower layer is copied up before it can move \
                to the graveyard, and a directory from one is deleted in the request, so deletes of \
                lower-layer entries are not instant
                """)
        }
    }

    /// Asks the kernel, through the transport layer, for what libfuse 3.14
    /// does not negotiate. KILLPRIV_V2 hands clearing setuid/setgid to the
    /// daemon (see `mustClearPrivileges`), which spares every write the
    /// kernel's GETXATTR of security.capability. PARALLEL_DIROPS lets
    /// lookups and readdirs of one directory run at once: lookup keeps no
    /// state but the inode table's (under its lock), the kernel never looks
    /// up one name twice at a time, and creates, unlinks and renames still
    /// hold the directory exclusively.
    private func negotiateKernelFeatures(_ transport: Transport) {
        var wanted: KernelFeatures = [.killprivV2, .parallelDirops, .directIOAllowMmap]
        var why = "on"
        let backingFiles = transport.backingFiles
        if !options.passthrough { why = "off by option" }
        else if options.writeback { why = "off: the kernel allows no passthrough beside writeback" }
        else if !BackingFiles.permitted { why = "off: registering backing files needs CAP_SYS_ADMIN" }
        else if backingFiles == nil { why = "off: no device" }
        else { wanted.insert(.passthrough) }
        // Backing files on overlayfs are one level deep already.
        let depth: UInt32 = vanish_filesystem_type(source.fd) == VANISH_OVERLAYFS_SUPER_MAGIC ? 2 : 1
        let granted = transport.request(wanted, maxStackDepth: depth)
        if wanted.contains(.passthrough) && !granted.contains(.passthrough) { why = "off: the kernel does not offer it" }
        if granted.contains(.passthrough), let backingFiles { openFiles.passthrough.start(backingFiles) }
        kernel.passthroughReason.withLock { $0 = why }
        log.info("kernel features", metadata: ["offered": "\(transport.offered)", "granted": "\(granted)",
                                               "passthrough": "\(why)"])
    }

    /// Lets the filesystem tell the kernel, through the session's
    /// `notifier`, to forget entries it removed or brought back on its own
    /// (`vanish rm`, a restore), as `EntryInvalidations.sender` decides.
    public func notifyKernel(through notifier: Notifier) {
        caches.invalidations.setInvalidator(EntryInvalidations.sender(notifier))
    }

    /// No more notices (the session is ending). Returns once any notice
    /// already queued has been sent, so the session can be destroyed after.
    public func stopNotifyingKernel() { caches.invalidations.setInvalidator(nil) }

    /// Has the reapers step aside while `foreground` (requests in flight) is above zero.
    public func yieldReaping(to foreground: @escaping @Sendable () -> UInt64) {
        deleter.reaper?.hooks.foregroundRequests = foreground
    }

    /// Stops every reaper at once (a stop signal), leaving the rest for the next start.
    public func stopReapingNow() { deleter.allReapers.forEach { $0.stop(.now) } }

    /// After the session ended: finish emptying the graveyard (after an
    /// unmount) or stop at once (after a signal).
    public func stopReaping(finish: Bool) {
        // Trees already gone from their place are owed their check first.
        oneStep.stop()
        deleter.stop(finish: finish)
    }

    public func destroy() {
        log.info("session ending", metadata: ["inodes": "\(table.count)"])
    }
}

/// The status attribute (`user.vanish.status` on the mount's root): what
/// it shows besides the mount's own facts (`StatusReport`).
package struct StatusAttribute: Sendable {
    package var socket = ""
    /// Where the daemon's log goes: "stderr", "syslog", or a file's path.
    package var log = ""

    package init(socket: String = "", log: String = "") {
        self.socket = socket
        self.log = log
    }
}

/// Inode numbers of filesystems mounted inside the source would collide
/// with the source's own (every root is inode 2 on ext4, 1 on tmpfs...)
/// once they all appear under the one FUSE st_dev, and `find`, `du`, `cp -a`
/// and git compare (st_dev, st_ino). Files on the source's device keep their
/// inode number; files on a nested device get its index in the top byte.
final class DeviceMap: Sendable {
    private let rootDevice: dev_t
    private let known = Lock<[dev_t: UInt64]>([:])

    init(rootDevice: dev_t) { self.rootDevice = rootDevice }

    @inline(__always)
    func present(_ st: stat) -> stat {
        if st.st_dev == rootDevice { return st }
        var out = st
        out.st_ino = (st.st_ino & 0x00FF_FFFF_FFFF_FFFF) | (UInt(index(of: st.st_dev).index) << 56)
        return out
    }

    /// The device's index, and whether this call gave it one.
    func index(of dev: dev_t) -> (index: UInt64, new: Bool) {
        known.withLock { map in
            if let i = map[dev] { return (i, false) }
            let i = UInt64(map.count + 1) & 0xFF
            map[dev] = i
            return (i, true)
        }
    }
}

/// The process's fd budget.
public enum FileLimits {
    /// Raises the soft RLIMIT_NOFILE to the hard limit (the most any process
    /// may have here) and returns it.
    @discardableResult
    public static func raise() -> Int {
        var lim = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &lim) == 0 else { return 1024 }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max
            _ = setrlimit(Int32(RLIMIT_NOFILE.rawValue), &lim)
        }
        return Int(min(lim.rlim_cur, rlim_t(Int32.max)))
    }

    /// The soft RLIMIT_NOFILE.
    static func current() -> Int {
        var lim = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &lim) == 0 else { return 1024 }
        return Int(min(lim.rlim_cur, 1 << 20))
    }

    /// Half the fd limit for cached inode fds, leaving the rest for files
    /// programs hold open through the mount and for libfuse.
    static func defaultCacheLimit() -> Int {
        var lim = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &lim) == 0 else { return 256 }
        let n = Int(min(lim.rlim_cur, 1 << 20))
        return max(16, n / 2 - 32)
    }
}
