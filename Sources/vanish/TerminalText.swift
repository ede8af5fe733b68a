/// Text from the filesystem (names, command names, other users' paths) as
/// it may be shown to a person: a control character in a file name would
/// otherwise forge a line of output or send escape sequences to the
/// reader's terminal (another user's `\e]0;…\a` retitling root's window).
enum TerminalText {
    /// `s` with every C0 and C1 control character and DEL written as an
    /// escape (`\n`, `\t`, `\x1b`, `\u{85}`), and backslash as `\\`, so
    /// what is shown is unambiguous and inert.
    static func escaped(_ s: String) -> String {
        guard s.unicodeScalars.contains(where: needsEscape) else { return s }
        var out = ""
        for scalar in s.unicodeScalars {
            switch scalar {
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\t": out += "\\t"
            case "\r": out += "\\r"
            case _ where scalar.value < 0x20 || scalar.value == 0x7F:
                out += "\\x" + hex(scalar.value, 2)
            case _ where (0x80...0x9F).contains(scalar.value):
                out += "\\u{" + hex(scalar.value, 2) + "}"
            default:
                out.unicodeScalars.append(scalar)
            }
        }
        return out
    }

    private static func needsEscape(_ c: Unicode.Scalar) -> Bool {
        c.value < 0x20 || (0x7F...0x9F).contains(c.value) || c == "\\"
    }

    private static func hex(_ v: UInt32, _ digits: Int) -> String {
        let s = String(v, radix: 16)
        return String(repeating: "0", count: max(0, digits - s.count)) + s
    }
}
