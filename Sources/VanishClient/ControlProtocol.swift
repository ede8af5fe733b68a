import CXattr

/// The control socket's protocol: the client sends one JSON object on one
/// line; the daemon answers with JSON lines (one for a request, a stream for
/// events) and closes the connection when done.
///
/// Paths are relative to the mount root. A path that is valid UTF-8 travels
/// as a JSON string in `path`; any other byte sequence adds `path_b64` (the
/// raw bytes, base64), and `path` then shows it with U+FFFD for display.
public enum ControlProtocol {
    /// The mount root's attribute with the daemon's status as JSON, the
    /// control socket's path (`socket`) among it.
    public static let statusAttribute = "user.vanish.status"
    /// Setting this attribute on a path inside a mount with `deleteFlags`
    /// removes it, a whole tree in one step (`vanish rm`). With any other
    /// flags it is an ordinary attribute, stored as natively: a copy of a
    /// tree that carries it (`rsync -X`, `tar --xattrs`, `cp -a`) must never
    /// delete the destination.
    public static let deleteAttribute = "user.vanish.delete"
    /// XATTR_CREATE and XATTR_REPLACE together: every other filesystem
    /// refuses the pair (EEXIST or ENODATA) and stores nothing, so no copy of
    /// data ever passes it, and elsewhere the call fails harmlessly.
    public static let deleteFlags = Int32(XATTR_CREATE | XATTR_REPLACE)

    /// Whether `s` has the form of a trash entry's id: its graveyard name,
    /// `<16 hex>-<8 hex>-<10 hex>`, and for an entry another user than the
    /// daemon's deleted, `-<8 hex uid><8 hex gid><16 hex key>` after it.
    public static func isEntryID(_ s: String) -> Bool {
        let count = s.utf8.count
        // A file's entry has `_` before its counter.
        return (count == 36 || count == 69)
            && s.utf8.allSatisfy { ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x61 && $0 <= 0x66) || $0 == 0x2D || $0 == 0x5F }
    }

    /// The requests the control socket answers (`op`).
    public enum Operation: String, Sendable, CaseIterable {
        /// The caller's restorable entries.
        case trashList = "trash-list"
        /// Put entries back (by `id` or `path`, optionally `to`).
        case restore
        /// Let the caller's kept entries go now (`ids`, `paths`, `older_than_ns`; none: all of them).
        case trashEmpty = "trash-empty"
        /// A stream of change events (`since`, `paths`, `types`, `snapshot`).
        case events
    }
}

/// The `type` of an event line: the journal's kinds of change, then those
/// only a subscriber's stream carries. The daemon, the client and the CLI
/// all take the names from here. (The journal stores a case's position:
/// new cases go last.)
public enum EventType: String, Sendable, CaseIterable {
    case created, written, truncated, renamed, deleted, linked, attributes
    case mounted, unmounting, reaped, restored
    /// The undo window's limits gave kept entries up early (`entries`,
    /// `bytes`, `because`): root's only, as `reaped`.
    case shortened
    /// Only in a subscriber's stream: its cursor cannot be served, rescan.
    case reset
    /// Only in a snapshot: the scan's bounds and one line per existing entry.
    case scanStarted = "scan-started", exists, scanCompleted = "scan-completed"
    /// Only in a stream: the daemon ends it (the mount is going away).
    case end
    /// Only in a stream, its first line: whose changes it carries (this
    /// client's, of a source other machines may share).
    case stream
    /// A directory's entries changed behind this mount (another client of a
    /// shared source, or a program on the backing directory): rescan it.
    case rescan

    /// A change the journal records (what `--type` filters), not a line
    /// about the stream itself.
    public var isJournaled: Bool {
        switch self {
        case .reset, .scanStarted, .exists, .scanCompleted, .end, .stream: false
        default: true
        }
    }
}

/// A path as raw bytes, with the JSON encoding described in `ControlProtocol`.
public struct PathBytes: Hashable, Sendable, CustomStringConvertible {
    public var bytes: [UInt8]
    public init(_ bytes: [UInt8]) { self.bytes = bytes }
    public init(_ string: String) { bytes = Array(string.utf8) }

    public var isValidUTF8: Bool { String(validating: bytes, as: UTF8.self) != nil }
    public var description: String { String(decoding: bytes, as: UTF8.self) }

    /// Adds `key` (and `key_b64` when needed) to a JSON object.
    public func put(into object: inout [String: JSON], key: String) {
        object[key] = .string(description)
        if !isValidUTF8 { object[key + "_b64"] = .string(Base64.encode(bytes)) }
    }

    /// Reads `key` / `key_b64` from a JSON object.
    public static func get(_ object: JSON, key: String) -> PathBytes? {
        if let b64 = object[key + "_b64"]?.string, let bytes = Base64.decode(b64) { return PathBytes(bytes) }
        return object[key]?.string.map(PathBytes.init)
    }
}
