import CLinux
import Foundation
import Glibc
import Testing
import VanishClient
import VanishTestSupport


/// The schedules of `m`'s reaper workers, once both are in SCHED_IDLE (as
/// a serving mount puts them): a function, to look again later.
func idleReapers(_ m: VanishMount) throws -> () -> [(tid: String, name: String, nice: Int, policy: Int)] {
    let reapers = { threadSchedules(m.pid).filter { $0.name == "vanish-reaper" } }
    try waitFor("two reaper workers in SCHED_IDLE") { reapers().filter { $0.policy == 5 }.count == 2 }
    return reapers
}

/// Shell busy loops started from the test, so in the session (and
/// autogroup) of the daemons it starts; `stop` kills and reaps them.
final class BusyLoops {
    private var pids: [pid_t] = []

    init(perCore: Int) throws {
        for _ in 0..<(perCore * sysconf(Int32(_SC_NPROCESSORS_ONLN))) {
            pids.append(try spawn(["/bin/sh", "-c", "while :; do :; done"]))
        }
    }

    func stop() {
        for p in pids { kill(p, SIGKILL); var status: Int32 = 0; waitpid(p, &status, 0) }
        pids = []
    }

    deinit { stop() }
}

/// Makes `count` files of `size` bytes spread over directories under `dir`.
func makeTree(_ dir: String, files count: Int, size: Int = 100) throws {
    let r = try run(["python3", "-c", """
        import os, sys
        root, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        data = b"x" * size
        for i in range(n):
            d = os.path.join(root, f"d{i // 1000}")
            if i % 1000 == 0: os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i}"), "wb") as f: f.write(data)
        """, dir, "\(count)", "\(size)"])
    guard r.ok else { throw TestFailure(r.stderr) }
}

