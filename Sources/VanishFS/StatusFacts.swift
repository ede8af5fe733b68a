import FUSEKit
import Glibc
import VanishGraveyard

/// A mount's state at one moment, for `vanish status` (`StatusReport` makes
/// its JSON): four parts, each built where its facts are.
package struct StatusFacts {
    package var place: Place
    package var reaping: Reaping
    package var undoWindow: UndoWindow
    package var serving: Serving

    /// Where the mount's source and state are, and who else shares them.
    package struct Place {
        package var source: String
        package var stateDirectory: String?
        package var graveyard: Bool
        package var socket: String
        /// Where the daemon's log goes.
        package var log: String
        /// This client's id in the source's state directory.
        package var client: String?
        package var leaseSeconds: Double
        /// The other clients of a shared source, and what their graveyards hold.
        package var otherClients: [ClientLeases.Peer]
    }

    /// The graveyards' backlog and the reapers' work (`Deleter.reapingFacts`).
    package struct Reaping {
        /// Graveyard entries not yet reaped, kept ones and one-step deletes being sorted included.
        package var pendingEntries: Int
        package var stuckEntries: Int
        /// One-step deletes (and held entries) put back since the mount, whole or as `rm -r` leaves them.
        package var putBack: Int
        /// Files and directories the reapers have left to delete in due entries; nil if unknown.
        package var remainingWork: Int?
        /// Disk space the graveyards hold, kept entries included, as far as known.
        package var holdingBytes: UInt64
        package var statistics: Reaper.Statistics
        package var pace: Reaper.Pace
        package var idle: Bool
        /// A reaper waits for the mount to go quiet: its pace is no estimate.
        package var yields: Bool
        package var workers: Int
        package var freeBytes: UInt64
        /// Unlinks on their way to the trash, by unlinker: in `pendingEntries`,
        /// not yet among the undo window's entries.
        package var queuedKept: [uid_t: Int] = [:]
    }

    /// The undo window: its terms, what it keeps and what its limits gave up
    /// (`Deleter.undoWindowFacts`).
    package struct UndoWindow {
        /// The asking user's restorable entries (root's facts list none).
        package var restorable: [TrashEntry]
        /// Every user's restorable entries, counted.
        package var count: Int
        /// Theirs in bytes, with the sizes measured since they were buried.
        package var bytes: UInt64
        /// Kept entries the window's limits gave up early since the mount.
        package var shortened: Reaper.Shortening?
        package var keepSeconds: Double
        package var keepMinAgeSeconds: Double
        package var keepExclude: [String]
    }

    /// How requests are served: the kernel's terms, the caches, the channel.
    package struct Serving {
        package var knownInodes: Int
        /// Entries statahead stat'ed ahead of lookups since the mount.
        package var stataheadEntries: UInt64
        package var cachedFDs: Int
        package var fdCacheLimit: Int
        package var kernelFeatures: String
        package var passthrough: String
        /// How long a worker (or a ring thread) spins for one caller's next request (µs; 0: never).
        package var spinMicroseconds: Int
        /// How long the kernel keeps names and attributes of the source's filesystem.
        package var cacheSeconds: Double
        /// Whether file handles outlive the kernel's cache and the mount.
        package var fileHandles: String
        /// /dev/fuse or io_uring, and why.
        package var requests: RequestChannel.State
    }
}

extension Deleter {
    /// The reapers' facts, with the one-step deletes `oneStep` is still sorting.
    func reapingFacts(oneStep: OneStepBurials, heldPutBack: Int) -> StatusFacts.Reaping {
        var fs = statvfs()
        _ = fstatvfs(rootFD, &fs)
        return .init(pendingEntries: pendingEntries + oneStep.count, stuckEntries: stuckEntries, putBack: oneStep.putBack + heldPutBack,
                     remainingWork: remainingWork, holdingBytes: holdingBytes, statistics: reapingStatistics,
                     pace: reapingPace, idle: reapersIdle && oneStep.count == 0, yields: reapersYield,
                     workers: reaper?.workerCount ?? 0, freeBytes: UInt64(fs.f_bavail) * UInt64(fs.f_frsize),
                     queuedKept: burials.queuedKeptByUser())
    }

    /// The undo window's facts, listing `uid`'s entries (none for root, who gets the totals).
    func undoWindowFacts(for uid: uid_t) -> StatusFacts.UndoWindow {
        .init(restorable: uid == 0 ? [] : graveyard?.restorable(of: uid) ?? [],
              count: graveyard?.restorableCount ?? 0, bytes: graveyard?.restorableBytes ?? 0,
              shortened: reaper?.shortened, keepSeconds: Duration.nanoseconds(undoWindow).inSeconds,
              keepMinAgeSeconds: Duration.nanoseconds(keepMinAge).inSeconds, keepExclude: keepExclude)
    }
}
