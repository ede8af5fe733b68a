import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Names another user chose are shown to root as inert text: a newline
/// cannot forge a line of `vanish trash list`, an escape sequence cannot
/// reach root's terminal through `vanish events`, and a bidi override or a
/// zero-width space cannot make one name read as another.
@Suite("hostile names in human output", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct HostileNamesTests {
    static let forged = "x\n18ea0b20486272b1-00005bae-0000000001  2026-01-01 00:00:00       6 B root     shadow"
    static let escape = "\u{1B}]0;PWNED\u{07}\u{1B}[2J"
    /// Shows as "invoiceexe.pdf"; and a name with a zero-width space in it.
    static let bidi = "invoice\u{202E}fdp.exe"
    static let hidden = "pass\u{200B}wd"

    @Test("nobody's file names are escaped in root's trash list and event lines")
    func escaped() throws {
        // keep_min_age=0: the script deletes files it made moments ago, which the window would not keep.
        try withVanishMount(options: ["allow_other", "keep_min_age=0"], arguments: ["--keep", "1h"], prepare: { src in
            guard try sh("mkdir -m 1777 shared", cwd: src).ok else { throw TestFailure("mkdir") }
        }) { m in
            // nobody makes both names; deletes one copy of each, keeps one.
            let script = m.base + "/names.py"
            try """
                import os, sys
                os.chdir(sys.argv[1])
                for n in sys.argv[2:]:
                    for d in ("gone-", "kept-"):
                        with open(d + n, "w") as f: f.write("x")
                    os.unlink("gone-" + n)
                """.write(toFile: script, atomically: true, encoding: .utf8)
            let made = try runAsNobody(["/usr/bin/python3", script, m.path("shared"), Self.forged, Self.escape,
                                         Self.bidi, Self.hidden])
            #expect(made.ok, "\(made.stderr)")

            let trash = try run([vanishBinary, "trash", "list", m.mountpoint])
            #expect(trash.ok, "\(trash.stderr)")
            let lines = trash.stdout.split(separator: "\n", omittingEmptySubsequences: false).filter { !$0.isEmpty }
            #expect(lines.count == 1 + 4, "a header and one line per deleted file: \(trash.stdout)")
            #expect(!trash.stdout.contains("\u{1B}"), "\(trash.stdout)")
            #expect(!trash.stdout.unicodeScalars.contains("\u{202E}") && !trash.stdout.unicodeScalars.contains("\u{200B}"),
                    "\(trash.stdout)")
            #expect(trash.stdout.contains("gone-invoice\\u{202e}fdp.exe") && trash.stdout.contains("gone-pass\\u{200b}wd"),
                    "\(trash.stdout)")
            #expect(trash.stdout.contains("gone-x\\n18ea0b20486272b1"), "\(trash.stdout)")

            // On a terminal (script's pty) events are lines for people.
            let cmd = [vanishBinary, "events", "--snapshot", "--once", m.mountpoint].map(shellQuote).joined(separator: " ")
            let events = try run(["script", "-q", "-e", "-c", cmd, "/dev/null"])
            #expect(events.ok, "\(events.stderr)")
            #expect(!events.stdout.contains("\u{1B}]0;PWNED"), "an escape sequence reached the terminal")
            #expect(events.stdout.contains("kept-\\x1b]0;PWNED\\x07\\x1b[2J"), "\(events.stdout)")
            #expect(events.stdout.contains("kept-x\\n18ea0b20486272b1"), "\(events.stdout)")
            #expect(events.stdout.contains("kept-invoice\\u{202e}fdp.exe"), "\(events.stdout)")
            #expect(!events.stdout.unicodeScalars.contains("\u{202E}"), "a bidi override reached the terminal")
        }
    }
}
