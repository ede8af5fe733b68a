import ArgumentParser
import Glibc
import SystemPackage
import VanishClient

struct EventsCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "events",
        abstract: "Follow every change made through a mount, live, lossless and in order.",
        discussion: """
            Prints readable lines on a terminal (the time, the change and the program that made \
            it; the reaper's `reaped` lines only with --all) and JSON lines otherwise (or with \
            --json), every event; the schema is in docs/events.md. Each event carries seq and \
            instance: resume after it with \
            --since INSTANCE:SEQ and nothing is lost or repeated. A cursor the journal no longer \
            holds, or one from an earlier mount, gets a single `reset` event: rescan (--snapshot). \
            So does a subscriber that falls further behind than the journal keeps \
            (events_max_bytes): its reset says which seq range it missed. The stream ends with \
            an `end` line when the mount goes away (exit 0); if the daemon dies instead, this \
            says so and exits 1.
            """
    )

    @Option(help: "Start after this cursor (INSTANCE:SEQ) instead of now.")
    var since: String?

    @Option(help: "Only events under this directory (relative to the mount, or an absolute path inside it); may repeat.")
    var path: [String] = []

    @Option(help: ArgumentHelp("Only these event types, comma-separated.", valueName: "type,..."))
    var type: String?

    @Flag(help: "First list every existing entry (between scan-started and scan-completed), then continue live.")
    var snapshot = false

    @Flag(help: "JSON lines even on a terminal.")
    var json = false

    @Flag(help: "On a terminal, also the reaper's housekeeping (reaped lines).")
    var all = false

    @Flag(help: "Stop after the snapshot instead of following.")
    var once = false

    @OptionGroup var target: MountpointArgument
    var mountpoint: String { target.mountpoint }

    func validate() throws {
        if let since, EventCursor(since) == nil {
            throw ValidationError("--since takes a cursor INSTANCE:SEQ, as events carry them")
        }
        if let type {
            let known = EventType.allCases.filter(\.isJournaled).map(\.rawValue)
            for t in type.split(separator: ",") where !known.contains(String(t)) {
                throw ValidationError("unknown event type \(t); known: \(known.joined(separator: ", "))")
            }
        }
        if once && !snapshot { throw ValidationError("--once needs --snapshot") }
        // A directory outside the mount has no events: refused, not streamed as silence for ever.
        let root = MountPaths.lexicallyAbsolute(mountpoint)
        for p in path {
            let abs = MountPaths.lexicallyAbsolute(p.hasPrefix("/") ? p : root + "/" + p)
            if abs != root && !abs.hasPrefix(root + "/") {
                throw ValidationError("--path \(p) is not inside the mount at \(root): give a directory in it, relative to it or absolute")
            }
        }
        try target.requireVanishRoot()
    }

    func run() throws {
        let root = MountPaths.lexicallyAbsolute(mountpoint)
        // Relative to the mount; the mount itself is no filter.
        let paths = path.compactMap { p -> String? in
            let abs = MountPaths.lexicallyAbsolute(p.hasPrefix("/") ? p : root + "/" + p)
            return abs.hasPrefix(root + "/") ? String(abs.dropFirst(root.count + 1)) : nil
        }
        let subscription: EventSubscription
        do {
            subscription = try EventSubscription(mountpoint: mountpoint, since: since, paths: paths.isEmpty ? nil : paths,
                                                 types: type.map { $0.split(separator: ",").map(String.init) },
                                                 snapshot: snapshot)
        } catch {
            throw RuntimeError(error.description)
        }
        let readable = !json && isatty(1) != 0
        // JSON lines go out as the daemon sent them, all that arrived in one
        // write, unbuffered: a pipe reader sees each as soon as it came.
        while !readable {
            let next: (lines: [UInt8], decoded: [Event])?
            do { next = try subscription.nextLines() } catch { throw RuntimeError(error.description) }
            guard let (lines, decoded) = next else { return }
            if once, let end = decoded.first(where: { $0.type == EventType.scanCompleted.rawValue }) {
                // Up to and including the scan's end, nothing after it.
                let upTo = lines.firstRange(of: end.line).map { $0.upperBound + 1 } ?? lines.count
                _ = writeAll(1, Array(lines[..<upTo]))
                return
            }
            guard writeAll(1, lines) else { return }
        }
        // Housekeeping is noise while watching a build, unless asked for.
        let asked = Set((type ?? "").split(separator: ",").map(String.init))
        let hidden: Set<String> = all || asked.contains(EventType.reaped.rawValue) ? [] : [EventType.reaped.rawValue]
        while true {
            let event: Event?
            do { event = try subscription.next() } catch { throw RuntimeError(error.description) }
            guard let event else { return }
            if hidden.contains(event.type) { continue }
            let line = event.type == EventType.stream.rawValue
                ? "watching \(root) (Ctrl-C to stop; --json for every field)"
                : EventsCommand.describe(event)
            guard writeAll(1, Array((TerminalText.escaped(line) + "\n").utf8)) else { return }
            if once && event.type == EventType.scanCompleted.rawValue { return }
        }
    }

    static func describe(_ e: Event) -> String {
        let f = e.fields
        let when = f["time_ns"]?.uint64.map { String(localTime(nanoseconds: $0).suffix(8)) } ?? "--:--:--"
        var s = "\(when) \(e.type)"
        if let kind = e.kind { s += " \(kind)" }
        if let from = e.from { s += " \(from) →" }
        if let p = e.path { s += " \(p)" }
        if let size = f["size"]?.uint64, e.type != EventType.exists.rawValue { s += " (\(size) bytes)" }
        if let src = f["copied_from"]?.string { s += " copied from \(src)" }
        if let changed = f["changed"]?.string { s += " [\(changed)]" }
        if f["replaced"]?.bool == true { s += " (replacing what was there)" }
        if f["exchange"]?.bool == true { s += " (the two swapped)" }
        if let comm = f["comm"]?.string, let pid = f["pid"]?.int { s += "  by \(comm)[\(pid)]" }
        if e.type == EventType.stream.rawValue {
            s += " of client \(f["client"]?.string ?? "-"): \(f["note"]?.string ?? "")"
        }
        if e.type == EventType.reaped.rawValue {
            let files = f["files"]?.int ?? 0, directories = f["directories"]?.int ?? 0
            s += " \(files) file\(files == 1 ? "" : "s")" + (directories > 0 ? ", \(directories) director\(directories == 1 ? "y" : "ies")" : "")
                + ", \(bytes(f["disk_bytes"]?.int ?? 0)) of disk freed"
        }
        if e.type == EventType.shortened.rawValue {
            let n = f["entries"]?.int ?? 0
            s += " undo window: \(n) kept entr\(n == 1 ? "y" : "ies") (\(bytes(f["bytes"]?.int ?? 0))) given up early, because \(f["because"]?.string ?? "?")"
        }
        if e.type == EventType.rescan.rawValue { s += " (changed behind this mount: rescan it)" }
        if e.type == EventType.reset.rawValue, let reason = f["reason"]?.string { s += ": \(reason)" }
        if e.type == EventType.reset.rawValue, let n = f["skipped"]?.uint64 { s += " (\(n) events skipped)" }
        return s
    }
}

/// Writes all of `bytes`; false if the reader went away.
private func writeAll(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
    (try? FileDescriptor(rawValue: fd).writeAll(bytes)) != nil
}
