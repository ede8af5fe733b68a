import Glibc
import Testing
import VanishTestSupport

@Suite("scale", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct ScaleTests {
    /// The kernel caches far more inodes than the daemon may hold fds; with
    /// `ulimit -n 1024` an fd per inode would fail after ~1,000 files.
    @Test("a 200,000-file tree is created, walked and removed under ulimit -n 1024")
    func twoHundredThousandFiles() throws {
        try withVanishMount(fileLimit: 1024) { m in
            let root = open(m.mountpoint, O_RDONLY | O_DIRECTORY)
            defer { close(root) }
            var failures: [String] = []
            for d in 0..<200 {
                guard mkdirat(root, "d\(d)", 0o755) == 0 else { failures.append("mkdir d\(d): \(errno)"); continue }
                let dir = openat(root, "d\(d)", O_RDONLY | O_DIRECTORY)
                for i in 0..<1000 {
                    let fd = openat(dir, "f\(i)", O_CREAT | O_WRONLY | O_EXCL, 0o644)
                    if fd < 0 { failures.append("create d\(d)/f\(i): \(errno)"); if failures.count > 10 { break } }
                    else { close(fd) }
                }
                close(dir)
                if failures.count > 10 { break }
            }
            #expect(failures.isEmpty, "\(failures)")
            let find = try sh("find . | wc -l", cwd: m.mountpoint)
            #expect(find.ok && find.stdout == "200201\n", "\(find.stderr)")
            let stat = try sh("find . -type f | wc -l && ls -lR . | grep -c '^-rw'",
                              cwd: m.mountpoint)
            #expect(stat.ok && stat.stdout == "200000\n200000\n", "\(stat.stderr)")
            let daemonFDs = try sh("ls /proc/$(pgrep -f 'vanish mount -f.*\(m.base)' | head -1)/fd | wc -l")
            #expect((Int(daemonFDs.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? .max) < 1024)
            let rm = try sh("rm -rf d*", cwd: m.mountpoint)
            #expect(rm.ok, "\(rm.stderr)")
            // Underneath only the state directory is left, and the reaper empties its graveyard.
            let left = try sh("ls -A | wc -l && ls -A \(shellQuote(m.source))", cwd: m.mountpoint)
            #expect(left.stdout == "0\n.vanish\n")
            #expect(try run(["timeout", "180", vanishBinary, "status", "--wait", m.mountpoint]).ok)
            let graves = try sh("find .vanish/clients/*/graveyard -mindepth 2 | wc -l", cwd: m.source)
            #expect(graves.stdout == "0\n")
            #expect(!m.log.contains("Too many open files"))
        }
    }

    @Test("after a burst of 50,000 files the daemon gives their memory back once the mount is quiet")
    func memoryComesBack() throws {
        // Without events: the journal's buffers keep the capacity a burst
        // gave them (by design, up to 24 MiB).
        try withVanishMount(options: ["noevents"]) { m in
            func residentKB() -> Int {
                let status = (try? String(contentsOfFile: "/proc/\(m.pid)/status", encoding: .utf8)) ?? ""
                let line = status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") } ?? ""
                return Int(line.split(separator: " ").dropFirst().first ?? "") ?? -1
            }
            let before = residentKB()
            let r = try run(["python3", "-c", """
                import os, sys
                for d in range(5):
                    os.mkdir(f"{sys.argv[1]}/b{d}")
                    for i in range(10000): open(f"{sys.argv[1]}/b{d}/f{i}", "w").close()
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            let peak = residentKB()
            #expect(try sh("rm -rf b*", cwd: m.mountpoint).ok)
            // Half of what the burst added goes back (here about 85 %: the rest
            // is code and data touched for the first time, and the stacks and
            // buffers of request workers, whose number varies with load).
            var now = peak
            let back = (try? waitFor("the daemon's memory to come back", timeout: 30) {
                now = residentKB()
                return now > 0 && now - before < (peak - before) / 2
            }) != nil
            #expect(back, "resident: \(before) kB before the burst, \(peak) kB after it, \(now) kB at the end")
        }
    }

    @Test("a file's other name stays reachable once the name the daemon saw last is gone and its fd evicted",
          arguments: ["cache=auto", "cache=always"])
    func hardLinkAfterEviction(_ cache: String) throws {
        // 256 open files leave the daemon's fd cache about 100 entries, so
        // reading 300 other files evicts the linked file's fd; the kernel
        // still has `c` (and `e`) cached and asks for the file by inode.
        try withVanishMount(options: [cache], fileLimit: 256) { m in
            let r = try sh("""
                set -e
                echo a > c && ln c c2 && rm c2
                echo b > e && ln e e2 && rm e2
                mkdir many && for i in $(seq 300); do echo $i > many/$i; done
                cat many/* >/dev/null
                cat c && stat -c %h c
                chmod 600 e && stat -c %a e && cat e
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "a\n1\n600\nb\n")
        }
    }
}
