import Glibc
import VanishClient
import VanishFS

/// The JSON `vanish status` shows, read through the mount root's
/// `user.vanish.status` attribute.
enum StatusReport {
    /// Restorable counts and bytes are the caller's own (everything for
    /// root), and only root learns how many entries were buried: another
    /// user's deletions are not theirs to learn of.
    static func json(_ f: StatusFacts, for uid: uid_t) -> String {
        let allRestorable = f.restorableCount
        var (pending, restorable) = (f.pendingEntries, allRestorable)
        var restorableBytes = f.restorableBytes
        if uid != 0 {
            let own = f.restorable.filter { $0.record.uid == uid }
            restorable = own.count
            restorableBytes = own.reduce(0) { $0 + ($1.record.bytes ?? 0) }
            // Others' kept entries leave the backlog too, or it would count them.
            pending = max(0, f.pendingEntries - (allRestorable - own.count))
        }
        // The files and directories left in due entries (the window's and
        // stuck ones are not due) at the recent pace; unknown (null) when a
        // tree's size is, or nothing was freed in the last seconds.
        let eta: JSON = switch f.remainingWork {
        case 0: 0
        case let work? where f.pace.filesPerSecond > 0: JSON(Int((Double(work) / f.pace.filesPerSecond).rounded(.up)))
        default: .null
        }
        let s = f.statistics
        let o: JSON = [
            "version": JSON(VanishVersion.current), "source": JSON(f.source), "pid": JSON(getpid()),
            "state_directory": f.stateDirectory.map { JSON($0) } ?? .null, "graveyard": JSON(f.graveyard),
            "pending_entries": JSON(pending), "eta_seconds": eta, "reaper_idle": JSON(f.reapersIdle),
            "reap_files_per_second": JSON(Int(f.pace.filesPerSecond)),
            "reap_entries_per_second": JSON(Int(f.pace.entriesPerSecond)),
            "reaped_entries": JSON(s.entries), "freed_files": JSON(s.freed.files),
            "freed_directories": JSON(s.freed.directories), "freed_data_bytes": JSON(s.freed.dataBytes),
            "freed_bytes": JSON(s.freed.diskBytes), "buried_entries": uid == 0 ? JSON(s.buried) : .null,
            "reaper_workers": JSON(f.reaperWorkers), "free_bytes": JSON(f.freeBytes),
            "restorable_entries": JSON(restorable), "stuck_entries": JSON(f.stuckEntries),
            "restorable_bytes": JSON(restorableBytes), "keep_seconds": JSON(f.keepSeconds),
            // Waiting to be reaped, the kept entries' known bytes aside.
            "graveyard_bytes": JSON(f.holdingBytes > f.restorableBytes ? f.holdingBytes - f.restorableBytes : 0),
            "socket": JSON(f.socket), "known_inodes": JSON(f.knownInodes),
            "statahead_entries": JSON(Int(f.stataheadEntries)), "cached_fds": JSON(f.cachedFDs),
            "fd_cache_limit": JSON(f.fdCacheLimit), "kernel_features": JSON(f.kernelFeatures),
            "passthrough": JSON(f.passthrough), "spin_microseconds": JSON(f.spinMicroseconds),
            "cache_seconds": JSON(f.cacheSeconds), "file_handles": JSON(f.fileHandles),
            "requests": ["channel": JSON(f.requests.name), "why": f.requests.reason.map { JSON($0) } ?? .null,
                         "queues": JSON(f.requests.queues), "queue_depth": JSON(f.requests.depth),
                         "threads": JSON(f.requests.threads), "buffer_bytes": JSON(Int(f.requests.bufferBytes)),
                         "spin_microseconds": JSON(f.requests.spinMicroseconds)],
            "client": f.client.map { JSON($0) } ?? .null, "lease_seconds": JSON(f.leaseSeconds),
            "other_clients": .array(f.otherClients.map { p -> JSON in
                ["client": JSON(p.client.name), "pending_entries": JSON(p.entries),
                 "silent_seconds": JSON(Int(p.silentSeconds)), "lease": JSON(p.expired ? "expired" : "live")]
            }),
        ]
        return o.serialized
    }
}
