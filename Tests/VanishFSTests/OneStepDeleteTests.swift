import Foundation
import Glibc
import Testing
import VanishTestSupport

/// The one-step delete (`vanish rm -r`, the `user.vanish.delete` trigger)
/// run by a hostile user on an allow_other mount of a root daemon: the tree
/// moves only where the kernel lets that user move it, and goes only where
/// `rm -r` by that user would empty it; anything else ends where it was.
@Suite("one-step delete as another user", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct OneStepDeleteTests {
    /// A tree `case/nb/A` for nobody to remove, built by root, and whether
    /// nobody's `rm -r` removes it on a plain directory.
    struct Case {
        var name: String
        var setup: String
        var removable: Bool
    }

    static let cases: [Case] = [
        Case(name: "another user's directory inside", setup: """
            install -d -o nobody nb nb/A && mkdir nb/A/r && echo x > nb/A/r/f
            """, removable: false),
        Case(name: "a read-only directory of one's own", setup: """
            install -d -o nobody nb nb/A nb/A/ro && install -o nobody /dev/null nb/A/ro/f && chmod 555 nb/A/ro
            """, removable: false),
        Case(name: "another user's 0700 directory", setup: """
            install -d -o nobody nb nb/A && install -d -m 700 nb/A/p && echo x > nb/A/p/f
            """, removable: false),
        Case(name: "own directory in a sticky one, holding root's", setup: """
            install -d -m 1777 nb && install -d -o nobody nb/A && mkdir nb/A/r && echo x > nb/A/r/f
            """, removable: false),
        Case(name: "root's 0777 directory holding a 0755 one", setup: """
            install -d -o nobody nb && install -d -m 777 nb/A && install -d -m 755 nb/A/s && echo x > nb/A/s/f
            """, removable: false),
        Case(name: "an ACL that denies write", setup: """
            install -d -o nobody nb && install -d -m 777 nb/A && echo x > nb/A/f && setfacl -m u:nobody:r-x nb/A
            """, removable: false),
        Case(name: "another user's file in a sticky directory inside", setup: """
            install -d -o nobody nb nb/A && install -d -m 1777 nb/A/t && echo x > nb/A/t/f
            """, removable: false),
        Case(name: "an immutable file of one's own", setup: """
            install -d -o nobody nb nb/A && install -o nobody /dev/null nb/A/f && chattr +i nb/A/f
            """, removable: false),
        Case(name: "an append-only directory of one's own", setup: """
            install -d -o nobody nb nb/A nb/A/d && install -o nobody /dev/null nb/A/d/f && chattr +a nb/A/d
            """, removable: false),
        Case(name: "own tree with empty unreadable and read-only directories", setup: """
            install -d -o nobody nb nb/A nb/A/b nb/A/e nb/A/ro && install -o nobody /dev/null nb/A/b/f
            chmod 0 nb/A/e && chmod 555 nb/A/ro
            """, removable: true),
        Case(name: "own files in a sticky directory inside", setup: """
            install -d -o nobody nb nb/A && install -d -m 1777 nb/A/t && install -o nobody /dev/null nb/A/t/f
            """, removable: true),
        Case(name: "another user's world-writable directory inside", setup: """
            install -d -o nobody nb nb/A && install -d -m 777 nb/A/w && echo x > nb/A/w/f
            """, removable: true),
        Case(name: "an ACL that grants write", setup: """
            install -d -o nobody nb nb/A && install -d -m 755 nb/A/g && echo x > nb/A/g/f && setfacl -m u:nobody:rwx nb/A/g
            """, removable: true),
    ]

    /// Builds every case in `dir`, one subdirectory each.
    static func build(in dir: String) throws {
        for (i, c) in cases.enumerated() {
            let r = try sh("mkdir case\(i) && cd case\(i) && " + c.setup, cwd: dir)
            guard r.ok else { throw TestFailure("setting up \(c.name): \(r.stderr)") }
        }
    }

    /// Takes the immutable and append-only flags off, so the trees can be removed.
    static func unprotect(_ dir: String) {
        _ = try? sh("chattr -R -i -a . 2>/dev/null", cwd: dir)
    }

    /// What nobody's room holds: trees moved in and not yet checked.
    static func room(_ m: VanishMount) throws -> String {
        try sh("ls .vanish/clients/*/users/65534 2>/dev/null", cwd: m.source).stdout
    }

    @Test("vanish rm -r as nobody ends each tree as nobody's rm -r ends it on a plain directory: paths, owners, modes")
    func parityWithRm() throws {
        let plain = try makeTempDirectory()
        defer { OneStepDeleteTests.unprotect(plain); removeTree(plain) }
        chmod(plain, 0o755)
        try OneStepDeleteTests.build(in: plain)
        var source = ""
        defer { if !source.isEmpty { OneStepDeleteTests.unprotect(source) } }
        try withVanishMount(options: ["allow_other"], prepare: { src in
            source = src
            try OneStepDeleteTests.build(in: src)
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let listing = "find case%d -printf '%%p %%u %%m\\n' | sort"
            for (i, c) in OneStepDeleteTests.cases.enumerated() {
                let native = try runAsNobody(["rm", "-r", "nb/A"], cwd: plain + "/case\(i)")
                #expect(native.ok == c.removable, "the fixture: rm -r as nobody, \(c.name): \(native.stderr)")
                let expected = try sh(String(format: listing, i), cwd: plain).stdout
                // The one rename is the kernel's, as nobody: it refuses where mv would.
                let vanish = try runAsNobody([binary, "rm", "-r", "nb/A"], cwd: m.path("case\(i)"))
                if c.removable {
                    #expect(vanish.ok, "vanish rm -r as nobody, \(c.name): \(vanish.stderr)")
                    #expect(access(m.backing("case\(i)/nb/A"), F_OK) != 0, "\(c.name): removed")
                } else {
                    // Refused, or what nobody could not remove put back.
                    try waitFor("\(c.name) to end as rm -r ends it") {
                        try sh(String(format: listing, i), cwd: m.source).stdout == expected
                    }
                    // The trigger any program can set ends the same way, whatever it answers.
                    _ = try runAsNobody(deleteTriggerCommand + ["nb/A"], cwd: m.path("case\(i)"))
                    try waitFor("\(c.name) to end as rm -r ends it after the trigger") {
                        try sh(String(format: listing, i), cwd: m.source).stdout == expected
                    }
                    // And the mount shows it again.
                    try waitFor("\(c.name) to show through the mount") { access(m.path("case\(i)/nb/A"), F_OK) == 0 }
                }
            }
            try waitFor("nobody's room to be empty") { try OneStepDeleteTests.room(m).isEmpty }
        }
    }

    @Test("vanish rm -r --wait reports what rm -r would have reported, with its exit status")
    func waitReportsLikeRm() throws {
        let fixture = """
            chmod 755 . && install -d -o nobody nb nb/A && install -d -m 1777 nb/A/t && echo x > nb/A/t/f
            install -o nobody /dev/null nb/A/t/g && install -d -m 755 nb/A/ro && echo x > nb/A/ro/h
            install -d -m 700 nb/A/p && echo y > nb/A/p/q && install -d -o nobody nb/A/own && install -o nobody /dev/null nb/A/own/o
            install -d -o nobody nb/B && install -o nobody /dev/null nb/B/b
            """
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        #expect(try sh(fixture, cwd: plain).ok)
        let native = try runAsNobody(["rm", "-r", "nb/A"], cwd: plain)
        #expect(native.status == 1)
        let expected = native.stderr.split(separator: "\n").map { "vanish " + $0 }.sorted()
        let left = try sh("find nb -printf '%p %u %m\\n' | sort", cwd: plain).stdout
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh(fixture, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let vanish = try runAsNobody([binary, "rm", "-r", "--wait", "nb/A"], cwd: m.mountpoint)
            #expect(vanish.status == 1, "\(vanish)")
            #expect(vanish.stderr.split(separator: "\n").map(String.init).sorted() == expected, "\(vanish.stderr)")
            #expect(try sh("find nb -printf '%p %u %m\\n' | sort", cwd: m.source).stdout == left)
            // Nothing left: silent, exit 0.
            let clean = try runAsNobody([binary, "rm", "-r", "--wait", "nb/B"], cwd: m.mountpoint)
            #expect(clean.ok && clean.stderr.isEmpty, "\(clean)")
        }
    }

    @Test("what nobody could not remove, its place taken meanwhile, is kept in nobody's trash until restored, with why, and not measured for them (issue 49)")
    func heldWhenPlaceTaken() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("""
                chmod 755 . && install -d -o nobody nb nb/A nb/A/many && mkdir -m 700 nb/A/r && echo x > nb/A/r/f
                cd nb/A/many && seq 1 30000 | sed 's/^/f/' | xargs touch && chown nobody: . *
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            // The check of 30,000 entries takes longer than a mkdir right after the delete returns.
            let taken = try runAsNobody(["/bin/sh", "-c", "\(binary) rm -r nb/A && mkdir nb/A"], cwd: m.mountpoint)
            try #require(taken.ok, "the name was not free right after the delete: \(taken)")
            try waitFor("nobody's room to be empty") { try OneStepDeleteTests.room(m).isEmpty }
            let list = try runAsNobody([binary, "trash", "list", m.mountpoint])
            #expect(list.stdout.contains("kept: holds what its deleter could not remove, and its name was taken"), "\(list)")
            // What it holds was measured with the daemon's rights: root's 0700 r is not nobody's to count.
            let json = try runAsNobody([binary, "trash", "list", "--json", m.mountpoint])
            #expect(json.ok && json.stdout.contains("\"held\"") && !json.stdout.contains("files_inside")
                    && !json.stdout.contains("\"size\"") && !json.stdout.contains("\"bytes\""), "\(json)")
            #expect(try trashList(m).contains { $0["held"] != nil && ($0["files_inside"] as? Int ?? 0) >= 1 }, "root sees what it holds")
            // Neither the window nor emptying the trash frees it: root's file stays.
            #expect(try runAsNobody([binary, "trash", "empty", m.mountpoint]).ok)
            try waitForReaper(m)
            let back = try runAsNobody([binary, "restore", m.path("nb/A"), "--to", m.path("nb/B")])
            #expect(back.ok, "\(back)")
            #expect(try sh("find nb/B -printf '%p %u\\n' | sort", cwd: m.source).stdout == "nb/B nobody\nnb/B/r root\nnb/B/r/f root\n")
        }
    }

    @Test("a tree exchanged under vanish rm -r is moved only if its deleter may move it (issue 49, attack 3)")
    func exchangeDuringDelete() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("""
                install -d -m 777 shared && install -d -m 755 shared/R && for f in 1 2 3; do echo x > shared/R/$f; done
                chmod 755 .
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            try whileNobodyExchanges("A", "R", in: m.backing("shared"), scratch: m.base) {
                for _ in 0..<50 {
                    _ = try runAsNobody(["/bin/sh", "-c", "mkdir -p A/d && touch A/d/f A/g; true"],
                                        cwd: m.path("shared"))
                    _ = try runAsNobody([vanishBinary, "rm", "-r", "-f", m.path("shared/A")])
                }
            }
            try waitFor("nobody's room to be empty") { try OneStepDeleteTests.room(m).isEmpty }
            let left = try sh("find shared -path '*/1' -o -path '*/2' -o -path '*/3' | wc -l", cwd: m.source)
            #expect(left.stdout == "3\n", "root's files left: \(left.stdout)")
        }
    }

    @Test("vanish rm -r of a tree returns before any walk of it: a 20k-file tree, as nobody, leaves the room checked")
    func constantTime() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("install -d -m 777 pub && install -d -o nobody pub/big && chmod 755 .", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let made = try runAsNobody(["/bin/sh", "-c",
                "cd pub/big && for d in $(seq 20); do mkdir $d && (cd $d && seq 1000 | xargs touch); done"],
                cwd: m.source)
            #expect(made.ok, "\(made.stderr)")
            let r = try runAsNobody([vanishBinary, "rm", "-r", m.path("pub/big")])
            #expect(r.ok, "\(r.stderr)")
            #expect(access(m.path("pub/big"), F_OK) != 0)
            try waitFor("the check to hand the tree to the graveyard") { try OneStepDeleteTests.room(m).isEmpty }
            try waitForReaper(m)
            #expect(access(m.backing("pub/big"), F_OK) != 0)
        }
    }

    @Test("nobody's one-step deletes being sorted do not hold back root's trash list; nobody's own list waits for them (issue 49)")
    func othersSortingDelaysNoOne() throws {
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("""
                chmod 755 . && install -d -o nobody home home/t && cd home/t
                for d in $(seq 50); do mkdir $d && (cd $d && seq 2000 | xargs touch); done
                chown -R nobody: .
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            #expect(try sh("echo mine > mine && rm mine", cwd: m.mountpoint).ok)
            // Sorting 100,000 entries as nobody, at nice 10, outlasts root's list.
            #expect(try runAsNobody([binary, "rm", "-r", m.path("home/t")]).ok)
            let list = try run([vanishBinary, "trash", "list", m.mountpoint])
            let stillSorting = try !OneStepDeleteTests.room(m).isEmpty
            #expect(list.ok && list.stdout.contains("mine"), "\(list)")
            #expect(stillSorting, "root's trash list waited for nobody's tree to be sorted")
            // nobody's own list shows the tree: it waits for their own.
            let own = try runAsNobody([binary, "trash", "list", m.mountpoint])
            #expect(own.ok && own.stdout.contains("home/t"), "\(own)")
        }
    }

    @Test("root's vanish rm -r deletes what it checked, never where a user's symlink swapped in points")
    func symlinkRace() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("""
                mkdir -p victim/data && echo precious > victim/data/f
                install -d -o nobody user && chmod 755 .
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // nobody swaps its directory `build` with a symlink to root's
            // victim, over and over, while root removes user/build.
            let swapper = m.base + "/swap.py"
            try """
                import ctypes, os, sys
                libc = ctypes.CDLL(None, use_errno=True)
                os.chdir(sys.argv[1])
                end = sys.argv[2]
                while not os.path.exists(end):
                    if not os.path.lexists("build"):
                        os.mkdir("build")
                    if not os.path.lexists("link"):
                        os.symlink(sys.argv[3], "link")
                    libc.renameat2(-100, b"build", -100, b"link", 2)  # RENAME_EXCHANGE
                """.write(toFile: swapper, atomically: true, encoding: .utf8)
            let stop = m.base + "/stop"
            let attacker = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                      "/usr/bin/python3", swapper, m.path("user"), stop, m.path("victim")])
            defer {
                _ = FileManager.default.createFile(atPath: stop, contents: nil)
                var status: Int32 = 0
                waitpid(attacker, &status, 0)
            }
            var removed = 0
            for _ in 0..<300 {
                if try run([vanishBinary, "rm", "-r", "-f", m.path("user/build")]).ok { removed += 1 }
                #expect(access(m.backing("victim/data/f"), F_OK) == 0, "root's victim tree was deleted through the symlink")
                if access(m.backing("victim/data/f"), F_OK) != 0 { break }
            }
            #expect(removed > 0, "the race never let root remove nobody's directory")
        }
    }

    @Test("vanish rm -r of nobody's tree with root's filesystem mounted on a path of the mount inside it is refused (EBUSY), and the mount stays")
    func mountOnTheMountPath() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("install -d -o nobody p p/d p/d/sub", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let sub = m.path("p/d/sub")
            #expect(try run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", sub]).ok)
            defer { _ = try? run(["umount", "-l", sub]) }
            #expect(try sh("echo x > \(shellQuote(sub))/rootfile").ok)
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let removed = try runAsNobody([binary, "rm", "-r", "d"], cwd: m.path("p"))
            #expect(removed.status == 1 && removed.stderr.contains("mounted inside"), "\(removed)")
            #expect(mountType(at: sub) == "tmpfs", "root's mount was detached")
            #expect(access(sub + "/rootfile", F_OK) == 0)
        }
    }

    @Test("a file in a tree vanish rm -r removed with another name outside it: that name's link count drops when the reaper frees the file, as after rm -rf")
    func linkCountAfterReaping() throws {
        try withVanishMount { m in
            let made = try sh("echo s > o && mkdir t && ln o t/hl && stat -c %h o", cwd: m.mountpoint)
            #expect(made.stdout == "2\n", "\(made)")
            let rm = try run([vanishBinary, "rm", "-r", "--wait", m.path("t")])
            #expect(rm.ok, "\(rm)")
            try waitForReaper(m)
            try waitFor("o's link count to drop") {
                var st = stat()
                return stat(m.path("o"), &st) == 0 && st.st_nlink == 1
            }
        }
    }

    @Test("the delete trigger on a name with other hard links removes nothing")
    func hardLinkedFile() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("""
                mkdir private pub && chmod 777 private pub
                install -o nobody /dev/null private/secret && ln private/secret pub/link
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // Both names looked up: the daemon's inode knows one of them.
            _ = try sh("stat pub/link private/secret >/dev/null", cwd: m.mountpoint)
            let r = try runAsNobody(deleteTriggerCommand + ["pub/link"], cwd: m.mountpoint)
            #expect(!r.ok)
            #expect(r.stderr.contains("Too many links"), "\(r.stderr)")
            #expect(access(m.backing("private/secret"), F_OK) == 0)
            #expect(access(m.backing("pub/link"), F_OK) == 0)
            // A plain unlink of the name works as ever.
            #expect(try runAsNobody(["rm", "pub/link"], cwd: m.mountpoint).ok)
            #expect(access(m.backing("private/secret"), F_OK) == 0)
        }
    }

    /// The trigger's name is only a command with both XATTR_CREATE and
    /// XATTR_REPLACE, flags no copy passes. Before, any setxattr of it
    /// removed its target: a tarball made by nobody with the attribute on
    /// `.`, extracted by root with `tar --xattrs` into a directory of
    /// root's, removed that directory; `cp -a` of such a tree, the copy.
    @Test("a user.vanish.delete attribute in nobody's tarball or tree, extracted or copied by root, is stored as natively and removes nothing")
    func copiedTriggerAttributeIsData() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            _ = try sh("mkdir -p dest/sub copy && echo precious > dest/precious && echo precious > dest/sub/precious", cwd: src)
        }) { m in
            // Nobody's tree and tarball, made in a plain directory of theirs.
            let evil = m.base + "/evil"
            mkdir(evil, 0o755)
            #expect(chown(evil, 65534, 65534) == 0)
            let made = try runAsNobody(["/bin/sh", "-c", """
                set -e
                mkdir -p tree/sub && echo new > tree/sub/new
                setfattr -n user.vanish.delete -v 1 tree && setfattr -n user.vanish.delete -v 1 tree/sub
                setfattr -n user.vanish.delete -v 1 tree/sub/new
                tar --xattrs -C tree -cf evil.tar .
                """], cwd: evil)
            try #require(made.ok, "\(made.stderr)")
            let plain = m.base + "/plain"
            let copy = """
                set -e
                mkdir -p dest/sub copy && echo precious > dest/precious && echo precious > dest/sub/precious
                tar --xattrs -xf \(shellQuote(evil))/evil.tar -C dest
                cp -a \(shellQuote(evil))/tree/. copy/
                find dest copy | sort
                getfattr -R -d -m user.vanish --absolute-names dest copy | sort
                """
            mkdir(plain, 0o755)
            let native = try sh(copy, cwd: plain)
            try #require(native.ok && native.stdout.contains("user.vanish.delete"), "\(native)")
            _ = try sh("rm -rf dest copy", cwd: m.mountpoint)
            let mounted = try sh(copy, cwd: m.mountpoint)
            #expect(mounted.stdout == native.stdout, "\(mounted.stderr)")
            #expect(access(m.backing("dest/precious"), F_OK) == 0 && access(m.backing("dest/sub/precious"), F_OK) == 0)
        }
    }

    /// rm on a terminal asks before removing what the caller may not write;
    /// `vanish rm -r` moved such a tree in one step without asking.
    @Test("vanish rm -r on a terminal asks before a write-protected entry as rm does, and takes the answer")
    func asksBeforeWriteProtected() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            _ = try sh("chmod 777 .", cwd: src)
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let plain = try Self.openDirectory(m, "plain")
            let script = """
                mkdir -p wp/s ok/s && echo keep > wp/s/prot && chmod 444 wp/s/prot && echo x > ok/s/f
                for answer in n y; do
                  echo $answer | script -qec '\(binary) rm -r wp' /dev/null; echo " rc=$?"; ls -R wp 2>&1
                done
                echo | script -qec '\(binary) rm -r ok' /dev/null; echo " rc=$?"; ls ok 2>&1
                mkdir -p wp/s && echo keep > wp/s/prot && chmod 444 wp/s/prot
                script -qec '\(binary) rm -rf wp' /dev/null </dev/null; echo " rc=$?"; ls wp 2>&1
                """
            let native = try runAsNobody(["/bin/sh", "-c", script], cwd: plain)
            try #require(native.stdout.contains("remove write-protected regular file"), "\(native)")
            let mounted = try runAsNobody(["/bin/sh", "-c", script], cwd: m.mountpoint)
            #expect(mounted.stdout == native.stdout, "\(mounted.stderr)")
        }
    }

    /// `vanish rm -r` arms a directory with an ioctl and removes it with
    /// rmdir. Arms were kept by thread id alone: nobody armed root's
    /// directory from short-lived children, kept the handle open, and when
    /// root's next process got one of those ids its plain rmdir (ENOTEMPTY
    /// natively) removed the whole tree.
    @Test("an arm for vanish rm -r is its own thread's: root's rmdir from a reused thread id stays a plain rmdir")
    func armsAreTheirThreads() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            _ = try sh("mkdir -p rootdata/sub && echo precious > rootdata/sub/f && chmod 755 rootdata", cwd: src)
        }) { m in
            let shared = try Self.openDirectory(m, "nb")
            let pids = shared + "/armed", done = shared + "/done"
            // nobody arms root's directory from three children, then holds the handle.
            let holder = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                    "/usr/bin/python3", "-c", """
                import fcntl, os, sys, time
                fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
                armed = []
                for i in range(3):
                    pid = os.fork()
                    if pid == 0:
                        fcntl.ioctl(fd, 0x76d1)
                        os._exit(0)
                    os.waitpid(pid, 0)
                    armed.append(str(pid))
                open(sys.argv[2] + ".new", "w").write(" ".join(armed))
                os.rename(sys.argv[2] + ".new", sys.argv[2])
                while not os.path.exists(sys.argv[3]): time.sleep(0.01)
                """, m.path("rootdata"), pids, done])
            defer {
                _ = FileManager.default.createFile(atPath: done, contents: nil)
                var st: Int32 = 0
                waitpid(holder, &st, 0)
            }
            try waitFor("nobody's arms") { access(pids, F_OK) == 0 }
            // Root's rmdir from each of those ids in turn (the kernel hands out the id after ns_last_pid).
            let r = try run(["/usr/bin/python3", "-c", """
                import os, sys
                target, reused = sys.argv[1], 0
                for pid in map(int, open(sys.argv[2]).read().split()):
                    for attempt in range(50):
                        open("/proc/sys/kernel/ns_last_pid", "w").write(str(pid - 1))
                        child = os.fork()
                        if child == 0:
                            if os.getpid() != pid: os._exit(3)
                            try: os.rmdir(target)
                            except OSError as e: os._exit(1 if e.errno == 39 else 2)
                            os._exit(0)
                        _, status = os.waitpid(child, 0)
                        code = os.waitstatus_to_exitcode(status)
                        if code == 3: continue
                        reused += 1
                        print(pid, "ENOTEMPTY" if code == 1 else "removed" if code == 0 else "other")
                        break
                print("reused", reused)
                """, m.path("rootdata"), pids])
            #expect(r.ok, "\(r.stderr)")
            #expect(!r.stdout.contains("removed") && !r.stdout.contains("other") && !r.stdout.contains("reused 0"), "\(r.stdout)")
            #expect(access(m.backing("rootdata/sub/f"), F_OK) == 0)
        }
    }

    /// A directory beside `m`'s mount that nobody may write too (mode 0777, whatever the umask).
    static func openDirectory(_ m: VanishMount, _ name: String) throws -> String {
        let path = m.base + "/" + name
        guard mkdir(path, 0o777) == 0, chmod(path, 0o777) == 0 else { throw TestFailure("cannot make \(path): \(errno)") }
        return path
    }

    /// The daemon's open descriptors.
    static func descriptors(_ m: VanishMount) throws -> Int {
        try FileManager.default.contentsOfDirectory(atPath: "/proc/\(m.pid)/fd").count
    }

    /// `useradd` gives each account 65,536 subordinate uids, which `newuidmap`
    /// lets it act as: each one a user with a room of its own. A descriptor
    /// kept for every room took all of the daemon's, root's requests and
    /// control connections included, and the next mount opened them all again.
    @Test("one account acting as 400 uids, each removing a directory in one step, leaves the daemon no descriptor per uid, before or after a remount")
    func roomsPerUidAreBounded() throws {
        let uids = 300_000..<300_400
        let script = """
            import os, sys
            for u in range(\(uids.lowerBound), \(uids.upperBound)):
                pid = os.fork()
                if pid == 0:
                    try:
                        os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
                        os.mkdir(f"pub/d{u}")
                        try: os.setxattr(f"pub/d{u}", "user.vanish.delete", b"1", os.XATTR_CREATE | os.XATTR_REPLACE)
                        except OSError: pass
                        os._exit(0)
                    except BaseException as e:
                        print(u, e, file=sys.stderr); os._exit(1)
                _, status = os.waitpid(pid, 0)
                if status != 0: sys.exit(f"uid {u} failed")
            """
        try withVanishMount(options: ["allow_other"], prepare: { src in
            guard try sh("install -d -m 1777 pub", cwd: src).ok else { throw TestFailure("prepare") }
        }) { m in
            let before = try Self.descriptors(m)
            let r = try run(["/usr/bin/python3", "-c", script], cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try waitFor("every directory to go", timeout: 60) { try sh("ls -A pub", cwd: m.source).stdout.isEmpty }
            let after = try Self.descriptors(m)
            #expect(after - before < 100, "\(before) descriptors before, \(after) after")
            #expect(try m.unmount() == 0)
            // The next mount of the source opens no room it does not use, and removes the empty ones.
            let again = try VanishMount(options: ["allow_other"], existingSource: m.source)
            defer { again.close() }
            try waitFor("the empty rooms to be removed") {
                try sh("ls .vanish/clients/*/users | wc -l", cwd: m.source).stdout == "0\n"
            }
            #expect(try Self.descriptors(again) < before + 50, "a fresh mount over 400 rooms")
        }
    }

    /// Mounts with `options` over what `setup` (a shell script) makes in the
    /// source, has nobody `vanish rm -r` `path` and kills the daemon the
    /// moment that is answered, its check hardly begun; then runs `body` on
    /// a fresh mount of the same source once nobody's room is empty.
    static func afterKilledOneStepDelete(options: [String], setup: String, path: String,
                                         _ body: (VanishMount) throws -> Void) throws {
        try withVanishMount(options: options, prepare: { src in
            let r = try sh(setup, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let r = try sh("setpriv --reuid=nobody --regid=nogroup --clear-groups -- \(shellQuote(vanishBinary)) rm -r "
                           + "\(shellQuote(path)); kill -9 \(m.pid)", cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            _ = try m.waitForExit()
            _ = try run(["fusermount3", "-u", m.mountpoint])
            let again = try VanishMount(options: options, existingSource: m.source)
            defer { again.close() }
            try waitFor("nobody's room to be empty", timeout: 60) { try OneStepDeleteTests.room(again).isEmpty }
            try body(again)
        }
    }

    /// Where a tree came from was known only to the daemon that moved it:
    /// one killed before the check left it in the room for good, root's
    /// directory inside gone from its place and restorable by no one.
    @Test("a daemon killed between nobody's one-step delete and its check: the next start puts root's directory inside back", arguments: ["keep=1h", "keep=0"])
    func leftoverGoesBack(keep: String) throws {
        try Self.afterKilledOneStepDelete(options: ["allow_other", keep], setup: """
            chmod 755 . && install -d -o nobody pub pub/big && install -d pub/big/rootsub && echo keep > pub/big/rootsub/keep
            for d in $(seq 1 20); do mkdir pub/big/d$d && (cd pub/big/d$d && seq 1 1000 | xargs touch); done
            chown -R nobody pub/big/d*
            """, path: "pub/big") { m throws in
            #expect(try sh("cat pub/big/rootsub/keep", cwd: m.mountpoint).stdout == "keep\n",
                    "root's directory is back where it was")
        }
    }

    @Test("a daemon killed between nobody's one-step delete of their own tree and its check: the next start keeps it restorable in the window")
    func leftoverStaysRestorable() throws {
        try Self.afterKilledOneStepDelete(options: ["allow_other", "keep=1h"], setup: """
            chmod 755 . && install -d -o nobody pub pub/own
            for d in $(seq 1 20); do mkdir pub/own/d$d && (cd pub/own/d$d && seq 1 1000 | xargs touch); done
            chown -R nobody pub/own
            """, path: "pub/own") { m throws in
            let listed = try runAsNobody([vanishBinary, "trash", "list", m.mountpoint])
            #expect(listed.stdout.contains("pub/own"), "\(listed.stdout) \(listed.stderr)")
            #expect(try runAsNobody([vanishBinary, "restore", m.path("pub/own")]).ok)
            #expect(try sh("ls pub/own | wc -l", cwd: m.mountpoint).stdout == "20\n")
        }
    }
}