@Suite("graveyard and reaper", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct GraveyardTests {
    @Test("unlink hides a file at once and the reaper gives its space back")
    func spaceComesBack() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for a tmpfs source")
        try withVanishMountOnTmpfs(size: "256m") { m in
            let w = try sh("dd if=/dev/urandom of=big bs=1M count=64 status=none && sync", cwd: m.mountpoint)
            #expect(w.ok)
            let before = freeBytes(m.source)
            #expect(unlink(m.path("big")) == 0)
            #expect(access(m.path("big"), F_OK) != 0)
            // Underneath, the rename into the graveyard lands just after the reply.
            try waitFor("big to leave the source") { access(m.backing("big"), F_OK) != 0 }
            try waitForReaper(m)
            #expect(try graveyardCount(m.source) == 0)
            #expect(freeBytes(m.source) >= before + 60 << 20)
        }
    }

    @Test("on a full filesystem a deleted or replaced file's space is free at once, as natively: the writer that comes next gets it",
          arguments: ["", "keep=1h"])
    func fullDiskFreesAtOnce(option: String) throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for a tmpfs source")
        try withVanishMountOnTmpfs(size: "64m", options: option.isEmpty ? [] : [option]) { m in
            let r = try sh("""
                echo small > small || exit 1
                dd if=/dev/zero of=big bs=1M count=100 status=none 2>/dev/null; test -s big || exit 2
                rm big || exit 3
                dd if=/dev/zero of=new bs=1M count=20 status=none || exit 4
                dd if=/dev/zero of=big2 bs=1M count=100 status=none 2>/dev/null; test -s big2 || exit 5
                mv small big2 || exit 6
                dd if=/dev/zero of=new2 bs=1M count=20 status=none || exit 7
                """, cwd: m.mountpoint)
            #expect(r.ok, "step \(r.status): \(r.stderr)")
            #expect(try String(contentsOfFile: m.path("big2"), encoding: .utf8) == "small\n")
        }
    }

    @Test("the state directory is invisible and its name reserved")
    func hiddenAndReserved() throws {
        try withVanishMount { m in
            #expect(access(m.backing(".vanish/clients"), F_OK) == 0)
            let r = try sh("""
                ls -A | grep -c vanish
                stat .vanish 2>&1 | grep -c 'No such file'
                for step in 'mkdir .vanish' 'touch .vanish' 'ln -s x .vanish' 'mkfifo .vanish'; do
                  $step 2>&1 | grep -c 'Operation not permitted'
                done
                touch f && mv f .vanish 2>&1 | grep -c 'Operation not permitted'
                mkdir sub && mkdir sub/.vanish && echo nested-is-fine
                """, cwd: m.mountpoint)
            #expect(r.stdout == "0\n1\n1\n1\n1\n1\n1\nnested-is-fine\n")
        }
    }

    @Test("the status name is refused on write and removal and never stored; the delete name without the trigger's flags is data, as natively")
    func controlNamesReserved() throws {
        try withVanishMount { m in
            let r = try sh("""
                touch f
                for target in . f; do
                  setfattr -n user.vanish.status -v x $target 2>&1 | grep -c 'Operation not permitted'
                  setfattr -x user.vanish.status $target 2>&1 | grep -c 'Operation not permitted'
                done
                getfattr -n user.vanish.status --only-values . | head -c 1
                """, cwd: m.mountpoint)
            #expect(r.stdout == "1\n1\n1\n1\n{", "\(r.stderr)")
            let stored = try sh("getfattr -d -m - . f", cwd: m.source)
            #expect(!stored.stdout.contains("vanish"), "\(stored.stdout)")
            // Set with no flags, or either one alone, the name is an attribute like any other.
            let data = try sh("""
                set -e
                setfattr -n user.vanish.delete -v 1 f
                /usr/bin/python3 -c 'import os; os.setxattr("f", "user.vanish.delete", b"2", os.XATTR_REPLACE)'
                getfattr -n user.vanish.delete --only-values f; echo
                setfattr -x user.vanish.delete f
                getfattr -n user.vanish.delete f 2>&1 | grep -c 'No such attribute'
                /usr/bin/python3 -c 'import os; os.setxattr(".", "user.vanish.delete", b"3", os.XATTR_CREATE)'
                getfattr -n user.vanish.delete --only-values .; echo
                """, cwd: m.mountpoint)
            #expect(data.stdout == "2\n1\n3\n", "\(data.stderr)")
            #expect(access(m.backing("f"), F_OK) == 0)
        }
    }

    @Test("a .vanish that is not Vanish's makes the mount refuse and stays untouched")
    func foreignStateDirectory() throws {
        let base = try makeTempDirectory()
        defer { removeTree(base) }
        mkdir(base + "/src", 0o755); mkdir(base + "/mnt", 0o755)
        mkdir(base + "/src/.vanish", 0o755)
        try "mine\n".write(toFile: base + "/src/.vanish/notes", atomically: true, encoding: .utf8)
        let r = try run([vanishBinary, "mount", base + "/src", base + "/mnt"])
        #expect(r.status == 1)
        #expect(r.stderr.contains("not Vanish's"))
        #expect(mountType(at: base + "/mnt") == nil)
        #expect(try String(contentsOfFile: base + "/src/.vanish/notes", encoding: .utf8) == "mine\n")
        #expect(try FileManager.default.contentsOfDirectory(atPath: base + "/src/.vanish") == ["notes"])
    }

    @Test("vanish rm -r removes a 20,000-file tree in one step; the reaper frees it")
    func vanishRmOfATree() throws {
        try withVanishMount(prepare: { src in try makeTree(src + "/tree", files: 20_000) }) { m in
            let r = try run([vanishBinary, "rm", "-r", m.path("tree")])
            #expect(r.ok, "\(r.stderr)")
            // Gone for every process, through the mount and underneath.
            #expect(try sh("test ! -e tree && ls -A | wc -l", cwd: m.mountpoint).stdout == "0\n")
            #expect(access(m.backing("tree"), F_OK) != 0)
            try waitForReaper(m)
            #expect(try graveyardCount(m.source) == 0)
            let status = try run([vanishBinary, "status", "--json", m.mountpoint])
            // 20,000 files of 100 bytes and the 21 directories that held them, counted apart
            let counts = JSON.parse(status.stdout)
            #expect(counts?["freed_files"]?.int == 20_000 && counts?["freed_directories"]?.int == 21
                     && counts?["freed_data_bytes"]?.int == 2_000_000, "\(status.stdout)")
        }
    }

    @Test("vanish rm -r of a tree the kernel has cached: gone for every process at once, and its space comes back")
    func vanishRmOfACachedTree() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for a tmpfs source")
        try withVanishMountOnTmpfs(size: "256m", prepare: { src in
            try makeTree(src + "/tree", files: 2_000, size: 16 << 10)
        }) { m in
            // Every entry and inode cached by the kernel, every file opened once through the daemon.
            #expect(try sh("find tree -type f -exec cat {} + | wc -c", cwd: m.mountpoint).stdout == "\(2_000 << 14)\n")
            let before = freeBytes(m.source)
            #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
            // No process looks the tree up until its space is back: the kernel drops the
            // cached entries below it and forgets their inodes on Vanish's word alone, so no
            // fd of ours holds them.
            try waitForReaper(m)
            try waitFor("the tree's 31 MiB to come back", timeout: 30) { freeBytes(m.source) >= before + (30 << 20) }
            // The top entry was expired first: the next lookup, by any process, asks the daemon.
            #expect(try sh("test ! -e tree/d0 && test ! -e tree && echo gone", cwd: m.mountpoint).stdout == "gone\n")
        }
    }

    @Test("after rm -rf of 10k files, status's first estimate once the reaper has shown its pace is within 2× of what it takes (issue 51)")
    func honestEstimate() throws {
        // At 500 files a second, as a slow disk would free them (here the reaper
        // frees tens of thousands a second and is done before anyone could ask).
        // A rate the idle-class reaper keeps even while the rest of the suite
        // runs beside it: at 2,000 a second it fell behind its own pace, once.
        try withVanishMount(options: ["reap_rate=500"], prepare: { src in
            let r = try sh("mkdir t && cd t && for d in $(seq 10); do mkdir $d && (cd $d && seq 1000 | xargs touch); done", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // rm -rf makes the reaper step aside while it runs: what it frees meanwhile is
            // the mount's business, not its pace (the build before estimated 40× too long).
            #expect(try sh("rm -rf t", cwd: m.mountpoint).ok)
            var first: (seconds: Int, at: Double)?
            var done = 0.0
            var shown = ""
            try waitFor("the graveyard to be reaped", timeout: 300) {
                let status = try statusJSON(m)
                var ts = timespec()
                clock_gettime(CLOCK_MONOTONIC, &ts)
                let now = Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
                // After two seconds' worth at the cap: a loaded machine (the whole
                // suite beside it) slows the first second, and an estimate made then
                // honestly says so (62 s for what then took 25 s, once, in CI).
                if first == nil, let eta = status["eta_seconds"] as? Int, eta > 0,
                   let freed = status["freed_files"] as? Int, freed >= 1_000 {
                    first = (eta, now)
                    shown = try run([vanishBinary, "status", m.mountpoint]).stdout
                }
                guard status["pending_entries"] as? Int == 0 else { return false }
                done = now
                return true
            }
            let estimate = try #require(first, "no estimate was ever shown")
            let took = done - estimate.at
            // Whole seconds, rounded up: 1 s stands for anything up to it.
            #expect(Double(estimate.seconds) <= max(2 * took, 1.5) && took <= 2 * Double(estimate.seconds),
                    "estimated \(estimate.seconds) s, took \(took) s: \(shown)")
        }
    }

    @Test("a recursive inotify watcher sees the top of a tree vanish rm -r removed deleted, in its parent too, as after rm -rf (issue 51)")
    func watchersSeeOneStepDeletes() throws {
        try withVanishMount(prepare: { src in
            let r = try sh("mkdir -p w/rmrf/a/b w/onestep/a/b && touch w/rmrf/a/b/f w/onestep/a/b/f", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let events = m.base + "/events", errors = m.base + "/watch.err"
            let watcher = try spawn(["/bin/sh", "-c", "exec inotifywait -m -r --format '%e %w%f' \(shellQuote(m.path("w"))) >\(events) 2>\(errors)"])
            defer {
                kill(watcher, SIGTERM)
                var st: Int32 = 0
                waitpid(watcher, &st, 0)
            }
            try waitFor("the watches to be set") { (try? String(contentsOfFile: errors, encoding: .utf8))?.contains("Watches established") == true }
            #expect(try sh("rm -rf w/rmrf", cwd: m.mountpoint).ok)
            #expect(try run([vanishBinary, "rm", "-r", m.path("w/onestep")]).ok)
            let read = { (try? String(contentsOfFile: events, encoding: .utf8)) ?? "" }
            try waitFor("rm -rf's delete of the tree's top") { read().contains("DELETE_SELF \(m.path("w/rmrf"))/\n") }
            try waitFor("rm -rf's delete in the parent") { read().contains("DELETE,ISDIR \(m.path("w/rmrf"))\n") }
            // An earlier build told the kernel only to forget the entry: the watcher saw
            // the trigger's ATTRIB and nothing else; the next, DELETE_SELF but nothing in
            // the parent (the kernel raises none for a delete notice: docs/design.md).
            try waitFor("vanish rm -r's delete of the tree's top, as rm -rf's") {
                read().contains("DELETE_SELF \(m.path("w/onestep"))/\n")
            }
            try waitFor("vanish rm -r's delete in the parent, as rm -rf's") {
                read().contains("DELETE,ISDIR \(m.path("w/onestep"))\n")
            }
        }
    }

    @Test("the in-band trigger returns with the path gone for everyone: it can be made again at once")
    func triggerThenRemake() throws {
        try withVanishMount { m in
            // Empty directories and small trees, each removed and made again
            // straight away, as a build tool does with its output directory.
            // The build before answered first and told the kernel after, so
            // lstat right after the trigger often still found the directory.
            var failures: [String] = []
            for i in 0..<50 {
                let dir = m.path("out")
                guard mkdir(dir, 0o755) == 0 else { failures.append("\(i): mkdir: \(errno)"); break }
                if i % 2 == 1 { _ = creat(dir + "/f", 0o644) }
                guard setxattr(dir, ControlProtocol.deleteAttribute, "", 0, ControlProtocol.deleteFlags) == 0 else {
                    failures.append("\(i): setxattr: \(errno)"); break
                }
                var st = stat()
                if lstat(dir, &st) == 0 { failures.append("\(i): still there after the trigger returned") }
            }
            #expect(failures.isEmpty, "\(failures)")
        }
    }

    @Test("a process inside a tree vanish rm removed cannot make entries there, as after rm -rf; after a restore it can")
    func insideARemovedTree() throws {
        try withVanishMount(arguments: ["--keep", "1h"]) { m in
            // A process whose working directory is in the tree, or its top.
            // The kernel does not know the tree went to the graveyard, so
            // before this, files made there went with it and were lost.
            let r = try sh(deleteTriggerFunction + """
                mkdir -p top/sub && echo kept > top/sub/old
                check() { if touch new 2>/dev/null; then echo "$1: made"; else echo "$1: refused"; fi; }
                (cd top/sub && "$0" rm -r ../../top && check inside && mkdir d 2>/dev/null || echo mkdir-refused
                 cat old && "$0" restore "$(pwd | sed 's|/sub$||')" >/dev/null && check restored && ls)
                mkdir top2 && (cd top2 && trigger . && check top)
                """.replacingOccurrences(of: "\"$0\"", with: shellQuote(vanishBinary)), cwd: m.mountpoint)
            #expect(r.stdout == "inside: refused\nmkdir-refused\nkept\nrestored: made\nnew\nold\ntop: refused\n",
                    "\(r.stderr)")
        }
    }

    @Test("vanish rm and vanish restore take names that are not UTF-8, byte for byte")
    func nonUTF8Names() throws {
        try withVanishMount(arguments: ["--keep", "1h"]) { m in
            let r = try sh("""
                set -e
                bad="$(printf 'sub/\\377\\376 bad')"; file="$(printf 'file\\377')"
                mkdir -p "$bad/inner" && echo x > "$bad/inner/f" && echo y > "$file"
                VANISH rm -r "$bad"
                VANISH rm "$file"
                test ! -e "$bad" && test ! -e "$file" && echo gone
                VANISH restore "$PWD/$bad" > /dev/null
                cat "$bad/inner/f"
                VANISH rm -r "$(printf 'sub/\\377 missing')" 2>&1 | grep -c 'No such file' || true
                """.replacingOccurrences(of: "VANISH", with: shellQuote(vanishBinary)), cwd: m.mountpoint)
            #expect(r.stdout == "gone\nx\n1\n", "\(r.stdout)\(r.stderr)")
        }
    }

    /// Each command run in a fresh copy of one tree; what it printed (the
    /// program's name taken off), its status, and the tree it left.
    static func rmTranscript(_ rm: String, in dir: String) throws -> String {
        let commands = ["RM file", "RM dir", "RM -d empty", "RM missing", "RM -f missing", "RM -rf a --", "RM b -r",
                        "RM -fR missing c", "RM --recursive --force -- -d", "RM -x c", "RM", "RM -r link", "RM -rv t",
                        "RM -r .", "RM -r ./a/..", "RM -r --interactive=never c", "RM -rf --one-file-system t",
                        "RM -rf link/", "RM -rf a/ b//"]
        var out = ""
        for (i, command) in commands.enumerated() {
            let r = try sh("""
                mkdir run\(i) && cd run\(i) && echo x > file && mkdir dir empty && mkdir -p a/x b/x c/x ./-d/x t/u &&
                touch t/u/f && ln -s a link && \(command.replacingOccurrences(of: "RM", with: rm)) 2>&1; echo "status $?"
                find . | sort | tr '\\n' ' '
                """, cwd: dir)
            out += "\(command): " + r.stdout.replacingOccurrences(of: "vanish rm: ", with: "").replacingOccurrences(of: "rm: ", with: "") + "\n"
        }
        return out
    }

    @Test("vanish rm is rm: the same options, messages, exit status and tree, on a Vanish mount and off it (issue 51)")
    func removeLikeRm() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        mkdir(plain + "/native", 0o755)
        mkdir(plain + "/elsewhere", 0o755)
        let native = try GraveyardTests.rmTranscript("rm", in: plain + "/native")
        #expect(native.contains("RM dir: cannot remove 'dir': Is a directory\nstatus 1"), "\(native)")
        #expect(try GraveyardTests.rmTranscript(shellQuote(vanishBinary) + " rm", in: plain + "/elsewhere") == native)
        try withVanishMount { m in
            #expect(try GraveyardTests.rmTranscript(shellQuote(vanishBinary) + " rm", in: m.mountpoint) == native)
            // Help comes from vanish, with rm's options listed.
            let help = try run([vanishBinary, "rm", "--help"])
            #expect(help.stdout.contains("USAGE: vanish rm") && help.stdout.contains("--one-file-system"), "\(help)")
        }
        // A copy of the trigger attribute elsewhere does not pass for a Vanish mount: rm removes it, as rm.
        mkdir(plain + "/d", 0o755)
        if setxattr(plain + "/d", "user.vanish.delete", "x", 1, 0) == 0 {
            #expect(try run([vanishBinary, "rm", "-r", plain + "/d"]).ok)
            #expect(access(plain + "/d", F_OK) != 0)
        }
    }

    @Test("vanish rm and the xattr trigger obey rm's rules for another user")
    func removePermissions() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        try withVanishMount(options: ["allow_other"], prepare: { src in
            _ = try sh("""
                mkdir -p rootdir/sub && chmod 755 rootdir
                mkdir -p sticky/roots && chmod 1777 sticky && chmod 777 sticky/roots
                mkdir -p sticky/mine && chown nobody:nogroup sticky/mine
                mkdir -p open/theirs && chmod 777 open open/theirs
                """, cwd: src)
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let r = try runAsNobody(["/bin/sh", "-c", deleteTriggerFunction + """
                cd \(shellQuote(m.mountpoint))
                \(binary) rm -r rootdir/sub 2>&1 | grep -c 'Permission denied'
                trigger rootdir/sub 2>&1 | grep -c 'Permission denied'
                \(binary) rm -r sticky/roots 2>&1 | grep -c 'Operation not permitted'
                \(binary) rm -r sticky/mine && echo own-in-sticky-ok
                \(binary) rm -r open/theirs && echo writable-parent-ok
                """])
            #expect(r.stdout == "1\n1\n1\nown-in-sticky-ok\nwritable-parent-ok\n", "\(r.stderr)")
            #expect(access(m.backing("rootdir/sub"), F_OK) == 0)
            #expect(access(m.backing("sticky/roots"), F_OK) == 0)
        }
    }

    @Test("rename over a file sends the old target to the graveyard")
    func renameOver() throws {
        try withVanishMount { m in
            let r = try sh("echo old > a && echo new > b && mv b a && cat a && ls", cwd: m.mountpoint)
            #expect(r.stdout == "new\na\n")
            let status = try run([vanishBinary, "status", "--json", m.mountpoint])
            #expect(status.stdout.contains("\"buried_entries\":1"), "\(status.stdout)")
        }
    }

    /// Mounts a tmpfs at `inner` in the source for the test's length.
    private func withNestedTmpfs(prepareInner: @escaping (String) throws -> Void = { _ in },
                                 _ body: (VanishMount, String) throws -> Void) throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for tmpfs")
        var tmpfs = ""
        defer { if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) } }
        try withVanishMount(prepare: { src in
            tmpfs = src + "/inner"
            mkdir(tmpfs, 0o755)
            guard try run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", tmpfs]).ok else { throw TestFailure("tmpfs") }
            try prepareInner(tmpfs)
        }) { m in try body(m, tmpfs) }
    }

    @Test("a filesystem mounted inside the source gets a graveyard of its own, hidden, and its space comes back")
    func nestedFilesystemGraveyard() throws {
        try withNestedTmpfs { m, tmpfs in
            let before = freeBytes(tmpfs)
            let r = try sh("""
                dd if=/dev/zero of=inner/big bs=1M count=16 status=none && mkdir -p inner/t/u && touch inner/t/u/f inner/t/g
                rm inner/big && ls -A inner
                ls -A inner | wc -l
                touch inner/.vanish 2>/dev/null || echo refused
                ls inner/.vanish 2>/dev/null || echo absent
                """, cwd: m.mountpoint)
            #expect(r.stdout == "t\n1\nrefused\nabsent\n", "\(r.stderr)")
            // A whole tree there is one rename too, into that filesystem's graveyard.
            let rm = try run([vanishBinary, "rm", "-r", m.path("inner/t")])
            #expect(rm.ok, "\(rm.stderr)")
            #expect(access(m.backing("inner/t"), F_OK) != 0)
            #expect(access(tmpfs + "/.vanish/VANISH-STATE-DIRECTORY", F_OK) == 0, "the graveyard lives on the tmpfs")
            try waitForReaper(m)
            #expect(try graveyardCount(tmpfs) == 0)
            #expect(freeBytes(tmpfs) + (1 << 20) >= before, "the 16 MiB must be given back to the tmpfs")
            #expect(m.log.contains("go to a graveyard of its own"), "\(m.log)")
            #expect(!m.log.contains("done in the request"))
        }
    }

    @Test("where a nested filesystem cannot have a graveyard (a foreign .vanish), deletes there happen in the request")
    func nestedFilesystemWithoutGraveyard() throws {
        try withNestedTmpfs(prepareInner: { inner in
            mkdir(inner + "/.vanish", 0o755)  // the user's, no marker
            _ = try sh("echo mine > .vanish/keep", cwd: inner)
        }) { m, tmpfs in
            let r = try sh("echo x > inner/f && rm inner/f && ls -A inner && cat inner/.vanish/keep", cwd: m.mountpoint)
            #expect(r.stdout == ".vanish\nmine\n", "\(r.stderr)")
            #expect(access(m.backing("inner/f"), F_OK) != 0)
            #expect(try sh("mkdir -p inner/t/u && touch inner/t/u/f inner/t/g", cwd: m.mountpoint).ok)
            let rm = try run([vanishBinary, "rm", "-r", m.path("inner/t")])
            #expect(rm.ok, "\(rm.stderr)")
            #expect(access(m.backing("inner/t"), F_OK) != 0)
            #expect(try sh("ls -A .vanish", cwd: tmpfs).stdout == "keep\n", "the user's .vanish is left as it was")
            #expect(m.log.contains("done in the request"), "\(m.log)")
        }
    }

    @Test("leftovers in a nested filesystem's graveyard are reaped by the next mount")
    func nestedFilesystemLeftovers() throws {
        try withNestedTmpfs(prepareInner: { inner in
            // What a SIGKILLed session leaves: entries in that filesystem's graveyard.
            _ = try sh("""
                (umask 077 && mkdir -p .vanish/graveyard/07/0-0-1/sub && touch .vanish/VANISH-STATE-DIRECTORY)
                dd if=/dev/zero of=.vanish/graveyard/07/0-0-1/sub/data bs=1M count=4 status=none
                echo kept > file
                """, cwd: inner)
        }) { m, tmpfs in
            // The first look at that filesystem's root finds the graveyard.
            #expect(try sh("ls -A inner", cwd: m.mountpoint).stdout == "file\n")
            try waitFor("the leftovers to be reaped") { try graveyardCount(tmpfs) == 0 }
            #expect(try sh("cat inner/file", cwd: m.mountpoint).stdout == "kept\n")
            #expect(m.log.contains("resuming the graveyard"), "\(m.log)")
        }
    }

    @Test("vanish reap SOURCE also empties the graveyards of filesystems mounted inside it")
    func reapNestedWithoutMounting() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for tmpfs")
        let src = try makeTempDirectory()
        var tmpfs = ""
        defer {
            if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) }
            removeTree(src)
        }
        tmpfs = src + "/inner"
        mkdir(tmpfs, 0o755)
        guard try run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", tmpfs]).ok else { throw TestFailure("tmpfs") }
        _ = try sh("""
            umask 077
            mkdir -p .vanish/graveyard/00/0-0-1 .vanish/graveyard/3f && touch .vanish/VANISH-STATE-DIRECTORY
            touch .vanish/graveyard/00/0-0-1/a .vanish/graveyard/3f/0-0-2
            mkdir -p inner/.vanish/graveyard/11/0-0-3/d && touch inner/.vanish/VANISH-STATE-DIRECTORY inner/.vanish/graveyard/11/0-0-3/d/f
            """, cwd: src)
        let r = try run([vanishBinary, "reap", src])
        #expect(r.ok, "\(r.stderr)")
        #expect(r.stdout.contains(": 3 files, 3 directories"), "\(r.stdout)")
        #expect(try graveyardCount(src) == 0)
        #expect(try graveyardCount(tmpfs) == 0)
    }

    @Test("a tree deeper than PATH_MAX is reaped")
    func deepTree() throws {
        try withVanishMount(prepare: { src in
            let r = try run(["python3", "-c", """
                import os, sys
                fd = os.open(sys.argv[1], os.O_RDONLY)
                os.mkdir("deep", dir_fd=fd)
                for i in range(1800):
                    nfd = os.open("deep" if i == 0 else "dd", os.O_RDONLY, dir_fd=fd)
                    os.close(fd); fd = nfd
                    os.mkdir("dd", dir_fd=fd)
                    open(f"/proc/self/fd/{fd}/file", "w").close()
                """, src])
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            #expect(try run([vanishBinary, "rm", "-r", m.path("deep")]).ok)
            try waitForReaper(m)
            #expect(try graveyardCount(m.source) == 0)
        }
    }

    @Test("after an unmount the daemon finishes reaping, then exits 0")
    func reapsAfterUnmount() throws {
        let m = try VanishMount(prepare: { src in try makeTree(src + "/tree", files: 20_000) })
        defer { m.close() }
        #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
        // The wait is for a condition, so it may be long: the CI runs every suite at once.
        #expect(try m.unmount(timeout: 90) == 0)
        #expect(try graveyardCount(m.source) == 0)
    }

    @Test("once unmounted, the reaper leaves the idle classes for nice 19: other work can no longer starve it")
    func drainsAtNice19() throws {
        let m = try VanishMount(options: ["reap_rate=500", "reapers=2"],
                                prepare: { src in try makeTree(src + "/tree", files: 4_000) })
        defer { m.close() }
        let reapers = try idleReapers(m)
        #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
        // About 8 s of reaping at 500 files/s remain after the unmount; a
        // worker ends when nothing is left for it.
        #expect(try run(["fusermount3", "-u", m.mountpoint]).ok)
        var drained: [(tid: String, name: String, nice: Int, policy: Int)] = []
        try waitFor("the reaper workers at nice 19, SCHED_OTHER") {
            drained = reapers()
            return !drained.isEmpty && drained.allSatisfy { $0.policy == 0 && $0.nice == 19 }
        }
        for worker in drained {
            #expect(try run(["ionice", "-p", worker.tid]).stdout.hasPrefix("best-effort: prio 7"), "thread \(worker.tid)")
        }
        #expect(try m.waitForExit(timeout: 90) == 0)
        #expect(try graveyardCount(m.source) == 0)
    }

    @Test("an entry the reaper cannot delete is logged and left: it holds up neither status --wait nor the exit after an unmount, and vanish reap frees it once it can")
    func undeletableEntry() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for chattr +i")
        // No delete through the mount frees an immutable file (vanish rm -r
        // puts it back, as rm -r fails on it), so the entry
        // is one a killed session left: d0 holding 20 files, f7 immutable.
        let m = try VanishMount(prepare: { src in
            let entry = src + "/.vanish/graveyard/07/0-0-1"
            guard try sh("umask 077 && mkdir -p \(entry) && touch .vanish/VANISH-STATE-DIRECTORY", cwd: src).ok
            else { throw TestFailure("making the graveyard") }
            try makeTree(entry, files: 20)
            try makeTree(src + "/t", files: 20)
            let r = try run(["chattr", "+i", entry + "/d0/f7", src + "/t/d0/f7"])
            guard r.ok else { throw TestFailure("chattr: \(r.stderr)") }
        })
        defer {
            // An immutable file would keep the test's directory from going.
            _ = try? run(["chattr", "-R", "-i", m.source])
            m.close()
        }
        let putBack = try run([vanishBinary, "rm", "-r", m.path("t")])
        #expect(putBack.ok, "\(putBack)")
        try waitForReaper(m)
        #expect(try sh("find t | sort", cwd: m.source).stdout == "t\nt/d0\nt/d0/f7\n",
                "t ends as root's rm -r leaves it: the immutable file and the directories on its path")
        let status = try run([vanishBinary, "status", "--json", m.mountpoint]).stdout
        #expect(JSON.parse(status)?["stuck_entries"]?.int == 1, "\(status)")
        #expect(JSON.parse(status)?["eta_seconds"]?.int == 0, "\(status)")
        #expect(try run([vanishBinary, "status", m.mountpoint]).stdout.contains("1 that cannot be deleted"))
        // d0, the directory holding the file, is what stays; its other 19 files are gone.
        #expect(try graveyardCount(m.source) == 1)
        #expect(try sh("find .vanish/clients/*/graveyard -type f | wc -l", cwd: m.source).stdout == "1\n")
        try waitFor("the daemon's warning") { m.log.contains("cannot delete a graveyard entry") }
        #expect(m.log.contains("Operation not permitted"))
        // After the unmount the daemon ends, leaving the entry for the next try.
        #expect(try m.unmount(timeout: 30) == 0)
        #expect(try graveyardCount(m.source) == 1)
        let refused = try run([vanishBinary, "reap", m.source])
        #expect(refused.status == 1 && refused.stderr.contains("Operation not permitted"), "\(refused)")
        #expect(try graveyardCount(m.source) == 1)
        #expect(try run(["chattr", "-i", "-R", m.source + "/.vanish/clients"]).ok)
        let reaped = try run([vanishBinary, "reap", m.source])
        #expect(reaped.ok, "\(reaped)")
        #expect(try graveyardCount(m.source) == 0)
    }

    @Test("next to CPU hogs in its scheduling group a starved worker leaves the idle class while the mount serves")
    func liftedWhenStarved() throws {
        let m = try VanishMount(options: ["reap_rate=500", "reapers=2"],
                                prepare: { src in try makeTree(src + "/tree", files: 4_000) })
        defer { m.close() }
        let reapers = try idleReapers(m)
        // Busy loops in the daemon's session (so its autogroup), one per core:
        // an idle-class thread there gets next to no CPU.
        let hogs = try BusyLoops(perCore: 1)
        defer { hogs.stop() }
        #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
        // 4,000 files at 500 a second: 8 s of work, and the watchdog looks once a second.
        try waitFor("a reaper worker lifted to nice 19, SCHED_OTHER", timeout: 60) {
            reapers().contains { $0.policy == 0 && $0.nice == 19 }
        }
        #expect(mountType(at: m.mountpoint) == "fuse.vanish")
        #expect(try sh("echo x > f && cat f", cwd: m.mountpoint).stdout == "x\n")
        hogs.stop()
        try waitForReaper(m)
        #expect(try graveyardCount(m.source) == 0)
        // Out of work, a worker's next busy spell starts in the idle class again.
        try waitFor("both workers back in SCHED_IDLE") { reapers().filter { $0.policy == 5 }.count == 2 }
    }

    @Test("an idle mount's reaper, watchdog and event writer sleep until there is work, and then wake for it")
    func idleThreadsSleep() throws {
        try withVanishMount(prepare: { src in try makeTree(src + "/tree", files: 100) }) { m in
            #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
            try waitForReaper(m)
            /// Times each of those threads went to sleep so far, by thread id.
            func sleeps() throws -> [String: Int] {
                var out: [String: Int] = [:]
                for t in try FileManager.default.contentsOfDirectory(atPath: "/proc/\(m.pid)/task") {
                    let dir = "/proc/\(m.pid)/task/\(t)"
                    // (libfuse's workers come and go; these threads stay.)
                    guard let name = try? String(contentsOfFile: dir + "/comm", encoding: .utf8),
                          ["vanish-reaper\n", "vanish-watch\n", "vanish-journal\n"].contains(name) else { continue }
                    let status = try String(contentsOfFile: dir + "/status", encoding: .utf8)
                    let line = status.split(separator: "\n").first { $0.hasPrefix("voluntary_ctxt_switches:") }!
                    out[name.dropLast() + " " + t] = Int(line.split(separator: "\t").last!)!
                }
                return out
            }
            // Settled: both workers asleep in the idle class, the mount event
            // written, and the watchdog past its last one-second look.
            _ = try idleReapers(m)
            try waitFor("a second and more without a wakeup") {
                let first = try sleeps()
                usleep(1_200_000)
                return try sleeps() == first
            }
            let before = try sleeps()
            #expect(before.count == 4, "\(before)")
            // Nothing to wait for here: the point is that nothing happens. The
            // workers used to look through their shards every 2 s, the
            // watchdog and the writer woke every second.
            usleep(3_000_000)
            let after = try sleeps()
            for (thread, count) in before {
                #expect(after[thread] == count, "\(thread) woke \((after[thread] ?? 0) - count) times while idle")
            }
            // And work still wakes them.
            #expect(try sh("echo x > f && rm f", cwd: m.mountpoint).ok)
            try waitForReaper(m)
            #expect(try graveyardCount(m.source) == 0)
        }
    }
}

