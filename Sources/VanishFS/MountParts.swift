import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import VanishEvents
import VanishGraveyard

/// The parts of one mount, built from its source in order, each from those
/// before it, the handler types (`RequestHandlers`) last, each given only
/// what it uses: the filesystem's share of the composition root. `Daemon`
/// assembles them and hands them to `VanishFilesystem`; nothing is opened
/// or replayed in an initializer.
package struct MountParts {
    let source: SourceRoot
    let options: FilesystemOptions
    let log: Logger
    let namespace: BackingNamespace
    let deleter: Deleter
    let oneStep: OneStepBurials
    let caches: Caches
    let changes: any ChangeObserver
    let control: MountControl
    /// What the kernel agreed to at INIT, filled in then.
    let kernel: KernelTerms
    let handlers: RequestHandlers

    /// Opens `source` (a directory) as the backing root and its graveyard,
    /// and builds the mount's parts, each from those before it; answered
    /// unlinks a crash left unfinished are finished here. `journal` opens
    /// the event journal in the state directory's `events` directory (an fd
    /// it may keep only while it runs); without it, or without a state
    /// directory, events are off.
    package static func assemble(source path: String, options: FilesystemOptions, logger: Logger,
                                 journal openJournal: ((_ eventsFD: Int32) -> Journal?)? = nil,
                                 status: StatusAttribute = .init()) throws -> MountParts {
        // The source, then deleting: the graveyard, its reaper, lease and unlink log.
        let (source, st) = try SourceRoot.open(path, options, logger)
        let opened: Deleter.Opened
        do { opened = try Deleter.open(source: path, fd: source.fd, options: options, logger: logger) } catch {
            Sys.close(source.fd)
            throw error
        }
        let grave = opened.graveyard
        // The inodes the kernel knows, and the one way handlers reach the backing directory.
        let root = Inode(key: InodeKey(dev: st.st_dev, ino: st.st_ino), type: S_IFDIR, id: UInt64(FUSE_ROOT_ID),
                         generation: 0, parent: nil, name: "")
        root.cache.fd = source.fd
        root.place.lookups = 1
        root.sawAttributes(st)
        let codec = VanishFilesystem.handleCodec(rootFD: source.fd, root: st)
        let table = InodeTable(root: root, codec: codec)
        let burials = DeferredBurials(intents: opened.defersUnlink ? opened.intents : nil)
        let namespace = BackingNamespace(table: table, fdLimit: options.fdCacheLimit ?? FileLimits.defaultCacheLimit(),
                                         burials: burials)
        // Caches that spare syscalls and round trips.
        let watch = options.cache == .auto && source.isLocalDisk && options.watchSource ? codec.flatMap(SourceWatch.init) : nil
        let absentXattrs = AbsentXattrs(enabled: source.isLocalDisk, device: st.st_dev,
                                        timeout: watch != nil ? SourceWatch.timeout : options.attrTimeout)
        let handles = HandleLimits(buried: codec != nil ? grave.map(BuriedNumbers.init) : nil,
                               stateDirectory: grave.flatMap { g in
                                   (try? Sys.fstat(g.sharedFD)).map { InodeKey(dev: $0.st_dev, ino: $0.st_ino) }
                               })
        // Events: the journal, and the recorder handlers tell each change.
        let journal = openJournal.flatMap { open in grave.flatMap(Self.openEventsDirectory).flatMap { fd in
            defer { Sys.close(fd) }
            return open(fd)
        } }
        let changes: any ChangeObserver
        if let journal {
            let recorder = EventRecorder(journal: journal, table: table, namespace: namespace, log: logger,
                                         readsWithoutAtime: SourceRoot.actsForOthers)
            if let reaper = opened.reaper { recorder.recordReaping(of: reaper) }
            changes = recorder
        } else {
            changes = NoEvents()
        }
        // Deleting, then what is built on it; answered unlinks a crash left unfinished are finished now.
        let deleter = Deleter(opened, rootFD: source.fd, namespace: namespace, burials: burials, log: logger)
        deleter.finishInterruptedUnlinks(opened)
        let invalidations = EntryInvalidations()
        let oneStep = OneStepBurials(deleter: deleter, changes: changes, invalidations: invalidations, log: logger)
        let control = MountControl(backingRoot: source.fd, journal: journal, graveyard: grave, reaper: opened.reaper,
                               namespace: namespace, oneStep: oneStep, invalidations: invalidations,
                               changes: changes, log: logger, status: status,
                               trashFolders: deleter.undoWindow > 0 ? grave.map {
                                   TrashFolders(graveyard: $0, table: table, mountpoint: options.mountpoint, log: logger)
                               } : nil)
        // What the reaper holds because its deleter could not remove all of
        // it goes back where it was when that is known; else it is logged.
        if let reaper = opened.reaper {
            let held = reaper.hooks.onHeld
            reaper.hooks.onHeld = { [control] entry, error in
                if !control.putBackHeld(entry) { held?(entry, error) }
            }
            // The file's other names show the link count the kernel cached: it asks again.
            reaper.hooks.onLinkDropped = { [table, invalidations] st in
                if let node = table.known(st) { invalidations.attributes(of: table.nodeID(node), wait: false) }
            }
        }
        let statahead = Statahead(table: table, namespace: namespace) { [deleter] dir, name in
            deleter.isStateDirectory(dir, name)
        }
        // The handlers, each given what it uses.
        let kernel = KernelTerms()
        let replies = EntryReplies(table: table, devices: source.devices, watched: watch != nil,
                                   attrTimeout: options.attrTimeout)
        let reserved = ReservedNames(deleter: deleter, trashFolders: control.trashFolders, table: table,
                                     rootFD: source.fd)
        let openFiles = OpenFiles(passthrough: PassthroughFiles(log: logger))
        let files = FileHandlers(namespace: namespace, openFiles: openFiles, changes: changes,
                                 invalidations: invalidations, deleter: deleter, cache: options.cache,
                                 openFlags: OpenFlagPolicy(options, source), sourceIsLocalDisk: source.isLocalDisk)
        let directories = DirectoryHandlers(namespace: namespace, shares: openFiles.shares, replies: replies,
                                            reserved: reserved, changes: changes, statahead: statahead,
                                            options: options, source: source)
        let attributes = AttributeHandlers(namespace: namespace, replies: replies, changes: changes,
                                           invalidations: invalidations)
        let xattrs = XattrHandlers(namespace: namespace, changes: changes, invalidations: invalidations,
                                   absentXattrs: absentXattrs, kernel: kernel)
        let entries = EntryHandlers(namespace: namespace, replies: replies, changes: changes, deleter: deleter,
                                    invalidations: invalidations, files: files, statahead: statahead, kernel: kernel,
                                    negativeTimeout: options.negativeTimeout,
                                    lookupsTellWalks: options.readdirPlus == .walk, log: logger)
        let trash = TrashRequests(trashFolders: control.trashFolders, namespace: namespace, replies: replies,
                                  reserved: reserved, entries: entries, changes: changes, deleter: deleter,
                                  control: control)
        let exported = ExportedHandles(namespace: namespace, replies: replies, limits: handles)
        let deleteTrigger = DeleteTrigger(namespace: namespace, changes: changes, deleter: deleter, oneStep: oneStep,
                                          invalidations: invalidations, source: source,
                                          mountpoint: options.mountpoint, armed: ArmedRemovals(), log: logger)
        let handlers = RequestHandlers(replies: replies, reserved: reserved, files: files, directories: directories,
                                       attributes: attributes, xattrs: xattrs, entries: entries, trash: trash,
                                       exported: exported, deleteTrigger: deleteTrigger)
        return MountParts(source: source, options: options, log: logger, namespace: namespace, deleter: deleter,
                          oneStep: oneStep,
                          caches: Caches(watch: watch, invalidations: invalidations, absentXattrs: absentXattrs,
                                         statahead: statahead),
                          changes: changes, control: control, kernel: kernel, handlers: handlers)
    }

    /// `.vanish/events`, made if needed: where the journal lives.
    private static func openEventsDirectory(_ graveyard: Graveyard) -> Int32? {
        if mkdirat(graveyard.stateFD, "events", 0o700) != 0 && errno != EEXIST { return nil }
        let fd = openat(graveyard.stateFD, "events", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        return fd >= 0 ? fd : nil
    }
}
