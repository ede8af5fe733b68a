/// A JSON value, for the control socket's lines.
///
/// Hand-written instead of Foundation's JSONSerialization so that neither
/// the CLI nor the daemon links Foundation: loading and initialising it was
/// 6 of the 10 ms `vanish rm` took to start. Numbers keep their literal
/// text, so a UInt64 sequence number or byte count round-trips exactly.
public enum JSON: Sendable, Equatable {
    case null
    case bool(Bool)
    case number(String)
    case string(String)
    case array([JSON])
    case object([String: JSON])

    public init(_ v: some BinaryInteger) { self = .number(String(v)) }
    public init(_ v: Double) { self = .number(v.isFinite ? String(v) : "0") }
    public init(_ v: String) { self = .string(v) }
    public init(_ v: Bool) { self = .bool(v) }
    public init(_ v: [String]) { self = .array(v.map(JSON.string)) }

    // MARK: Reading

    public subscript(key: String) -> JSON? {
        if case .object(let o) = self { return o[key] }
        return nil
    }

    public var string: String? { if case .string(let s) = self { return s } else { return nil } }
    public var bool: Bool? { if case .bool(let b) = self { return b } else { return nil } }
    public var array: [JSON]? { if case .array(let a) = self { return a } else { return nil } }
    public var object: [String: JSON]? { if case .object(let o) = self { return o } else { return nil } }
    public var int: Int? { number.flatMap { Int($0) ?? Double($0).flatMap { Int(exactly: $0.rounded(.towardZero)) } } }
    public var uint64: UInt64? { number.flatMap { UInt64($0) } }
    public var double: Double? { number.flatMap { Double($0) } }
    private var number: String? { if case .number(let n) = self { return n } else { return nil } }

    // MARK: Writing

    /// One line of JSON: no spaces, keys sorted, no `\/` escapes, non-ASCII as UTF-8.
    public var serialized: String {
        var out: [UInt8] = []
        out.reserveCapacity(256)
        write(to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    private func write(to out: inout [UInt8]) {
        switch self {
        case .null: out += "null".utf8
        case .bool(let b): out += (b ? "true" : "false").utf8
        case .number(let n): out += n.utf8
        case .string(let s): JSON.writeString(s, to: &out)
        case .array(let a):
            out.append(UInt8(ascii: "["))
            for (i, v) in a.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                v.write(to: &out)
            }
            out.append(UInt8(ascii: "]"))
        case .object(let o):
            out.append(UInt8(ascii: "{"))
            for (i, k) in o.keys.sorted().enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                JSON.writeString(k, to: &out)
                out.append(UInt8(ascii: ":"))
                o[k]!.write(to: &out)
            }
            out.append(UInt8(ascii: "}"))
        }
    }

    private static func writeString(_ s: String, to out: inout [UInt8]) {
        out.append(UInt8(ascii: "\""))
        for c in s.utf8 {
            switch c {
            case UInt8(ascii: "\""): out += #"\""#.utf8
            case UInt8(ascii: "\\"): out += #"\\"#.utf8
            case 0x0A: out += #"\n"#.utf8
            case 0x0D: out += #"\r"#.utf8
            case 0x09: out += #"\t"#.utf8
            case 0..<0x20:
                let hex = Array("0123456789abcdef".utf8)
                out += #"\u00"#.utf8
                out.append(hex[Int(c >> 4)])
                out.append(hex[Int(c & 0xF)])
            default: out.append(c)
            }
        }
        out.append(UInt8(ascii: "\""))
    }

    // MARK: Parsing

    /// Parses one JSON text (surrounding white space allowed); nil if it is not valid JSON.
    public static func parse(_ bytes: some Collection<UInt8>) -> JSON? {
        var p = Parser(Array(bytes))
        guard let v = p.value() else { return nil }
        p.skipSpace()
        return p.atEnd ? v : nil
    }

    public static func parse(_ text: String) -> JSON? { parse(Array(text.utf8)) }