/// SIGKILL at random points during deletes and reaping: nothing that was not
/// deleted is lost, the graveyard never shows, leftovers are reaped later.
@Suite("crash safety", .serialized, .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct CrashSafetyTests {
    @Test("SIGKILL during rm -rf, vanish rm and reaping", arguments: 0..<4)
    func killAndRemount(_ round: Int) throws {
        let m = try VanishMount(prepare: { src in
            try makeTree(src + "/keep", files: 2_000, size: 4096)
            try makeTree(src + "/doomed1", files: 10_000)
            try makeTree(src + "/doomed2", files: 10_000)
        })
        defer { m.close() }
        let sums = try sh("find keep -type f -exec md5sum {} + | sort", cwd: m.source).stdout
        // Deletes in flight through the mount, then the daemon dies mid-way.
        let rm = try spawn(["/bin/sh", "-c", "rm -rf \(shellQuote(m.path("doomed1"))) 2>/dev/null"])
        _ = try run([vanishBinary, "rm", "-r", m.path("doomed2")])
        usleep(UInt32(1_000 * (20 + 70 * round)))
        kill(m.pid, SIGKILL)
        _ = try m.waitForExit()
        var status: Int32 = 0
        waitpid(rm, &status, 0)
        #expect(try run(["fusermount3", "-u", m.mountpoint]).ok)

        // Nothing that was kept is damaged, underneath or after remounting.
        #expect(try sh("find keep -type f -exec md5sum {} + | sort", cwd: m.source).stdout == sums)
        if round % 2 == 0 {
            try withVanishMount(prepareExisting: m.source) { again in
                #expect(try sh("ls -A | grep -c vanish || true", cwd: again.mountpoint).stdout == "0\n")
                #expect(try sh("find keep -type f -exec md5sum {} + | sort", cwd: again.mountpoint).stdout == sums)
                try waitForReaper(again)
            }
        } else {
            let r = try run([vanishBinary, "reap", m.source])
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout.contains("reaped"))
        }
        #expect(try graveyardCount(m.source) == 0)
    }
}

