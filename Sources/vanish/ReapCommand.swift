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
            For leftovers of a mount that ended before its reaper finished. Safe while the \
            source is mounted too. SIGINT or SIGTERM stops it; what is left stays for next time.
            """
    )

    @Option(help: "Reaper threads (default: number of cores).")
    var workers: Int?

    @Argument(help: "The source directory (what was mounted).")
    var source: String

    func run() throws {
        // First, before any thread exists, so every thread inherits the block.
        StopSignals.block()
        let src = try MountPaths.resolve(source, what: "source")
        try MountPaths.requireDirectory(src, what: "source")
        try MountPaths.lockSource(src)
        // The source's graveyard, and those of filesystems mounted inside it.
        let roots = [src] + MountPaths.mounts().map(\.point).filter { $0.hasPrefix(src == "/" ? "/" : src + "/") }
        var found: [Reaper] = []
        for root in roots {
            guard let fd = try? Sys.open(root, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
            defer { Sys.close(fd) }
            guard Graveyard.isStateDirectory(in: fd) else { continue }
            do {
                let graveyard = try Graveyard(rootFD: fd, create: false)
                if root == src, let intents = try? UnlinkIntents(stateFD: graveyard.stateFD) {
                    // Unlinks a killed daemon answered but had not done yet: done now, as a mount would.
                    let (finished, _) = intents.finish(rootFD: fd, graveyard: graveyard, keepingRecords: false,
                                                       buried: { _ in }, failed: { _ in })
                    if finished > 0 { print("finished \(finished) unlinks the last mount had answered but not done") }
                }
                found.append(Reaper(graveyard: graveyard, workers: root == src ? workers ?? cores : 1))
            } catch {
                throw RuntimeError("cannot reap \(root): \(error)")
            }
        }
        let reapers = found
        if reapers.isEmpty {
            print("nothing to reap: \(src) has no \(Graveyard.stateDirectoryName)")
            return
        }
        let total = reapers.reduce(0) { $0 + $1.pendingEntries() }
        let interrupted = StopFlag()
        StopSignals.watch { _ in interrupted.set(); reapers.forEach { $0.stop(.now) } }
        let failures = Failures()
        for r in reapers {
            r.onStuck = { entry, error in failures.add("  \(entry): \(error)") }
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
            let line = "reaping: \(s.entries) of \(total) entries, \(s.freed.files) files, \(bytes(Int(s.freed.diskBytes))) freed"
            if terminal { print("\r\u{1B}[K" + line, terminator: ""); fflush(nil) }
        }
        let s = tally()
        if terminal { print("\r\u{1B}[K", terminator: "") }
        print("reaped \(s.entries) entries: \(s.freed.files) files, \(s.freed.directories) directories, "
              + "\(bytes(Int(s.freed.diskBytes))) freed"
              + (interrupted.value ? " (interrupted; the rest stays for next time)" : ""))
        let stuck = failures.value
        if !stuck.isEmpty {
            throw RuntimeError("\(stuck.count) graveyard entries could not be deleted, they stay for the next try:\n"
                               + stuck.prefix(10).joined(separator: "\n") + (stuck.count > 10 ? "\n…" : ""))
        }
    }

    private var cores: Int { Int(sysconf(Int32(_SC_NPROCESSORS_ONLN))) }
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
