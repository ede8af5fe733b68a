import Foundation
import Glibc
import Testing
import VanishTestSupport

/// `vanish mount` and `vanish unmount` as users and service managers run them.
@Suite("mount lifecycle", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct MountLifecycleTests {
    /// pid of the daemon serving `mountpoint`, found by its command line.
    func daemonPID(_ mountpoint: String) throws -> pid_t? {
        let r = try run(["pgrep", "-f", "vanish mount .*\(mountpoint)"])
        return r.stdout.split(separator: "\n").first.flatMap { pid_t($0) }
    }

    @Test("in the background by default; vanish unmount ends it and leaves no mount")
    func daemonizes() throws {
        let base = try makeTempDirectory()
        defer { unmountAndRemove(base + "/mnt", base: base) }
        mkdir(base + "/src", 0o755); mkdir(base + "/mnt", 0o755)
        let r = try run([vanishBinary, "mount", base + "/src", base + "/mnt"])
        #expect(r.ok, "\(r.stderr)")
        // The parent returns only once the mount is up.
        #expect(mountType(at: base + "/mnt") == "fuse.vanish")
        let pid = try #require(try daemonPID(base + "/mnt"))
        let ls = try sh("echo hi > f && cat f", cwd: base + "/mnt")
        #expect(ls.stdout == "hi\n")
        // Background threads carry names, so `top -H` and perf tell them from request workers.
        // (A libfuse worker may end between the listing and the read of its name.)
        // The control thread starts once the mount is up, which may follow `vanish mount`'s return.
        let wanted = ["vanish-journal\n", "vanish-reaper\n", "vanish-control\n", "vanish-notify\n", "vanish-lease\n"]
        var names: [String] = []
        try? waitFor("the background threads") {
            names = try FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task").compactMap {
                try? String(contentsOfFile: "/proc/\(pid)/task/\($0)/comm", encoding: .utf8)
            }
            return wanted.allSatisfy(names.contains)
        }
        for name in wanted {
            #expect(names.contains(name), "threads: \(names)")
        }
        let u = try run([vanishBinary, "unmount", base + "/mnt"])
        #expect(u.ok, "\(u.stderr)")
        #expect(mountType(at: base + "/mnt") == nil)
        try waitFor("daemon \(pid) to exit") { kill(pid, 0) != 0 }
        #expect(try String(contentsOfFile: base + "/src/f", encoding: .utf8) == "hi\n")
    }

    @Test("SIGTERM, SIGINT and SIGHUP unmount cleanly and exit 0", arguments: [SIGTERM, SIGINT, SIGHUP])
    func signals(_ signal: Int32) throws {
        let m = try VanishMount()
        defer { m.close() }
        kill(m.pid, signal)
        let status = try m.waitForExit()
        #expect(status == 0)
        #expect(mountType(at: m.mountpoint) == nil)
    }

    @Test("status names the daemon's release and process, as --version prints the release")
    func statusVersion() throws {
        let m = try VanishMount()
        defer { m.close() }
        let version = try run([vanishBinary, "--version"]).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        let json = try statusJSON(m)
        #expect(json["version"] as? String == version)
        #expect(json["pid"] as? Int == Int(m.pid))
        let human = try run([vanishBinary, "status", m.mountpoint])
        #expect(human.stdout.contains("(vanish \(version), pid \(m.pid))"), "\(human.stdout)")
    }

    @Test("fusermount3 -u ends the daemon with status 0")
    func fusermount() throws {
        let m = try VanishMount()
        defer { m.close() }
        #expect(try m.unmount() == 0)
    }

    @Test("mounted in place over a git repository, git and a build work unchanged")
    func inPlace() throws {
        let env = ["GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                   "GIT_COMMITTER_EMAIL": "t@e", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp"]
        try withVanishMount(inPlace: true, prepare: { src in
            let r = try sh("""
                git init -q -b main . && printf 'all:\\n\\techo built > out.txt\\n' > Makefile
                echo 'int main(void){return 0;}' > main.c && git add -A && git commit -qm init
                """, cwd: src, environment: env)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            #expect(m.mountpoint == m.source)
            #expect(mountType(at: m.source) == "fuse.vanish")
            let r = try sh("""
                set -e
                git status --porcelain
                echo change >> main.c && git commit -qam change && git log --oneline | wc -l
                make -s && cat out.txt && rm out.txt
                git status --porcelain
                """, cwd: m.mountpoint, environment: env)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "2\nbuilt\n")
            #expect(try m.unmount() == 0)
            // What was done through the mount is in the directory underneath.
            let after = try sh("git log --oneline | wc -l", cwd: m.source, environment: env)
            #expect(after.stdout == "2\n")
        }
    }

    @Test("an in-place mount run from a shell inside the directory says that shell is still underneath, and `cd .` brings it through")
    func inPlaceFromInside() throws {
        let base = try makeTempDirectory()
        let dir = base + "/d"
        defer { unmountAndRemove(dir, base: base) }
        mkdir(dir, 0o755)
        let r = try sh("""
            \(shellQuote(vanishBinary)) mount . 2>../err || exit 1
            stat -f -c %T . && cd . && stat -f -c %T .
            """, cwd: dir)
        #expect(r.ok, "\(r)")
        let lines = r.stdout.split(separator: "\n")
        #expect(lines.count == 2 && !lines[0].hasPrefix("fuse") && lines[1].hasPrefix("fuse"), "\(r.stdout)")
        let said = try String(contentsOfFile: base + "/err", encoding: .utf8)
        #expect(said.contains("still in \(dir) underneath the mount") && said.contains("cd ."), "\(said)")
        #expect(try run([vanishBinary, "unmount", dir]).ok)
        try waitFor("the daemon to let go of the source") { try run(["/usr/bin/flock", "-n", sourceLock(dir), "true"]).ok }
        // From outside the directory there is nothing to say.
        let outside = try run([vanishBinary, "mount", dir])
        #expect(outside.ok && outside.stderr.isEmpty, "\(outside)")
    }

    @Test("an in-place mount keeps its state outside the directory: git status and git clean -fdx never meet it, the kept trash outlives them, a .vanish from before moves out, vanish reap finds it")
    func stateOutsideTheTree() throws {
        let env = ["GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                   "GIT_COMMITTER_EMAIL": "t@e", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp"]
        let base = try makeTempDirectory()
        defer { unmountAndRemove(base + "/repo", base: base) }
        let repo = base + "/repo"
        #expect(try sh("mkdir repo && cd repo && git init -q . && echo a > a && echo b > b && git add a b && git commit -qm one",
                       cwd: base, environment: env).ok)
        // A state directory from before, in the tree (as a mount on another mountpoint makes one).
        mkdir(base + "/mnt", 0o755)
        #expect(try run([vanishBinary, "mount", "--keep", "1h", repo, base + "/mnt"]).ok)
        #expect(try sh("rm mnt/a", cwd: base).ok)
        #expect(try run([vanishBinary, "unmount", base + "/mnt"]).ok)
        try waitFor("the daemon to let go of the source") { try run(["/usr/bin/flock", "-n", sourceLock(repo), "true"]).ok }
        #expect(access(repo + "/.vanish", F_OK) == 0)

        #expect(try run([vanishBinary, "mount", "--keep", "1h", repo]).ok)
        let state = try #require(try statusJSON(path: repo)["state_directory"] as? String)
        #expect(!state.hasPrefix(repo + "/"), "\(state)")
        #expect(access(state, F_OK) == 0)
        #expect(try sh("rm b", cwd: repo).ok)
        #expect(try run([vanishBinary, "trash", "list", "--json", repo]).stdout.split(separator: "\n").count == 2,
                "the entry kept before the move is still in the trash, beside the new one")
        #expect(try run([vanishBinary, "unmount", repo]).ok)
        try waitFor("the daemon to let go of the source") { try run(["/usr/bin/flock", "-n", sourceLock(repo), "true"]).ok }

        #expect(access(repo + "/.vanish", F_OK) != 0, "the old state moved out of the tree")
        #expect(try sh("git status --porcelain --ignored", cwd: repo, environment: env).stdout == " D a\n D b\n")
        #expect(try sh("git clean -fdx", cwd: repo, environment: env).stdout == "")
        #expect(access(state, F_OK) == 0, "git clean -fdx cannot reach the kept trash")

        #expect(try run([vanishBinary, "mount", repo]).ok)
        #expect(try run([vanishBinary, "restore", repo + "/b"]).ok)
        #expect(try String(contentsOfFile: repo + "/b", encoding: .utf8) == "b\n")
        #expect(try run([vanishBinary, "unmount", repo]).ok)
        try waitFor("the daemon to let go of the source") { try run(["/usr/bin/flock", "-n", sourceLock(repo), "true"]).ok }
        // Without a mount, vanish reap finds the state outside and frees what it keeps.
        let reap = try run([vanishBinary, "reap", repo])
        #expect(reap.ok && reap.stdout.contains("reaped 1 deletion:"), "\(reap.stdout)\(reap.stderr)")
    }

    @Test("one mount per source: a second mount and vanish reap are refused until it is unmounted")
    func oneMountPerSource() throws {
        let m = try VanishMount()
        defer { m.close() }
        let other = try makeTempDirectory()
        defer { unmountAndRemove(other, base: other) }
        // A second daemon would share the graveyard and delete the first one's event journal.
        let second = try run([vanishBinary, "mount", m.source, other])
        #expect(second.status == 1)
        #expect(second.stderr.contains("already mounted by Vanish at \(m.mountpoint)"), "\(second.stderr)")
        #expect(mountType(at: other) == nil)
        // What it offers instead: the one mount in a second place, renames across both
        // (as xfstests generic/732 does with two mounts of one device).
        #expect(second.stderr.contains("mount --bind \(m.mountpoint) DIR"), "\(second.stderr)")
        #expect(try run(["mount", "--bind", m.mountpoint, other]).ok)
        let moved = try sh("mkdir A B && echo x > A/f && mv A/f \(shellQuote(other))/B/ && cat B/f", cwd: m.mountpoint)
        #expect(try run(["umount", other]).ok)
        #expect(moved.ok && moved.stdout == "x\n", "\(moved.stderr)")
        let reap = try run([vanishBinary, "reap", m.source])
        #expect(reap.status == 1 && reap.stderr.contains("already mounted by Vanish at \(m.mountpoint)"), "\(reap.stderr)")
        // The first mount is untouched, its events too.
        #expect(try sh("echo x > f && cat f", cwd: m.mountpoint).stdout == "x\n")
        #expect(try run([vanishBinary, "events", "--json", "--snapshot", "--once", m.mountpoint]).stdout.contains("\"path\":\"f\""))
        // Free again as soon as it is unmounted, even while the daemon still reaps.
        #expect(try m.unmount() == 0)
        let again = try run([vanishBinary, "mount", m.source, other])
        #expect(again.ok, "\(again.stderr)")
        #expect(try run([vanishBinary, "unmount", other]).ok)
    }

    @Test("another user's flock on the source keeps neither a mount nor vanish reap out (issue 49)", .timeLimit(.minutes(2)))
    func sourceLockIsPrivate() throws {
        let (base, src, mnt) = try makeSourceAndMountpoint()
        defer { unmountAndRemove(mnt, base: base) }
        chmod(base, 0o755)
        chmod(src, 0o755)
        let stop = base + "/stop"
        let holder = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                "/usr/bin/flock", "-o", "-x", src, "/bin/sh", "-c",
                                "while [ ! -e \(shellQuote(stop)) ]; do sleep 0.1; done"])
        defer {
            _ = FileManager.default.createFile(atPath: stop, contents: nil)
            var st: Int32 = 0
            waitpid(holder, &st, 0)
        }
        try waitFor("nobody to hold a flock on the source") {
            try run(["/usr/bin/flock", "-n", "-x", src, "true"]).status != 0
        }
        let mount = try run([vanishBinary, "mount", src, mnt])
        #expect(mount.ok, "\(mount.stderr)")
        #expect(!mount.stderr.contains("waiting"), "\(mount.stderr)")
        #expect(try run([vanishBinary, "unmount", mnt]).ok)
        try waitFor("the daemon to let go of the source") { try run(["/usr/bin/flock", "-n", sourceLock(src), "true"]).ok }
        let reap = try run(["timeout", "20", vanishBinary, "reap", src])
        #expect(reap.ok, "\(reap.stderr)")
    }

    @Test("a source or mountpoint that is already Vanish's is refused: no mount stacks on another")
    func noStacking() throws {
        let inPlace = try VanishMount(inPlace: true)
        defer { inPlace.close() }
        let again = try run([vanishBinary, "mount", inPlace.source])
        #expect(again.status == 64, "\(again.stderr)")
        #expect(again.stderr.contains("already mounted in place by Vanish"), "\(again.stderr)")
        let other = try makeTempDirectory()
        defer { unmountAndRemove(other, base: other) }
        let over = try run([vanishBinary, "mount", inPlace.source + "/", other])
        #expect(over.status == 64, "\(over.stderr)")
        #expect(mountType(at: other) == nil)
        let m = try VanishMount()
        defer { m.close() }
        let sub = m.path("sub")
        #expect(mkdir(sub, 0o755) == 0)
        let through = try run([vanishBinary, "mount", sub, other])
        #expect(through.status == 64 && through.stderr.contains("inside the Vanish mount at \(m.mountpoint)"), "\(through.stderr)")
        let onto = try run([vanishBinary, "mount", other, m.mountpoint])
        #expect(onto.status == 64 && onto.stderr.contains("already has a Vanish mount"), "\(onto.stderr)")
        #expect(try sh("grep -c ' fuse.vanish ' /proc/self/mountinfo | tr -d '\n'").stdout.isEmpty == false)
        #expect(mountType(at: other) == nil)
    }

    @Test("mounting right after an unmount waits for the leaving daemon instead of refusing", .timeLimit(.minutes(2)))
    func remountAtOnce() throws {
        let (base, src, mnt) = try makeSourceAndMountpoint()
        defer { unmountAndRemove(mnt, base: base) }
        // A daemon leaving holds the source's lock a moment after its
        // unmount returns: a holder of the lock for 3 s stands for a slow one.
        let holder = try spawn(["/usr/bin/flock", "-x", sourceLock(src), "-c", "sleep 3"])
        defer { var st: Int32 = 0; waitpid(holder, &st, 0) }
        try waitFor("the holder to take the lock") {
            try run(["/usr/bin/flock", "-n", "-x", sourceLock(src), "true"]).status != 0
        }
        let waited = try run([vanishBinary, "mount", src, mnt])
        #expect(waited.ok, "\(waited.stderr)")
        // A wait one notices is explained (after a second).
        #expect(waited.stderr.contains("waiting for the vanish process leaving"), "\(waited.stderr)")
        #expect(try run(["fusermount3", "-u", mnt]).ok)
        for i in 0..<30 {
            let up = try run([vanishBinary, "mount", src, mnt])
            #expect(up.ok, "mount \(i): \(up.stderr)")
            guard up.ok else { break }
            #expect(try sh("touch f\(i) && rm f\(i)", cwd: mnt).ok)
            let down = try run(["fusermount3", "-u", mnt])
            #expect(down.ok, "unmount \(i): \(down.stderr)")
        }
    }

    @Test("vanish unmount returns with the source free: its filesystem unmounts at once, 5 of 5 with a backlog; --reap frees the backlog first (issue 51)",
          .timeLimit(.minutes(3)))
    func unmountFreesTheSource() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for a tmpfs source")
        let base = try makeTempDirectory()
        let (disk, mnt) = (base + "/disk", base + "/mnt")
        mkdir(disk, 0o755); mkdir(mnt, 0o755)
        defer {
            if mountType(at: mnt) != nil { _ = try? run(["fusermount3", "-uz", mnt]) }
            _ = try? run(["umount", "-l", disk])
            removeTree(base)
        }
        for round in 0..<6 {
            #expect(try run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", disk]).ok)
            #expect(try sh("mkdir t && cd t && seq 1 20000 | sed 's/^/f/' | xargs touch", cwd: disk).ok)
            let reap = round == 5
            // A backlog for the reaper, freed 100 entries a second (but for --reap's round).
            #expect(try run([vanishBinary, "mount"] + (reap ? [] : ["-o", "reap_rate=100"]) + [disk, mnt]).ok)
            #expect(try sh("rm -rf t", cwd: mnt).ok)
            let u = try run([vanishBinary, "unmount"] + (reap ? ["--reap"] : []) + [mnt])
            #expect(u.ok, "\(u.stderr)")
            #expect(try graveyardCount(disk) == 0 || !reap, "--reap returned before the graveyard was empty")
            let umount = try run(["umount", disk])
            #expect(umount.ok, "round \(round): the source's filesystem stayed busy: \(umount.stderr)")
            if !umount.ok { _ = try run(["umount", "-l", disk]); break }
        }
    }

    @Test("vanish unmount of a mount whose daemon is stopped asks it nothing through the mount, unmounts, and continues it to let go of the source")
    func unmountStoppedDaemon() throws {
        let (base, src, mnt) = try makeSourceAndMountpoint()
        defer { unmountAndRemove(mnt, base: base) }
        #expect(try run([vanishBinary, "mount", src, mnt]).ok)
        let pid = pid_t(try #require(try statusJSON(path: mnt)["pid"] as? Int))
        kill(pid, SIGSTOP)
        defer { kill(pid, SIGCONT) }
        // Reading its status through the mount would wait for it for ever, and keep the mount busy.
        let u = try run(["timeout", "30", vanishBinary, "unmount", mnt])
        #expect(u.ok, "\(u)")
        #expect(mountType(at: mnt) == nil)
        // Exited (init may not have reaped it yet): its descriptors, the source's among them, are closed.
        let state = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8)
        #expect(state == nil || state!.contains(") Z "), "the daemon still runs: \(state ?? "")")
    }

    @Test("a new mount of a source whose unmounted daemon is still reaping takes over: the old one stops, one reaper finishes the graveyard", .timeLimit(.minutes(2)))
    func takeOverReaping() throws {
        let (base, src, mnt) = try makeSourceAndMountpoint()
        defer { unmountAndRemove(mnt, base: base) }
        #expect(try sh("mkdir t && for i in $(seq 1 600); do echo $i > t/f$i; done", cwd: src).ok)
        // At 50 deletions a second the first daemon reaps for some 12 s after its unmount.
        #expect(try run([vanishBinary, "mount", "-o", "reap_rate=50", src, mnt]).ok)
        let old = pid_t(try #require(try statusJSON(path: mnt)["pid"] as? Int))
        #expect(try run([vanishBinary, "rm", "-r", mnt + "/t"]).ok)
        // (vanish unmount would wait for the daemon to stop.)
        #expect(try run(["fusermount3", "-u", mnt]).ok)
        #expect(kill(old, 0) == 0, "the old daemon reaps on after its unmount")
        let log = base + "/daemon.log"
        let up = try run([vanishBinary, "mount", "--log-file", log, src, mnt])
        #expect(up.ok, "\(up.stderr)")
        // The usual course of a remount: in the log, not on the terminal (a mount that succeeds is silent).
        #expect(up.stderr.isEmpty, "\(up.stderr)")
        let logged = try String(contentsOfFile: log, encoding: .utf8)
        #expect(logged.contains("still reaping its graveyard: asked it to stop") && logged.contains("pid=\(old)"), "\(logged)")
        try waitFor("the old daemon to exit") { kill(old, 0) != 0 }
        let m = try statusJSON(path: mnt)
        #expect(m["pid"] as? Int != Int(old))
        #expect(try run([vanishBinary, "status", "--wait", mnt]).ok)
        #expect(try graveyardCount(src) == 0, "the new mount's reaper finished what the old one left")
    }

    @Test("unmounting a busy mount names the processes using it and --lazy; restoring into a directory that is gone says what to do")
    func helpfulMessages() throws {
        let m = try VanishMount(arguments: ["--keep", "1h"])
        defer { m.close() }
        #expect(try sh("mkdir d && echo x > d/f && rm d/f && rmdir d", cwd: m.mountpoint).ok)
        let gone = try run([vanishBinary, "restore", m.path("d/f")])
        #expect(gone.status == 1 && gone.stderr.contains("its directory d no longer exists (restore d first, or give another place with --to)"),
                "\(gone.stderr)")
        #expect(gone.stderr.components(separatedBy: "cannot restore").count == 2, "said once: \(gone.stderr)")
        // As it says: the directory first, which brings back the file deleted in it too.
        #expect(try run([vanishBinary, "restore", m.path("d")]).ok)
        #expect(access(m.path("d/f"), F_OK) == 0)
        let holder = try spawn(["/bin/sh", "-c", "cd \(shellQuote(m.mountpoint)) && exec sleep 60"])
        defer { kill(holder, SIGKILL); var st: Int32 = 0; waitpid(holder, &st, 0) }
        try waitFor("the holder inside the mount") {
            (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/\(holder)/cwd")) == m.mountpoint
        }
        let busy = try run([vanishBinary, "unmount", m.mountpoint])
        #expect(busy.status == 1, "\(busy.stderr)")
        #expect(busy.stderr.contains("is busy: in use by sleep[\(holder)]") && busy.stderr.contains("vanish unmount --lazy"), "\(busy.stderr)")
        // One complaint, Vanish's: fusermount3's own is kept off stderr.
        #expect(!busy.stderr.contains("fusermount3:"), "\(busy.stderr)")
        #expect(mountType(at: m.mountpoint) == "fuse.vanish", "nothing was detached")
    }

    @Test("a dead mount gets a clear message, and vanish unmount clears it")
    func deadMount() throws {
        let m = try VanishMount()
        defer { m.close() }
        kill(m.pid, SIGKILL)
        _ = try m.waitForExit()
        // Over io_uring the kernel ends the connection once it has torn the
        // dead daemon's rings down, a moment after its exit.
        try waitFor("the kernel to end the dead daemon's connection") {
            var st = stat()
            return stat(m.mountpoint, &st) != 0 && errno == ENOTCONN
        }
        let again = try run([vanishBinary, "mount", m.source, m.mountpoint])
        // The machine's state, not a bad argument: status 1, no usage line.
        #expect(again.status == 1)
        #expect(!again.stderr.contains("Usage:"), "\(again.stderr)")
        #expect(again.stderr.contains("Transport endpoint is not connected"))
        #expect(again.stderr.contains("vanish unmount"))
        // Every command that talks to the daemon says the same fix.
        for command in [["status"], ["trash", "list"], ["events"]] {
            let r = try run([vanishBinary] + command + [m.mountpoint])
            #expect(r.status == 1 && r.stderr.contains("is gone") && r.stderr.contains("vanish unmount \(m.mountpoint)"),
                    "\(command): \(r.stderr)")
        }
        let u = try run([vanishBinary, "unmount", m.mountpoint])
        #expect(u.ok, "\(u.stderr)")
        #expect(mountType(at: m.mountpoint) == nil)
        let remount = try run([vanishBinary, "mount", m.source, m.mountpoint])
        #expect(remount.ok, "\(remount.stderr)")
        let second = try #require(try daemonPID(m.mountpoint))
        #expect(try run([vanishBinary, "unmount", m.mountpoint]).ok)
        // Unmounted at once, perhaps before it took the kernel's INIT: it ends all the same.
        try waitFor("daemon \(second) to exit") { kill(second, 0) != 0 }
    }

    @Test("-d prints every request; --log-file gets the daemon's log once it is in the background")
    func debugAndLogFile() throws {
        try withVanishMount(arguments: ["-d"]) { m in
            _ = try sh("ls -la", cwd: m.mountpoint)
            try waitFor("debug output") { m.log.contains("opcode: READDIR") || m.log.contains("opcode: READDIRPLUS") }
        }
        let base = try makeTempDirectory()
        defer { unmountAndRemove(base + "/mnt", base: base) }
        mkdir(base + "/src", 0o755); mkdir(base + "/mnt", 0o755)
        let r = try run([vanishBinary, "mount", "--log-file", base + "/log", base + "/src", base + "/mnt"])
        #expect(r.ok, "\(r.stderr)")
        // The session starts with the kernel's INIT, which the first access
        // waits for; an unmount before any access may come first.
        #expect(try sh("ls -A", cwd: base + "/mnt").ok)
        #expect(try run([vanishBinary, "unmount", base + "/mnt"]).ok)
        try waitFor("the daemon's last log line") {
            ((try? String(contentsOfFile: base + "/log", encoding: .utf8)) ?? "").contains("reaper stopped")
        }
        let log = try String(contentsOfFile: base + "/log", encoding: .utf8)
        #expect(log.contains("mounted") && log.contains("session started") && log.contains("unmounted"))
    }

    @Test("shows as fuse.vanish with the source as its device")
    func mountEntry() throws {
        try withVanishMount { m in
            let line = try String(contentsOfFile: "/proc/mounts", encoding: .utf8)
                .split(separator: "\n").first { $0.contains(" \(m.mountpoint) ") }
            #expect(line?.hasPrefix("\(m.source) \(m.mountpoint) fuse.vanish ") == true)
        }
    }

    @Test("the kernel reads ahead 1 MiB by default (FUSE's own is 128 KiB); -o readahead= sets it",
          arguments: [(nil, "1024\n"), ("readahead=256", "256\n"), ("readahead=0", "0\n")])
    func readahead(_ option: String?, _ expected: String) throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to set a mount's readahead")
        try withVanishMount(options: option.map { [$0] } ?? [], prepare: { src in
            try sh("head -c 3000000 /dev/urandom > f", cwd: src)
        }) { m in
            let device = try run(["mountpoint", "-d", m.mountpoint]).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            let kb = try String(contentsOfFile: "/sys/class/bdi/\(device)/read_ahead_kb", encoding: .utf8)
            #expect(kb == expected, "\(device)")
            #expect(try sh("cmp f \(m.backing("f")) && echo same", cwd: m.mountpoint).stdout == "same\n")
        }
    }
}

