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

/// Vanish's filesystem: every operation on the mount is done on the backing
/// directory, through fds relative to it, with its errno passed back unchanged.
public final class VanishFilesystem: LowLevelFilesystem, Sendable {
    let table: InodeTable
    /// The inodes, their fds and the pending burials: every handler reaches
    /// the backing directory through it (see `BackingNamespace`).
    let namespace: BackingNamespace
    let options: FilesystemOptions
    let log: Logger
    /// The backing root, opened before mounting (so an in-place mount still reaches it).
    let rootFD: Int32
    /// Set when the daemon runs as root: new entries are then given to the
    /// caller with fchown, since the kernel already checked the caller may make them.
    let actsForOthers: Bool
    /// Whether the backing root keeps POSIX ACLs. Without them (tmpfs built
    /// without, GlusterFS mounted without `acl`) it answers EOPNOTSUPP, which
    /// the kernel's own ACL check would hand the caller as the error of every
    /// access outside the owner's bits.
    let backingKeepsACLs: Bool
    /// Set at INIT: the kernel checks POSIX ACLs (FUSE_POSIX_ACL).
    let kernelChecksACLs = Atomic(false)
    /// Set at INIT: the kernel sends the caller's umask with each mode
    /// instead of applying it (FUSE_DONT_MASK), so a directory's default ACL
    /// can decide in its place, as natively.
    let kernelLeavesUmask = Atomic(false)
    let devices: DeviceMap
    /// The graveyard, its reapers and the burials owed: all deleting.
    let deleter: Deleter
    /// One-step deletes in their deleters' rooms, waiting for their check.
    let oneStep: OneStepBurials
    /// Whether close(2) of the source's own files never reports an error
    /// (see `configure`).
    let closesSilently: Bool
    /// The source is served through a private copy of its mount (an atime option).
    let sourceIsPrivateMount: Bool
    /// The source is a local disk filesystem (ext4, XFS, btrfs, tmpfs):
    /// requests are served in microseconds, so workers may spin for the next.
    public let sourceIsLocalDisk: Bool
    /// Whether the kernel may keep listings of the source's own directories
    /// between opens (see `opendir`).
    let cachesListings: Bool
    /// For `vanish rm`: is a filesystem mounted inside the tree?
    let mounts = MountTable()
    /// Cache invalidations for the kernel, sent from their own thread.
    let invalidations = EntryInvalidations()
    /// Reads directories ahead of programs that stat what they list.
    let statahead: Statahead
    /// For handles of files the kernel no longer holds: the graveyard's
    /// files (refused) and the state directory (never passed). See ExportedHandles.
    let buriedNumbers: BuriedNumbers?
    let stateDirectoryKey: InodeKey?
    /// Changes behind the mount as they happen: with it, the kernel keeps
    /// names and attributes of the source's filesystem for an hour (`cacheTimeout`).
    let watch: SourceWatch?
    /// Files known to have no xattrs, answered without a syscall.
    let absentXattrs: AbsentXattrs
    let sourcePath: String
    /// Where each change made through the mount is told: the event journal's
    /// recorder, or `NoEvents`.
    let changes: any ChangeObserver
    /// The event journal (nil with events off, or without a state directory).
    public let journal: Journal?
    /// What the control plane may do to the mount.
    package let control: MountControl
    /// The undo window as desktop trash folders (nil without one).
    let trashFolders: TrashFolders?
    /// How many open handles each user may have the daemon hold.
    let handleShares = HandleShares(fdLimit: FileLimits.current())
    /// Backing ids of files opened in passthrough mode.
    let passthrough: PassthroughFiles
    /// Why passthrough is on or off, as negotiated at INIT (for the log and `vanish status`).
    let passthroughReason = Mutex("off: not negotiated yet")
    /// What the status attribute shows (`vanish status`).
    let status: StatusAttribute
    /// The session's transport, from INIT on: how requests are served, for the status.
    let sessionTransport = Mutex<Transport?>(nil)

