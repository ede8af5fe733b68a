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
        /// Nodes forgotten in forgets read from /dev/fuse, and the reads that brought them.
        public var forgets = 0
        public var forgetReads = 0
        /// Replies after which a ring thread watched its queue for the caller's next request.
        public var watches = 0
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

    /// The status as JSON, by `fields`.
    public var json: JSON {
        .object(Dictionary(uniqueKeysWithValues: Self.fields.map { ($0.key, $0.write(self)) }))
    }

    /// Reads the JSON a daemon wrote; nil if it is not an object. Missing
    /// fields (an older daemon) keep their defaults.
    public init?(json o: JSON) {
        guard o.object != nil else { return nil }
        for field in Self.fields { field.read(&self, o[field.key]) }
    }

    /// One field: its key, and how it is written and read. Both directions
    /// come from this one table, so a new field is one line here.
    struct Field: @unchecked Sendable {
        let key: String
        let write: (MountStatus) -> JSON
        let read: (inout MountStatus, JSON?) -> Void

        /// `path` as `key`; `missing` when an older daemon did not write it.
        static func plain<V: StatusValue>(_ key: String, _ path: WritableKeyPath<MountStatus, V>, missing: V) -> Field {
            Field(key: key, write: { $0[keyPath: path].json }, read: { s, j in s[keyPath: path] = j.flatMap(V.init(json:)) ?? missing })
        }
    }

    static let fields: [Field] = [
        .plain("version", \.version, missing: "unknown"), .plain("source", \.source, missing: "?"), .plain("pid", \.pid, missing: 0),
        .plain("state_directory", \.stateDirectory, missing: nil), .plain("graveyard", \.graveyard, missing: false),
        .plain("pending_entries", \.pendingEntries, missing: 0), .plain("eta_seconds", \.etaSeconds, missing: nil),
        .plain("reaper_idle", \.reaperIdle, missing: true), .plain("reap_files_per_second", \.reapFilesPerSecond, missing: 0),
        .plain("reap_entries_per_second", \.reapEntriesPerSecond, missing: 0), .plain("reaped_entries", \.reapedEntries, missing: 0),
        .plain("freed_files", \.freedFiles, missing: 0), .plain("freed_directories", \.freedDirectories, missing: 0),
        .plain("freed_data_bytes", \.freedDataBytes, missing: 0), .plain("freed_bytes", \.freedBytes, missing: 0),
        .plain("buried_entries", \.buriedEntries, missing: nil), .plain("reaper_workers", \.reaperWorkers, missing: 0),
        .plain("free_bytes", \.freeBytes, missing: 0), .plain("restorable_entries", \.restorableEntries, missing: 0),
        .plain("stuck_entries", \.stuckEntries, missing: 0), .plain("put_back_entries", \.putBackEntries, missing: 0),
        .plain("restorable_bytes", \.restorableBytes, missing: 0),
        .plain("keep_seconds", \.keepSeconds, missing: 0), .plain("keep_min_age_seconds", \.keepMinAgeSeconds, missing: 0),
        .plain("reaper_yields", \.reaperYields, missing: false), .plain("shortened_entries", \.shortenedEntries, missing: 0),
        .plain("shortened_bytes", \.shortenedBytes, missing: 0), .plain("shortened_at_ns", \.shortenedAtNS, missing: 0),
        .plain("shortened_because", \.shortenedBecause, missing: ""), .plain("keep_exclude", \.keepExclude, missing: []),
        .plain("graveyard_bytes", \.graveyardBytes, missing: 0), .plain("socket", \.socket, missing: ""),
        .plain("log", \.log, missing: ""), .plain("known_inodes", \.knownInodes, missing: 0),
        .plain("statahead_entries", \.stataheadEntries, missing: 0), .plain("cached_fds", \.cachedFDs, missing: 0),
        .plain("fd_cache_limit", \.fdCacheLimit, missing: 0), .plain("kernel_features", \.kernelFeatures, missing: "?"),
        .plain("passthrough", \.passthrough, missing: "?"), .plain("spin_microseconds", \.spinMicroseconds, missing: 0),
        .plain("cache_seconds", \.cacheSeconds, missing: 0), .plain("file_handles", \.fileHandles, missing: ""),
        .plain("client", \.client, missing: nil), .plain("lease_seconds", \.leaseSeconds, missing: 0),
        Field(key: "requests", write: { s in
            let r = s.requests
            return ["channel": JSON(r.channel), "why": r.why.map { JSON($0) } ?? .null, "queues": JSON(r.queues),
                    "queue_depth": JSON(r.queueDepth), "threads": JSON(r.threads), "buffer_bytes": JSON(r.bufferBytes),
                    "spin_microseconds": JSON(r.spinMicroseconds), "forgets": JSON(r.forgets),
                    "forget_reads": JSON(r.forgetReads), "watches": JSON(r.watches)]
        }, read: { s, r in
            guard let r else { return }
            s.requests.channel = r["channel"]?.string ?? "?"
            s.requests.why = r["why"]?.string
            s.requests.queues = r["queues"]?.int ?? 0
            s.requests.queueDepth = r["queue_depth"]?.int ?? 0
            s.requests.threads = r["threads"]?.int ?? 0
            s.requests.bufferBytes = r["buffer_bytes"]?.int ?? 0
            s.requests.spinMicroseconds = r["spin_microseconds"]?.int ?? 0
            s.requests.forgets = r["forgets"]?.int ?? 0
            s.requests.forgetReads = r["forget_reads"]?.int ?? 0
            s.requests.watches = r["watches"]?.int ?? 0
        }),
        Field(key: "other_clients", write: { s in
            .array(s.otherClients.map { c -> JSON in
                ["client": JSON(c.client), "pending_entries": JSON(c.pendingEntries),
                 "silent_seconds": JSON(c.silentSeconds), "lease": JSON(c.leaseExpired ? "expired" : "live")]
            })
        }, read: { s, o in
            s.otherClients = (o?.array ?? []).map { c in
                OtherClient(client: c["client"]?.string ?? "?", pendingEntries: c["pending_entries"]?.int ?? 0,
                            silentSeconds: c["silent_seconds"]?.int ?? 0, leaseExpired: c["lease"]?.string == "expired")
            }
        }),
    ]
}

/// A value a status field holds, to and from JSON.
protocol StatusValue {
    var json: JSON { get }
    init?(json: JSON)
}

extension Int: StatusValue {
    var json: JSON { JSON(self) }
    init?(json: JSON) { guard let v = json.int else { return nil }; self = v }
}
extension UInt64: StatusValue {
    var json: JSON { JSON(self) }
    init?(json: JSON) { guard let v = json.uint64 else { return nil }; self = v }
}
extension Double: StatusValue {
    var json: JSON { JSON(self) }
    init?(json: JSON) { guard let v = json.double else { return nil }; self = v }
}
extension Bool: StatusValue {
    var json: JSON { JSON(self) }
    init?(json: JSON) { guard let v = json.bool else { return nil }; self = v }
}
extension String: StatusValue {
    var json: JSON { JSON(self) }
    init?(json: JSON) { guard let v = json.string else { return nil }; self = v }
}
extension Array: StatusValue where Element == String {
    var json: JSON { .array(map { JSON($0) }) }
    init?(json: JSON) { guard let a = json.array else { return nil }; self = a.compactMap(\.string) }
}
extension Optional: StatusValue where Wrapped: StatusValue {
    var json: JSON { map(\.json) ?? .null }
    init?(json: JSON) {
        guard let v = Wrapped(json: json) else { return nil }
        self = .some(v)
    }
}
