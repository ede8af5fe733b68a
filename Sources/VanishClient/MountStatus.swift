/// What `vanish status` shows of a mount: the one schema the daemon writes
/// (as JSON, in the mount root's `user.vanish.status` attribute) and the
/// command line and other clients read. Counts of deletions are the asking
/// user's own (everything for root).
public struct MountStatus: Sendable, Equatable {
    /// The daemon's release and process.
    public var version = ""
    public var pid = 0
    public var source = ""
    /// Where its state directory is (in the source, or outside it for an in-place mount).
    public var stateDirectory: String?
    /// Whether deletes go to a graveyard (not on a read-only mount).
    public var graveyard = false
    /// Deletions waiting for the reaper, kept ones included.
    public var pendingEntries = 0
    /// Seconds until the due entries are freed at the recent pace; nil when unknown.
    public var etaSeconds: Int?
    /// All reaper workers asleep.
    public var reaperIdle = true
    /// The recent pace (the last few seconds).
    public var reapFilesPerSecond = 0
    public var reapEntriesPerSecond = 0
    public var reapedEntries = 0
    public var freedFiles = 0
    public var freedDirectories = 0
    public var freedDataBytes = 0
    public var freedBytes = 0
    /// Deletions through the mount since it began (root only).
    public var buriedEntries: Int?
    public var reaperWorkers = 0
    public var freeBytes = 0
    public var restorableEntries = 0
    /// Entries the reaper could not delete (logged); tried again later.
    public var stuckEntries = 0
    /// One-step deletes put back since the mount (all or part): their deleters could not remove all of them.
    public var putBackEntries = 0
    public var restorableBytes = 0
    /// The undo window for what is deleted from now on.
    public var keepSeconds = 0.0
    /// Kept entries the window's limits gave up early since the mount, their
    /// bytes, when the latest went (ns since the epoch, 0: never) and why.
    /// The reaper waits for the mount to go quiet now (no estimate meanwhile).
    public var reaperYields = false
    public var shortenedEntries = 0
    public var shortenedBytes = 0
    public var shortenedAtNS: UInt64 = 0
    public var shortenedBecause = ""
    /// Files younger than this when deleted are not kept (s; 0: all are).
    public var keepMinAgeSeconds = 0.0
    /// Name patterns the window never keeps.
    public var keepExclude: [String] = []
    /// Disk space entries waiting for the reaper hold, kept ones aside, as far as known.
    public var graveyardBytes = 0
    public var socket = ""
    /// Where the daemon logs: "stderr", "syslog", or a file's path.
    public var log = ""
    public var knownInodes = 0
    public var stataheadEntries = 0
    public var cachedFDs = 0
    public var fdCacheLimit = 0
    /// What was negotiated beyond libfuse 3.14 (passthrough, parallel_dirops, ...).
    public var kernelFeatures = ""
    /// "on", or "off: " and why.
    public var passthrough = ""
    /// How long a worker spins for one program's next call (µs; 0: never).
    public var spinMicroseconds = 0
    /// How long the kernel keeps names and attributes.
    public var cacheSeconds = 0.0
    public var fileHandles = ""
    public var requests = Requests()
    /// This client's id in the source's state directory.
    public var client: String?
    public var leaseSeconds = 0.0
    public var otherClients: [OtherClient] = []

    /// Which channel brings requests, and why.
    public struct Requests: Sendable, Equatable {
        public var channel = ""
        public var why: String?
        public var queues = 0
        public var queueDepth = 0
        public var threads = 0
        public var bufferBytes = 0
        public var spinMicroseconds = 0
        public init() {}
    }

    /// Another client of a shared source, as this one sees its lease.
    public struct OtherClient: Sendable, Equatable {
        public var client: String
        public var pendingEntries: Int
        public var silentSeconds: Int
        public var leaseExpired: Bool
        public init(client: String, pendingEntries: Int, silentSeconds: Int, leaseExpired: Bool) {
            self.client = client
            self.pendingEntries = pendingEntries
            self.silentSeconds = silentSeconds
            self.leaseExpired = leaseExpired
        }
    }

    public init() {}