    /// Opens `source` (a directory) as the backing root and its graveyard.
    /// `journal` opens the event journal in the state directory's `events`
    /// directory (an fd it may keep only while it runs); without it, or
    /// without a state directory, events are off.
    package init(source: String, options: FilesystemOptions, logger: Logger,
                 journal openJournal: ((_ eventsFD: Int32) -> Journal?)? = nil, status: StatusAttribute = .init()) throws {
        let (fd, privateMount) = try VanishFilesystem.openSource(source, options, logger)
        let st: stat
        do { st = try Sys.fstat(fd) } catch { Sys.close(fd); throw error }
        let opened: Deleter.Opened
        do { opened = try Deleter.open(source: source, fd: fd, options: options, logger: logger) } catch {
            Sys.close(fd)
            throw error
        }
        let grave = opened.graveyard
        sourceIsPrivateMount = privateMount
        sourcePath = source
        let localDisk = FilesystemKind.isLocalDisk(fd)
        closesSilently = localDisk
        sourceIsLocalDisk = localDisk
        cachesListings = switch options.cache {
        case .always: true
        case .auto: localDisk
        case .never: false
        }
        let root = Inode(key: InodeKey(dev: st.st_dev, ino: st.st_ino), type: S_IFDIR, id: UInt64(FUSE_ROOT_ID),
                         generation: 0, parent: nil, name: "")
        root.cache.fd = fd
        root.place.lookups = 1
        root.sawAttributes(st)
        rootFD = fd
        let codec = Self.handleCodec(rootFD: fd, root: st)
        table = InodeTable(root: root, codec: codec)
        buriedNumbers = codec != nil ? grave.map(BuriedNumbers.init) : nil
        stateDirectoryKey = grave.flatMap { g in (try? Sys.fstat(g.sharedFD)).map { InodeKey(dev: $0.st_dev, ino: $0.st_ino) } }
        watch = options.cache == .auto && localDisk && options.watchSource ? codec.flatMap(SourceWatch.init) : nil
        absentXattrs = AbsentXattrs(enabled: localDisk, device: st.st_dev,
                                    timeout: watch != nil ? SourceWatch.timeout : options.attrTimeout)
        self.options = options
        self.status = status
        log = logger
        passthrough = PassthroughFiles(log: logger)
        let burials = DeferredBurials(intents: opened.defersUnlink ? opened.intents : nil)
        namespace = BackingNamespace(table: table, fdLimit: options.fdCacheLimit ?? FileLimits.defaultCacheLimit(),
                                     burials: burials)
        actsForOthers = geteuid() == 0
        backingKeepsACLs = Self.keepsACLs(fd)
        devices = DeviceMap(rootDevice: st.st_dev)
        let journal = openJournal.flatMap { open in grave.flatMap(Self.openEventsDirectory).flatMap { fd in
            defer { Sys.close(fd) }
            return open(fd)
        } }
        self.journal = journal
        if let journal {
            let recorder = EventRecorder(journal: journal, table: table, namespace: namespace, log: logger,
                                         readsWithoutAtime: actsForOthers)
            if let reaper = opened.reaper { recorder.recordReaping(of: reaper) }
            changes = recorder
        } else {
            changes = NoEvents()
        }
        deleter = Deleter(opened, rootFD: fd, table: table, namespace: namespace, burials: burials, log: logger)
        oneStep = OneStepBurials(deleter: deleter, changes: changes, invalidations: invalidations, log: logger)
        control = MountControl(backingRoot: fd, journal: journal, graveyard: grave, reaper: opened.reaper,
                               namespace: namespace, oneStep: oneStep, table: table, invalidations: invalidations,
                               changes: changes, log: logger)
        let table = table
        trashFolders = deleter.undoWindow > 0 ? grave.map { TrashFolders(graveyard: $0, table: table) } : nil
        statahead = Statahead(table: table, namespace: namespace) { [deleter] dir, name in
            deleter.isStateDirectory(dir, name)
        }
    }

