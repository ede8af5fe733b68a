import Glibc
import VanishClient

/// The JSON `vanish status` shows, read through the mount root's
/// `user.vanish.status` attribute.
package enum StatusReport {
    /// Restorable counts and bytes are the caller's own (everything for
    /// root), and only root learns how many entries were buried: another
    /// user's deletions are not theirs to learn of.
    package static func json(_ f: StatusFacts, for uid: uid_t) -> String {
        let allRestorable = f.restorableCount
        var (pending, restorable) = (f.pendingEntries, allRestorable)
        var restorableBytes = f.restorableBytes
        if uid != 0 {
            let own = f.restorable.filter { $0.record.uid == uid }
            restorable = own.count
            // A held entry's measure is root's to see (see `trash list`).
            restorableBytes = own.reduce(0) { $0 + ($1.record.held == nil ? $1.record.bytes ?? 0 : 0) }
            // Others' kept entries leave the backlog too, or it would count them.
            pending = max(0, f.pendingEntries - (allRestorable - own.count))
        }
        // The files and directories left in due entries (the window's and
        // stuck ones are not due) at the recent pace; unknown (null) when a
        // tree's size is, or nothing was freed in the last seconds.
        // Nor while the reaper steps aside for requests: after rm -rf of 111k
        // files the pace it kept meanwhile said 24 min for what took 29 s.
        let eta: Int? = switch f.remainingWork {
        case 0: 0
        case let work? where f.pace.filesPerSecond > 0 && !f.reapersYield: Int((Double(work) / f.pace.filesPerSecond).rounded(.up))
        default: nil
        }
        let s = f.statistics
        var o = MountStatus()
        o.version = VanishVersion.current
        o.source = f.source
        o.pid = Int(getpid())
        o.stateDirectory = f.stateDirectory
        o.graveyard = f.graveyard
        o.pendingEntries = pending
        o.etaSeconds = eta
        o.reaperIdle = f.reapersIdle
        o.reaperYields = f.reapersYield
        o.reapFilesPerSecond = Int(f.pace.filesPerSecond)
        o.reapEntriesPerSecond = Int(f.pace.entriesPerSecond)
        o.reapedEntries = Int(s.entries)
        o.freedFiles = Int(s.freed.files)
        o.freedDirectories = Int(s.freed.directories)
        o.freedDataBytes = Int(s.freed.dataBytes)
        o.freedBytes = Int(s.freed.diskBytes)
        o.buriedEntries = uid == 0 ? Int(s.buried) : nil
        o.reaperWorkers = f.reaperWorkers
        o.freeBytes = Int(f.freeBytes)
        o.restorableEntries = restorable
        o.stuckEntries = f.stuckEntries
        o.putBackEntries = f.putBack
        if let s = f.shortened {
            (o.shortenedEntries, o.shortenedBytes, o.shortenedAtNS, o.shortenedBecause) = (s.entries, Int(s.bytes), s.at, s.because)
        }
        o.restorableBytes = Int(restorableBytes)
        o.keepSeconds = f.keepSeconds
        o.keepMinAgeSeconds = f.keepMinAgeSeconds
        o.keepExclude = f.keepExclude
        // Waiting to be reaped, the kept entries' known bytes aside.
        // Nothing waiting holds nothing, whatever the estimate kept.
        o.graveyardBytes = pending == 0 ? 0 : Int(f.holdingBytes > f.restorableBytes ? f.holdingBytes - f.restorableBytes : 0)
        o.socket = f.socket
        o.log = f.log
        o.knownInodes = f.knownInodes
        o.stataheadEntries = Int(f.stataheadEntries)
        o.cachedFDs = f.cachedFDs
        o.fdCacheLimit = f.fdCacheLimit
        o.kernelFeatures = f.kernelFeatures
        o.passthrough = f.passthrough
        o.spinMicroseconds = f.spinMicroseconds
        o.cacheSeconds = f.cacheSeconds
        o.fileHandles = f.fileHandles
        o.requests.channel = f.requests.name
        o.requests.why = f.requests.reason
        o.requests.queues = f.requests.queues
        o.requests.queueDepth = f.requests.depth
        o.requests.threads = f.requests.threads
        o.requests.bufferBytes = Int(f.requests.bufferBytes)
        o.requests.spinMicroseconds = f.requests.spinMicroseconds
        o.client = f.client
        o.leaseSeconds = f.leaseSeconds
        o.otherClients = f.otherClients.map {
            MountStatus.OtherClient(client: $0.client.name, pendingEntries: $0.entries,
                                    silentSeconds: Int($0.silentSeconds), leaseExpired: $0.expired)
        }
        return o.json.serialized
    }
}
