import Foundation

/// One event from a mount's journal (or a snapshot line), with the fields
/// every event has pulled out and the rest left in `fields`.
public struct Event: @unchecked Sendable {
    public var seq: UInt64?
    public var type: String
    public var instance: String?
    /// Relative to the mount root; nil for lifecycle events.
    public var path: PathBytes?
    /// For `renamed`: where it was. For `linked`: the existing name.
    public var from: PathBytes?
    public var kind: String?
    public var id: String?
    public var fields: [String: Any]

    public init(_ object: [String: Any]) {
        fields = object
        seq = (object["seq"] as? NSNumber)?.uint64Value
        type = object["type"] as? String ?? ""
        instance = object["instance"] as? String
        path = PathBytes.get(object, key: "path")
        from = PathBytes.get(object, key: "from") ?? PathBytes.get(object, key: "target")
        kind = object["kind"] as? String
        id = object["id"] as? String
    }

    /// Resume here with `--since` / `EventSubscription(since:)`.
    public var cursor: String? {
        if let seq, let instance { return "\(instance):\(seq)" }
        return fields["cursor"] as? String
    }
}

/// A live subscription to a mount's events over its control socket: resumes
/// after a cursor with nothing lost or repeated, or reports `reset` when the
/// cursor is too old (then rescan, for instance with `snapshot`).
public final class EventSubscription {
    private let client: ControlClient
    /// The position after the last event returned; save it to resume.
    public private(set) var cursor: String?

    public init(mountpoint: String, since: String? = nil, paths: [String]? = nil, types: [String]? = nil,
                snapshot: Bool = false) throws(ControlClient.Failure) {
        client = try ControlClient(mountpoint: mountpoint)
        var request: [String: Any] = ["op": "events", "snapshot": snapshot]
        if let since { request["since"] = since }
        if let paths { request["paths"] = paths }
        if let types { request["types"] = types }
        cursor = since
        try client.send(request)
    }

    /// The next event; nil when the mount went away.
    public func next() throws(ControlClient.Failure) -> Event? {
        guard let object = try client.receive() else { return nil }
        if let message = object["error"] as? String {
            throw ControlClient.Failure(message, errno: Int32((object["errno"] as? Int) ?? Int(EIO)))
        }
        let event = Event(object)
        if let c = event.cursor, event.type != "exists" { cursor = c }
        return event
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
        switch e.type {
        case "scan-started":
            entries = [:]
            scanned = false
        case "scan-completed":
            scanned = true
        case "reset":
            scanned = false
        case "exists", "created", "linked", "restored":
            guard let p = e.path else { return }
            entries[p] = Entry(kind: e.kind ?? "", id: e.id ?? "", size: (e.fields["size"] as? NSNumber)?.intValue)
        case "written", "truncated":
            guard let p = e.path else { return }
            entries[p, default: Entry(kind: "file", id: e.id ?? "")].size = (e.fields["size"] as? NSNumber)?.intValue
        case "deleted":
            guard let p = e.path else { return }
            remove(p)
        case "renamed":
            guard let to = e.path, let from = e.from else { return }
            if e.fields["exchange"] as? Bool == true {
                let a = subtree(from), b = subtree(to)
                remove(from); remove(to)
                for (k, v) in a { entries[rebase(k, from, to)] = v }
                for (k, v) in b { entries[rebase(k, to, from)] = v }
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
