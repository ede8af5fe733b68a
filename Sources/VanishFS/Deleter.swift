import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import SystemPackage
import VanishGraveyard

/// The one owner of deleting: the graveyard and its reapers (the source's
/// and those of filesystems mounted inside it), this client's lease, the
/// log of answered unlinks and the burials they owe. Handlers ask it to
/// remove, replace or bury an entry (Mutations.swift); only it knows
/// whether an undo window keeps what goes.
final class Deleter: Sendable {
    /// Where deleted entries go; nil when the source cannot hold one
    /// (read-only): deletes are then done in the request.
    let graveyard: Graveyard?
    let reaper: Reaper?
    /// This client's lease, and the adoption of gone clients' graveyards.
    let leases: ClientLeases?
    /// Graveyards of filesystems mounted inside the source, made as needed.
    let nested = NestedGraveyards()
    /// The state directory's path (in the source, or outside it: `StateLocation`); nil without a graveyard.
    let stateDirectory: String?
    /// Whether unlinks are answered before their rename (see `DeferredBurials`).
    let defersUnlink: Bool
    /// The log of answered unlinks when it is kept on this machine (a network
    /// backend): removed at a clean end, once every answered unlink landed.
    private let localUnlinkLog: String?
    let namespace: BackingNamespace
    /// The unlinks answered before their rename: begun, queued and landed
    /// here; the namespace waits for them before showing a name.
    let burials: DeferredBurials
    let rootFD: Int32
    let log: Logger
    /// Each deleter's room for one-step deletes (nil without a graveyard, or where it could not be made).
    let rooms: DeleterRooms?

    /// How long deleted entries stay restorable (ns; 0: no undo window).
    var undoWindow: UInt64 { reaper?.policy.keep ?? 0 }
    /// What the window does not keep (see `Reaper.Policy`).
    var keepMinAge: UInt64 { reaper?.policy.keepMinAge ?? 0 }
    var keepExclude: [String] { reaper?.policy.keepExclude ?? [] }
    /// The inodes the kernel knows (the namespace's).
    var table: InodeTable { namespace.table }

    /// What deleting needs from the source, opened before the inode table
    /// and namespace exist (the namespace holds the unlink log).
    struct Opened {
        var graveyard: Graveyard?
        var stateDirectory: String?
        var reaper: Reaper?
        var leases: ClientLeases?
        /// The log of answered unlinks, when unlinks are answered before their burial.
        var intents: UnlinkIntents?
        /// An older log left by a crashed session, to finish.
        var leftover: UnlinkIntents?
        var localLog: String?
        var defersUnlink = false
    }

    /// Opens the graveyard of `source` (its backing root `fd`), in the
    /// source or outside it (see StateLocation), its reaper, lease and
    /// unlink log. A source that cannot hold a graveyard gets none.
    static func open(source: String, fd: Int32, options: FilesystemOptions, logger: Logger) throws -> Opened {
        var opened = Opened()
        guard options.deleting.graveyard else { return opened }
        let outside = options.deleting.stateBases.isEmpty ? nil
            : StateLocation.directory(for: source, sourceFD: fd, bases: options.deleting.stateBases, create: options.deleting.stateOutside)
        defer { if let outside { Sys.close(outside.fd) } }
        var stateRoot = fd
        var statePlace = source
        if let outside, options.deleting.stateOutside || Graveyard.isStateDirectory(in: outside.fd) {
            if options.deleting.stateOutside, try !StateLocation.moveIn(from: fd, to: outside.fd) {
                logger.warning("the source has a state directory of its own beside the one outside it; using the outside one",
                               metadata: ["source": "\(source)"])
            }
            stateRoot = outside.fd
            statePlace = outside.path
        }
        let grave: Graveyard
        do {
            grave = try Graveyard(rootFD: stateRoot, client: options.deleting.client ?? ClientID.local(source: source))
        } catch GraveyardError.cannotCreate(let why)
                    where [.permissionDenied, .readOnlyFileSystem, .notPermitted].contains(why) {
            // A source we may read but not write: serve it, deleting in the request.
            logger.warning("no graveyard: deletes will be done in the request", metadata: ["why": "\(why)"])
            return opened
        } catch {
            throw error
        }
        opened.graveyard = grave
        opened.stateDirectory = (statePlace == "/" ? "" : statePlace) + "/" + Graveyard.stateDirectoryName
        let reaper = Reaper(graveyard: grave, workers: options.deleting.reaperWorkers ?? Reaper.defaultWorkers(for: grave),
                            policy: options.deleting.reaping)
        reaper.hooks.onStuck = { entry, error in
            logger.warning("cannot delete a graveyard entry; it stays until the next mount or vanish reap",
                           metadata: ["entry": "\(entry)", "error": "\(error)"])
        }
        reaper.hooks.onShortened = { s in
            logger.warning("undo window shortened: kept entries given up before their windows ended",
                           metadata: ["entries": "\(s.entries)", "bytes": "\(s.bytes)", "because": "\(s.because)"])
        }
        reaper.hooks.onHeld = { entry, error in
            logger.warning("its deleter could not remove all of a graveyard entry: kept in their trash until restored",
                           metadata: ["entry": "\(entry)", "error": "\(error)"])
        }
        opened.reaper = reaper
        let leases = try ClientLeases(graveyard: grave, length: options.deleting.leaseLength, adopting: true)
        leases.landed = { [unowned reaper] shard in reaper.noteBuried(shard: shard, dueNow: true) }
        leases.adopted = { client, entries in
            logger.notice("adopted the graveyard of a client whose lease expired",
                          metadata: ["client": "\(client)", "entries": "\(entries)"])
        }
        opened.leases = leases
        // Answering unlinks before their burial needs the log that lets the
        // next mount finish them if this daemon dies first.
        do {
            (opened.intents, opened.leftover, opened.localLog) = try UnlinkIntents.open(for: grave, source: source)
        } catch {
            logger.warning("cannot keep the log of answered unlinks: unlinks wait for their burial",
                           metadata: ["error": "\(error)"])
        }
        opened.defersUnlink = opened.intents != nil && options.deleting.deferUnlink && options.cache != .never
        return opened
    }

