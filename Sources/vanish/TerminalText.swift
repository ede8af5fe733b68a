/// Text from the filesystem (names, command names, other users' paths) as
/// it may be shown to a person: a control character in a file name would
/// otherwise forge a line of output or send escape sequences to the
/// reader's terminal (another user's `\e]0;…\a` retitling root's window).
enum TerminalText {
    /// `s` with every C0 and C1 control character and DEL written as an
    /// escape (`\n`, `\t`, `\x1b`, `\u{85}`), and backslash as `\\`, so
    /// what is shown is unambiguous and inert. Bidirectional controls,
    /// zero-width characters and the line and paragraph separators are
    /// escaped too (`\u{202e}`): they would make a name read as another
    /// (`invoice\u{202e}fdp.exe` shows as "invoiceexe.pdf") or hide in it.
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
            case _ where isInvisible(scalar):
                out += "\\u{" + hex(scalar.value, 4) + "}"
            default:
                out.unicodeScalars.append(scalar)
            }
        }
        return out
    }

    private static func needsEscape(_ c: Unicode.Scalar) -> Bool {
        c.value < 0x20 || (0x7F...0x9F).contains(c.value) || c == "\\" || isInvisible(c)
    }

    /// Format characters that change how the text around them reads, or
    /// show as nothing: bidi marks, embeddings, overrides and isolates,
    /// zero-width spaces and joiners, the BOM, line and paragraph separators.
    private static func isInvisible(_ c: Unicode.Scalar) -> Bool {
        switch c.value {
        case 0x061C, 0x200B...0x200F, 0x2028...0x202E, 0x2060...0x2064, 0x2066...0x206F, 0xFEFF: true
        default: false
        }
    }

    private static func hex(_ v: UInt32, _ digits: Int) -> String {
        let s = String(v, radix: 16)
        return String(repeating: "0", count: max(0, digits - s.count)) + s
    }
}
