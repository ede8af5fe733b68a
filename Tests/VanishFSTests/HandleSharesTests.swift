import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Every user's open files through the mount are fds of the one daemon:
/// no user may take so many that root's opens fail.
@Suite("open handles per user", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct HandleSharesTests {
    @Test("two of nobody's processes holding files open share one user's share, and root still opens, creates and lists")
    func sharesLeaveRootRoom() throws {
        // A daemon with 1,024 fds: a user may hold 256 handles, all users 512.
        try withVanishMount(options: ["allow_other"], fileLimit: 1024, prepare: { src in
            guard try sh("mkdir -m 777 pub && mkdir roots", cwd: src).ok else { throw TestFailure("mkdir") }
        }) { m in
            let holder = m.base + "/hold.py"
            try """
                import errno, os, sys, time
                os.chdir(sys.argv[1])
                held, error = [], ""
                for i in range(700):
                    try:
                        held.append(os.open("%s-%d" % (sys.argv[2], i), os.O_CREAT | os.O_RDWR, 0o600))
                    except OSError as e:
                        error = errno.errorcode[e.errno]
                        break
                with open(sys.argv[3] + ".part", "w") as f:
                    f.write("%d %s" % (len(held), error))
                os.rename(sys.argv[3] + ".part", sys.argv[3])
                while not os.path.exists(sys.argv[4]):
                    time.sleep(0.01)
                """.write(toFile: holder, atomically: true, encoding: .utf8)
            chmod(m.base, 0o777)
            let stop = m.base + "/stop"
            var holders: [pid_t] = []
            defer {
                _ = FileManager.default.createFile(atPath: stop, contents: nil)
                for h in holders { var st: Int32 = 0; waitpid(h, &st, 0) }
            }
            for name in ["a", "b"] {
                holders.append(try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                          "/usr/bin/python3", holder, m.path("pub"), name, m.base + "/held-" + name, stop]))
            }
            var held = 0
            for name in ["a", "b"] {
                try waitFor("holder \(name) to report") { access(m.base + "/held-" + name, F_OK) == 0 }
                let report = try String(contentsOfFile: m.base + "/held-" + name, encoding: .utf8)
                #expect(report.hasSuffix(" ENFILE"), "holder \(name): \(report)")
                held += Int(report.split(separator: " ")[0]) ?? 0
            }
            #expect(held == 256, "nobody's two processes share one user's share")
            // Root, meanwhile: 200 files open at once, directories made and listed.
            let r = try run(["python3", "-c", """
                import os, sys
                os.chdir(sys.argv[1])
                fds = [os.open("f%d" % i, os.O_CREAT | os.O_RDWR, 0o600) for i in range(200)]
                for i in range(20):
                    os.mkdir("d%d" % i)
                print(len(os.listdir(".")))
                """, m.path("roots")])
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "220\n")
        }
    }

    /// A peer `accept` cannot take for want of a descriptor stays queued,
    /// and the listener stays readable: the control thread spun on it and
    /// root's `vanish trash list` waited for ever.
    @Test("with every descriptor of the daemon held by open files, a control request is told so at once, and served once they are closed")
    func controlAnswersWithoutDescriptors() throws {
        try withVanishMount(fileLimit: 256) { m in
            let stop = m.base + "/stop", report = m.base + "/held"
            let holder = try spawn(["/usr/bin/python3", "-c", """
                import os, sys, time
                held, told = [], False
                # Every descriptor the daemon frees (its other threads open and close some) is taken again.
                while not os.path.exists(sys.argv[3]):
                    try:
                        held.append(os.open(sys.argv[1] + "/f%d" % len(held), os.O_CREAT | os.O_RDWR, 0o600))
                    except OSError:
                        if not told:
                            open(sys.argv[2], "w").write(str(len(held)))
                            told = True
                        time.sleep(0.001)
                """, m.mountpoint, report, stop])
            defer {
                _ = FileManager.default.createFile(atPath: stop, contents: nil)
                var st: Int32 = 0
                waitpid(holder, &st, 0)
            }
            try waitFor("the holder to run out") { access(report, F_OK) == 0 }
            let daemonFDs = try FileManager.default.contentsOfDirectory(atPath: "/proc/\(m.pid)/fd").count
            try #require(daemonFDs >= 255, "the daemon holds \(daemonFDs) of its 256 descriptors")
            for _ in 0..<3 {
                let starved = try run(["timeout", "20", vanishBinary, "trash", "list", m.mountpoint])
                #expect(starved.status != 124, "the control request was left waiting")
                #expect(starved.ok || starved.stderr.contains("out of file descriptors"), "\(starved.status) \(starved.stderr)")
            }
            _ = FileManager.default.createFile(atPath: stop, contents: nil)
            var st: Int32 = 0
            waitpid(holder, &st, 0)
            try waitFor("the control socket to serve again") {
                try run(["timeout", "20", vanishBinary, "trash", "list", m.mountpoint]).ok
            }
        }
    }

    /// Two accounts holding all users' half of the daemon's descriptors
    /// left every other user ENFILE on each open (cat, ls, even their
    /// trash folder, so nothing of theirs could be restored).
    @Test("two users holding files open until refused leave a third user able to read, list and create")
    func twoUsersLeaveAThird() throws {
        try withVanishMount(options: ["allow_other"], fileLimit: 1024, prepare: { src in
            guard try sh("mkdir -m 1777 pub && echo hello > pub/readme && chmod 644 pub/readme", cwd: src).ok else {
                throw TestFailure("mkdir")
            }
        }) { m in
            let stop = m.base + "/stop"
            chmod(m.base, 0o777)
            var holders: [pid_t] = []
            defer {
                _ = FileManager.default.createFile(atPath: stop, contents: nil)
                for h in holders { var st: Int32 = 0; waitpid(h, &st, 0) }
            }
            for uid in [300_100, 300_101] {
                holders.append(try spawn(["/usr/bin/setpriv", "--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", "--",
                                          "/usr/bin/python3", "-c", """
                    import os, sys, time
                    held = []
                    try:
                        while len(held) < 1000:
                            held.append(os.open("%s/h%d-%d" % (sys.argv[1], os.getuid(), len(held)), os.O_CREAT | os.O_RDWR, 0o600))
                    except OSError:
                        pass
                    open(sys.argv[2] + ".part", "w").write(str(len(held)))
                    os.rename(sys.argv[2] + ".part", sys.argv[2])
                    while not os.path.exists(sys.argv[3]):
                        time.sleep(0.01)
                    """, m.path("pub"), m.base + "/held-\(uid)", stop]))
            }
            for uid in [300_100, 300_101] {
                try waitFor("holder \(uid) to be refused") { access(m.base + "/held-\(uid)", F_OK) == 0 }
            }
            let third = try run(["/usr/bin/setpriv", "--reuid=300102", "--regid=300102", "--clear-groups", "--",
                                 "/bin/sh", "-c", "cat pub/readme && ls pub | wc -l && echo mine > pub/third && cat pub/third"],
                                cwd: m.mountpoint)
            #expect(third.ok, "\(third.stderr)")
            #expect(third.stdout == "hello\n513\nmine\n", "\(third.stdout)")
        }
    }
}
