import Glibc

/// Command-line arguments with every byte kept. Linux paths are bytes, and
/// Swift's `CommandLine.arguments` replaces what is not UTF-8 with U+FFFD,
/// so `vanish rm` of such a name removed nothing ("No such file"). Here each
/// byte outside a valid sequence becomes the private-use scalar U+F700+byte,
/// which the argument parser passes through untouched, and `bytes` and
/// `withCString` turn it back into that byte for the syscall.
enum RawArguments {
    private static let escapes: ClosedRange<UInt32> = 0xF780...0xF7FF

    /// argv, decoded as above.
    static func decode() -> [String] {
        (0..<Int(CommandLine.argc)).map { i in
            guard let p = CommandLine.unsafeArgv[i] else { return "" }
            return string(UnsafeBufferPointer(start: UnsafeRawPointer(p).assumingMemoryBound(to: UInt8.self), count: strlen(p)))
        }
    }

    /// Decodes `bytes` as UTF-8, escaping each byte that is not part of a valid sequence.
    static func string<C: Collection>(_ bytes: C) -> String where C.Element == UInt8 {
        if let s = String(validating: bytes, as: UTF8.self) { return s }
        var out = String.UnicodeScalarView()
        var parser = Unicode.UTF8.ForwardParser()
        var input = bytes.makeIterator()
        var index = bytes.startIndex
        loop: while true {
            switch parser.parseScalar(from: &input) {
            case .valid(let encoded):
                out.append(Unicode.UTF8.decode(encoded))
                index = bytes.index(index, offsetBy: encoded.count)
            case .error(let length):
                for _ in 0..<length {
                    out.append(Unicode.Scalar(0xF700 + UInt32(bytes[index]))!)
                    index = bytes.index(after: index)
                }
            case .emptyInput:
                break loop
            }
        }
        return String(out)
    }

    /// The bytes an argument stands for.
    static func bytes(_ s: String) -> [UInt8] {
        var out: [UInt8] = []
        for scalar in s.unicodeScalars {
            if escapes.contains(scalar.value) { out.append(UInt8(scalar.value - 0xF700)) } else { out += Array(String(scalar).utf8) }
        }
        return out
    }

    /// Calls `body` with the argument's bytes as a C string.
    static func withCString<R>(_ s: String, _ body: (UnsafePointer<CChar>) throws -> R) rethrows -> R {
        try (bytes(s) + [0]).withUnsafeBufferPointer { try body(UnsafeRawPointer($0.baseAddress!).assumingMemoryBound(to: CChar.self)) }
    }

    /// For messages: the argument as a person reads it (U+FFFD for what is not UTF-8).
    static func display(_ s: String) -> String { String(decoding: bytes(s), as: UTF8.self) }
}
