import Foundation
import Glibc
import Testing
@testable import VanishFS
import VanishGraveyard
import VanishTestSupport

/// The desktop trash folders: the undo window as trash-cli, gio and file
/// managers see it (freedesktop.org Trash specification), on real mounts.
@Suite(.serialized)
struct TrashFoldersTests {
    /// trash-cli and gio write into $HOME's trash for files on its volume: a home elsewhere.
    static func environment(_ home: String) -> [String: String] {
        ["HOME": home, "PATH": "/usr/bin:/bin", "XDG_DATA_HOME": home + "/.local/share", "LC_ALL": "C.UTF-8"]
    }

    /// Runs `args` (as root) where no other Vanish mount is: trash-list and
    /// trash-empty act on every mount they see, other tests' included. A
    /// lazy unmount in a mount namespace of its own leaves those mounts be.
    static func confined(_ m: VanishMount, _ args: [String], environment: [String: String]) throws -> ProcessResult {
        let script = #"""
            awk -v keep="$1" '$3 == "fuse.vanish" && $2 != keep { print $2 }' /proc/mounts |
                while read -r p; do umount -l "$p"; done
            shift; exec "$@"
            """#
        return try run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh", m.mountpoint] + args,
                       cwd: m.mountpoint, environment: environment)
    }

    static func requireClients() throws {
        try #require(which("trash-put") != nil && which("trash-list") != nil, "trash-cli (mount-scripts/install --deps-only installs it)")
        try #require(which("gio") != nil, "gio (libglib2.0-bin; mount-scripts/install --deps-only installs it)")
    }

    @Test("rm and rm -rf land in the desktop trash: trash-cli lists, restores and empties them; the root's listing never shows the folder")
    func trashCLI() throws {
        try Self.requireClients()
        try withVanishMount(arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("mkdir -p proj/sub && echo hello > proj/a.txt && echo deep > proj/sub/b && echo top > top.txt", cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            let env = Self.environment(m.base)
            #expect(try sh("rm top.txt && rm -rf proj", cwd: m.mountpoint).ok)
            let rootListing = try sh("ls -a", cwd: m.mountpoint).stdout
            #expect(!rootListing.contains(".Trash"), "\(rootListing)")
            var st = stat()
            #expect(lstat(m.path(".Trash-0"), &st) == 0 && st.st_mode & S_IFMT == S_IFDIR && st.st_mode & 0o777 == 0o700)

            let list = try Self.confined(m, ["trash-list"], environment: env)
            #expect(list.ok, "\(list.stderr)")
            // rm -rf emptied and removed each directory: each is one entry with its files, as a file manager trashes a folder.
            for path in ["top.txt", "proj", "proj/sub"] {
                #expect(list.stdout.contains(" \(m.mountpoint)/\(path)\n"), "\(path) in \(list.stdout)")
            }
            #expect(!list.stdout.contains("a.txt") && !list.stdout.contains("sub/b"), "\(list.stdout)")
            #expect(try String(contentsOfFile: m.path(".Trash-0/files/proj/a.txt"), encoding: .utf8) == "hello\n")
            let info = try String(contentsOfFile: m.path(".Trash-0/info/top.txt.trashinfo"), encoding: .utf8)
            #expect(info.hasPrefix("[Trash Info]\nPath=top.txt\nDeletionDate=20"), "\(info)")
            #expect(try String(contentsOfFile: m.path(".Trash-0/files/top.txt"), encoding: .utf8) == "top\n")

            // trash-restore asks which: the line that names top.txt.
            let menu = try run(["trash-restore"], cwd: m.mountpoint, environment: env, input: "\n")
            let line = try #require(menu.stdout.split(separator: "\n").first { $0.hasSuffix("/top.txt") })
            let index = String(line.split(separator: " ").first ?? "")
            let restored = try run(["trash-restore"], cwd: m.mountpoint, environment: env, input: index + "\n")
            #expect(restored.ok, "\(restored.stderr)")
            #expect(try String(contentsOfFile: m.path("top.txt"), encoding: .utf8) == "top\n")
            #expect(access(m.path(".Trash-0/info/top.txt.trashinfo"), F_OK) != 0)
            #expect(!(try trashPaths(m)).contains("top.txt"))

            // trash-empty removes the directories' contents one by one, then each entry: all gone.
            let empty = try Self.confined(m, ["trash-empty"], environment: env)
            #expect(empty.ok && empty.stderr.isEmpty, "\(empty.stderr)")
            #expect(try trashPaths(m).isEmpty)
            #expect(try Self.confined(m, ["trash-list"], environment: env).stdout.isEmpty)
            try waitForReaper(m)
            #expect(try graveyardCount(m.source) == 0)
        }
    }

    @Test("moving out of files/ is rename(2): it replaces a file, an empty directory by a directory, and refuses what rename refuses (issue 51)")
    func restoreByRenameReplaces() throws {
        // The same renames on a plain directory give the errors to expect.
        let script = """
            import ctypes, errno, os, sys
            libc = ctypes.CDLL(None, use_errno=True)
            def rename(a, b, noreplace=False):
                if libc.renameat2(-100, a.encode(), -100, b.encode(), 1 if noreplace else 0) == 0:
                    return "ok"
                return errno.errorcode[ctypes.get_errno()]
            t = sys.argv[1]
            print(rename(t + "/file", "file"), open("file").read().strip())
            print(rename(t + "/kept", "kept", noreplace=True))
            print(rename(t + "/dir", "empty"), sorted(os.listdir("empty")))
            print(rename(t + "/dir2", "full"))
            print(rename(t + "/dir3", "plain"))
            print(rename(t + "/kept", "adir"))
            """
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        #expect(try sh("""
            mkdir -p t/dir t/dir2 t/dir3 empty full adir && echo new > t/file && echo k > t/kept \
              && echo old > file && echo o > kept && echo f > full/f && echo p > plain
            """, cwd: plain).ok)
        let native = try run(["/usr/bin/python3", "-c", script, "t"], cwd: plain)
        #expect(native.stdout == "ok new\nEEXIST\nok []\nENOTEMPTY\nENOTDIR\nEISDIR\n", "\(native)")
        try withVanishMount(arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("""
                mkdir -p t/dir t/dir2 t/dir3 empty full adir && echo new > t/file && echo k > t/kept \\
                  && echo old > file && echo o > kept && echo f > full/f && echo p > plain
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            #expect(try sh("rm -r t/file t/kept t/dir t/dir2 t/dir3", cwd: m.mountpoint).ok)
            let names = try sh("ls .Trash-0/files", cwd: m.mountpoint).stdout
            #expect(names == "dir\ndir2\ndir3\nfile\nkept\n", "\(names)")
            let viaMount = try run(["/usr/bin/python3", "-c", script, ".Trash-0/files"], cwd: m.mountpoint)
            #expect(viaMount.stdout == native.stdout, "\(viaMount)")
            // What was replaced is a deletion of its own, restorable.
            let kept = try trashPaths(m)
            #expect(kept.contains("file") && kept.contains("empty"), "\(kept)")
            #expect(try sh("cat kept && ls full", cwd: m.mountpoint).stdout == "o\nf\n")
        }
    }

    @Test("trash-put and gio trash move into the undo window, not a copy; vanish restore brings the same file back")
    func put() throws {
        try Self.requireClients()
        try withVanishMount(arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("mkdir -p d/e && echo f > d/e/f && echo one > one.txt && echo two > two.txt && echo 1 > 1 && echo 2 > 2", cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            let env = Self.environment(m.base)
            var before = stat()
            stat(m.path("one.txt"), &before)
            let put = try run(["trash-put", "one.txt", "d"], cwd: m.mountpoint, environment: env)
            #expect(put.ok, "\(put.stderr)")
            let gio = try run(["gio", "trash", "two.txt"], cwd: m.mountpoint, environment: env)
            #expect(gio.ok, "\(gio.stderr)")
            #expect(access(m.path("one.txt"), F_OK) != 0 && access(m.path("d"), F_OK) != 0 && access(m.path("two.txt"), F_OK) != 0)
            // The very file, in the graveyard: same inode, no copy.
            var after = stat()
            #expect(stat(m.path(".Trash-0/files/one.txt"), &after) == 0)
            #expect(after.st_ino == before.st_ino)
            #expect(try String(contentsOfFile: m.path(".Trash-0/files/d/e/f"), encoding: .utf8) == "f\n")
            #expect(try trashPaths(m) == ["d", "one.txt", "two.txt"])
            let info = try String(contentsOfFile: m.path(".Trash-0/info/two.txt.trashinfo"), encoding: .utf8)
            #expect(info.contains("Path=two.txt\n"), "\(info)")
            // A second entry of the same name gets its own name, which stays as others go.
            #expect(try sh("echo again > one.txt", cwd: m.mountpoint).ok)
            #expect(try run(["trash-put", "one.txt"], cwd: m.mountpoint, environment: env).ok)
            let names = try FileManager.default.contentsOfDirectory(atPath: m.path(".Trash-0/files")).sorted()
            #expect(names.count == 4, "\(names)")
            let second = try #require(names.first { $0.hasPrefix("one.txt") && $0 != "one.txt" })
            #expect(unlink(m.path(".Trash-0/files/one.txt")) == 0)
            #expect(try String(contentsOfFile: m.path(".Trash-0/files/" + second), encoding: .utf8) == "again\n")

            // Deleting inside a directory entry removes for good; trash list counts what is left.
            let d = try #require(try trashList(m).first { $0["path"] as? String == "d" })
            #expect(d["files_inside"] as? Int == 1 && d["directories_inside"] as? Int == 1, "\(d)")
            #expect(try sh("echo g > g && mv g .Trash-0/files/d/e/ 2>/dev/null; rm .Trash-0/files/d/e/f", cwd: m.mountpoint).ok)
            let emptied = try #require(try trashList(m).first { $0["path"] as? String == "d" })
            #expect(emptied["files_inside"] as? Int == 0 && emptied["directories_inside"] as? Int == 1, "only e is left: \(emptied)")

            // The command line sees the same entries.
            #expect(try run([vanishBinary, "restore", m.path("d")]).ok)
            #expect(access(m.path("d/e"), F_OK) == 0 && access(m.path("d/e/f"), F_OK) != 0 && access(m.path("d/e/g"), F_OK) != 0)
            #expect(access(m.path(".Trash-0/files/d"), F_OK) != 0)
            // Nothing made inside an entry; nothing but entries moved in.
            #expect(mkdir(m.path(".Trash-0/files/x"), 0o755) != 0)
            #expect(creat(m.path(".Trash-0/files/new"), 0o644) < 0)
            #expect(rename(m.path("1"), m.path(".Trash-0/info/1")) != 0 && errno == EPERM)
            // An info file written for a move that never came is just a file in info/, removable.
            // truncate(2) and ftruncate(2) of it work as on any file (the kernel's SETATTR also carries times).
            #expect(try sh("printf '[Trash Info]\\nPath=x\\n' > .Trash-0/info/never.trashinfo", cwd: m.mountpoint).ok)
            #expect(truncate(m.path(".Trash-0/info/never.trashinfo"), 5) == 0, "\(errno)")
            let cut = open(m.path(".Trash-0/info/never.trashinfo"), O_WRONLY)
            #expect(cut >= 0 && ftruncate(cut, 2) == 0, "\(errno)")
            close(cut)
            #expect(try String(contentsOfFile: m.path(".Trash-0/info/never.trashinfo"), encoding: .utf8) == "[T")
            #expect(try sh("rm .Trash-0/info/never.trashinfo", cwd: m.mountpoint).ok)
        }
    }

    @Test("vanish rm -r and the trigger inside a trash entry remove for good, as rm does there: no entry named by the graveyard")
    func oneStepInsideAnEntry() throws {
        try Self.requireClients()
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("install -d -o nobody nd nd/k/sub nd/k/sub2 && touch nd/k/sub/f nd/k/sub2/g && chown -R nobody nd", cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            let r = try runAsNobody(["/bin/sh", "-c", """
                \(shellQuote(vanishBinary)) rm -r nd/k && \(shellQuote(vanishBinary)) rm -r .Trash-65534/files/k/sub || exit 1
                \(deleteTriggerCommand.map(shellQuote).joined(separator: " ")) .Trash-65534/files/k/sub2; echo "trigger: $?"
                ls .Trash-65534/files/k
                """], cwd: m.mountpoint)
            #expect(r.stdout.contains("File exists") || r.stderr.contains("File exists"), "\(r)")
            #expect(r.stdout.hasSuffix("sub2\n"), "\(r)")
            let list = try runAsNobody([vanishBinary, "trash", "list", "--json", m.mountpoint])
            #expect(list.ok && list.stdout.contains("\"nd/k\"") && !list.stdout.contains("sub"), "\(list)")
        }
    }

    @Test("gio's trash backend (gvfs) lists, restores and deletes from the folder")
    func gvfs() throws {
        try Self.requireClients()
        try #require(which("dbus-run-session") != nil && access("/usr/libexec/gvfsd-trash", X_OK) == 0,
                     "gvfs-daemons and dbus-run-session (mount-scripts/install --deps-only installs them)")
        try withVanishMount(arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("echo a > a.txt && mkdir -p b/c && echo c > b/c/d", cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            #expect(try sh("rm a.txt && rm -rf b", cwd: m.mountpoint).ok)
            let script = """
                set -e
                gio trash --list | sort > list
                uri=$(grep -F '\(m.mountpoint)/a.txt' list | cut -f1)
                gio trash --restore "$uri"
                uri=$(grep -F '\(m.mountpoint)/b' list | grep -vF '/b/' | cut -f1)
                gio remove "$uri"
                """
            let r = try run(["dbus-run-session", "--", "/bin/sh", "-c", script], cwd: m.base, environment: Self.environment(m.base))
            #expect(r.ok, "\(r.stdout) \(r.stderr)")
            let listed = (try? String(contentsOfFile: m.base + "/list", encoding: .utf8)) ?? ""
            #expect(listed.contains("\t\(m.mountpoint)/a.txt\n"), "\(listed)")
            #expect(try String(contentsOfFile: m.path("a.txt"), encoding: .utf8) == "a\n")
            #expect(!(try trashPaths(m)).contains("b"))
        }
    }

    @Test("watchers of a listed folder see what rm and vanish rm -r put into it created, as inotifywait and gio monitor show (issue 51)")
    func watchersSeeNewEntries() throws {
        try Self.requireClients()
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("""
                chmod 755 . && install -d -o nobody own && echo z > z && echo a > a && mkdir -p t/u && ln -s a l
                for f in first second; do echo $f > own/$f; done && chown nobody own/*
                """, cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            // A folder exists once something is in it; a watcher lists it first.
            #expect(try sh("rm z && ls .Trash-0/files >/dev/null", cwd: m.mountpoint).ok)
            #expect(try runAsNobody(["/bin/sh", "-c", "rm own/first && ls .Trash-65534/files >/dev/null"], cwd: m.mountpoint).ok)
            let events = m.base + "/events", errors = m.base + "/watch.err", gioOut = m.base + "/gio"
            for file in [events, errors] {
                _ = FileManager.default.createFile(atPath: file, contents: nil)
                chmod(file, 0o666)
            }
            chmod(m.base, 0o755)
            let watcher = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                     "/bin/sh", "-c", "exec inotifywait -m --format '%e %w%f' \(shellQuote(m.path(".Trash-65534/files"))) >>\(events) 2>>\(errors)"])
            let monitor = try spawn(["/bin/sh", "-c", "exec gio monitor \(shellQuote(m.path(".Trash-0/files"))) >\(gioOut) 2>&1"])
            defer {
                for pid in [watcher, monitor] {
                    kill(pid, SIGTERM)
                    var st: Int32 = 0
                    waitpid(pid, &st, 0)
                }
            }
            try waitFor("the watches to be set") { (try? String(contentsOfFile: errors, encoding: .utf8))?.contains("Watches established") == true }
            let read = { (path: String) in (try? String(contentsOfFile: path, encoding: .utf8)) ?? "" }
            #expect(try sh("rm a l && \(shellQuote(vanishBinary)) rm -r t", cwd: m.mountpoint).ok)
            #expect(try runAsNobody(["rm", m.path("own/second")]).ok)
            try waitFor("nobody's watcher to see their deletion created in their folder") {
                read(events).contains("CREATE \(m.path(".Trash-65534/files"))/second\n")
            }
            try waitFor("gio monitor to see root's three") {
                let out = read(gioOut)
                return ["a", "l", "t"].allSatisfy { out.contains(m.path(".Trash-0/files/\($0)") + ": created") }
            }
            #expect(!read(events).contains("/a\n"), "root's entries are not announced in nobody's folder")
            // Announcing makes nothing: the folders and the source are as they were.
            #expect(try sh("ls .Trash-0/files", cwd: m.mountpoint).stdout == "a\nl\nt\nz\n")
            #expect(try sh("ls .Trash-0/info", cwd: m.mountpoint).stdout == "a.trashinfo\nl.trashinfo\nt.trashinfo\nz.trashinfo\n")
            #expect(try sh("ls -A", cwd: m.source).stdout == ".vanish\nown\n")
            #expect(try trashPaths(m).count == 6)
            #expect(try run([vanishBinary, "restore", m.path("t")]).ok)
            #expect(access(m.path("t/u"), F_OK) == 0)
        }
    }

    @Test("nobody who may write a directory on the mountpoint's path cannot lead the announcements to a folder of theirs: root's names are neither made nor seen there")
    func announcementsStayOnTheMount() throws {
        let base = try makeTempDirectory()
        chmod(base, 0o755)
        var mountpoint = base + "/ua/x/mnt"
        defer {
            _ = try? run(["umount", "-l", mountpoint])
            removeTree(base)
        }
        #expect(try sh("""
            mkdir -p src ua/x/mnt && echo s > src/secret-name && echo o > src/other && chown nobody ua
            """, cwd: base).ok)
        let mounted = try run([vanishBinary, "mount", "--keep", "1h", "-o", "allow_other", "--log-file", base + "/log",
                               base + "/src", mountpoint])
        try #require(mounted.ok, "\(mounted)")
        // Root lists its folder: its new entries are announced from now on.
        #expect(try sh("rm other && ls .Trash-0/files", cwd: mountpoint).stdout == "other\n")
        // nobody puts a directory of theirs where the mountpoint's path leads.
        let swap = try runAsNobody(["/bin/sh", "-c", """
            mv ua/x ua/x-real && mkdir -p ua/x/mnt/.Trash-0/files ua/x/mnt/.Trash-0/info && chmod -R 777 ua/x
            """], cwd: base)
        try #require(swap.ok, "\(swap)")
        mountpoint = base + "/ua/x-real/mnt"
        #expect(try sh("rm secret-name", cwd: mountpoint).ok)
        try waitFor("the daemon to refuse the path, or to be misled") {
            (try? String(contentsOfFile: base + "/log", encoding: .utf8))?.contains("leads elsewhere") == true
                || access(base + "/ua/x/mnt/.Trash-0/files/secret-name", F_OK) == 0
        }
        #expect(try sh("find ua/x -mindepth 4", cwd: base).stdout == "", "nothing made in nobody's folder")
        #expect(try sh("ls .Trash-0/files", cwd: mountpoint).stdout == "other\nsecret-name\n")
        #expect(try run([vanishBinary, "unmount", mountpoint]).ok)
    }

    @Test("another user's folder is closed: they cannot list, make, move into or restore from it")
    func otherUsers() throws {
        try Self.requireClients()
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let made = try sh("mkdir -m 1777 shared && echo secret > rootfile && echo mine > shared/theirs && chown nobody shared/theirs", cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            #expect(try sh("rm rootfile", cwd: m.mountpoint).ok)
            let env = Self.environment(m.base + "/nobody-home")
            // nobody deletes and restores their own, through their own folder.
            let own = try runAsNobody(["/bin/sh", "-c", """
                set -e
                echo x > note && rm note && rm theirs
                trash-list
                ls -ld ../.Trash-65534 | cut -c1-10
                """], cwd: m.path("shared"), environment: env)
            #expect(own.ok, "\(own.stderr)")
            #expect(own.stdout.contains("/shared/note\n") && own.stdout.contains("/shared/theirs\n"), "\(own.stdout)")
            #expect(!own.stdout.contains("rootfile"), "\(own.stdout)")
            #expect(own.stdout.contains("drwx------"), "\(own.stdout)")
            // Root's folder: no listing, no reading, no mkdir of it, no move into it, no restore from it.
            let attack = try runAsNobody(["/bin/sh", "-c", """
                ls ../.Trash-0/files >/dev/null 2>&1 && echo listed
                cat ../.Trash-0/files/rootfile 2>/dev/null && echo read
                cat ../.Trash-0/info/rootfile.trashinfo 2>/dev/null && echo info
                mv ../.Trash-0/files/rootfile stolen 2>/dev/null && echo restored
                echo y > bait; mv bait ../.Trash-0/files/bait 2>/dev/null && echo planted
                mkdir ../.Trash-4242 2>/dev/null && echo made
                echo done
                """], cwd: m.path("shared"), environment: env)
            #expect(attack.stdout == "done\n", "\(attack.stdout)")
            #expect(try trashPaths(m).contains("rootfile"))
            #expect(access(m.path("shared/stolen"), F_OK) != 0)
            // nobody's own restore is theirs: back in the sticky directory, owned by them.
            let back = try runAsNobody(["/bin/sh", "-c", "mv ../.Trash-65534/files/theirs theirs && cat theirs"],
                                       cwd: m.path("shared"), environment: env)
            #expect(back.ok && back.stdout == "mine\n", "\(back.stderr)")
            // An info file nobody writes ahead truncates as any file of theirs would (the kernel asks a
            // caller without CAP_FSETID's truncate to clear setuid bits too).
            let cut = try runAsNobody(["/bin/sh", "-c", """
                printf '[Trash Info]\\nPath=x\\n' > ../.Trash-65534/info/ahead.trashinfo
                truncate -s 5 ../.Trash-65534/info/ahead.trashinfo && cat ../.Trash-65534/info/ahead.trashinfo
                """], cwd: m.path("shared"), environment: env)
            #expect(cut.ok && cut.stdout == "[Tras", "\(cut.stdout) \(cut.stderr)")
            var st = stat()
            #expect(lstat(m.path("shared/theirs"), &st) == 0 && st.st_uid == 65534)
        }
    }

    @Test("folder names, info files and entry names, in process")
    func naming() throws {
        #expect(".Trash-1000".withCString { TrashFolders.uid(ofFolder: $0) } == 1000)
        #expect(".Trash-0".withCString { TrashFolders.uid(ofFolder: $0) } == 0)
        for bad in [".Trash-", ".Trash-01", ".Trash-1x", ".Trash-4294967296", ".Trash", ".trash-1"] {
            #expect(bad.withCString { TrashFolders.uid(ofFolder: $0) } == nil, "\(bad)")
        }
        #expect(String(decoding: TrashFolders.escaped(Array("a b/ü%\n.txt".utf8)), as: UTF8.self) == "a%20b/%C3%BC%25%0A.txt")
        let info = String(decoding: TrashFolders.trashInfo(path: Array("dir/x y".utf8), deleted: 0), as: UTF8.self)
        #expect(info.hasPrefix("[Trash Info]\nPath=dir/x%20y\nDeletionDate=19"), "\(info)")
        #expect(info.hasSuffix("\n") && info.split(separator: "\n").count == 3)

        func entry(_ id: String, _ path: String) -> TrashEntry {
            TrashEntry(id: id, shard: 0, deleted: 0,
                       record: TrashRecord(path: Array(path.utf8), uid: 1, gid: 1, bytes: nil, kind: .file))
        }
        var chosen: [String: [UInt8]] = [:]
        let first = TrashFolders.name([entry("1", "a/x"), entry("2", "b/x"), entry("3", "y")], chosen: &chosen)
        #expect(first.names.map { String(decoding: $0, as: UTF8.self) } == ["x", "x.2", "y"])
        // The oldest goes: the others keep their names.
        let later = TrashFolders.name([entry("2", "b/x"), entry("3", "y"), entry("4", "c/x")], chosen: &chosen)
        #expect(later.names.map { String(decoding: $0, as: UTF8.self) } == ["x.2", "y", "x"])
    }
}

/// Attacks on the desktop trash and on the restore it makes cheap to repeat.
@Suite(.serialized)
struct TrashFolderAttackTests {
    static func requireClientsForAttack() throws { try TrashFoldersTests.requireClients() }

    /// Each open of a trash folder took a copy of its user's whole listing:
    /// a user with 90,000 entries drove the daemon to 5.8 GB with 5,000
    /// handles of their own folder.
    @Test("nobody holds at most 16 handles of their trash folders open, and gets them back on close")
    func trashHandlesPerAccount() throws {
        try withVanishMount(options: ["allow_other", "keep_min_age=0"], arguments: ["--keep", "1h"], prepare: { src in
            _ = try sh("mkdir -m 1777 shared", cwd: src)
        }) { m in
            let r = try runAsNobody(["/usr/bin/python3", "-c", """
                import os, sys
                for i in range(50): open(f"f{i}", "w").close()
                for i in range(50): os.unlink(f"f{i}")
                held, refused = [], 0
                for i in range(100):
                    try: held.append(os.open("../.Trash-65534/files", os.O_RDONLY | os.O_DIRECTORY))
                    except OSError as e:
                        if e.errno != 24: raise
                        refused += 1
                print(len(held), refused)
                for fd in held: os.close(fd)
                print(len(os.listdir("../.Trash-65534/files")))
                """], cwd: m.path("shared"))
            #expect(r.stdout == "16 84\n50\n", "\(r.stderr)")
        }
    }

    /// Info files a client writes before its file comes live in the
    /// daemon's memory, up to 1,024 of 16 KiB a uid: each of an account's
    /// 65,536 subordinate uids took its own 16 MiB.
    @Test("the info files nobody's account writes ahead into its trash folders are capped for the account, all its uids together")
    func looseInfoPerAccount() throws {
        try withSubordinateRange(owner: 65534, first: 410_000, count: 65536) {
            try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
                _ = try sh("chmod 1777 .", cwd: src)
            }) { m in
                let r = try run(["/usr/bin/python3", "-c", """
                    import os, sys
                    mount = sys.argv[1]
                    total = 0
                    for u in [65534, 410000, 410001, 410002]:
                        r, w = os.pipe()
                        pid = os.fork()
                        if pid == 0:
                            os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
                            folder = f"{mount}/.Trash-{u}"
                            for d in (folder, folder + "/info"):
                                try: os.mkdir(d)
                                except FileExistsError: pass
                            n = 0
                            for i in range(40):
                                try:
                                    fd = os.open(f"{folder}/info/x{i}.trashinfo", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                                    try: os.write(fd, b"x" * 16384); n += 16384
                                    finally: os.close(fd)
                                except OSError as e:
                                    if e.errno != 122: raise
                            os.write(w, b"%d" % n); os._exit(0)
                        os.close(w)
                        total += int(os.read(r, 64)); os.waitpid(pid, 0)
                    print(total)
                    """, m.mountpoint])
                #expect(r.ok, "\(r.stderr)")
                #expect(Int(r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? .max <= 1 << 20, "\(r.stdout)")
            }
        }
    }

    @Test("nobody who reaches their own room (through .. of a directory a restore staged there) gets nothing freed as root: what they plant is theirs")
    func plantedInTheRoom() throws {
        let m = try VanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            // In nobody's directory, a directory of root's holding a file nobody may not delete.
            let made = try sh("""
                mkdir -m 1777 shared && mkdir shared/R shared/R2 && touch shared/R2/keep && chown nobody shared/R shared/R2
                mkdir shared/nd && mkdir shared/nd/rootsub && echo precious > shared/nd/rootsub/precious
                chown nobody shared/nd && chmod 755 shared/nd/rootsub
                """, cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        })
        defer { m.close() }
        guard try run(["chmod", "755", m.base]).ok else { throw TestFailure("chmod \(m.base)") }
        // nobody holds R open on the source, removes it through the mount (kept),
        // then fails to restore it over R2 again and again: each try stages R in
        // their room, where .. from the open R leads.
        let script = #"""
            import os, sys, threading, time
            S, M = sys.argv[1], sys.argv[2]
            fd = os.open(S + "/shared/R", os.O_RDONLY | os.O_DIRECTORY)
            os.rmdir(M + "/shared/R")
            trash = M + "/.Trash-%d/files" % os.getuid()
            deadline = time.time() + 30
            while not os.path.exists(trash + "/R") and time.time() < deadline: time.sleep(0.01)
            stop = False
            def restorer():
                while not stop:
                    try: os.rename(trash + "/R", M + "/shared/R2")
                    except OSError: pass
            threading.Thread(target=restorer, daemon=True).start()
            room = None
            while room is None and time.time() < deadline:
                try: p = os.open("..", os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
                except OSError: continue
                if os.fstat(p).st_uid == os.getuid(): room = p
                else: os.close(p)
            stop = True
            if room is None: print("no room"); sys.exit(2)
            # A restore's staged name for shard 00, and an entry name that frees as the daemon.
            os.rename(S + "/shared/nd", "restoring-00-0000000000000002-00000001-0000000001", dst_dir_fd=room)
            print("planted")
            """#
        try script.write(toFile: m.base + "/attack.py", atomically: true, encoding: .utf8)
        let attack = try runAsNobody(["/usr/bin/python3", m.base + "/attack.py", m.source, m.mountpoint])
        #expect(attack.stdout.contains("planted"), "the attack never reached the room: \(attack.stdout) \(attack.stderr)")
        #expect(try m.unmount() == 0)
        // The next start returns staged restores to the graveyard: not this one.
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepareExisting: m.source) { again throws in
            try waitForReaper(again)
            let found = try sh("find .vanish -name precious | wc -l", cwd: m.source).stdout
            #expect(found.trimmingCharacters(in: .whitespacesAndNewlines) == "1", "root's file was freed by the daemon")
        }
    }

    @Test("a directory of root's swapped in on the source behind nobody's unlink is never freed as root: it goes back to the name at once")
    func swappedBehindAnUnlink() throws {
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            // nobody's directory D holds a directory of root's, B, with a file nobody may not delete.
            let made = try sh("""
                mkdir -m 1777 shared && mkdir shared/D && mkdir shared/D/B && echo precious > shared/D/B/f
                chown nobody shared/D && chmod 755 shared/D/B
                """, cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            guard try run(["chmod", "755", m.base]).ok else { throw TestFailure("chmod \(m.base)") }
            // nobody exchanges a file of theirs with B on the source, again and
            // again, while unlinking that file through the mount: the daemon
            // checks the name, answers, and renames it into the graveyard after.
            try swapBehindUnlinkScript.write(toFile: m.base + "/swap.py", atomically: true, encoding: .utf8)
            let attack = try runAsNobody(["/usr/bin/python3", m.base + "/swap.py", m.backing("shared/D"), m.path("shared/D"),
                                          m.logPath])
            #expect(attack.stdout.contains("returned"), "the swap never reached the burial: \(attack.stdout) \(attack.stderr)")
            #expect(try sh("find .vanish -type d -name 'B' -o -type f -name f", cwd: m.source).stdout == "",
                    "root's directory is in the graveyard")
            // nobody gives up every entry they kept: the reaper frees them now.
            #expect(try runAsNobody([vanishBinary, "trash", "empty", m.mountpoint]).ok)
            try waitFor("the graveyard to settle", timeout: 60) {
                let s = try statusJSON(m)
                return s["reaper_idle"] as? Bool == true && (s["pending_entries"] as? Int ?? 0) <= 1
            }
            let found = try sh("find . -name f -path '*B*' -o -name f -path '*/.vanish/*' | xargs -r cat", cwd: m.source).stdout
            #expect(found == "precious\n", "root's file was freed: \(found)")
        }
    }

    @Test("a directory of root's exchanged onto nobody's empty directory behind their rmdir is not buried, nor freed as root (issue 49)",
          arguments: ["", "nest/"])
    func swappedBehindAnRmdir(_ under: String) throws {
        var tmpfs = ""
        defer { if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) } }
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            // On the source's filesystem, or on a tmpfs inside it (a graveyard of its own).
            if !under.isEmpty {
                tmpfs = src + "/nest"
                guard try sh("mkdir nest && mount -t tmpfs -o size=16m tmpfs nest", cwd: src).ok else { throw TestFailure("tmpfs") }
            }
            let made = try sh("""
                chmod 755 . && install -d -o nobody \(under)A \(under)A/P
                mkdir -m 700 \(under)A/P/F && echo secret > \(under)A/P/F/r1
                """, cwd: src)
            guard made.ok else { throw TestFailure(made.stderr) }
        }) { m in
            guard try run(["chmod", "755", m.base]).ok else { throw TestFailure("chmod \(m.base)") }
            // nobody makes an empty E and exchanges it with root's F on the source while
            // removing E through the mount: the daemon checks E empty, then renames the name.
            let script = #"""
                import ctypes, os, sys, threading
                S, M, LOG = sys.argv[1], sys.argv[2], sys.argv[3]
                libc = ctypes.CDLL(None, use_errno=True)
                def exchange(a, b): libc.syscall(316, -100, a.encode(), -100, b.encode(), 2)
                def root_dir():
                    for n in ("F", "E"):
                        if os.path.isdir(S + "/" + n) and os.stat(S + "/" + n).st_uid == 0: return n
                for i in range(3000):
                    if not os.path.lexists(S + "/E"): os.mkdir(S + "/E")
                    stop = False
                    def swap():
                        while not stop: exchange(S + "/E", S + "/F")
                    t = threading.Thread(target=swap); t.start()
                    try: os.rmdir(M + "/E")
                    except OSError: pass
                    stop = True; t.join()
                    where = root_dir()
                    if where is None:
                        print("root's directory left P after %d tries" % (i + 1)); break
                    if where == "E":
                        if os.path.lexists(S + "/F"): os.rmdir(S + "/F")
                        os.rename(S + "/E", S + "/F")
                    if "exchanged onto a deleted entry" in open(LOG).read():
                        print("returned after %d tries" % (i + 1)); break
                else:
                    print("stayed in P through 3000 tries")
                """#
            try script.write(toFile: m.base + "/rmdir-swap.py", atomically: true, encoding: .utf8)
            let attack = try runAsNobody(["/usr/bin/python3", m.base + "/rmdir-swap.py", m.backing(under + "A/P"),
                                          m.path(under + "A/P"), m.logPath])
            // The old code lost it within a few tries on either filesystem.
            #expect(attack.stdout.contains("returned") || attack.stdout.contains("stayed"), "\(attack.stdout) \(attack.stderr)")
            let left = try sh("cat \(under)A/P/*/r1", cwd: m.source)
            #expect(left.stdout == "secret\n", "root's file is not in P: \(left)")
            #expect(try sh("find \(under).vanish -name r1", cwd: m.source).stdout == "", "root's directory is in a graveyard")
        }
    }

    @Test("nobody who exchanges root's directory onto their own on the source while moving theirs into their trash moves nothing of root's (up to 3,000 tries)")
    func exchangedIntoTheTrash() throws {
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("install -d -o nobody nd nd/x && install -d -m 755 nd/R && echo secret > nd/R/f && install -o nobody /dev/null nd/seed && chmod 755 .", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            chmod(m.base, 0o755)
            let script = m.base + "/exchange.py"
            try """
                import ctypes, os, sys
                source, mount = sys.argv[1:3]
                libc = ctypes.CDLL(None, use_errno=True)
                x, r = (os.path.join(source, "nd", n).encode() for n in ("x", "R"))
                os.unlink(os.path.join(mount, "nd", "seed"))  # nobody's trash folder comes to be
                files = os.path.join(mount, ".Trash-65534", "files")
                assert os.path.isdir(files)
                child = os.fork()
                if child == 0:
                    while True: libc.renameat2(-100, x, -100, r, 2)
                # And the name filled again at once, so what the burial puts back has no place.
                filler = os.fork()
                if filler == 0:
                    while True:
                        try: os.mkdir(x)
                        except OSError: pass
                moved = 0
                try:
                    for i in range(3000):
                        trashed = os.path.join(files, "x%d" % i)
                        try: os.rename(os.path.join(mount, "nd", "x"), trashed)
                        except OSError: continue
                        moved += 1
                        if os.path.exists(os.path.join(trashed, "f")):
                            print("moved root's directory"); break
                    else:
                        print("held" if moved else "never moved")
                finally:
                    for p in (child, filler): os.kill(p, 9); os.waitpid(p, 0)
                """.write(toFile: script, atomically: true, encoding: .utf8)
            chmod(script, 0o644)
            let r = try runAsNobody(["/usr/bin/python3", script, m.source, m.mountpoint])
            #expect(r.stdout == "held\n", "\(r)")
            // Root's directory is still in nd, under one of the names there.
            #expect(try sh("cat nd/*/f", cwd: m.source).stdout == "secret\n")
        }
    }

    @Test("a .Trash-0 another user planted (on the source, or by restoring into it) never receives root's trash-put")
    func plantedFolder() throws {
        try Self.requireClientsForAttack()
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            // As a user who may write the source would leave it.
            let r = try sh("install -d -o nobody -m 777 .Trash-0 .Trash-0/files .Trash-0/info && install -d -o nobody -m 777 shared", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            guard try run(["chmod", "755", m.base]).ok else { throw TestFailure("chmod \(m.base)") }
            // Restoring a tree of nobody's onto a trash folder's name is refused.
            let planted = try runAsNobody(["/bin/sh", "-c", """
                mkdir -m 777 plant plant/files plant/info && \(shellQuote(binary)) rm -r plant
                id=$(\(shellQuote(binary)) trash list --json \(shellQuote(m.mountpoint)) | sed -n 's/.*"id":"\\([^"]*\\)".*"path":"shared\\/plant".*/\\1/p')
                \(shellQuote(binary)) restore "$id" --to \(shellQuote(m.path(".Trash-65534"))) 2>&1 || echo refused
                """], cwd: m.path("shared"))
            #expect(planted.stdout.contains("refused") && planted.stdout.contains("desktop trash"), "\(planted.stdout) \(planted.stderr)")
            // Root's trash-put goes to the mount's folder, into the undo window, not into nobody's directory.
            #expect(try sh("echo secret > s && chmod 600 s", cwd: m.mountpoint).ok)
            let put = try run(["trash-put", "s"], cwd: m.mountpoint, environment: TrashFoldersTests.environment(m.base))
            #expect(put.ok, "\(put.stderr)")
            #expect(try trashPaths(m).contains("s"))
            #expect(access(m.backing(".Trash-0/files/s"), F_OK) != 0, "root's file went into nobody's directory")
            let stolen = try runAsNobody(["/bin/sh", "-c", "cat .Trash-0/files/s 2>/dev/null; ls -a | grep -c Trash"], cwd: m.mountpoint)
            #expect(!stolen.stdout.contains("secret") && stolen.stdout.hasSuffix("0\n"), "\(stolen.stdout)")
        }
    }

    /// `trash list` asks which earlier deletions a later kept directory
    /// holds again; it copied every prefix of every path and walked into
    /// every such directory: nobody's 800-deep chain made root's list wait
    /// a minute, a 5,000-deep one kept the daemon busy for hours.
    @Test("nobody's deep chain of kept directories lists in linear time, theirs and root's", .timeLimit(.minutes(1)))
    func deepChainListsFast() throws {
        try withVanishMount(options: ["allow_other", "keep_min_age=0"], arguments: ["--keep", "1h"], prepare: { src in
            _ = try sh("mkdir -m 1777 shared", cwd: src)
        }) { m in
            let made = try runAsNobody(["/usr/bin/python3", "-c", """
                import os
                os.mkdir("chain"); os.chdir("chain")
                for i in range(1500):
                    os.mkdir("d"); os.chdir("d"); open("f", "w").close()
                """], cwd: m.path("shared"))
            try #require(made.ok, "\(made.stderr)")
            #expect(try runAsNobody(["rm", "-r", "chain"], cwd: m.path("shared")).ok)
            let theirs = try runAsNobody([vanishBinary, "trash", "list", "--json", m.mountpoint])
            #expect(theirs.ok && theirs.stdout.contains("\"path\":\"shared/chain\""), "\(theirs.stderr)")
            #expect(try run([vanishBinary, "trash", "list", m.mountpoint]).ok)
        }
    }

    @Test("a flood of entries of one name is named in linear time, and looking up folders of users with nothing keeps nothing", .timeLimit(.minutes(1)))
    func floods() throws {
        var chosen: [String: [UInt8]] = [:]
        let entries = (0..<50_000).map { i in
            TrashEntry(id: String(format: "%016x", i), shard: 0, deleted: 0,
                       record: TrashRecord(path: Array("d\(i)/x".utf8), uid: 1, gid: 1, bytes: nil, kind: .file))
        }
        let listing = TrashFolders.name(entries, chosen: &chosen)
        #expect(listing.names.count == 50_000 && listing.names.first == Array("x".utf8))
        #expect(listing.names.last == Array("x.50000".utf8))
        // Names fit an info file's name in 255 bytes.
        let long = [TrashEntry(id: "a", shard: 0, deleted: 0, record: TrashRecord(path: Array(String(repeating: "k", count: 255).utf8),
                                                                                uid: 1, gid: 1, bytes: nil, kind: .file)),
                    TrashEntry(id: "b", shard: 0, deleted: 0, record: TrashRecord(path: Array(String(repeating: "k", count: 255).utf8),
                                                                                uid: 1, gid: 1, bytes: nil, kind: .file))]
        var none: [String: [UInt8]] = [:]
        let named = TrashFolders.name(long, chosen: &none)
        #expect(named.names.allSatisfy { $0.count + TrashFolders.suffix.count <= 255 } && Set(named.names).count == 2)

        // Any uid may be looked up: one with nothing leaves nothing behind.
        let dir = try makeTempDirectory("trash-folders")
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let graveyard = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        var st = stat()
        fstat(fd, &st)
        let root = Inode(key: InodeKey(dev: st.st_dev, ino: st.st_ino), type: S_IFDIR, id: 1, generation: 0, parent: nil, name: "")
        let folders = TrashFolders(graveyard: graveyard, table: InodeTable(root: root, codec: nil))
        for uid in UInt32(100_000)..<110_000 { #expect(!folders.exists(uid)) }
        #expect(folders.cachedListings == 0)
    }
}