    /// `.vanish/events`, made if needed: where the journal lives.
    private static func openEventsDirectory(_ graveyard: Graveyard) -> Int32? {
        if mkdirat(graveyard.stateFD, "events", 0o700) != 0 && errno != EEXIST { return nil }
        let fd = openat(graveyard.stateFD, "events", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        return fd >= 0 ? fd : nil
    }

    deinit {
        Sys.close(rootFD)
        if let codec = table.codec { Sys.close(codec.mountFD) }
    }

    /// The backing root: the source itself, or for an atime option a private
    /// copy of its mount carrying it (see `AtimeMode`), if the daemon may
    /// make one; otherwise `noatime` falls back to O_NOATIME opens.
    private static func openSource(_ source: String, _ options: FilesystemOptions,
                                   _ log: Logger) throws -> (Int32, Bool) {
        let attributes: (set: UInt64, clear: UInt64)? = switch options.atime {
        case .backing: nil
        case .relatime: (VANISH_MOUNT_ATTR_RELATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .noatime: (VANISH_MOUNT_ATTR_NOATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .strictatime: (VANISH_MOUNT_ATTR_STRICTATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .nodiratime: (VANISH_MOUNT_ATTR_NODIRATIME, 0)
        }
        if let attributes {
            if options.atimeCopyAllowed && geteuid() == 0 {
                let fd = vanish_open_tree_clone(source, attributes.set, attributes.clear)
                if fd >= 0 { return (fd, true) }
                log.warning("cannot give the source a mount of its own with the atime option: files opened O_NOATIME for noatime",
                            metadata: ["option": "\(options.atime.rawValue)", "error": "\(String(cString: strerror(errno)))"])
            } else {
                log.notice("the atime option applies to files the daemon opens itself (a filesystem is mounted in the source, or the daemon is not root)",
                           metadata: ["option": "\(options.atime.rawValue)"])
            }
        }
        return (try Sys.open(source, VANISH_O_PATH | O_DIRECTORY), false)
    }

    public var fdCacheLimit: Int { namespace.fdLimit }

    public func initialize(_ conn: UnsafeMutablePointer<fuse_conn_info>, transport: Transport) {
        sessionTransport.withLock { $0 = transport }
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
            kernelLeavesUmask.store(true, ordering: .relaxed)
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
            if backingKeepsACLs {
                conn.pointee.want |= UInt32(FUSE_CAP_POSIX_ACL)
                kernelChecksACLs.store(true, ordering: .relaxed)
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
        deleter.start()
        invalidations.start()
        startWatching()
        log.info("session started", metadata: ["fd_cache": "\(namespace.fdLimit)", "cache": "\(options.cache.rawValue)",
                                                "reapers": "\(deleter.reaper?.workerCount ?? 0)", "caller_names": "\(changes.callerNames)",
                                                "passthrough": "\(passthrough.active ? "on" : "off")",
                                                "watch": "\(watch != nil ? "on" : "off")",
                                                "requests": "\(transport.ringComing ? "io_uring" : "/dev/fuse")",
                                                "file_handles": "\(table.codec != nil ? "exportable" : "while cached")"])
        if deleter.graveyard != nil, vanish_filesystem_type(rootFD) == VANISH_OVERLAYFS_SUPER_MAGIC {
            log.warning("""
                the source is on overlayfs: a file from a lower layer is copied up before it can move \
                to the graveyard, and a directory from one is deleted in the request, so deletes of \
                lower-layer entries are not instant
                """)
        }
    }

    private static func keepsACLs(_ rootFD: Int32) -> Bool {
        do throws(Errno) {
            _ = try Sys.getxattr(pathFD: rootFD, "system.posix_acl_access", nil)
            return true
        } catch {
            return error != .notSupported
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
        let depth: UInt32 = vanish_filesystem_type(rootFD) == VANISH_OVERLAYFS_SUPER_MAGIC ? 2 : 1
        let granted = transport.request(wanted, maxStackDepth: depth)
        if wanted.contains(.passthrough) && !granted.contains(.passthrough) { why = "off: the kernel does not offer it" }
        if granted.contains(.passthrough), let backingFiles { passthrough.start(backingFiles) }
        passthroughReason.withLock { $0 = why }
        log.info("kernel features", metadata: ["offered": "\(transport.offered)", "granted": "\(granted)",
                                               "passthrough": "\(why)"])
    }

    /// Lets the filesystem tell the kernel, through the session's
    /// `notifier`, to forget entries it removed or brought back on its own
    /// (`vanish rm`, a restore), as `EntryInvalidations.sender` decides.
    public func notifyKernel(through notifier: Notifier) {
        invalidations.setInvalidator(EntryInvalidations.sender(notifier))
    }

    /// No more notices (the session is ending). Returns once any notice
    /// already queued has been sent, so the session can be destroyed after.
    public func stopNotifyingKernel() { invalidations.setInvalidator(nil) }

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

    // MARK: Shared helpers

    @inline(__always)
    func inode(_ id: fuse_ino_t) -> Inode { table.inode(id) }

    /// The reply for a name that now refers to `node`.
    @inline(__always)
    func entry(_ node: Inode, _ st: stat) -> fuse_entry_param {
        node.sawAttributes(st)
        var e = fuse_entry_param()
        e.ino = table.nodeID(node)
        e.generation = node.generation
        e.attr = devices.present(st)
        e.attr_timeout = cacheTimeout(node)
        e.entry_timeout = e.attr_timeout
        return e
    }

    /// How long the kernel may keep `node`'s name and attributes: an hour
    /// on the source's own filesystem while it is watched, else the cache mode's.
    @inline(__always)
    func cacheTimeout(_ node: Inode) -> Double {
        watch != nil && node.key.dev == table.root.key.dev ? SourceWatch.timeout : options.attrTimeout
    }

    /// Applies the cache policy to a freshly opened file served as `kind`.
    @inline(__always)
    func configure(_ fi: UnsafeMutablePointer<fuse_file_info>, _ kind: OpenKind, _ node: Inode) {
        switch kind {
        // The kernel's page cache is the backing file's: nothing to keep or bypass.
        case .passthrough: break
        case .passthroughDirect: fi.pointee.direct_io = 1
        case .daemon, .cached:
            switch options.cache {
            case .always: fi.pointee.keep_cache = 1
            case .never: fi.pointee.direct_io = 1
            case .auto: break
            }
        }
        // A read-only handle has nothing for close() to report: no write
        // error can be pending on it, it never ends a writing session (the
        // `written` event), and locks are the kernel's. FOPEN_NOFLUSH spares
        // every close of it a round trip (cat, compilers, tar, git reading).
        if fi.pointee.flags & O_ACCMODE == O_RDONLY { fi.pointee.noflush = 1 }
        // A writer in passthrough writes the backing file itself, so no data
        // waits in the kernel at close, and where that file's own close can
        // report nothing (`closesSilently`), a FLUSH would only dup and close
        // an fd: every created file (tar, git checkout, compilers) was one
        // round trip more. Its writing session still ends at the release.
        // O_RDWR handles keep it: a shared mapping, which needs O_RDWR, writes
        // behind the kernel's copy of the mtime, and only FLUSH comes before
        // close() returns (`dropAttributesIfMappedWrites`).
        else if closesSilently && node.key.dev == table.root.key.dev
                    && (kind == .passthrough || kind == .passthroughDirect)
                    && fi.pointee.flags & O_ACCMODE != O_RDWR {
            fi.pointee.noflush = 1
        }
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