@Suite("argument errors")
struct ArgumentErrorTests {
    @Test("bad arguments exit 64 with a message and mount nothing", arguments: [
        (["mount", "/nonexistent-vanish-src", "/tmp"], "/nonexistent-vanish-src"),
        (["mount", "-o", "cache=sometimes", "/tmp", "/tmp"], "cache="),
        (["mount", "-o", "io_uring=maybe", "/tmp", "/tmp"], "io_uring= takes one of: auto, on, off"),
        (["mount", "-o", "readdirplus=sometimes", "/tmp", "/tmp"], "readdirplus="),
        (["mount", "-o", "readahead=lots", "/tmp", "/tmp"], "readahead="),
        (["mount", "--threads", "0", "/tmp"], "--threads"),
        (["mount", "-o", "no_default_permissions", "/tmp"], "permissions"),
        (["mount", "-o", "bogus_opt", "/tmp", "/tmp"], "unknown mount option(s): bogus_opt ("),
        (["mount", "--keep", "1", "/tmp", "/tmp"], "with a unit"),
        (["mount", "--keep", "-5m", "/tmp", "/tmp"], "with a unit"),
        (["mount", "-o", "keep=30", "/tmp", "/tmp"], "with a unit"),
        (["mount", "-o", "passthrough=maybe", "/tmp", "/tmp"], "passthrough="),
        (["mount", "-o", "spin=5000", "/tmp", "/tmp"], "spin="),
        (["mount", "-o", "spin=fast", "/tmp", "/tmp"], "spin="),
        (["mount", "--log-file", "/nonexistent-vanish-dir/log", "/tmp", "/tmp"], "/nonexistent-vanish-dir/log"),
        (["unmount", "/tmp"], "not a mountpoint"),
        (["events", "--path", "/etc", "/tmp"], "--path /etc is not inside the mount"),
        (["events", "--path", "src/../../x", "/tmp"], "is not inside the mount"),
        // Not a Vanish mount: the same exit and message from every command that talks to one.
        (["events", "/tmp"], "is not the root of a Vanish mount"),
        (["status", "/tmp"], "is not the root of a Vanish mount"),
        (["trash", "list", "/tmp"], "is not the root of a Vanish mount"),
        (["status", "/nonexistent-vanish-mount"], "/nonexistent-vanish-mount: No such file or directory"),
        // Paths outside every Vanish mount, for the commands that take one: 64 and the command's own usage
        // (vanish rm is rm there).
        (["restore", "/tmp/f"], "Usage: vanish restore"),
        (["unmount", "/tmp"], "Usage: vanish unmount"),
        (["reap", "/nonexistent-vanish-source"], "Usage: vanish reap"),
        (["frobnicate"], "frobnicate"),
    ])
    func badArguments(_ args: [String], _ mentions: String) throws {
        // "/tmp" stands for a scratch directory holding a file f: a build that let one of these
        // through would mount there (a daemonizing mount), never over /tmp.
        let dir = try makeTempDirectory()
        defer {
            if mountType(at: dir) != nil { unmountAndRemove(dir, base: dir) } else { removeTree(dir) }
        }
        #expect(close(open(dir + "/f", O_CREAT | O_WRONLY, 0o644)) == 0)
        let r = try run([vanishBinary] + args.map { $0 == "/tmp" ? dir : $0.hasPrefix("/tmp/") ? dir + $0.dropFirst(4) : $0 })
        #expect(mountType(at: dir) == nil, "\(args) mounted")
        #expect(r.status == 64, "\(args): \(r.stderr)")
        #expect(r.stderr.contains(mentions), "\(args): \(r.stderr)")
        // One complaint, Vanish's: libfuse's own (twice, for the option probes) is kept off stderr.
        #expect(!r.stderr.contains("fuse: "), "\(args): \(r.stderr)")
    }