/// Unlinks every file under `dir` of `m` (its subdirectories' files, or its
/// own), one after another, until `count` were answered; then SIGKILLs the
/// daemon and clears the dead mount. Returns the answered paths (relative to `dir`).
func killDuringUnlinks(_ m: VanishMount, under dir: String, after count: Int) throws -> [String] {
    let answered = m.base + "/answered"
    // Each name is written down once its unlink returned.
    let loop = try spawn(["/usr/bin/python3", "-c", """
        import os, sys
        root, out = sys.argv[1], open(sys.argv[2], "w")
        def files(d, prefix):
            for n in sorted(os.listdir(d)):
                p = os.path.join(d, n)
                if os.path.isdir(p): yield from files(p, prefix + n + "/")
                else: yield p, prefix + n
        for path, name in files(root, ""):
            try: os.unlink(path)
            except OSError: sys.exit(0)
            out.write(name + "\\n"); out.flush()
        """, m.path(dir), answered])
    var status: Int32 = 0
    defer { if waitpid(loop, &status, WNOHANG) == 0 { kill(loop, SIGKILL); waitpid(loop, &status, 0) } }
    func names() -> [String] {
        ((try? String(contentsOfFile: answered, encoding: .utf8)) ?? "").split(separator: "\n").map(String.init)
    }
    try waitFor("\(count) answered unlinks", timeout: 60) { names().count >= count }
    kill(m.pid, SIGKILL)
    _ = try m.waitForExit()
    waitpid(loop, &status, 0)
    guard try run(["fusermount3", "-u", m.mountpoint]).ok else { throw TestFailure("fusermount3 -u of the dead mount") }
    return names()
}