    private struct Parser {
        let b: [UInt8]
        var i = 0
        var depth = 0
        init(_ b: [UInt8]) { self.b = b }

        var atEnd: Bool { i >= b.count }

        mutating func skipSpace() {
            while i < b.count, b[i] == 0x20 || b[i] == 0x0A || b[i] == 0x0D || b[i] == 0x09 { i += 1 }
        }

        mutating func literal(_ word: String, _ v: JSON) -> JSON? {
            let w = Array(word.utf8)
            guard b.count - i >= w.count, Array(b[i..<i + w.count]) == w else { return nil }
            i += w.count
            return v
        }

        mutating func value() -> JSON? {
            skipSpace()
            guard i < b.count else { return nil }
            switch b[i] {
            case UInt8(ascii: "{"): return object()
            case UInt8(ascii: "["): return array()
            case UInt8(ascii: "\""): return string().map(JSON.string)
            case UInt8(ascii: "t"): return literal("true", .bool(true))
            case UInt8(ascii: "f"): return literal("false", .bool(false))
            case UInt8(ascii: "n"): return literal("null", .null)
            default: return number()
            }
        }

        mutating func object() -> JSON? {
            depth += 1
            defer { depth -= 1 }
            guard depth < 512 else { return nil }
            i += 1
            var o: [String: JSON] = [:]
            skipSpace()
            if i < b.count, b[i] == UInt8(ascii: "}") { i += 1; return .object(o) }
            while true {
                skipSpace()
                guard i < b.count, b[i] == UInt8(ascii: "\""), let k = string() else { return nil }
                skipSpace()
                guard i < b.count, b[i] == UInt8(ascii: ":") else { return nil }
                i += 1
                guard let v = value() else { return nil }
                o[k] = v
                skipSpace()
                guard i < b.count else { return nil }
                if b[i] == UInt8(ascii: ",") { i += 1; continue }
                if b[i] == UInt8(ascii: "}") { i += 1; return .object(o) }
                return nil
            }
        }

        mutating func array() -> JSON? {
            depth += 1
            defer { depth -= 1 }
            guard depth < 512 else { return nil }
            i += 1
            var a: [JSON] = []
            skipSpace()
            if i < b.count, b[i] == UInt8(ascii: "]") { i += 1; return .array(a) }
            while true {
                guard let v = value() else { return nil }
                a.append(v)
                skipSpace()
                guard i < b.count else { return nil }
                if b[i] == UInt8(ascii: ",") { i += 1; continue }
                if b[i] == UInt8(ascii: "]") { i += 1; return .array(a) }
                return nil
            }
        }

        mutating func number() -> JSON? {
            let start = i
            while i < b.count, b[i] == UInt8(ascii: "-") || b[i] == UInt8(ascii: "+") || b[i] == UInt8(ascii: ".")
                    || b[i] == UInt8(ascii: "e") || b[i] == UInt8(ascii: "E") || (b[i] >= 0x30 && b[i] <= 0x39) {
                i += 1
            }
            let text = String(decoding: b[start..<i], as: UTF8.self)
            guard !text.isEmpty, Double(text) != nil else { return nil }
            return .number(text)
        }

        /// A string starting at the opening quote; escapes decoded, surrogate pairs joined.
        mutating func string() -> String? {
            i += 1
            var out: [UInt8] = []
            while i < b.count {
                let c = b[i]
                i += 1
                switch c {
                case UInt8(ascii: "\""):
                    return String(decoding: out, as: UTF8.self)
                case UInt8(ascii: "\\"):
                    guard i < b.count else { return nil }
                    let e = b[i]
                    i += 1
                    switch e {
                    case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): out.append(e)
                    case UInt8(ascii: "n"): out.append(0x0A)
                    case UInt8(ascii: "r"): out.append(0x0D)
                    case UInt8(ascii: "t"): out.append(0x09)
                    case UInt8(ascii: "b"): out.append(0x08)
                    case UInt8(ascii: "f"): out.append(0x0C)
                    case UInt8(ascii: "u"):
                        guard var scalar = hex4() else { return nil }
                        if scalar >= 0xD800 && scalar < 0xDC00, i + 1 < b.count, b[i] == UInt8(ascii: "\\"),
                           b[i + 1] == UInt8(ascii: "u") {
                            i += 2
                            guard let low = hex4(), low >= 0xDC00 && low < 0xE000 else { return nil }
                            scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                        }
                        out += String(Character(Unicode.Scalar(scalar) ?? "\u{FFFD}")).utf8
                    default: return nil
                    }
                default:
                    out.append(c)
                }
            }
            return nil
        }

