import ArgumentParser
import CFuse
import Foundation
import LinuxSyscalls
import VanishGraveyard

struct ReapCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "reap",
        abstract: "Empty a source directory's graveyard without mounting it.",
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
        let src = try MountPaths.resolve(source, what: "source")
        try MountPaths.requireDirectory(src, what: "source")
        var st = stat()
        guard lstat(src + "/" + Graveyard.stateDirectoryName, &st) == 0 else {
            print("nothing to reap: \(src) has no \(Graveyard.stateDirectoryName)")
            return
        }
        let rootFD = try Sys.open(src, VANISH_O_PATH | O_DIRECTORY)
        let graveyard: Graveyard
        do { graveyard = try Graveyard(rootFD: rootFD) } catch { throw ValidationError("\(error)") }
        let reaper = Reaper(graveyard: graveyard, workers: workers ?? ProcessInfo.processInfo.activeProcessorCount)
        let total = reaper.pendingEntries()
        let interrupted = Atomic(false)
        let sources = stopOnSignals { interrupted.set(); reaper.stop(.now) }
        reaper.start()
        reaper.stop(.whenEmpty)
        let done = DispatchSemaphore(value: 0)
        DispatchQueue.global().async { reaper.join(); done.signal() }
        let terminal = isatty(1) != 0
        while done.wait(timeout: .now() + .milliseconds(200)) == .timedOut {
            let s = reaper.statistics
            let line = "reaping: \(s.entries) of \(total) entries, \(s.files) files, \(bytes(Int(s.bytes))) freed"
            if terminal { print("\r\u{1B}[K" + line, terminator: ""); fflush(nil) }
        }
        withExtendedLifetime(sources) {}
        let s = reaper.statistics
        if terminal { print("\r\u{1B}[K", terminator: "") }
        print("reaped \(s.entries) entries: \(s.files) files, \(bytes(Int(s.bytes))) freed"
              + (interrupted.value ? " (interrupted; the rest stays for next time)" : ""))
    }
}

/// A flag set from a signal handler's queue and read on the main thread.
final class Atomic: @unchecked Sendable {
    private let lock = NSLock()
    private var flag: Bool
    init(_ v: Bool) { flag = v }
    func set() { lock.lock(); flag = true; lock.unlock() }
    var value: Bool { lock.lock(); defer { lock.unlock() }; return flag }
}
