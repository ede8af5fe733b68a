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
        var (status, raw) = try read()
        if wait {
            let start = Condition.now()
            // Progress is what was freed since waiting began, not since the mount.
            let first = (files: status.freedFiles, directories: status.freedDirectories, bytes: status.freedBytes)
            let firstDue = status.due
            let terminal = isatty(1) != 0
            var lastLine: UInt64 = 0
            while !status.settled {
                let now = Condition.now()
                let elapsed = Duration.between(start, now).inSeconds
                let freed = status.freedFiles - first.files + status.freedDirectories - first.directories
                let average = elapsed > 0 ? Int(Double(freed) / elapsed) : 0
                let rate = status.reapFilesPerSecond > 0 ? status.reapFilesPerSecond : average
                let line = "waiting: \(status.due) of \(max(firstDue, status.due)) deletions left; "
                    + "\(freed) files and directories, \(bytes(status.freedBytes - first.bytes)) freed in \(duration(elapsed))"
                    + (rate >= 1 ? ", \(rate)/s" : "")
                    + (status.etaSeconds.map { ", about \(duration(Double($0))) left" } ?? "")
                if terminal {
                    print("\r\u{1B}[K" + line, terminator: "")
                    fflush(nil)
                } else if lastLine == 0 || now - lastLine >= Duration.seconds(1).nanoseconds {
                    print(line)
                    lastLine = now
                }
                usleep(100_000)
                (status, raw) = try read()
            }
            if terminal { print("\r\u{1B}[K", terminator: "") }
        }
        if json {
            print(raw)
        } else {
            print("""
                source:           \(status.source) (vanish \(status.version), pid \(status.pid))
                graveyard:        \(counted(status.pendingEntries, "deletion")) waiting, \(status.restorableEntries) of them restorable (\(bytes(status.restorableBytes)) known)\(status.stuckEntries > 0 ? ", \(status.stuckEntries) that cannot be deleted (see the daemon's log)" : "")\(status.putBackEntries > 0 ? "\nput back:         \(counted(status.putBackEntries, "one-step delete")) whose deleters could not have removed all (see the daemon's log)" : "")
                undo window:      \(status.window)\(status.shortenedEntries > 0 ? "\nshortened:        \(counted(status.shortenedEntries, "kept entry", "kept entries")) (\(bytes(status.shortenedBytes))) given up early, the latest at \(localTime(nanoseconds: status.shortenedAtNS)), because \(status.shortenedBecause)" : "")
                reaped:           \(counted(status.reapedEntries, "deletion")), \(counted(status.freedFiles, "file")), \(counted(status.freedDirectories, "directory", "directories")), \(bytes(status.freedBytes)) of disk (\(bytes(status.freedDataBytes)) of data)
                reaping now:      \(status.pace)
                deleted (mount):  \(counted(status.buriedEntries ?? 0, "deletion")) since mount
                reaper workers:   \(status.reaperWorkers)
                client:           \(status.client ?? "none (no graveyard)")\(status.otherClients.isEmpty ? "" : "\nother clients:   " + status.others.joined(separator: "\n                  "))
                free space:       \(status.space)
                file data:        \(status.passthrough == "on" ? "passthrough (kernel to backing file)" : "through the daemon; passthrough \(status.passthrough)")
                kernel features:  \(status.kernelFeatures)
                requests:         \(status.channel)
                log:              \(status.log.isEmpty ? "unknown" : status.log == "syslog" ? "syslog (journalctl -t vanish)" : status.log)
                workers:          \(status.requests.channel == "io_uring" ? "forgets and interrupts only" : status.spinMicroseconds > 0 ? "one receives and spins up to \(status.spinMicroseconds) µs for a program's next call" : "wait in the kernel (no spin)")
                """)
        }
    }

    /// The mount's status as its daemon wrote it, and the JSON as it came.
    func read() throws -> (MountStatus, String) {
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        let n = getxattr(mountpoint, ControlProtocol.statusAttribute, &buffer, buffer.count)
        guard n > 0 else {
            let e = errno
            if e == ENODATA || e == ENOTSUP { throw ValidationError("\(mountpoint) is not the root of a Vanish mount") }
            throw RuntimeError("cannot read status of \(mountpoint): \(String(cString: strerror(e)))")
        }
        guard let json = JSON.parse(buffer[..<n]), let status = MountStatus(json: json) else {
            throw RuntimeError("unreadable status from \(mountpoint)")
        }
        return (status, String(decoding: buffer[..<n], as: UTF8.self))
    }
}

/// How `vanish status` puts a mount's status in words.
extension MountStatus {
    /// The undo window for what is deleted from now on; entries deleted
    /// before keep the window they were deleted under.
    var window: String {
        var now = keepSeconds > 0 ? "\(duration(keepSeconds)) for what is deleted now" : "none for what is deleted now"
        if keepSeconds > 0 {
            var not: [String] = []
            if keepMinAgeSeconds > 0 { not.append("files younger than \(duration(keepMinAgeSeconds))") }
            not += keepExclude
            if !not.isEmpty { now += " (not kept: " + not.joined(separator: ", ") + ")" }
        }
        return restorableEntries > 0 ? now + "; restorable entries keep the window they were deleted under" : now
    }

    /// Free space, and what deleted entries still hold of the rest.
    var space: String {
        var s = bytes(freeBytes)
        if graveyardBytes > 0 { s += ", +\(bytes(graveyardBytes)) as the reaper frees the graveyard" }
        if restorableBytes > 0 { s += ", +\(bytes(restorableBytes)) kept in the trash" }
        return s
    }

    /// Deletions the reaper may free now: neither kept by the window nor stuck.
    var due: Int { max(0, pendingEntries - restorableEntries - stuckEntries) }

    /// Nothing is left that the reaper could free now.
    var settled: Bool { pendingEntries <= restorableEntries + stuckEntries && reaperIdle }

    var pace: String {
        if settled { return "idle (nothing due)" }
        if reaperYields { return "stepping aside while the mount is busy (\(reapFilesPerSecond) files/s; no estimate until it is quiet)" }
        guard reapFilesPerSecond > 0 else { return "starting (no recent pace yet)" }
        return "\(reapFilesPerSecond) files/s" + (etaSeconds.map { ", about \(duration(Double($0))) left for the entries now due" } ?? "")
    }

    /// Which channel brings requests, and why.
    var channel: String {
        if requests.channel == "io_uring" {
            return "io_uring, \(requests.queues) queues of \(requests.queueDepth) entries served on their CPUs "
                + "by \(requests.threads) threads (\(bytes(requests.bufferBytes)) of buffers mapped)"
                + (requests.spinMicroseconds > 0
                    ? ", each watched up to \(requests.spinMicroseconds) µs after a reply while one caller calls on" : "")
        }
        return requests.channel + (requests.why.map { ": " + $0 } ?? "")
    }

    /// One line per other client of a shared source.
    var others: [String] {
        otherClients.map { c in
            let lease = c.leaseExpired ? "lease expired, adopted when it has entries"
                : "lease live (last change \(c.silentSeconds) s ago)"
            return "\(c.client): \(c.pendingEntries) entries waiting, \(lease)"
        }
    }
}

/// "1 file", "2 files": a count and its noun.
func counted(_ n: Int, _ one: String, _ many: String? = nil) -> String {
    "\(n) " + (n == 1 ? one : many ?? one + "s")
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
