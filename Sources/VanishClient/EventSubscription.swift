/// One event from a mount's journal (or a snapshot line), with the fields
/// every event has pulled out and the rest left in `fields`.
public struct Event: Sendable {
    public var seq: UInt64?
    public var type: String
    public var instance: String?
    /// Relative to the mount root; nil for lifecycle events.
    public var path: PathBytes?
    /// For `renamed`: where it was. For `linked`: the existing name.
    public var from: PathBytes?
    public var kind: String?
    public var id: String?
    public var fields: JSON
    /// The JSON line as the daemon sent it (no newline): pass it on as is.
    public var line: [UInt8]

    public init(_ object: JSON, line: [UInt8] = []) {
        fields = object
        self.line = line
        seq = object["seq"]?.uint64
        type = object["type"]?.string ?? ""
        instance = object["instance"]?.string
        path = PathBytes.get(object, key: "path")
        from = PathBytes.get(object, key: "from") ?? PathBytes.get(object, key: "target")
        kind = object["kind"]?.string
        id = object["id"]?.string
    }

    private static let seqPrefix = Array(#"{"seq":"#.utf8)

    /// The `seq` of a journal line, which always starts `{"seq":N,`; nil for
    /// any other line (also `{"seq":` with no digits after it).
    public static func seq(of line: UnsafeRawBufferPointer) -> UInt64? {
        let prefix = seqPrefix
        guard line.count > prefix.count, line.starts(with: prefix) else { return nil }
        var v: UInt64 = 0
        var digits = 0
        for c in line[prefix.count...] {
            guard c >= 0x30 && c <= 0x39 else { break }
            v = v &* 10 &+ UInt64(c - 0x30)
            digits += 1
        }
        return digits > 0 ? v : nil
    }

    /// The `instance` of a journal line (16 hex digits, fixed place after time_ns).
    static func instance(of line: [UInt8]) -> String? {
        let key = Array(#","instance":""#.utf8)
        guard let at = line.firstRange(of: key) else { return nil }
        let rest = line[at.upperBound...]
        guard let end = rest.firstIndex(of: 0x22) else { return nil }
        return String(decoding: rest[..<end], as: UTF8.self)
    }

    /// Resume here with `--since` / `EventSubscription(since:)`.
    public var cursor: String? {
        if let seq, let instance { return EventCursor(instance: instance, sequence: seq).description }
        return fields["cursor"]?.string
    }
}

/// A live subscription to a mount's events over its control socket: resumes
/// after a cursor with nothing lost or repeated, or reports `reset` when the
/// cursor is too old (then rescan, for instance with `snapshot`).
public final class EventSubscription {
    private let client: ControlClient
    /// The position after the last event returned; save it to resume.
    public private(set) var cursor: String?
    /// The daemon ended the stream itself (an `end` line: the mount is going
    /// away). A connection that closes without one means the daemon died.
    private var ended = false

    public init(mountpoint: String, since: String? = nil, paths: [String]? = nil, types: [String]? = nil,
                snapshot: Bool = false) throws(ControlClient.Failure) {
        client = try ControlClient(mountpoint: mountpoint)
        var request: [String: JSON] = ["op": JSON(ControlProtocol.Operation.events.rawValue), "snapshot": JSON(snapshot)]
        if let since { request["since"] = JSON(since) }
        if let paths { request["paths"] = JSON(paths) }
        if let types { request["types"] = JSON(types) }
        cursor = since
        try client.send(.object(request))
    }

    /// The end of the connection: nil after the daemon's `end`, else a failure.
    private func finished<T>() throws(ControlClient.Failure) -> T? {
        guard ended else {
            throw ControlClient.Failure("""
                the daemon stopped without ending the stream (it crashed or was killed); \
                resume from the last cursor once the mount is back
                """)
        }
        return nil
    }

    /// The next event; nil when the mount went away (after its `end`).
    /// Throws if the daemon died instead.
    public func next() throws(ControlClient.Failure) -> Event? {
        guard let (object, line) = try client.receiveObject() else { return try finished() }
        try ControlClient.Failure.check(object)
        let event = Event(object, line: line)
        if event.type == EventType.end.rawValue { ended = true }
        if let c = event.cursor, event.type != EventType.exists.rawValue { cursor = c }
        return event
    }

    /// Every line received so far, as the daemon sent them (each with its
    /// newline), for programs that pass events on: journal events are not
    /// decoded (only the last one's cursor is read), so a relay keeps up
    /// with a burst. Other lines (snapshot, reset) also come decoded in
    /// `decoded`. nil when the mount went away.
    public func nextLines() throws(ControlClient.Failure) -> (lines: [UInt8], decoded: [Event])? {
        guard let lines = try client.receiveLines() else { return try finished() }
        var decoded: [Event] = []
        var lastJournalLine: Range<Int>?
        var start = 0
        while start < lines.count, let nl = lines[start...].firstIndex(of: 0x0A) {
            defer { start = nl + 1 }
            let isJournal = lines.withUnsafeBytes { Event.seq(of: UnsafeRawBufferPointer(rebasing: $0[start..<nl])) } != nil
            if isJournal { lastJournalLine = start..<nl; continue }
            let line = Array(lines[start..<nl])
            guard let object = JSON.parse(line), object.object != nil else {
                throw ControlClient.Failure("unreadable answer from the daemon")
            }
            try ControlClient.Failure.check(object)
            let event = Event(object, line: line)
            if event.type == EventType.end.rawValue { ended = true }
            if let c = event.cursor, event.type != EventType.exists.rawValue { cursor = c; lastJournalLine = nil }
            decoded.append(event)
        }
        if let r = lastJournalLine, let seq = lines.withUnsafeBytes({ Event.seq(of: UnsafeRawBufferPointer(rebasing: $0[r])) }),
           let instance = Event.instance(of: Array(lines[r])) {
            cursor = EventCursor(instance: instance, sequence: seq).description
        }
        return (lines, decoded)
    }
}

/// An in-memory picture of a mount's tree kept current by its events: a
/// snapshot first, then every change (TOFileSystemObserver's live objects).
public final class LiveTree {
    public struct Entry: Sendable, Equatable {
        public var kind: String
        public var id: String
        public var size: Int?
    }

    public private(set) var entries: [PathBytes: Entry] = [:]
    public private(set) var scanned = false

    public init() {}

    /// Applies one event.
    public func apply(_ e: Event) {
        switch EventType(rawValue: e.type) {
        case .scanStarted:
            entries = [:]
            scanned = false
        case .scanCompleted:
            scanned = true
        case .reset:
            scanned = false
        case .exists, .created, .linked, .restored:
            guard let p = e.path else { return }
            entries[p] = Entry(kind: e.kind ?? "", id: e.id ?? "", size: e.fields["size"]?.int)
        case .written, .truncated:
            guard let p = e.path else { return }
            entries[p, default: Entry(kind: "file", id: e.id ?? "")].size = e.fields["size"]?.int
        case .deleted:
            guard let p = e.path else { return }
            // Only a directory has a subtree to drop; a file is one key, not a scan.
            if e.kind == "directory" { remove(p) } else { entries[p] = nil }
        case .renamed:
            guard let to = e.path, let from = e.from else { return }
            if e.fields["exchange"]?.bool == true {
                let a = subtree(from), b = subtree(to)
                remove(from); remove(to)
                for (k, v) in a { entries[rebase(k, from, to)] = v }
                for (k, v) in b { entries[rebase(k, to, from)] = v }
            } else if e.kind != "directory" {
                let moved = entries.removeValue(forKey: from)
                entries[to] = moved
            } else {
                let moved = subtree(from)
                remove(to)
                remove(from)
                for (k, v) in moved { entries[rebase(k, from, to)] = v }
            }
        default:
            break
        }
    }

    private func isWithin(_ p: PathBytes, _ dir: PathBytes) -> Bool {
        p == dir || (p.bytes.count > dir.bytes.count && p.bytes[dir.bytes.count] == 0x2F
                     && Array(p.bytes[..<dir.bytes.count]) == dir.bytes)
    }

    private func subtree(_ dir: PathBytes) -> [PathBytes: Entry] { entries.filter { isWithin($0.key, dir) } }

    private func remove(_ dir: PathBytes) {
        for k in entries.keys where isWithin(k, dir) { entries[k] = nil }
    }

    private func rebase(_ p: PathBytes, _ from: PathBytes, _ to: PathBytes) -> PathBytes {
        PathBytes(to.bytes + p.bytes[from.bytes.count...])
    }
}
