import ArgumentParser
import CLinux
import Glibc
import LinuxSyscalls
import VanishClient

struct StatusCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "status",
        abstract: "Show a mount's graveyard backlog and what the reaper has freed.",
        discussion: "Reads the user.vanish.status attribute of the mount's root."
    )

    @Flag(help: "Print the raw JSON.")
    var json = false

    @Flag(help: "Wait until the graveyard is empty (but for entries the undo window keeps and those that cannot be deleted), showing progress.")
    var wait = false

    @OptionGroup var target: MountpointArgument
    var mountpoint: String { target.mountpoint }

    func validate() throws { try target.requireVanishRoot() }

    func run() throws {
        var status = try read()
        if wait {
            let start = Condition.now()
            // Progress is what was freed since waiting began, not since the mount.
            let first = (files: status.freedFiles, directories: status.freedDirectories, bytes: status.freedBytes)
            let firstDue = status.due
            let terminal = isatty(1) != 0
            var lastLine: UInt64 = 0
            while !status.settled {
                let now = Condition.now()
                let elapsed = Double(now - start) / 1e9
                let freed = status.freedFiles - first.files + status.freedDirectories - first.directories
                let average = elapsed > 0 ? Int(Double(freed) / elapsed) : 0
                let rate = status.filesPerSecond > 0 ? status.filesPerSecond : average
                let line = "waiting: \(status.due) of \(max(firstDue, status.due)) deletions left; "
                    + "\(freed) files and directories, \(bytes(status.freedBytes - first.bytes)) freed in \(duration(elapsed))"
                    + (rate >= 1 ? ", \(rate)/s" : "")
                    + (status.eta.map { ", about \(duration(Double($0))) left" } ?? "")
                if terminal {
                    print("\r\u{1B}[K" + line, terminator: "")
                    fflush(nil)
                } else if lastLine == 0 || now - lastLine >= 1_000_000_000 {
                    print(line)
                    lastLine = now
                }
                usleep(100_000)
                status = try read()
            }
            if terminal { print("\r\u{1B}[K", terminator: "") }
        }
        if json {
            print(status.raw)
        } else {
            print("""
                source:           \(status.source) (vanish \(status.version), pid \(status.pid))
                graveyard:        \(status.pending) entries waiting, \(status.restorable) of them restorable (\(bytes(status.restorableBytes)) known)\(status.stuck > 0 ? ", \(status.stuck) that cannot be deleted (see the daemon's log)" : "")
                undo window:      \(status.window)
                reaped:           \(status.reaped) entries, \(status.freedFiles) files, \(status.freedDirectories) directories, \(bytes(status.freedBytes)) of disk (\(bytes(status.freedDataBytes)) of data)
                reaping now:      \(status.pace)
                deleted (mount):  \(status.buried) entries since mount
                reaper workers:   \(status.workers)
                client:           \(status.client)\(status.others.isEmpty ? "" : "\nother clients:   " + status.others.joined(separator: "\n                  "))
                free space:       \(status.space)
                file data:        \(status.passthrough == "on" ? "passthrough (kernel to backing file)" : "through the daemon; passthrough \(status.passthrough)")
                kernel features:  \(status.kernelFeatures)
                requests:         \(status.requests)
                workers:          \(status.ring ? "forgets and interrupts only" : status.spin > 0 ? "one receives and spins up to \(status.spin) µs for a program's next call" : "wait in the kernel (no spin)")
                """)
        }
    }

    struct Status {
        var raw: String
        var source: String
        /// The daemon's release and process.
        var version: String
        var pid: Int
        var pending: Int
        var reaped: Int
        var freedFiles: Int
        var freedDirectories: Int
        var freedDataBytes: Int
        var freedBytes: Int
        var buried: Int
        var workers: Int
        var free: Int
        var restorable: Int
        /// Entries the reaper failed to delete (it logged why); tried again later.
        var stuck: Int
        var restorableBytes: Int
        /// Disk space entries waiting for the reaper hold (kept ones aside), as far as known.
        var graveyardBytes: Int
        var keepSeconds: Double
        /// All reaper workers asleep (nothing in flight between shards).
        var idle: Bool
        /// Recent pace, as the daemon measured it over the last few seconds.
        var filesPerSecond: Int
        /// Seconds until the entries now due are freed, at that pace; nil when unknown.
        var eta: Int?
        /// "on", or "off: " and why.
        var passthrough: String
        /// What the daemon negotiated beyond libfuse 3.14 (passthrough, parallel_dirops, killpriv_v2).
        var kernelFeatures: String
        /// How long a worker spins for one program's next call (µs; 0: never).
        var spin: Int
        /// Which channel brings requests, and why.
        var requests: String
        var ring: Bool
        /// This client's id in the source's state directory.
        var client: String
        /// One line per other client of a shared source.
        var others: [String]

        /// The undo window for what is deleted from now on; entries deleted
        /// before keep the window they were deleted under.
        var window: String {
            let now = keepSeconds > 0 ? "\(duration(keepSeconds)) for what is deleted now" : "none for what is deleted now"
            return restorable > 0 ? now + "; restorable entries keep the window they were deleted under" : now
        }

        /// Free space, and what deleted entries still hold of the rest.
        var space: String {
            var s = bytes(free)
            if graveyardBytes > 0 { s += ", +\(bytes(graveyardBytes)) as the reaper frees the graveyard" }
            if restorableBytes > 0 { s += ", +\(bytes(restorableBytes)) kept in the trash" }
            return s
        }

        /// Deletions the reaper may free now: neither kept by the window nor stuck.
        var due: Int { max(0, pending - restorable - stuck) }

        /// Nothing is left that the reaper could free now.
        var settled: Bool { pending <= restorable + stuck && idle }

        var pace: String {
            if settled { return "idle (nothing due)" }
            guard filesPerSecond > 0 else { return "starting (no recent pace yet)" }
            return "\(filesPerSecond) files/s" + (eta.map { ", about \(duration(Double($0))) left for the entries now due" } ?? "")
        }
    }

    static func requests(_ r: JSON?) -> String {
        guard let r, let channel = r["channel"]?.string else { return "?" }
        if channel == "io_uring" {
            return "io_uring, \(r["queues"]?.int ?? 0) queues of \(r["queue_depth"]?.int ?? 0) entries served on their CPUs "
                + "by \(r["threads"]?.int ?? 0) threads (\(bytes(r["buffer_bytes"]?.int ?? 0)) of buffers mapped)"
                + ((r["spin_microseconds"]?.int ?? 0) > 0 ? ", each watched up to \(r["spin_microseconds"]?.int ?? 0) µs after a reply" : "")
        }
        return channel + (r["why"]?.string.map { ": " + $0 } ?? "")
    }

    func read() throws -> Status {
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        let n = getxattr(mountpoint, ControlProtocol.statusAttribute, &buffer, buffer.count)
        guard n > 0 else {
            let e = errno
            if e == ENODATA || e == ENOTSUP { throw ValidationError("\(mountpoint) is not the root of a Vanish mount") }
            throw RuntimeError("cannot read status of \(mountpoint): \(String(cString: strerror(e)))")
        }
        let raw = String(decoding: buffer[..<n], as: UTF8.self)
        guard let obj = JSON.parse(buffer[..<n]), obj.object != nil else {
            throw RuntimeError("unreadable status from \(mountpoint)")
        }
        func int(_ k: String) -> Int { obj[k]?.int ?? 0 }
        return Status(raw: raw, source: obj["source"]?.string ?? "?",
                      version: obj["version"]?.string ?? "unknown", pid: int("pid"), pending: int("pending_entries"),
                      reaped: int("reaped_entries"), freedFiles: int("freed_files"),
                      freedDirectories: int("freed_directories"), freedDataBytes: int("freed_data_bytes"),
                      freedBytes: int("freed_bytes"),
                      buried: int("buried_entries"), workers: int("reaper_workers"), free: int("free_bytes"),
                      restorable: int("restorable_entries"), stuck: int("stuck_entries"),
                      restorableBytes: int("restorable_bytes"), graveyardBytes: int("graveyard_bytes"),
                      keepSeconds: obj["keep_seconds"]?.double ?? 0,
                      idle: obj["reaper_idle"]?.bool ?? true, filesPerSecond: int("reap_files_per_second"),
                      eta: obj["eta_seconds"]?.int, passthrough: obj["passthrough"]?.string ?? "?",
                      kernelFeatures: obj["kernel_features"]?.string ?? "?", spin: int("spin_microseconds"),
                      requests: Self.requests(obj["requests"]), ring: obj["requests"]?["channel"]?.string == "io_uring",
                      client: obj["client"]?.string ?? "none (no graveyard)",
                      others: (obj["other_clients"]?.array ?? []).map { c in
                          let lease = c["lease"]?.string == "expired" ? "lease expired, adopted when it has entries"
                              : "lease live (last change \(c["silent_seconds"]?.int ?? 0) s ago)"
                          return "\(c["client"]?.string ?? "?"): \(c["pending_entries"]?.int ?? 0) entries waiting, \(lease)"
                      })
    }
}

/// A duration as people read it: "45 s", "12 min", "1 h", "1 h 30 min", "7 d".
func duration(_ seconds: Double) -> String {
    let s = Int(seconds.rounded(.up))
    if s < 60 { return "\(s) s" }
    if s < 3600 { return "\(s / 60) min" + (s % 60 != 0 && s < 600 ? " \(s % 60) s" : "") }
    if s < 86400 { return "\(s / 3600) h" + ((s % 3600) / 60 != 0 ? " \((s % 3600) / 60) min" : "") }
    return "\(s / 86400) d" + ((s % 86400) / 3600 != 0 ? " \((s % 86400) / 3600) h" : "")
}

func bytes(_ n: Int) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"]
    var v = Double(n)
    var i = 0
    while v >= 1024 && i < units.count - 1 { v /= 1024; i += 1 }
    // One decimal, rounded half up, without Foundation's String(format:).
    let tenths = Int((v * 10).rounded())
    return i == 0 ? "\(n) B" : "\(tenths / 10).\(tenths % 10) \(units[i])"
}