    init(_ opened: Opened, rootFD: Int32, namespace: BackingNamespace, burials: DeferredBurials, log: Logger) {
        graveyard = opened.graveyard
        reaper = opened.reaper
        leases = opened.leases
        stateDirectory = opened.stateDirectory
        defersUnlink = opened.defersUnlink
        localUnlinkLog = opened.localLog
        self.rootFD = rootFD
        self.namespace = namespace
        self.burials = burials
        self.log = log
        rooms = opened.graveyard?.rooms
        if opened.graveyard != nil && rooms == nil {
            log.warning("no rooms for one-step deletes: vanish rm deletes file by file")
        }
    }

    /// Starts the reapers, the lease and the landing of queued burials
    /// (after daemonizing: a fork keeps only the forking thread).
    /// `landed`: burials landed in this directory, which changed its size
    /// (tmpfs, btrfs, XFS) and times after the kernel was given them.
    func start(landed: @escaping @Sendable (Inode) -> Void) {
        reaper?.start()
        leases?.start()
        if defersUnlink {
            burials.start(land: { [unowned self] q in
                do throws(Errno) {
                    try namespace.landing(in: q.directory) { pfd in landQueued(q, parentFD: pfd) }
                } catch {
                    // The directory is no longer where it was: it went to the
                    // graveyard whole (`vanish rm` of it or above), with the file.
                    log.debug("a queued burial's directory is gone", metadata: ["error": "\(error)"])
                }
            }, landed: landed)
        }
    }

    /// After the session ended: finish emptying the graveyard (after an
    /// unmount) or stop at once (after a signal, leaving the rest for the next start).
    func stop(finish: Bool) {
        // Unlinks already answered are owed their rename, whatever the signal.
        burials.stop()
        if let localUnlinkLog { Glibc.unlink(localUnlinkLog) }
        leases?.stopAdopting()
        let reapers = allReapers
        for r in reapers { r.stop(finish ? .whenEmpty : .now) }
        for r in reapers { r.join() }
        leases?.stop()
        let s = reapingStatistics
        log.info("reaper stopped", metadata: ["entries": "\(s.entries)", "files": "\(s.freed.files)",
                                              "directories": "\(s.freed.directories)", "bytes": "\(s.freed.diskBytes)",
                                              "left": "\(pendingEntries)"])
    }

    /// The source's reaper and those of nested filesystems.
    var allReapers: [Reaper] { (reaper.map { [$0] } ?? []) + nested.reapers }

    /// Entries no reaper could delete, still in their graveyards.
    var stuckEntries: Int { allReapers.reduce(0) { $0 + $1.stuckEntries().count } }

    /// Files and directories every reaper has left to delete in due
    /// entries, with burials still pending counted one each; nil if unknown.
    var remainingWork: Int? {
        var sum = burials.count
        for r in allReapers {
            guard let w = r.remainingWork() else { return nil }
            sum += w
        }
        return sum
    }

    /// What every reaper (the source's and nested filesystems') has done.
    var reapingStatistics: Reaper.Statistics {
        allReapers.reduce(into: .zero) { sum, r in
            let s = r.statistics
            sum.entries += s.entries; sum.freed += s.freed; sum.buried += s.buried
        }
    }

    /// The recent pace of every reaper together.
    var reapingPace: Reaper.Pace {
        allReapers.reduce(into: .zero) { sum, r in
            let p = r.pace
            sum.filesPerSecond += p.filesPerSecond
            sum.entriesPerSecond += p.entriesPerSecond
        }
    }

    /// Entries waiting in every graveyard, and unlinks on their way there
    /// (directory scans: not for the hot path).
    var pendingEntries: Int { burials.count + allReapers.reduce(0) { $0 + $1.pendingEntries() } }

    /// Whether every reaper is asleep with nothing left to do.
    var reapersIdle: Bool { burials.isEmpty && allReapers.allSatisfy(\.isIdle) }
    /// Whether a reaper steps aside for requests now (see `Reaper.yieldsToForeground`).
    var reapersYield: Bool { allReapers.contains { $0.yieldsToForeground } }

    /// Disk space the graveyards hold, kept entries included, as far as known.
    var holdingBytes: UInt64 { allReapers.reduce(0) { $0 + $1.holdingBytes } }

    /// Whether `name` in `parent` is a state directory: the source root's,
    /// or a nested filesystem's root's with a graveyard. Compared without allocating.
    @inline(__always)
    func isStateDirectory(_ parent: Inode, _ name: UnsafePointer<CChar>) -> Bool {
        guard name[0] == 0x2E, graveyard != nil, strcmp(name, Graveyard.stateDirectoryName) == 0 else { return false }
        return parent === table.root || isNestedStateDirectory(in: parent)
    }
}

extension Deleter {
    /// Runs `body` once more when the backing filesystem answered ENOSPC
    /// while the undo window holds entries, once the oldest are freed
    /// (`Reaper.makeRoom`): deleting never costs a writer its space.
    @inline(__always)
    func makingRoom<T>(_ body: () throws(Errno) -> T) throws(Errno) -> T {
        do throws(Errno) {
            return try body()
        } catch .noSpace {
            // Files deleted a moment ago may still wait on their directory's queue: into the trash first.
            burials.landQueued()
            guard let reaper, reaper.makeRoom() else { throw .noSpace }
            return try body()
        }
    }
}
