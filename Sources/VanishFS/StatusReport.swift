import Glibc
import VanishClient

/// The JSON `vanish status` shows, read through the mount root's
/// `user.vanish.status` attribute.
package enum StatusReport {
    /// Restorable counts and bytes are the caller's own (everything for
    /// root), and only root learns how many entries were buried: another
    /// user's deletions are not theirs to learn of.
    package static func json(_ f: StatusFacts, for uid: uid_t) -> String {
        let allRestorable = f.undoWindow.count
        var (pending, restorable) = (f.reaping.pendingEntries, allRestorable)
        var restorableBytes = f.undoWindow.bytes
        if uid != 0 {
            let own = f.undoWindow.restorable.filter { $0.record.uid == uid }
            restorable = own.count
            // A held entry's measure is root's to see (see `trash list`).
            restorableBytes = own.reduce(0) { $0 + ($1.record.held == nil ? $1.record.bytes ?? 0 : 0) }
            // Others' kept entries leave the backlog too, or it would count them,
            // and so do their unlinks still on the way to the trash.
            let othersOnTheWay = f.reaping.queuedKept.reduce(0) { $0 + ($1.key == uid ? 0 : $1.value) }
            pending = max(0, f.reaping.pendingEntries - (allRestorable - own.count) - othersOnTheWay)
        }
        // The files and directories left in due entries (the window's and
        // stuck ones are not due) at the recent pace; unknown (null) when a
        // tree's size is, or nothing was freed in the last seconds.
        // Nor while the reaper steps aside for requests: after rm -rf of 111k
        // files the pace it kept meanwhile said 24 min for what took 29 s.
        let eta: Int? = switch f.reaping.remainingWork {
        case 0: 0
        case let work? where f.reaping.pace.filesPerSecond > 0 && !f.reaping.yields: Int((Double(work) / f.reaping.pace.filesPerSecond).rounded(.up))
        default: nil
        }
        let s = f.reaping.statistics
        var o = MountStatus()
        o.version = VanishVersion.current
        o.source = f.place.source
        o.pid = Int(getpid())
        o.stateDirectory = f.place.stateDirectory
        o.graveyard = f.place.graveyard
        o.pendingEntries = pending
        o.etaSeconds = eta
        o.reaperIdle = f.reaping.idle
        o.reaperYields = f.reaping.yields
        o.reapFilesPerSecond = Int(f.reaping.pace.filesPerSecond)
        o.reapEntriesPerSecond = Int(f.reaping.pace.entriesPerSecond)
        o.reapedEntries = Int(s.entries)
        o.freedFiles = Int(s.freed.files)
        o.freedDirectories = Int(s.freed.directories)
        o.freedDataBytes = Int(s.freed.dataBytes)
        o.freedBytes = Int(s.freed.diskBytes)
        o.buriedEntries = uid == 0 ? Int(s.buried) : nil
        o.reaperWorkers = f.reaping.workers
        o.freeBytes = Int(f.reaping.freeBytes)
        o.restorableEntries = restorable
        o.stuckEntries = f.reaping.stuckEntries
        o.putBackEntries = f.reaping.putBack
        if let s = f.undoWindow.shortened {
            (o.shortenedEntries, o.shortenedBytes, o.shortenedAtNS, o.shortenedBecause) = (s.entries, Int(s.bytes), s.at, s.because)
        }
        o.restorableBytes = Int(restorableBytes)
        o.keepSeconds = f.undoWindow.keepSeconds
        o.keepMinAgeSeconds = f.undoWindow.keepMinAgeSeconds
        o.keepExclude = f.undoWindow.keepExclude
        // Waiting to be reaped, the kept entries' known bytes aside.
        // Nothing waiting holds nothing, whatever the estimate kept.
        o.graveyardBytes = pending == 0 ? 0 : Int(f.reaping.holdingBytes > f.undoWindow.bytes ? f.reaping.holdingBytes - f.undoWindow.bytes : 0)
        o.socket = f.place.socket
        o.log = f.place.log
        o.knownInodes = f.serving.knownInodes
        o.stataheadEntries = Int(f.serving.stataheadEntries)
        o.cachedFDs = f.serving.cachedFDs
        o.fdCacheLimit = f.serving.fdCacheLimit
        o.kernelFeatures = f.serving.kernelFeatures
        o.passthrough = f.serving.passthrough
        o.spinMicroseconds = f.serving.spinMicroseconds
        o.cacheSeconds = f.serving.cacheSeconds
        o.fileHandles = f.serving.fileHandles
        o.requests.channel = f.serving.requests.name
        o.requests.why = f.serving.requests.reason
        o.requests.queues = f.serving.requests.queues
        o.requests.queueDepth = f.serving.requests.depth
        o.requests.threads = f.serving.requests.threads
        o.requests.bufferBytes = Int(f.serving.requests.bufferBytes)
        o.requests.spinMicroseconds = f.serving.requests.spinMicroseconds
        o.requests.forgets = Int(f.serving.requests.forgets)
        o.requests.forgetReads = Int(f.serving.requests.forgetReads)
        o.requests.watches = Int(f.serving.requests.watches)
        o.client = f.place.client
        o.leaseSeconds = f.place.leaseSeconds
        o.otherClients = f.place.otherClients.map {
            MountStatus.OtherClient(client: $0.client.name, pendingEntries: $0.entries,
                                    silentSeconds: Int($0.silentSeconds), leaseExpired: $0.expired)
        }
        return o.json.serialized
    }
}
