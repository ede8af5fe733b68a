import VanishClient

/// One event as a request handler leaves it: its fields copied into a
/// compact binary form that the journal's writer thread turns into a JSON
/// line (`EventLine`). Escaping, number formatting and UTF-8 checks cost a
/// handler more than the copy does, and the client waits for the handler,
/// not for the writer, which runs on whatever core is idle.
///
/// Each field is a tag byte, its key (a `StaticString`'s address and length:
/// keys live for the whole run, so only where they are is copied) and the
/// value: a length and bytes for text, eight bytes for a number, one for a bool.
public struct EventRecord: ~Copyable {
    private var buffer = ByteBuffer(capacity: 192)

    enum Tag: UInt8 { case path = 1, string, integer, bool }

    init() {}

    /// The fields as `format` reads them; valid until the next change.
    var bytes: UnsafeRawBufferPointer { buffer.bytes }

    public mutating func path(_ key: StaticString, _ value: [UInt8]) {
        value.withUnsafeBufferPointer { path(key, $0) }
    }

    public mutating func path(_ key: StaticString, _ value: UnsafeBufferPointer<UInt8>) {
        field(.path, key)
        text(value)
    }

    public mutating func string(_ key: StaticString, _ value: String) {
        field(.string, key)
        var value = value
        value.withUTF8 { text($0) }
    }

    /// Inlined so each caller gets a concrete conversion, not a generic call.
    @inlinable
    public mutating func int(_ key: StaticString, _ value: some BinaryInteger) {
        integer(key, Int64(truncatingIfNeeded: value))
    }

    public mutating func integer(_ key: StaticString, _ value: Int64) {
        field(.integer, key)
        buffer.append(bytesOf: value)
    }

    public mutating func bool(_ key: StaticString, _ value: Bool) {
        field(.bool, key)
        buffer.append(value ? 1 : 0)
    }

    private mutating func field(_ tag: Tag, _ key: StaticString) {
        // Keys are short ASCII literals, so their length fits a byte.
        precondition(key.hasPointerRepresentation && key.utf8CodeUnitCount < 256)
        buffer.append(tag.rawValue)
        buffer.append(bytesOf: UInt(bitPattern: key.utf8Start))
        buffer.append(UInt8(key.utf8CodeUnitCount))
    }

    private mutating func text(_ value: UnsafeBufferPointer<UInt8>) {
        buffer.append(bytesOf: UInt32(value.count))
        buffer.append(value)
    }

    /// Adds the fields of `record` (as `bytes` holds them) to `line`.
    static func format(_ record: UnsafeRawBufferPointer, into line: inout EventLine) {
        var at = 0
        func load<T: FixedWidthInteger>(_: T.Type) -> T {
            defer { at += MemoryLayout<T>.size }
            return record.loadUnaligned(fromByteOffset: at, as: T.self)
        }
        while at < record.count {
            let tag = Tag(rawValue: load(UInt8.self))!
            let keyStart = UnsafePointer<UInt8>(bitPattern: load(UInt.self))!
            let key = UnsafeBufferPointer(start: keyStart, count: Int(load(UInt8.self)))
            switch tag {
            case .path, .string:
                let count = Int(load(UInt32.self))
                let value = UnsafeRawBufferPointer(rebasing: record[at..<at + count]).bindMemory(to: UInt8.self)
                at += count
                if tag == .path { line.path(key, value) } else { line.string(key, value) }
            case .integer:
                line.integer(key, load(Int64.self))
            case .bool:
                line.bool(key, load(UInt8.self) != 0)
            }
        }
    }
}

extension EventType {
    /// The case as one byte (its place in `allCases`), for records.
    var code: UInt8 {
        // A few byte compares: cases without payload compare by their tag.
        UInt8(EventType.allCases.firstIndex(of: self)!)
    }

    init(code: UInt8) {
        self = EventType.allCases[Int(code)]
    }
}