/// An unlink is answered before its file moves into the graveyard; one
/// answered just before the daemon is SIGKILLed must still be done after
/// the remount (issue 22, item 2: 2,008 of 20k files came back).
@Suite("answered unlinks survive a crash", .serialized, .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct AnsweredUnlinkTests {
    @Test("every unlink answered before a SIGKILL is done after the remount", arguments: [false, true])
    func killDuringUnlinkLoop(undoWindow: Bool) throws {
        let window = undoWindow ? ["--keep", "1h"] : []
        let m = try VanishMount(arguments: window, prepare: { src in try makeTree(src + "/t", files: 20_000) })
        defer { m.close() }
        // Mid-way through a directory, so a queue of answered unlinks is pending.
        let gone = try killDuringUnlinks(m, under: "t", after: 4_500)
        #expect(gone.count >= 4_500 && gone.count < 20_000)

        try withVanishMount(arguments: window, prepareExisting: m.source) { again in
            // The unlink in flight at the kill may have been done without its answer; none other.
            let left = try sh("cd t && find . -type f | wc -l", cwd: again.mountpoint).stdout
            let count = Int(left.trimmingCharacters(in: .whitespacesAndNewlines)) ?? -1
            #expect(count == 20_000 - gone.count || count == 20_000 - gone.count - 1, "\(count) left, \(gone.count) answered")
            let back = gone.filter { access(again.path("t/" + $0), F_OK) == 0 || access(m.backing("t/" + $0), F_OK) == 0 }
            let undone = back.count
            #expect(undone == 0, "answered unlinks undone, e.g. \(back.prefix(3))")
            if undoWindow {
                // Each is restorable too, as an unlink that landed would be.
                let list = try run([vanishBinary, "trash", "list", "--json", again.mountpoint])
                let records = list.stdout.split(separator: "\n").count
                #expect(records == 20_000 - count, "\(records) restorable, \(20_000 - count) deleted")
                let name = gone.last!
                #expect(try run([vanishBinary, "restore", again.path("t/" + name)]).ok)
                #expect(access(again.path("t/" + name), F_OK) == 0)
            } else {
                try waitForReaper(again)
                #expect(try graveyardCount(again.source) == 0)
            }
        }
    }
}

extension AnsweredUnlinkTests {
    @Test("vanish reap of the source after a SIGKILL finishes the answered unlinks too, without mounting")
    func reapFinishesUnlinks() throws {
        let m = try VanishMount(prepare: { src in try makeTree(src + "/t", files: 3_000) })
        defer { m.close() }
        let gone = try killDuringUnlinks(m, under: "t/d1", after: 300)
        let r = try run([vanishBinary, "reap", m.source])
        #expect(r.ok, "\(r.stderr)")
        let back = gone.filter { access(m.backing("t/d1/" + $0), F_OK) == 0 }.count
        #expect(!gone.isEmpty)
        #expect(back == 0)
        #expect(try graveyardCount(m.source) == 0)
    }

    @Test("a file the undo window leaves out (keep_exclude), answered before a SIGKILL, is not kept by the remount")
    func unkeptStaysUnkept() throws {
        let options = ["keep_exclude=*.tmp"]
        let m = try VanishMount(options: options, arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("mkdir -p t/d && cd t/d && for i in $(seq 1000); do echo x > f$i.tmp; done", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        })
        defer { m.close() }
        // Mid-way through the directory: its queue of answered unlinks is pending at the kill.
        let gone = try killDuringUnlinks(m, under: "t", after: 300)
        #expect(gone.count >= 300 && gone.count < 1_000)
        try withVanishMount(options: options, arguments: ["--keep", "1h"], prepareExisting: m.source) { again in
            let back = gone.filter { access(again.path("t/" + $0), F_OK) == 0 }
            #expect(back.isEmpty, "answered unlinks undone, e.g. \(back.prefix(3))")
            // The build before kept every one the remount finished, excluded or not.
            let list = try run([vanishBinary, "trash", "list", "--json", again.mountpoint])
            #expect(list.ok && list.stdout.split(separator: "\n").isEmpty, "kept after the remount: \(list.stdout.prefix(300))")
            try waitForReaper(again)
            #expect(try graveyardCount(again.source) == 0)
        }
    }

    @Test("unlinks in a directory renamed right after them stay done across a SIGKILL")
    func renamedDirectory() throws {
        let m = try VanishMount(prepare: { src in try makeTree(src + "/t", files: 200) })
        defer { m.close() }
        // 111 files go (f1, f10-f19, f100-f199), then their directory moves, then the daemon dies.
        // (Nothing may look into it before the kill: a listing lands what is pending in it.)
        let r = try sh("rm t/d0/f1* && mv t/d0 t/moved", cwd: m.mountpoint)
        #expect(r.ok, "\(r.stderr)")
        kill(m.pid, SIGKILL)
        _ = try m.waitForExit()
        #expect(try run(["fusermount3", "-u", m.mountpoint]).ok)
        try withVanishMount(prepareExisting: m.source) { again in
            let left = try sh("ls t/moved | wc -l", cwd: again.mountpoint).stdout
            #expect(left == "89\n")
        }
    }
}

@Suite("sources that cannot hold a graveyard", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct NoGraveyardTests {
    @Test("a read-only mount writes nothing into the source")
    func readOnlyMount() throws {
        try withVanishMount(options: ["ro"], prepare: { src in
            try "x\n".write(toFile: src + "/f", atomically: true, encoding: .utf8)
        }) { m in
            let cat = try sh("cat f", cwd: m.mountpoint)
            #expect(cat.stdout == "x\n")
            #expect(access(m.backing(".vanish"), F_OK) != 0)
            #expect(unlink(m.path("f")) != 0 && errno == EROFS)
            let restore = try run([vanishBinary, "restore", m.path("f")])
            #expect(restore.status == 1 && restore.stderr.contains("this mount keeps no deleted entries (it is read-only"),
                    "\(restore.stderr)")
        }
    }

    @Test("a source the daemon may not write is served, deleting in the request")
    func unwritableSource() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        try withFUSEDeviceOpenToAll { try nobodyServesRootsSource() }
    }

    func nobodyServesRootsSource() throws {
        let base = try makeTempDirectory()
        defer { unmountAndRemove(base + "/mnt", base: base) }
        chmod(base, 0o755)
        // The root of the source is root's; a subdirectory in it is nobody's.
        let setup = try sh("mkdir -p src/mine mnt && chown nobody:nogroup src/mine mnt && cp \(shellQuote(vanishBinary)) vanish",
                           cwd: base)
        #expect(setup.ok)
        let m = try runAsNobody([base + "/vanish", "mount", base + "/src", base + "/mnt"],
                                environment: try nobodyRuntimeDirectory(in: base))
        #expect(m.ok, "\(m.stderr)")
        let r = try runAsNobody(["/bin/sh", "-c", "cd \(base)/mnt && echo x > mine/f && rm mine/f && ls -A mine | wc -l"])
        #expect(r.stdout == "0\n", "\(r.stderr)")
        #expect(access(base + "/src/.vanish", F_OK) != 0)
        let u = try runAsNobody([base + "/vanish", "unmount", base + "/mnt"])
        #expect(u.ok)
    }
}
