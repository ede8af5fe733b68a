import Foundation
import Glibc
import Testing
import VanishTestSupport

/// The reaper frees what a buried directory holds with its deleter's
/// credentials (issue 49, attacks 4 and 5): a descriptor held inside the
/// directory on the source can move another user's tree into it after the
/// delete, and nothing of that may be freed that the deleter could not
/// have removed with `rm -r`.
@Suite("the reaper frees with its deleter's rights", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct ReaperRightsTests {
    /// root's `pub/drop` (0777, in a 0777 directory) holding root's
    /// read-only `archive/data`, and nobody's empty `home/t` (its file too, for
    /// the one-step case) in nobody's `home`, with a process of nobody's holding its cwd there.
    static let fixture = """
        chmod 755 . && install -d -m 777 pub pub/drop && install -d -m 755 pub/drop/archive
        echo keep > pub/drop/archive/data && install -d -o nobody home home/t
        """

    /// Runs nobody's holder: cwd in `tree` on the source, it waits for
    /// `signals/go`, moves `drop` in from `pub`, and writes how that went
    /// to `signals/moved`.
    static func holder(_ m: VanishMount, tree: String, moving moved: String = "pub/drop") throws -> (pid: pid_t, signals: String) {
        let signals = m.base + "/signals"
        mkdir(signals, 0o777)
        chmod(signals, 0o777)
        let script = m.base + "/holder.py"
        try """
            import os, sys
            os.chdir(sys.argv[1])
            signals = sys.argv[2]
            open(signals + "/ready", "w").close()
            while not os.path.exists(signals + "/go"):
                os.sched_yield()
            try:
                os.rename(sys.argv[3], "drop")
                result = "moved"
            except OSError as e:
                result = str(e)
            with open(signals + "/moved", "w") as f:
                f.write(result)
            """.write(toFile: script, atomically: true, encoding: .utf8)
        let pid = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                             "/usr/bin/python3", script, m.backing(tree), signals, m.backing(moved)])
        try waitFor("the holder to be in \(tree)") { access(signals + "/ready", F_OK) == 0 }
        return (pid, signals)
    }

    /// Lets the holder move `drop` in and checks it could (natively, as nobody).
    static func moveIn(_ signals: String, _ pid: pid_t) throws {
        _ = FileManager.default.createFile(atPath: signals + "/go", contents: nil)
        var status: Int32 = 0
        waitpid(pid, &status, 0)
        let result = try String(contentsOfFile: signals + "/moved", encoding: .utf8)
        #expect(result == "moved", "the held directory took root's drop/: \(result)")
    }

    /// nobody's own `rm -r` of a tree holding `drop/` leaves root's file: the
    /// fixture's premise. Returns what is left under `home` (paths, owners, modes).
    static func nativeKeepsData(extra: String, moving moved: String = "pub/drop") throws -> String {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        #expect(try sh(fixture + extra + " && mv \(moved) home/t/drop", cwd: plain).ok)
        _ = try runAsNobody(["rm", "-r", "home/t"], cwd: plain)
        if moved == "pub/drop" {
            #expect(try sh("cat home/t/drop/archive/data", cwd: plain).stdout == "keep\n", "nobody's rm -r leaves root's file")
        }
        return try listing(plain)
    }

    /// What is under `home` in `dir`: each path with its owner and mode.
    static func listing(_ dir: String) throws -> String {
        try sh("find home -mindepth 1 -printf '%P %u %m\\n' | sort", cwd: dir).stdout
    }

    /// root's file, wherever it is in the source (in the graveyard, stuck): its text, owner and mode.
    static func rootsFile(_ m: VanishMount, inode: String) throws -> String {
        try sh("find . -inum \(inode) -exec stat -c '%U %a' {} \\; -exec cat {} \\;", cwd: m.source).stdout
    }

    /// The attack: `extra` set up, nobody's holder in `home/t`, `delete`
    /// run as nobody with the vanish binary given, drop/ moved in, nobody's
    /// trash emptied. Then root's file must still be there, as it was, and
    /// the tree end as nobody's `rm -r` leaves it on a plain directory: what
    /// they could not remove put back where it was. With `retake`, nobody
    /// makes `home/t` again first: the place is taken, so what stays is held
    /// in their trash, with why, for them to restore elsewhere.
    /// `window`: with none (`reap_rate=0.2`, so the reaper is still at the
    /// tree when drop/ comes), nothing is kept and no trash is emptied.
    static func attack(extra: String = "", moving moved: String = "pub/drop", retake: Bool = false, window: Bool = true,
                       _ delete: (VanishMount, String) throws -> Void) throws {
        let native = try nativeKeepsData(extra: extra, moving: moved)
        try withVanishMount(options: ["allow_other"] + (window ? [] : ["reap_rate=0.2"]),
                            arguments: window ? ["--keep", "1h"] : [], prepare: { src in
            let r = try sh(fixture + extra, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let inode = try sh("stat -c %i pub/drop/archive/data", cwd: m.source).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            let (pid, signals) = try holder(m, tree: "home/t", moving: moved)
            try delete(m, binary)
            try moveIn(signals, pid)
            if retake { #expect(try runAsNobody(["mkdir", m.path("home/t")]).ok) }
            if window {
                let empty = try runAsNobody([binary, "trash", "empty", m.mountpoint])
                #expect(empty.ok, "\(empty)")
            }
            try waitForReaper(m)
            #expect(try rootsFile(m, inode: inode) == "root 644\nkeep\n", "root's file is not freed")
            #expect(try sh("find .vanish -name f -user nobody | wc -l", cwd: m.source).stdout == "0\n",
                    "nobody's own file is freed")
            let list = try runAsNobody([binary, "trash", "list", "--json", m.mountpoint])
            let held = list.stdout.split(separator: "\n").compactMap {
                (try? JSONSerialization.jsonObject(with: Data($0.utf8))) as? [String: Any]
            }.filter { $0["held"] is String }
            guard retake else {
                #expect(held.isEmpty, "\(list)")
                #expect(try listing(m.source) == native, "the tree ends as nobody's rm -r leaves it")
                #expect(try listing(m.mountpoint) == native, "and the mount shows it so")
                return
            }
            // What stays is in nobody's trash, held, with why; nobody may move it out where they may write.
            try restoresHeld(m, held, "\(list)", inode: inode, to: "home/back", as: { try runAsNobody($0) })
        }
    }

    /// The one held entry in `held` (of the trash listing `list`) restored
    /// with --to `to` by its deleter (`restore`: how they run a command) brings root's file along.
    static func restoresHeld(_ m: VanishMount, _ held: [[String: Any]], _ list: String, inode: String, to: String,
                             as restore: ([String]) throws -> ProcessResult) throws {
        #expect(held.count == 1, "\(list)")
        let id = try #require(held.first?["id"] as? String)
        let back = try restore([m.base + "/vanish", "restore", id, "--mount", m.mountpoint, "--to", m.path(to)])
        #expect(back.ok, "\(back)")
        #expect(try sh("find \(to) -inum \(inode) | wc -l", cwd: m.source).stdout == "1\n")
    }

    @Test("a tree moved into a one-step delete through a held cwd is not freed as root, and goes back where it was (attack 5)")
    func oneStepHeldDirectory() throws {
        try ReaperRightsTests.attack(extra: " && install -o nobody /dev/null home/t/f") { m, binary in
            let rm = try runAsNobody([binary, "rm", "-r", m.path("home/t")])
            #expect(rm.ok, "\(rm)")
            try waitFor("nobody's room to be empty") {
                try sh("ls .vanish/clients/*/users/65534 2>/dev/null", cwd: m.source).stdout.isEmpty
            }
        }
    }

    @Test("without an undo window too, a tree moved into a one-step delete through a held cwd goes back where it was (attack 5)")
    func oneStepHeldDirectoryWithoutWindow() throws {
        try ReaperRightsTests.attack(extra: " && install -o nobody /dev/null home/t/f", window: false) { m, binary in
            let rm = try runAsNobody([binary, "rm", "-r", m.path("home/t")])
            #expect(rm.ok, "\(rm)")
            try waitFor("nobody's room to be empty") {
                try sh("ls .vanish/clients/*/users/65534 2>/dev/null", cwd: m.source).stdout.isEmpty
            }
        }
    }

    @Test("a tree moved into a removed directory through a held cwd is not freed as root, and goes back where it was (attack 5, by rmdir)")
    func rmdirHeldDirectory() throws {
        try ReaperRightsTests.attack { m, _ in
            let rmdir = try runAsNobody(["rmdir", m.path("home/t")])
            #expect(rmdir.ok, "\(rmdir)")
        }
    }

    @Test("nobody's own read-only directory moved into their removed directory is not emptied: it goes back as it was, as after their rm -r")
    func ownReadOnlyDirectoryGoesBack() throws {
        let extra = " && install -d -o nobody home/box home/box/ro && install -o nobody /dev/null home/box/ro/f && chmod 500 home/box/ro"
        try ReaperRightsTests.attack(extra: extra, moving: "home/box") { m, _ in
            let rmdir = try runAsNobody(["rmdir", m.path("home/t")])
            #expect(rmdir.ok, "\(rmdir)")
        }
    }

    @Test("what nobody could not remove goes back only to a free place: a taken one leaves it held in their trash (attack 5)")
    func rmdirHeldDirectoryPlaceTaken() throws {
        try ReaperRightsTests.attack(retake: true) { m, _ in
            let rmdir = try runAsNobody(["rmdir", m.path("home/t")])
            #expect(rmdir.ok, "\(rmdir)")
        }
    }

    @Test("what a deleter could remove is freed as them: their own tree in their own buried directory goes whole")
    func ownTreeFreed() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("chmod 755 . && install -d -o nobody t", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            #expect(try runAsNobody(["/bin/sh", "-c", """
                mkdir -p t/a/b/c t/ro && for i in 1 2 3; do echo $i > t/a/b/c/$i; echo $i > t/ro/$i; done && chmod 555 t/ro
                """], cwd: m.mountpoint).ok)
            let rm = try runAsNobody([binary, "rm", "-r", m.path("t/a")])
            #expect(rm.ok, "\(rm)")
            // nobody's own read-only directory: rm -r leaves it; the one-step delete puts it back.
            _ = try runAsNobody([binary, "rm", "-r", m.path("t/ro")])
            try waitForReaper(m)
            #expect(try sh("find .vanish/clients/*/graveyard -mindepth 2 | wc -l", cwd: m.source).stdout == "0\n")
            #expect(access(m.path("t/a"), F_OK) != 0)
            #expect(try sh("ls t/ro | wc -l", cwd: m.source).stdout == "3\n", "the read-only directory is back whole")
        }
    }

    /// The other way round: root deletes `srv/t` with a world-writable
    /// `pub/` in it, where nobody holds a cwd; nobody then moves in their
    /// own directory holding root's read-only `archive/data`, which they
    /// cannot remove. Natively the move fails (the directory is gone); here
    /// it lands in the buried tree, and root's reaper must not free it.
    static func movedIntoRootsTree(_ delete: (VanishMount) throws -> Void) throws {
        try withVanishMount(options: ["allow_other"], arguments: ["--keep", "1h"], prepare: { src in
            let r = try sh("""
                chmod 755 . && install -d -m 755 srv srv/t && install -d -m 1777 srv/t/pub && echo x > srv/t/f \
                && install -d -o nobody home home/mine && install -d -m 755 home/mine/archive && echo keep > home/mine/archive/data
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            #expect(try runAsNobody(["rm", "-r", m.path("home/mine")]).stderr.contains("Permission denied"),
                    "the premise: nobody cannot remove root's archive")
            let inode = try sh("stat -c %i home/mine/archive/data", cwd: m.source).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            #expect(try run(["cp", vanishBinary, m.base + "/vanish"]).ok)
            let (pid, signals) = try holder(m, tree: "srv/t/pub", moving: "home/mine")
            try delete(m)
            try moveIn(signals, pid)
            let empty = try run([vanishBinary, "trash", "empty", m.mountpoint])
            #expect(empty.ok, "\(empty)")
            try waitForReaper(m)
            #expect(try rootsFile(m, inode: inode) == "root 644\nkeep\n", "root's file is not freed")
            #expect(access(m.path("srv/t"), F_OK) != 0, "root's tree is gone, as after rm -r")
            // Held in root's trash, with why; root can bring it out.
            let list = try trashList(m)
            let held = list.filter { ($0["held"] as? String)?.contains("moved into it after it was deleted") == true }
            try restoresHeld(m, held, "\(list)", inode: inode, to: "back", as: { try run($0) })
        }
    }

    @Test("root's vanish rm -r: nobody's directory moved in afterwards through a held cwd is held in root's trash, not freed as root")
    func movedIntoRootsOneStepDelete() throws {
        try ReaperRightsTests.movedIntoRootsTree { m in
            let rm = try run([vanishBinary, "rm", "-r", m.path("srv/t")])
            #expect(rm.ok, "\(rm)")
        }
    }

    @Test("root's rm -r through the mount: nobody's directory moved into its removed directory afterwards is held, not freed as root")
    func movedIntoRootsRemovedDirectory() throws {
        try ReaperRightsTests.movedIntoRootsTree { m in
            let rm = try run(["rm", "-r", m.path("srv/t")])
            #expect(rm.ok, "\(rm)")
        }
    }

    /// nobody's racer: its cwd in `tmp` (a 1777 directory of root's tree,
    /// holding nobody's directories), it waits for the reaper to move one
    /// of them out (IN_MOVED_FROM) and at once exchanges the next with its
    /// own `mine`, which holds root's read-only archive: between the
    /// reaper's look at that name and its move.
    static let racer = #"""
        #define _GNU_SOURCE
        #include <dirent.h>
        #include <fcntl.h>
        #include <stdio.h>
        #include <string.h>
        #include <sys/inotify.h>
        #include <unistd.h>
        int main(int argc, char **argv) {
            if (chdir(argv[1])) return 1;
            char names[64][32]; int n = 0;
            DIR *d = opendir("."); struct dirent *e;
            while ((e = readdir(d)) && n < 64) if (e->d_type == DT_DIR && e->d_name[0] != '.') strcpy(names[n++], e->d_name);
            closedir(d);
            int home = open(argv[2], O_RDONLY | O_DIRECTORY), in = inotify_init1(IN_NONBLOCK);
            inotify_add_watch(in, ".", IN_MOVED_FROM);
            close(open(argv[3], O_CREAT | O_WRONLY, 0666));
            char buf[65536] __attribute__((aligned(8)));
            for (long spins = 0; spins < 4000000000L; spins++) {
                ssize_t r = read(in, buf, sizeof buf);
                for (char *p = buf; r > 0 && p < buf + r;) {
                    struct inotify_event *ev = (void *)p; p += sizeof *ev + ev->len;
                    for (int i = 0; i + 1 < n; i++)
                        if (!strcmp(names[i], ev->name) && renameat2(AT_FDCWD, names[i + 1], home, "mine", RENAME_EXCHANGE) == 0) return 0;
                }
            }
            return 2;
        }
        """#

    @Test("root's vanish rm -r: nobody's directory exchanged onto a name between the reaper's look and its move out as a piece is never freed as root (4 tries)")
    func exchangedWhileSplit() throws {
        let build = try makeTempDirectory()
        defer { removeTree(build) }
        try Self.racer.write(toFile: build + "/racer.c", atomically: true, encoding: .utf8)
        let cc = try run(["cc", "-O2", "-o", build + "/racer", build + "/racer.c"])
        try #require(cc.ok, "\(cc)")
        chmod(build, 0o755)
        for _ in 0..<4 {
            try withVanishMount(options: ["allow_other"], prepare: { src in
                let r = try sh("""
                    chmod 755 . && install -d data && install -d -m 1777 data/tmp
                    for d in $(seq 10 29); do install -d -o nobody data/tmp/d$d && (cd data/tmp/d$d && seq 300 | xargs touch); done
                    install -d -o nobody home home/nb home/nb/mine && install -d -m 755 home/nb/mine/archive
                    echo keep > home/nb/mine/archive/secret
                    """, cwd: src)
                guard r.ok else { throw TestFailure(r.stderr) }
            }) { m in
                let inode = try sh("stat -c %i home/nb/mine/archive/secret", cwd: m.source).stdout
                    .trimmingCharacters(in: .whitespacesAndNewlines)
                // Older than the clock's tick, so nothing of the tree counts as changed after its burial.
                let made = try sh("stat -c %Z.%N data/tmp/d29 | cut -c1-14", cwd: m.source).stdout
                try waitFor("the tree to be older than a clock tick") {
                    Date().timeIntervalSince1970 > (Double(made.trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0) + 0.05
                }
                let signals = m.base + "/signals"
                mkdir(signals, 0o777)
                chmod(signals, 0o777)
                let pid = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                     build + "/racer", m.backing("data/tmp"), m.backing("home/nb"), signals + "/ready"])
                defer {
                    kill(pid, SIGKILL)
                    var st: Int32 = 0
                    waitpid(pid, &st, 0)
                }
                try waitFor("the racer to be ready") { access(signals + "/ready", F_OK) == 0 }
                let rm = try run([vanishBinary, "rm", "-r", m.path("data")])
                #expect(rm.ok, "\(rm)")
                try waitForReaper(m)
                #expect(try Self.rootsFile(m, inode: inode) == "root 644\nkeep\n", "root's file is not freed")
            }
        }
    }

    @Test("a tree nobody made moments before, group-writable (umask 002), goes whole with their vanish rm -r: nothing held or put back (20 tries)")
    func freshTreeFreed() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("chmod 755 . && install -d -o nobody w", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            let r = try runAsNobody(["/bin/sh", "-c", """
                umask 002
                for i in $(seq 20); do
                    mkdir -p t$i/src/a && echo x > t$i/src/a/f.c && cp t$i/src/a/f.c t$i/src/a/f.o && \(binary) rm -r t$i || exit 1
                done
                """], cwd: m.path("w"))
            #expect(r.ok, "\(r)")
            try waitForReaper(m)
            let left = try sh("find w -mindepth 1 -printf '%p %M %u %C@\\n'", cwd: m.source).stdout
            #expect(left == "", "nothing put back: \(left)")
            #expect(try sh("find .vanish/clients/*/graveyard -mindepth 2 | wc -l", cwd: m.source).stdout == "0\n", "nothing held")
        }
    }
}

