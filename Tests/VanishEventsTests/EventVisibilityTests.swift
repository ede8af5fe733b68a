import Foundation
import Glibc
import Testing
import VanishTestSupport

/// What another user's event stream, snapshot and restore answers may
/// reveal: only names they could have seen when the change happened.
@Suite("event visibility for other users", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct EventVisibilityTests {
    @Test("root's changes in a private directory stay hidden after nobody makes a directory of the same name")
    func judgedWhenTheyHappened() throws {
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("""
                mkdir -m 1777 tmp && mkdir -m 777 pub && mkdir -m 700 private && echo x > private/X
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let root = try Subscriber(m, name: "root")
            defer { root.stop() }
            try attach(root, m)
            let instance = try #require(root.header?["instance"] as? String)
            #expect(try sh("""
                set -e
                mkdir -m 700 tmp/job-42 && echo x > tmp/job-42/SECRET-CUSTOMER-NAME.csv
                rm tmp/job-42/SECRET-CUSTOMER-NAME.csv && rmdir tmp/job-42
                """, cwd: m.mountpoint).ok)
            #expect(try runAsNobody(["mkdir", m.path("tmp/job-42")]).ok)
            #expect(try sh("""
                set -e
                mv private/X pub/now-public
                setfattr -n trusted.secret-name -v 1 pub/now-public
                touch pub/end
                """, cwd: m.mountpoint).ok)
            let s = try Subscriber(m, ["--since", "\(instance):0"], name: "nobody", asNobody: true)
            defer { s.stop() }
            try s.waitFor("pub/end") { $0["path"] as? String == "pub/end" }
            let all = s.events.map { "\($0)" }.joined(separator: "\n")
            #expect(!all.contains("SECRET-CUSTOMER-NAME"), "\(all)")
            #expect(!all.contains("private/X"), "\(all)")
            #expect(!all.contains("trusted."), "\(all)")
            #expect(!s.events.contains { $0["type"] as? String == "reaped" }, "\(all)")
            // What moved into their sight appears to them, as it would to a rescan.
            #expect(s.events.contains { $0["type"] as? String == "created" && $0["path"] as? String == "pub/now-public" },
                    "\(all)")
            // nobody's own directory is theirs to see.
            #expect(s.events.contains { $0["type"] as? String == "created" && $0["path"] as? String == "tmp/job-42" })

            // Restoring root's name and a name never deleted get one answer.
            let binary = m.base + "/vanish-for-nobody"
            let deleted = try runAsNobody([binary, "restore", m.path("tmp/job-42/SECRET-CUSTOMER-NAME.csv")])
            let never = try runAsNobody([binary, "restore", m.path("tmp/job-42/GUESSED-NAME.csv")])
            #expect(deleted.status == 1 && deleted.stderr.contains("nothing restorable is known"), "\(deleted.stderr)")
            #expect(deleted.stderr.replacingOccurrences(of: "SECRET-CUSTOMER-NAME", with: "GUESSED-NAME") == never.stderr)
            let status = try runAsNobody([binary, "status", "--json", m.mountpoint]).stdout
            #expect(status.contains("\"buried_entries\":null"), "\(status)")
        }
    }

    @Test("nobody's own writes and links through a handle do not name the link root made to their file in a private directory (issue 49)")
    func ownWritesUnderAnotherName() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("chmod 755 . && mkdir -m 777 w", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let root = try Subscriber(m, name: "root")
            defer { root.stop() }
            try attach(root, m)
            let instance = try #require(root.header?["instance"] as? String)
            // nobody keeps their log open and writes to it; meanwhile root links it into a
            // private directory (as cp -al and rsync --link-dest backups do).
            let writer = m.base + "/writer.py", go = m.base + "/go"
            #expect(try sh("chmod 755 \(m.base)").ok)
            try """
                import os, sys
                log, go, end = sys.argv[1:4]
                fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(fd, b"one\\n")
                while not os.path.exists(go):
                    os.sched_yield()
                os.write(fd, b"two\\n")
                os.close(fd)
                open(end, "w").close()
                """.write(toFile: writer, atomically: true, encoding: .utf8)
            let started = try sh("""
                setpriv --reuid=nobody --regid=nogroup --clear-groups -- /usr/bin/python3 \(writer) \
                  \(m.path("w/nlog")) \(go) \(m.path("w/end")) > /dev/null 2>&1 &
                """)
            #expect(started.ok)
            try waitFor("nobody's log") { access(m.path("w/nlog"), F_OK) == 0 }
            #expect(try sh("mkdir -m 700 -p r7/backup && ln w/nlog r7/backup/SECRETBACKUP && touch \(go)",
                           cwd: m.mountpoint).ok)
            try waitFor("nobody's writer to finish") { access(m.path("w/end"), F_OK) == 0 }
            // A link nobody makes to their file names it by inode: its target is the last name too.
            #expect(try runAsNobody(["ln", m.path("w/nlog"), m.path("w/nlog2")]).ok)
            #expect(try runAsNobody(["touch", m.path("w/end2")]).ok)
            let s = try Subscriber(m, ["--since", "\(instance):0"], name: "nobody", asNobody: true)
            defer { s.stop() }
            try s.waitFor("w/end2") { $0["path"] as? String == "w/end2" }
            let all = s.events.map { "\($0)" }.joined(separator: "\n")
            #expect(!all.contains("SECRETBACKUP") && !all.contains("r7/backup/"), "\(all)")
            #expect(s.events.contains { $0["type"] as? String == "linked" && $0["path"] as? String == "w/nlog2" }, "\(all)")
            #expect(s.events.contains { $0["type"] as? String == "created" && $0["path"] as? String == "w/nlog" }, "\(all)")
            // Root sees the write under the name it is known by.
            try root.waitFor("w/end") { $0["path"] as? String == "w/end" }
            #expect(root.events.contains { $0["type"] as? String == "written" && $0["path"] as? String == "r7/backup/SECRETBACKUP" })
        }
    }

    @Test("nobody's snapshot of a 3000-deep chain costs the daemon time in proportion to the entries, not their depth squared")
    func deepChain() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try run(["python3", "-c", """
                import os, sys
                os.chdir(sys.argv[1])
                for i in range(3000):
                    os.mkdir("d")
                    os.chdir("d")
                """, src])
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish-for-nobody"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let before = try cpuTicks(m.pid)
            let r = try runAsNobody([binary, "events", "--json", "--snapshot", "--once", m.mountpoint])
            let used = try cpuTicks(m.pid) - before
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout.components(separatedBy: "\"type\":\"exists\"").count - 1 == 3000)
            // Quadratic checks took 17.5 s for this; a linear walk takes milliseconds.
            #expect(used < 300, "the daemon used \(used) ticks (1/100 s) for one snapshot")
        }
    }

    @Test("nobody's stalled snapshots of a deep chain of long names hold the daemon's memory to one path each, not the depth squared")
    func stalledDeepSnapshots() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try run(["python3", "-c", """
                import os, sys
                os.chdir(sys.argv[1])
                os.mkdir("nd"); os.chown("nd", 65534, 65534); os.chdir("nd")
                for i in range(1500):
                    os.mkdir("d" * 100)
                    os.chdir("d" * 100)
                """, src])
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let socket = try #require(try statusJSON(m)["socket"] as? String)
            let client = m.base + "/stall.py"
            try """
                import socket, sys
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(sys.argv[1])
                s.sendall(b'{"op":"events","snapshot":true}\\n')
                data = b""
                # Read until the walk is 1,200 levels down, then stop reading.
                while max((len(l) for l in data.split(b"\\n")), default=0) < 120000:
                    chunk = s.recv(1 << 20)
                    if not chunk: sys.exit("the stream ended")
                    data = data[data.rfind(b"\\n") + 1:] + chunk if len(data) > (4 << 20) else data + chunk
                print("stalled", flush=True)
                sys.stdin.read()
                """.write(toFile: client, atomically: true, encoding: .utf8)
            chmod(m.base, 0o755)
            chmod(client, 0o644)
            func rss() throws -> Int {
                let status = try String(contentsOfFile: "/proc/\(m.pid)/status", encoding: .utf8)
                let line = try #require(status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") })
                return Int(line.split(separator: " ").dropFirst().first ?? "0") ?? 0
            }
            let before = try rss()
            var clients: [(Process, Pipe)] = []
            defer { for (p, input) in clients { try? input.fileHandleForWriting.close(); p.waitUntilExit() } }
            for _ in 0..<3 {
                let p = Process(), input = Pipe(), output = Pipe()
                p.executableURL = URL(fileURLWithPath: "/usr/bin/setpriv")
                p.arguments = ["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "/usr/bin/python3", client, socket]
                p.standardInput = input
                p.standardOutput = output
                try p.run()
                clients.append((p, input))
                let said = String(decoding: output.fileHandleForReading.readData(ofLength: 8), as: UTF8.self)
                try #require(said == "stalled\n", "the client said \(said)")
            }
            let grown = try rss() - before
            // A copy of the path per level took about 70 MB a subscriber here.
            #expect(grown < 32 << 10, "the daemon grew \(grown) KiB for three stalled snapshots")
        }
    }
}
