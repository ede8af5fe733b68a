import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Telling copies (`copied_from`) reads files back: a user must not be able
/// to turn that into work for the daemon out of proportion to their own.
@Suite("copy detection cost", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct CopyDetectionCostTests {
    @Test("nobody closing 256 MiB sparse copies in a loop costs the daemon next to nothing, and each is still told a copy")
    func sparseCopies() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            guard try sh("mkdir -m 777 pub", cwd: src).ok else { throw TestFailure("mkdir") }
        }) { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let script = m.base + "/copies.py"
            try """
                import os, sys
                os.chdir(sys.argv[1])
                size = 256 << 20
                with open("src", "wb") as f:
                    f.seek(size - 1)
                    f.write(b"x")
                for i in range(40):
                    r = open("src", "rb")
                    with open("copy%d" % i, "wb") as w:
                        w.seek(size - 1)
                        w.write(b"x")
                    r.close()
                """.write(toFile: script, atomically: true, encoding: .utf8)
            let before = try cpuTicks(m.pid)
            let r = try runAsNobody(["/usr/bin/python3", script, m.path("pub")])
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("the last copy's written event") { $0["type"] as? String == "written" && $0["path"] as? String == "pub/copy39" }
            let used = try cpuTicks(m.pid) - before
            // Comparing byte by byte read 20 GiB for this.
            #expect(used < 200, "the daemon used \(used) ticks (1/100 s)")
            let last = try #require(s.events.last { $0["path"] as? String == "pub/copy39" && $0["type"] as? String == "written" })
            #expect(last["copied_from"] as? String == "pub/src", "\(last)")
        }
    }
}

/// utime + stime of `pid`, in clock ticks.
func cpuTicks(_ pid: pid_t) throws -> Int {
    let stat = try String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8)
    guard let close = stat.lastIndex(of: ")") else { throw TestFailure("unreadable stat") }
    let fields = stat[stat.index(after: close)...].split(separator: " ")
    guard fields.count > 13, let u = Int(fields[11]), let s = Int(fields[12]) else { throw TestFailure("stat fields") }
    return u + s
}
