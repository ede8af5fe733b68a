import ArgumentParser
import CLinux
import Dispatch
import FUSEKit
import Glibc
import Synchronization
import LinuxSyscalls
import VanishGraveyard

struct ReapCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "reap",
        abstract: "Empty a source directory's graveyard (and those of filesystems mounted inside it) without mounting it.",
        discussion: """
            For leftovers of a mount that ended before its reaper finished. SIGINT or SIGTERM \
            stops it; what is left stays for next time. On a source shared by several clients \
            (one volume mounted on many machines), this reaps this client's graveyard; \
            --adopt CLIENT takes over the graveyard of a client that is gone first (also \
            while the source is mounted here: the mount then reaps it). `vanish status` \
            lists the other clients.
            """
    )

    @Option(help: "Reaper threads (default: number of cores; at least 8 on a network or FUSE backend).")
    var workers: Int?

    @Option(help: ArgumentHelp("Take over the graveyard of this other client of a shared source (it is gone); may repeat.",
                               valueName: "client"))
    var adopt: [String] = []

    @Option(help: "This client's id in a shared source, as given to mount with -o client= (default: the host name and a hash of the machine id and the source path).")
    var client: String?

    @Argument(help: "The source directory (what was mounted).")
    var source: String

    func validate() throws {
        try MountPaths.requireDirectory(try MountPaths.resolve(source, what: "source"), what: "source")
    }

    func run() throws {
        // First, before any thread exists, so every thread inherits the block.
        StopSignals.block()
        let src = try MountPaths.resolve(source, what: "source")
        let me: ClientID
        let others: [ClientID]
        do {
            me = try client.map { try ClientID($0) } ?? ClientID.local(source: src)
            others = try adopt.map { try ClientID($0) }
        } catch {
            throw ValidationError("\(error)")
        }
        do {
            try MountPaths.lockSource(src)
        } catch where !others.isEmpty {
            // Mounted here: claim them for the mount, whose lease thread moves them in and reaps them.
            try claim(others, in: src, as: me)
            print("the mount of \(src) reaps what was adopted (see vanish status on its mountpoint)")
            return
        }
        if !others.isEmpty { try claim(others, in: src, as: me) }
        // The source's graveyard, and those of filesystems mounted inside it.
        let roots = [src] + MountPaths.mounts().map(\.point).filter { MountPaths.isBelow($0, src) }
        var found: [Reaper] = []
        for root in roots {
            guard let fd = try? Sys.opened(root, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
            // The source's state may be outside it (an in-place mount's), in it, or both.
            let outside = root == src
                ? StateLocation.directory(for: src, sourceFD: fd.raw, bases: MountPaths.stateBases(for: src), create: false) : nil
            defer { if let outside { Sys.close(outside.fd) } }
            for stateRoot in [outside?.fd, fd.raw].compactMap({ $0 }) where Graveyard.isStateDirectory(in: stateRoot) {
                do {
                    let graveyard = try Graveyard(rootFD: stateRoot, client: me, create: false)
                    graveyard.absorbAdopted { _ in }
                    if root == src, let (intents, leftover, _) = try? UnlinkIntents.open(for: graveyard, source: src) {
                        // Unlinks a killed daemon answered but had not done yet: done now, as a mount would
                        // (with no record: reaping without a mount ends the window anyway).
                        let (finished, _) = UnlinkIntents.finishInterrupted(
                            intents, leftover: leftover, graveyard: graveyard, rootFD: fd.raw, keepingRecords: false,
                            buried: { _ in }, failed: { _ in })
                        if finished > 0 { print("finished \(finished) unlinks the last mount had answered but not done") }
                    }
                    var policy = Reaper.Policy()
                    policy.freesKeptEntries = true
                    found.append(Reaper(graveyard: graveyard, workers: root == src ? workers ?? Reaper.defaultWorkers(for: graveyard) : 1,
                                        policy: policy))
                } catch {
                    throw RuntimeError("cannot reap \(root): \(error)")
                }
            }
        }
        let reapers = found
        // Held while reaping, so no other client of a shared source adopts this graveyard meanwhile.
        let lease = reapers.isEmpty ? nil : try? ClientLeases(graveyard: reapers[0].graveyard, length: Duration.seconds(60).nanoseconds, adopting: false)
        lease?.start()
        defer { lease?.stop() }
        if reapers.isEmpty {
            print("nothing to reap: \(src) has no \(Graveyard.stateDirectoryName)")
            return
        }
        let total = reapers.reduce(0) { $0 + $1.pendingEntries() }
        let interrupted = StopFlag()
        StopSignals.watch { _ in interrupted.set(); reapers.forEach { $0.stop(.now) } }
        let failures = Failures()
        for r in reapers {
            r.hooks.onStuck = { entry, error in failures.add("  \(entry): \(error)") }
            r.hooks.onHeld = { entry, error in
                FileHandleStderr.write("vanish reap: kept in its deleter's trash until restored (\(error)): \(entry)\n")
            }
            r.start()
            r.stop(.whenEmpty)
        }
        let done = DispatchSemaphore(value: 0)
        DispatchQueue.global().async { reapers.forEach { $0.join() }; done.signal() }
        let terminal = isatty(1) != 0
        func tally() -> Reaper.Statistics {
            reapers.reduce(into: .zero) { t, r in
                let s = r.statistics
                t.entries += s.entries; t.freed += s.freed
            }
        }
        while done.wait(timeout: .now() + .milliseconds(200)) == .timedOut {
            let s = tally()
            let line = "reaping: \(s.entries) of \(counted(total, "deletion")) done, \(counted(Int(s.freed.files), "file")), "
                + "\(bytes(Int(s.freed.diskBytes))) freed"
            if terminal { print("\r\u{1B}[K" + line, terminator: ""); fflush(nil) }
        }
        let s = tally()
        if terminal { print("\r\u{1B}[K", terminator: "") }
        // Emptied, every deletion counted at the start is done, also pieces a
        // daemon left of a tree it had begun (counted as one; no original entry ends them).
        let deletions = interrupted.value ? Int(s.entries) : max(Int(s.entries), total)
        print("reaped \(counted(deletions, "deletion")): \(counted(Int(s.freed.files), "file")), "
              + "\(counted(Int(s.freed.directories), "directory", "directories")), \(bytes(Int(s.freed.diskBytes))) freed"
              + (interrupted.value ? " (interrupted; the rest stays for next time)" : ""))
        let stuck = failures.value
        if !stuck.isEmpty {
            throw RuntimeError("\(stuck.count) graveyard entries could not be deleted, they stay for the next try:\n"
                               + stuck.prefix(10).joined(separator: "\n") + (stuck.count > 10 ? "\n…" : ""))
        }
    }

    /// Claims each client's graveyard into this client's, by one rename each.
    private func claim(_ others: [ClientID], in src: String, as me: ClientID) throws {
        let fd = try Sys.opened(src, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        let graveyard: Graveyard
        do { graveyard = try Graveyard(rootFD: fd.raw, client: me, create: false) } catch {
            throw RuntimeError("cannot adopt in \(src): \(error)")
        }
        let known = graveyard.clients()
        for other in others {
            guard other != me else { throw ValidationError("\(other) is this client: its graveyard is reaped anyway") }
            guard known.contains(other) else {
                throw ValidationError("\(src) has no client \(other); its clients: \(known.map(\.name).joined(separator: ", "))")
            }
            let n = graveyard.pendingEntries(of: other)
            do {
                let took = try graveyard.claim(other)
                print(took ? "adopted \(other)'s graveyard (\(n) entries)" : "\(other) has no graveyard to adopt (another client took it, or it is empty)")
            } catch {
                throw RuntimeError("cannot adopt \(other)'s graveyard: \(error)")
            }
        }
    }

}

/// What the reaper workers could not delete, for the summary.
final class Failures: Sendable {
    private let list = Mutex<[String]>([])
    func add(_ line: String) { list.withLock { $0.append(line) } }
    var value: [String] { list.withLock { $0 } }
}

/// A flag set by the signal-watching thread and read on the main thread.
final class StopFlag: Sendable {
    private let flag = Atomic<Bool>(false)
    func set() { flag.store(true, ordering: .relaxed) }
    var value: Bool { flag.load(ordering: .relaxed) }
}