        mutating func hex4() -> UInt32? {
            guard b.count - i >= 4 else { return nil }
            var v: UInt32 = 0
            for _ in 0..<4 {
                let c = b[i]
                i += 1
                let d: UInt8
                switch c {
                case 0x30...0x39: d = c - 0x30
                case 0x61...0x66: d = c - 0x61 + 10
                case 0x41...0x46: d = c - 0x41 + 10
                default: return nil
                }
                v = v << 4 | UInt32(d)
            }
            return v
        }
    }
}

// No ExpressibleByNilLiteral: with it, a `return nil` meant as "not JSON"
// in a function returning JSON? can silently become `.null`.
extension JSON: ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, ExpressibleByBooleanLiteral,
                ExpressibleByDictionaryLiteral, ExpressibleByArrayLiteral {
    public init(stringLiteral value: String) { self = .string(value) }
    public init(integerLiteral value: Int) { self = .number(String(value)) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(dictionaryLiteral elements: (String, JSON)...) {
        self = .object(Dictionary(elements, uniquingKeysWith: { $1 }))
    }
    public init(arrayLiteral elements: JSON...) { self = .array(elements) }
}

/// Base64 (RFC 4648, with padding), for path bytes that are not UTF-8:
/// the one encoder for the control socket, the CLI and the event journal.
package enum Base64 {
    private static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    /// Hands each output byte of `bytes`' encoding to `emit`, allocating
    /// nothing (the journal writes it straight into its buffer).
    @inline(__always)
    package static func encode(_ bytes: UnsafeBufferPointer<UInt8>, _ emit: (UInt8) -> Void) {
        var i = 0
        while i < bytes.count {
            let n = min(3, bytes.count - i)
            let v = UInt32(bytes[i]) << 16 | (n > 1 ? UInt32(bytes[i + 1]) << 8 : 0) | (n > 2 ? UInt32(bytes[i + 2]) : 0)
            for k in 0..<4 {
                emit(k <= n ? alphabet[Int((v >> UInt32(18 - 6 * k)) & 0x3F)] : UInt8(ascii: "="))
            }
            i += 3
        }
    }

    package static func encode(_ bytes: [UInt8]) -> String {
        var out: [UInt8] = []
        out.reserveCapacity((bytes.count + 2) / 3 * 4)
        bytes.withUnsafeBufferPointer { encode($0) { out.append($0) } }
        return String(decoding: out, as: UTF8.self)
    }

    package static func decode(_ text: String) -> [UInt8]? {
        var values: [UInt8] = []
        for c in text.utf8 where c != UInt8(ascii: "=") {
            guard let v = alphabet.firstIndex(of: c) else { return nil }
            values.append(UInt8(v))
        }
        guard values.count % 4 != 1 else { return nil }
        var out: [UInt8] = []
        var i = 0
        while i < values.count {
            let chunk = values[i..<min(i + 4, values.count)]
            var v: UInt32 = 0
            for (k, x) in chunk.enumerated() { v |= UInt32(x) << UInt32(18 - 6 * k) }
            for k in 0..<(chunk.count - 1) { out.append(UInt8((v >> UInt32(16 - 8 * k)) & 0xFF)) }
            i += 4
        }
        return out
    }
}
