import Glibc
import VanishClient

/// Events as lines of JSON, built straight into bytes (no Foundation, no
/// intermediate objects): the journal's writer turns each handler's
/// `EventRecord` into one, and appends a whole batch to one buffer.
///
/// Field order is fixed: `seq` first, then `type`, so readers can skip and
/// filter without parsing the rest. Paths are relative to the mount root;
/// bytes that are not valid UTF-8 are shown as U+FFFD in the string field
/// and the exact bytes are added as `<field>_b64`.
public struct EventLine: ~Copyable {
    private var buffer: ByteBuffer

    /// An empty buffer for a batch of lines.
    init() { buffer = ByteBuffer(capacity: 64 << 10) }

    /// A buffer holding the start of one line.
    init(seq: UInt64, type: EventType, time: UInt64, instance: String) {
        buffer = ByteBuffer(capacity: 256)
        begin(seq: seq, type: type, time: time, instance: instance)
    }

    /// The lines so far; valid until the next change.
    var bytes: UnsafeRawBufferPointer { buffer.bytes }

    /// Starts a line after those already in the buffer.
    mutating func begin(seq: UInt64, type: EventType, time: UInt64, instance: String) {
        raw("{\"seq\":")
        number(seq)
        raw(",\"type\":\"")
        text(type.rawValue)
        raw("\",\"time_ns\":")
        number(time)
        raw(",\"instance\":\"")
        text(instance)
        raw("\"")
    }

    /// Empties the buffer, keeping its capacity unless it grew past `keeping` bytes.
    mutating func removeAll(keeping limit: Int) {
        buffer.removeAll(keepingAtMost: limit)
    }

    mutating func path(_ key: UnsafeBufferPointer<UInt8>, _ value: UnsafeBufferPointer<UInt8>) {
        raw(",\"")
        buffer.append(key)
        raw("\":\"")
        let valid = value.allSatisfy { $0 < 0x80 } || String(validating: value, as: UTF8.self) != nil
        if valid {
            escape(value)
        } else {
            var repaired = String(decoding: value, as: UTF8.self)
            repaired.withUTF8 { escape($0) }
        }
        raw("\"")
        if !valid {
            raw(",\"")
            buffer.append(key)
            raw("_b64\":\"")
            Base64.encode(value) { buffer.append($0) }
            raw("\"")
        }
    }

    /// `value` is UTF-8 (it came from a String).
    mutating func string(_ key: UnsafeBufferPointer<UInt8>, _ value: UnsafeBufferPointer<UInt8>) {
        raw(",\"")
        buffer.append(key)
        raw("\":\"")
        escape(value)
        raw("\"")
    }

    mutating func integer(_ key: UnsafeBufferPointer<UInt8>, _ value: Int64) {
        raw(",\"")
        buffer.append(key)
        raw("\":")
        if value < 0 { buffer.append(0x2D); number(value.magnitude) } else { number(UInt64(value)) }
    }

    mutating func bool(_ key: UnsafeBufferPointer<UInt8>, _ value: Bool) {
        raw(",\"")
        buffer.append(key)
        raw(value ? "\":true" : "\":false")
    }

    mutating func finish() {
        raw("}\n")
    }

    private mutating func raw(_ s: StaticString) {
        buffer.append(s.utf8Start, count: s.utf8CodeUnitCount)
    }

    private mutating func text(_ s: String) {
        var s = s
        s.withUTF8 { buffer.append($0) }
    }

    /// `v` in decimal ASCII, without going through String.
    private mutating func number(_ v: UInt64) {
        if v == 0 { buffer.append(0x30); return }
        var n = v
        withUnsafeTemporaryAllocation(byteCount: 24, alignment: 8) { buf in
            // Filled from the end, so the digits are in order for one copy.
            var i = buf.count
            while n > 0 { i -= 1; buf[i] = UInt8(n % 10) + 0x30; n /= 10 }
            buffer.append(UnsafeRawBufferPointer(rebasing: buf[i...]))
        }
    }

    private static let hex: [UInt8] = Array("0123456789abcdef".utf8)

    /// Appends `value` as the inside of a JSON string. Runs that need no
    /// escaping (nearly every path and name) go in with one copy: a
    /// byte-at-a-time append cost each event a uniqueness check per byte.
    private mutating func escape(_ value: UnsafeBufferPointer<UInt8>) {
        guard let base = value.baseAddress else { return }
        var start = 0
        for i in 0..<value.count {
            let c = base[i]
            guard c < 0x20 || c == 0x22 || c == 0x5C || c == 0x7F else { continue }
            if i > start { buffer.append(base + start, count: i - start) }
            buffer.append(0x5C)
            switch c {
            case 0x22: buffer.append(0x22)
            case 0x5C: buffer.append(0x5C)
            case 0x0A: buffer.append(0x6E)
            default: raw("u00"); buffer.append(EventLine.hex[Int(c >> 4)]); buffer.append(EventLine.hex[Int(c & 0xF)])
            }
            start = i + 1
        }
        if value.count > start { buffer.append(base + start, count: value.count - start) }
    }

    /// The `type` of a journal line, read from its fixed place after `seq`
    /// (for filtering by type without parsing the line).
    public static func type(of line: UnsafeRawBufferPointer) -> UnsafeRawBufferPointer? {
        let key: StaticString = ",\"type\":\""
        let count = key.utf8CodeUnitCount
        guard seq(of: line) != nil, var i = line.firstIndex(of: UInt8(ascii: ",")),
              line.count - i > count, memcmp(line.baseAddress! + i, key.utf8Start, count) == 0 else { return nil }
        i += count
        guard let end = line[i...].firstIndex(of: UInt8(ascii: "\"")) else { return nil }
        return UnsafeRawBufferPointer(rebasing: line[i..<end])
    }

    /// The `seq` of a line this type wrote (nil for anything else): the
    /// client's reading of it, one rule for both.
    public static func seq(of line: UnsafeRawBufferPointer) -> UInt64? { Event.seq(of: line) }
}
