import Glibc
import Testing
import VanishTestSupport

/// A filesystem mounted inside the source shows through the Vanish mount.
@Suite("nested mounts", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct SubmountTests {
    /// A Vanish mount whose source has a small tmpfs mounted at `relative`
    /// (made if missing), after `fill` ran in the source; the tmpfs is
    /// detached afterwards, whatever happens.
    func withTmpfsInside(at relative: String, fill: String, _ body: (VanishMount) throws -> Void) throws {
        var tmpfs = ""
        defer { if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) } }
        try withVanishMount(prepare: { src in
            let r = try run(["sh", "-c", "mkdir -p \"$1\" && mount -t tmpfs -o size=16m tmpfs \"$1\"", "sh",
                             src + "/" + relative])
            guard r.ok else { throw TestFailure(r.stderr) }
            tmpfs = src + "/" + relative
            let f = try sh(fill, cwd: src)
            guard f.ok else { throw TestFailure(f.stderr) }
        }, body)
    }

    @Test("a tmpfs inside the source: lookups cross into it, inode numbers stay unique, rename gives EXDEV")
    func tmpfsInside() throws {
        try withTmpfsInside(at: "inner", fill: "echo data > inner/file && echo top > file") { m in
            let r = try sh("""
                cat inner/file
                echo more > inner/new
                stat -c %i inner file inner/file . | sort | uniq -d | wc -l
                python3 -c 'import os, errno
                try:
                    os.rename("inner/file", "moved"); print("renamed")
                except OSError as e:
                    print(errno.errorcode[e.errno])'
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "data\n0\nEXDEV\n", "inode numbers must not collide, rename must give EXDEV")
            let inner = try sh("cat inner/new", cwd: m.source)
            #expect(inner.stdout == "more\n")
            // The crossing is logged once per nested filesystem, however many lookups cross it.
            #expect(m.log.components(separatedBy: "mounted inside the source").count == 2, "\(m.log)")
        }
    }

    @Test("on a nested filesystem without a graveyard, a directory of root's swapped onto nobody's file behind their unlink is not removed as root")
    func swapBehindAnUnlinkWithoutGraveyard() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        var tmpfs = ""
        defer { if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) } }
        try withVanishMount(options: ["allow_other"], prepare: { src in
            tmpfs = src + "/nest"
            // A .vanish that is not Vanish's: deletes there are done in the request.
            let r = try sh("""
                chmod 755 . && mkdir nest && mount -t tmpfs -o size=16m tmpfs nest && mkdir nest/.vanish
                mkdir -m 1777 nest/shared && mkdir nest/shared/D nest/shared/D/B && echo precious > nest/shared/D/B/f
                chown nobody nest/shared/D
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            guard try run(["chmod", "755", m.base]).ok else { throw TestFailure("chmod \(m.base)") }
            // nobody exchanges a file of theirs with B on the source while unlinking it through the mount.
            try swapBehindUnlinkScript.write(toFile: m.base + "/swap.py", atomically: true, encoding: .utf8)
            let attack = try runAsNobody(["/usr/bin/python3", m.base + "/swap.py", m.backing("nest/shared/D"),
                                          m.path("nest/shared/D"), m.logPath])
            #expect(attack.stdout.contains("held") || attack.stdout.contains("returned"), "\(attack.stdout) \(attack.stderr)")
            #expect(try sh("ls -A nest/.vanish", cwd: m.source).stdout == "", "a graveyard was made on the nested filesystem")
            let left = try sh("cat nest/shared/D/B/f", cwd: m.source)
            #expect(left.stdout == "precious\n", "root's file was removed: \(left)")
        }
    }

    @Test("a FUSE filesystem without renameat2 flags inside the source: renames still work")
    func bindfsInside() throws {
        try #require(which("bindfs") != nil, "bindfs (mount-scripts/install --deps-only installs it)")
        let back = try makeTempDirectory()
        var inner = ""
        defer {
            if !inner.isEmpty { _ = try? run(["umount", "-l", inner]) }
            removeTree(back)
        }
        try withVanishMount(prepare: { src in
            inner = src + "/inner"
            mkdir(inner, 0o755)
            let r = try run(["bindfs", back, inner])
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // Vanish replaces a file by exchanging the two names and burying
            // the old one, and renames to a free name with RENAME_NOREPLACE;
            // bindfs refuses both flags (EINVAL), as NFS does. Then the top
            // directory, after the refusal was seen.
            let r = try sh("""
                cd inner && echo a > a && echo b > b
                mv a b && cat b
                python3 -c 'import os, errno
                os.rename("b", "c"); print(sorted(os.listdir(".")))
                os.mkdir("d")
                try:
                    os.rename("d", "d/x")
                except OSError as e:
                    print(errno.errorcode[e.errno])'
                cd .. && echo top > x && mv x y && cat y
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "a\n['c']\nEINVAL\ntop\n")
            #expect(try sh("cat c && ls", cwd: back).stdout == "a\nc\nd\n")

            // Burials there too: the graveyard's renames ask for RENAME_NOREPLACE.
            let rm = try sh("""
                set -e
                cd inner && mkdir -p t/a/b && echo 1 > t/a/b/f1 && echo 2 > t/a/b/f2
                ln c c2 && rm c2 && cat c
                rm -rf t/a && ls -A t
                mkdir t2 && echo y > t2/y && \(shellQuote(vanishBinary)) rm -r t2
                ls -A
                """, cwd: m.mountpoint)
            #expect(rm.ok, "\(rm.stderr)")
            #expect(rm.stdout == "a\nc\nd\nt\n")
            #expect(try run(["timeout", "180", vanishBinary, "status", "--wait", m.mountpoint]).ok)
            // Freed from the backing filesystem, not just hidden.
            #expect(try sh("ls -A && find .vanish/clients/*/graveyard -mindepth 2 | wc -l", cwd: back).stdout ==
                    ".vanish\nc\nd\nt\n0\n")
        }
    }

    @Test("a source on overlayfs: directories from the lower layer are removed by rm -rf and vanish rm")
    func overlayfsSource() throws {
        // overlayfs refuses to rename a lower layer's directory (EXDEV),
        // even within the one filesystem; those are deleted in the request.
        let base = try makeTempDirectory()
        let merged = base + "/merged"
        defer {
            _ = try? run(["umount", "-l", merged])
            removeTree(base)
        }
        let setup = try sh("""
            set -e
            mkdir -p lower/a/sub lower/b upper work merged
            echo 1 > lower/a/sub/f && echo 2 > lower/b/g && echo 3 > lower/c
            mount -t overlay overlay -o lowerdir=lower,upperdir=upper,workdir=work merged
            """, cwd: base)
        try #require(setup.ok, "\(setup.stderr)")
        try withVanishMount(prepareExisting: merged) { m in
            let r = try sh("""
                set -e
                rm -rf a && \(shellQuote(vanishBinary)) rm -r b && rm c
                ls -A
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "")
            #expect(m.log.contains("the source is on overlayfs"), "\(m.log)")
            #expect(try run(["timeout", "180", vanishBinary, "status", "--wait", m.mountpoint]).ok)
        }
        // The lower layer is untouched; the overlay shows nothing left.
        #expect(try sh("ls -A merged; cat lower/a/sub/f lower/b/g lower/c", cwd: base).stdout == ".vanish\n1\n2\n3\n")
    }

    @Test("vanish rm refuses a tree with a filesystem mounted inside it (EBUSY), and loses nothing")
    func removeTreeHoldingAMount() throws {
        // A space in the path: mountinfo escapes it.
        try withTmpfsInside(at: "a tree/deep/mnt", fill: "echo top > 'a tree/file' && echo inner > 'a tree/deep/mnt/x'") { m in
            // A rename would take the mount into the graveyard, hidden, where
            // the reaper must not enter it: the entry would never go.
            let r = try run([vanishBinary, "rm", "-r", m.path("a tree")])
            #expect(r.status == 1)
            #expect(r.stderr.contains("Device or resource busy"), "\(r.stderr)")
            #expect(try sh("cat 'a tree/file' 'a tree/deep/mnt/x'", cwd: m.mountpoint).stdout == "top\ninner\n")
            #expect(try sh("find .vanish/clients/*/graveyard -mindepth 2 | wc -l", cwd: m.source).stdout == "0\n")
            // A sibling tree without a mount goes as always.
            #expect(try sh("mkdir -p 'a tree2/x' && \(shellQuote(vanishBinary)) rm -r 'a tree2' && ls -A", cwd: m.mountpoint)
                .stdout == "a tree\n")
            // A mount made after the daemon last read the mount table counts too.
            let late = m.source + "/b/c"
            defer { _ = try? run(["umount", "-l", late]) }
            #expect(try sh("mkdir -p b/c && mount -t tmpfs -o size=1m tmpfs b/c", cwd: m.source).ok)
            #expect(try run([vanishBinary, "rm", "-r", m.path("b")]).status == 1)
            _ = try run(["umount", late])
            #expect(try run([vanishBinary, "rm", "-r", m.path("b")]).ok)
        }
    }

    @Test("a FUSE filesystem mounted inside a buried tree and stopped there holds no reaper worker: that tree waits, the rest goes")
    func stoppedFUSEInsideABuriedTree() throws {
        let other = try makeTempDirectory()
        var innerPID: pid_t = 0
        // Where `other` is mounted now: the graveyard renames the tree holding it.
        func inner() throws -> String? {
            let mounts = try String(contentsOfFile: "/proc/self/mounts", encoding: .utf8)
            for line in mounts.split(separator: "\n") {
                let fields = line.split(separator: " ").map(String.init)
                if fields.count > 1 && fields[0] == other { return fields[1] }
            }
            return nil
        }
        defer {
            if let path = try? inner() { _ = try? run(["umount", "-l", path]) }
            removeTree(other)
        }
        try withVanishMount(arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("mkdir -p t/sub u/v && echo 1 > u/v/f", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // Before the mount's own teardown, which waits for its reaper.
            defer { if innerPID > 0 { kill(innerPID, SIGCONT) } }
            let rm = try run([vanishBinary, "rm", "-r", m.path("t"), m.path("u")])
            #expect(rm.ok, "\(rm)")
            // Where a descriptor held inside the tree could have mounted it
            // (with user_allow_other), then its server stops.
            // Once the one-step check has moved it from the deleter's room
            // into the graveyard, where it stays for the undo window.
            var sub = ""
            try waitFor("the checked tree in the graveyard") {
                sub = try sh("find .vanish/clients/*/graveyard -type d -name sub", cwd: m.source).stdout
                    .trimmingCharacters(in: .whitespacesAndNewlines)
                return !sub.isEmpty
            }
            let mounted = try run([vanishBinary, "mount", other, m.source + "/" + sub])
            try #require(mounted.ok, "\(mounted)")
            innerPID = pid_t(try statusJSON(path: m.source + "/" + sub)["pid"] as? Int ?? 0)
            try #require(innerPID > 0)
            kill(innerPID, SIGSTOP)
            #expect(try run([vanishBinary, "trash", "empty", m.mountpoint]).ok)
            // The idle-class reaper may get little CPU while the rest of the suite runs (15 s ran
            // out once, in a full run): a condition, however long it takes to come.
            try waitFor("the tree holding the stopped mount to wait as stuck, and the other to go", timeout: 120) {
                let s = try statusJSON(m)
                return s["stuck_entries"] as? Int == 1 && s["pending_entries"] as? Int == 1
            }
            #expect(try sh("echo z > z && cat z && rm z", cwd: m.mountpoint).stdout == "z\n", "requests go on meanwhile")
            kill(innerPID, SIGCONT)
            innerPID = 0
            let path = try #require(try inner())
            #expect(try run(["umount", path]).ok)
        }
    }
}
