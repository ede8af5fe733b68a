import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Access times through the mount follow its atime options, as they would
/// on a filesystem mounted with them.
@Suite("access times", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct AtimeTests {
    /// Sets f's and d's atime to 2020-01-01, reads both, prints their atimes (epoch seconds).
    static let script = """
        touch -a -d @1577836800 f d && cat f >/dev/null && ls d >/dev/null && stat -c %X f d
        """

    static func prepare(_ dir: String) throws {
        guard try sh("echo data > f && mkdir d && touch d/x", cwd: dir).ok else { throw TestFailure("prepare") }
    }

    @Test("noatime keeps access times, reading files and listing directories, with passthrough on and off",
          arguments: ["auto", "off"])
    func noatime(passthrough: String) throws {
        try withVanishMount(options: ["noatime", "passthrough=\(passthrough)", "cache=never"], prepare: AtimeTests.prepare) { m in
            let r = try sh(AtimeTests.script, cwd: m.mountpoint)
            #expect(r.stdout == "1577836800\n1577836800\n", "\(r.stderr)")
            #expect(try sh("stat -c %X f d", cwd: m.source).stdout == "1577836800\n1577836800\n")
            #expect(try String(contentsOfFile: "/proc/self/mountinfo", encoding: .utf8)
                .split(separator: "\n").contains { $0.contains(" \(m.mountpoint) ") && $0.contains("noatime") })
        }
    }

    @Test("strictatime moves the access time on every read; relatime and the default only on the first after a change",
          arguments: [(["strictatime"], "moved"), (["relatime"], "same"), ([], "same")])
    func strictatime(options: [String], expected: String) throws {
        try withVanishMount(options: options + ["cache=never"], prepare: AtimeTests.prepare) { m in
            // Reads until the access time moves (the clock's tick may hold it still a moment), 300 at most.
            let r = try sh("""
                cat f >/dev/null; a=$(stat -c %x f); b=$a; i=0
                while [ $i -lt 300 ]; do cat f >/dev/null; b=$(stat -c %x f); [ "$a" != "$b" ] && break; i=$((i+1)); done
                if [ "$a" = "$b" ]; then echo same; else echo moved; fi
                """, cwd: m.mountpoint)
            #expect(r.stdout == expected + "\n", "\(options): \(r.stdout)\(r.stderr)")
        }
    }

    @Test("by default, and with relatime or strictatime, a read after the last change moves the access time as on the backing filesystem",
          arguments: [[], ["relatime"], ["strictatime"]])
    func backingRule(options: [String]) throws {
        try withVanishMount(options: options + ["cache=never"], prepare: AtimeTests.prepare) { m in
            let r = try sh(AtimeTests.script, cwd: m.mountpoint)
            let times = r.stdout.split(separator: "\n").compactMap { Int($0) }
            #expect(times.count == 2 && times.allSatisfy { $0 > 1577836800 }, "\(r.stdout)\(r.stderr)")
        }
    }
}