    public var json: JSON {
        [
            "version": JSON(version), "source": JSON(source), "pid": JSON(pid),
            "state_directory": stateDirectory.map { JSON($0) } ?? .null, "graveyard": JSON(graveyard),
            "pending_entries": JSON(pendingEntries), "eta_seconds": etaSeconds.map { JSON($0) } ?? .null,
            "reaper_idle": JSON(reaperIdle), "reap_files_per_second": JSON(reapFilesPerSecond),
            "reap_entries_per_second": JSON(reapEntriesPerSecond), "reaped_entries": JSON(reapedEntries),
            "freed_files": JSON(freedFiles), "freed_directories": JSON(freedDirectories),
            "freed_data_bytes": JSON(freedDataBytes), "freed_bytes": JSON(freedBytes),
            "buried_entries": buriedEntries.map { JSON($0) } ?? .null, "reaper_workers": JSON(reaperWorkers),
            "free_bytes": JSON(freeBytes), "restorable_entries": JSON(restorableEntries),
            "stuck_entries": JSON(stuckEntries), "put_back_entries": JSON(putBackEntries), "restorable_bytes": JSON(restorableBytes),
            "keep_seconds": JSON(keepSeconds), "keep_min_age_seconds": JSON(keepMinAgeSeconds),
            "reaper_yields": JSON(reaperYields), "shortened_entries": JSON(shortenedEntries), "shortened_bytes": JSON(shortenedBytes),
            "shortened_at_ns": JSON(shortenedAtNS), "shortened_because": JSON(shortenedBecause),
            "keep_exclude": .array(keepExclude.map { JSON($0) }), "graveyard_bytes": JSON(graveyardBytes), "socket": JSON(socket), "log": JSON(log),
            "known_inodes": JSON(knownInodes), "statahead_entries": JSON(stataheadEntries),
            "cached_fds": JSON(cachedFDs), "fd_cache_limit": JSON(fdCacheLimit),
            "kernel_features": JSON(kernelFeatures), "passthrough": JSON(passthrough),
            "spin_microseconds": JSON(spinMicroseconds), "cache_seconds": JSON(cacheSeconds),
            "file_handles": JSON(fileHandles),
            "requests": ["channel": JSON(requests.channel), "why": requests.why.map { JSON($0) } ?? .null,
                         "queues": JSON(requests.queues), "queue_depth": JSON(requests.queueDepth),
                         "threads": JSON(requests.threads), "buffer_bytes": JSON(requests.bufferBytes),
                         "spin_microseconds": JSON(requests.spinMicroseconds)],
            "client": client.map { JSON($0) } ?? .null, "lease_seconds": JSON(leaseSeconds),
            "other_clients": .array(otherClients.map { c -> JSON in
                ["client": JSON(c.client), "pending_entries": JSON(c.pendingEntries),
                 "silent_seconds": JSON(c.silentSeconds), "lease": JSON(c.leaseExpired ? "expired" : "live")]
            }),
        ]
    }

    /// Reads the JSON a daemon wrote; nil if it is not an object. Missing
    /// fields (an older daemon) keep their defaults.
    public init?(json o: JSON) {
        guard o.object != nil else { return nil }
        func int(_ k: String) -> Int { o[k]?.int ?? 0 }
        version = o["version"]?.string ?? "unknown"
        pid = int("pid")
        source = o["source"]?.string ?? "?"
        stateDirectory = o["state_directory"]?.string
        graveyard = o["graveyard"]?.bool ?? false
        pendingEntries = int("pending_entries")
        etaSeconds = o["eta_seconds"]?.int
        reaperIdle = o["reaper_idle"]?.bool ?? true
        reapFilesPerSecond = int("reap_files_per_second")
        reapEntriesPerSecond = int("reap_entries_per_second")
        reapedEntries = int("reaped_entries")
        freedFiles = int("freed_files")
        freedDirectories = int("freed_directories")
        freedDataBytes = int("freed_data_bytes")
        freedBytes = int("freed_bytes")
        buriedEntries = o["buried_entries"]?.int
        reaperWorkers = int("reaper_workers")
        freeBytes = int("free_bytes")
        restorableEntries = int("restorable_entries")
        stuckEntries = int("stuck_entries")
        putBackEntries = int("put_back_entries")
        restorableBytes = int("restorable_bytes")
        keepSeconds = o["keep_seconds"]?.double ?? 0
        keepMinAgeSeconds = o["keep_min_age_seconds"]?.double ?? 0
        reaperYields = o["reaper_yields"]?.bool ?? false
        shortenedEntries = int("shortened_entries")
        shortenedBytes = int("shortened_bytes")
        shortenedAtNS = o["shortened_at_ns"]?.uint64 ?? 0
        shortenedBecause = o["shortened_because"]?.string ?? ""
        keepExclude = (o["keep_exclude"]?.array ?? []).compactMap(\.string)
        graveyardBytes = int("graveyard_bytes")
        socket = o["socket"]?.string ?? ""
        log = o["log"]?.string ?? ""
        knownInodes = int("known_inodes")
        stataheadEntries = int("statahead_entries")
        cachedFDs = int("cached_fds")
        fdCacheLimit = int("fd_cache_limit")
        kernelFeatures = o["kernel_features"]?.string ?? "?"
        passthrough = o["passthrough"]?.string ?? "?"
        spinMicroseconds = int("spin_microseconds")
        cacheSeconds = o["cache_seconds"]?.double ?? 0
        fileHandles = o["file_handles"]?.string ?? ""
        if let r = o["requests"] {
            requests.channel = r["channel"]?.string ?? "?"
            requests.why = r["why"]?.string
            requests.queues = r["queues"]?.int ?? 0
            requests.queueDepth = r["queue_depth"]?.int ?? 0
            requests.threads = r["threads"]?.int ?? 0
            requests.bufferBytes = r["buffer_bytes"]?.int ?? 0
            requests.spinMicroseconds = r["spin_microseconds"]?.int ?? 0
        }
        client = o["client"]?.string
        leaseSeconds = o["lease_seconds"]?.double ?? 0
        otherClients = (o["other_clients"]?.array ?? []).map { c in
            OtherClient(client: c["client"]?.string ?? "?", pendingEntries: c["pending_entries"]?.int ?? 0,
                        silentSeconds: c["silent_seconds"]?.int ?? 0, leaseExpired: c["lease"]?.string == "expired")
        }
    }
}