    /// `useradd` gives each account 65,536 subordinate uids, which
    /// `newuidmap` lets it act as: counted per uid, eight of them held
    /// 112 connections, and no other user could list or restore.
    @Test("the uids of one account's subordinate range share that account's 16 control connections")
    func controlSocketPerAccount() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become other uids")
        // An account (uid 300300) with a range, as useradd writes it.
        try withSubordinateRange(owner: 300_300, first: 400_000, count: 65536) { try withVanishMount(options: ["allow_other"]) { m in
            let socket = try socketPath(m)
            let out = m.base + "/held", go = m.base + "/go", connected = m.base + "/connected"
            let script = """
                import os, socket, sys, time
                path, out, go, connected = sys.argv[1:5]
                children = []
                for u in range(400000, 400008):
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        os.close(r)
                        os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
                        # Each asks for an event stream, which lasts: its first line says
                        # whether it is held (a stream) or refused, with no time involved.
                        conns = []
                        for i in range(16):
                            s = socket.socket(socket.AF_UNIX); s.connect(path); s.settimeout(120)
                            try: s.sendall(b'{"op":"events"}\\n')
                            except OSError: pass
                            conns.append(s)
                        os.write(w, b"c")
                        held = 0
                        for s in conns:
                            line = b""
                            try:
                                while not line.endswith(b"\\n"):
                                    part = s.recv(4096)
                                    if not part: break
                                    line += part
                            except OSError: pass
                            if b'"type":"stream"' in line: held += 1
                        os.write(w, b"%d\\n" % held)
                        while not os.path.exists(go): time.sleep(0.01)
                        os._exit(0)
                    os.close(w)
                    children.append((pid, r))
                for _, r in children: os.read(r, 1)
                open(connected, "w").close()
                total = sum(int(os.read(r, 64)) for _, r in children)
                open(out, "w").write("%d" % total)
                for pid, _ in children: os.waitpid(pid, 0)
                """
            let holder = try spawn(["/usr/bin/python3", "-c", script, socket, out, go, connected])
            defer {
                _ = FileManager.default.createFile(atPath: go, contents: nil)
                var st: Int32 = 0
                waitpid(holder, &st, 0)
            }
            try waitFor("the account's connections", timeout: 60) { access(connected, F_OK) == 0 }
            // Another user's request gets through meanwhile.
            let other = try run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                 vanishBinary, "trash", "list", m.mountpoint])
            #expect(other.ok, "\(other.stderr)")
            try waitFor("each connection's first line", timeout: 120) { access(out, F_OK) == 0 }
            #expect(try String(contentsOfFile: out, encoding: .utf8) == "16", "connections the account holds")
        } }
    }

    @Test("another user cannot lock root out of the control socket: connections per user are bounded and idle ones time out")
    func controlSocketBounded() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        try withVanishMount(options: ["allow_other"]) { m in
            let socket = try socketPath(m)
            let out = m.base + "/holder.out", go = m.base + "/go"
            #expect(mkfifo(go, 0o666) == 0)
            chmod(go, 0o666)
            #expect(FileManager.default.createFile(atPath: out, contents: nil, attributes: [.posixPermissions: 0o666]))
            // nobody opens 128 idle connections and holds them until told to go on.
            let script = """
                import socket, sys
                path, out, go = sys.argv[1:4]
                # All at once, well inside the daemon's 5 s request timeout; then see who was turned away.
                socks = []
                for i in range(128):
                    s = socket.socket(socket.AF_UNIX); s.connect(path); socks.append(s)
                held, refused = [], 0
                for s in socks:
                    s.settimeout(0.05)
                    try:
                        if b"too many connections from this user" in s.recv(4096): refused += 1
                        else: held.append(s)
                    except socket.timeout: held.append(s)
                open(out, "w").write(f"ready {refused} {len(held)}\\n")
                open(go).read()
                closed = 0
                for s in held:
                    s.settimeout(20)
                    try:
                        data = s.recv(4096)
                        if b"within" in data or data == b"": closed += 1
                    except OSError: pass
                open(out, "a").write(f"closed {closed}\\n")
                """
            func threadNames() throws -> [String] {
                try FileManager.default.contentsOfDirectory(atPath: "/proc/\(m.pid)/task").map {
                    (try? String(contentsOfFile: "/proc/\(m.pid)/task/\($0)/comm", encoding: .utf8)) ?? ""
                }
            }
            let threadsBefore = try threadNames().count
            let holder = try spawn(["/bin/sh", "-c", "exec setpriv --reuid=nobody --regid=nogroup --clear-groups -- /usr/bin/python3 -c "
                                    + shellQuote(script) + " " + [socket, out, go].map(shellQuote).joined(separator: " ")])
            var reaped = false
            defer {
                if !reaped { kill(holder, SIGKILL); var st: Int32 = 0; waitpid(holder, &st, 0) }
            }
            try waitFor("nobody's connections", timeout: 60) {
                if (try? String(contentsOfFile: out, encoding: .utf8))?.hasPrefix("ready") == true { return true }
                var st: Int32 = 0
                if waitpid(holder, &st, WNOHANG) == holder { reaped = true; throw TestFailure("the holder exited early") }
                return false
            }
            #expect(try String(contentsOfFile: out, encoding: .utf8) == "ready 112 16\n")
            // The held peers cost the daemon no thread each: one thread polls them all.
            let names = try threadNames()
            #expect(names.filter { $0 == "vanish-control\n" }.count == 1, "\(names)")
            #expect(names.count < threadsBefore + 8, "\(names)")
            // Root still gets answers.
            let list = try run([vanishBinary, "trash", "list", m.mountpoint])
            #expect(list.ok, "\(list.stderr)")
            #expect(try sh("echo > \(shellQuote(go))").ok)
            var status: Int32 = 0
            try waitFor("the holder to finish", timeout: 60) { waitpid(holder, &status, WNOHANG) == holder }
            reaped = true
            // The held connections sent nothing: the daemon answered and closed each within its timeout.
            #expect(try String(contentsOfFile: out, encoding: .utf8).hasSuffix("closed 16\n"))
        }
    }

    @Test("a killed daemon's control socket goes with it; live ones stay")
    func killedDaemonsSocketRemoved() throws {
        try withVanishMount { live in
            let liveSocket = try socketPath(live)
            let dead = try VanishMount()
            defer { dead.close() }
            let deadSocket = try socketPath(dead)
            kill(dead.pid, SIGKILL)
            _ = try dead.waitForExit()
            try waitFor("the killed daemon's socket to go") { access(deadSocket, F_OK) != 0 }
            #expect(access(liveSocket, F_OK) == 0)
        }
    }

    @Test("a socket left by a daemon killed with its unlinker is removed by the next mount; live ones stay")
    func staleSocketsRemoved() throws {
        try withVanishMount { live in
            let liveSocket = try socketPath(live)
            let dead = try VanishMount()
            defer { dead.close() }
            let deadSocket = try socketPath(dead)
            // The unlinker names itself once it runs: on a busy machine, a moment after the mount.
            var unlinker: pid_t = 0
            try waitFor("the unlinker to start") {
                unlinker = children(of: dead.pid, named: "vanish-unlinker").first ?? 0
                return unlinker > 0
            }
            kill(unlinker, SIGKILL)
            try waitFor("the unlinker to go") { children(of: dead.pid, named: "vanish-unlinker").isEmpty }
            kill(dead.pid, SIGKILL)
            _ = try dead.waitForExit()
            #expect(access(deadSocket, F_OK) == 0, "with no unlinker a SIGKILLed daemon leaves its socket")
            try withVanishMount { _ in
                #expect(access(deadSocket, F_OK) != 0, "the next mount removed it")
                #expect(access(liveSocket, F_OK) == 0)
            }
        }
    }

    /// Living children of `pid` whose command name is `name`.
    private func children(of pid: pid_t, named name: String) -> [pid_t] {
        let entries = (try? FileManager.default.contentsOfDirectory(atPath: "/proc")) ?? []
        return entries.compactMap { entry -> pid_t? in
            guard let child = pid_t(entry),
                  let stat = try? String(contentsOfFile: "/proc/\(entry)/stat", encoding: .utf8),
                  let open = stat.firstIndex(of: "("), let close = stat.lastIndex(of: ")") else { return nil }
            let fields = stat[stat.index(close, offsetBy: 2)...].split(separator: " ")
            guard stat[stat.index(after: open)..<close] == name, fields.count > 1, fields[0] != "Z",
                  pid_t(fields[1]) == pid else { return nil }
            return child
        }
    }

    private func socketPath(_ m: VanishMount) throws -> String {
        let s = try run([vanishBinary, "status", "--json", m.mountpoint]).stdout
        let range = try #require(s.range(of: #""socket":"([^"]+)""#, options: .regularExpression))
        return String(s[range].dropFirst(10).dropLast())
    }

    @Test("a source that is a file is refused")
    func fileSource() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        #expect(FileManager.default.createFile(atPath: dir + "/file", contents: Data()))
        let r = try run([vanishBinary, "mount", dir + "/file", dir])
        #expect(r.status == 64)
        #expect(r.stderr.contains("not a directory"))
    }

    @Test("a mountpoint inside the source is refused (the mount would contain itself)")
    func mountpointInsideSource() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        mkdir(dir + "/inner", 0o755)
        let r = try run([vanishBinary, "mount", dir, dir + "/inner"])
        #expect(r.status == 64)
        #expect(r.stderr.contains("inside"))
        #expect(mountType(at: dir + "/inner") == nil)
    }
}
