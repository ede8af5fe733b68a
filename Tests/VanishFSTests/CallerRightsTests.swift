import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Entries made for a user are made with that user's credentials, so the
/// backing kernel checks them at that moment and sets their owner: a name
/// swapped on the source between the kernel's check and the daemon's call
/// gives the attacker nothing they would not get natively. Each attack runs
/// as nobody, through the mount and on the source, and its outcome is
/// compared with the same steps on a plain directory.
@Suite("the caller's own rights", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct CallerRightsTests {
    /// A 0777 directory `d` holding root's 0600 `secret`.
    static func prepareSecret(_ src: String) throws {
        let r = try sh("install -d -m 777 d && echo root-only > d/secret && chmod 600 d/secret && chmod 755 .", cwd: src)
        guard r.ok else { throw TestFailure(r.stderr) }
    }

    /// As nobody: the name `x` is looked up and found absent through `view`,
    /// root's file is renamed to `x` on `source`, and `x` is opened with
    /// O_CREAT | O_RDWR through `view`. Prints the open's outcome.
    static let createOverRenamed = """
        import os, sys
        view, source = sys.argv[1], sys.argv[2]
        try:
            os.stat(view + "/d/x")
        except FileNotFoundError:
            pass
        os.rename(source + "/d/secret", source + "/d/x")
        try:
            fd = os.open(view + "/d/x", os.O_CREAT | os.O_RDWR, 0o644)
            print("opened", os.read(fd, 100))
        except OSError as e:
            print("refused", e.errno)
        """

    @Test("create over a name renamed in on the source opens nothing with the daemon's rights (issue 49, attack 1)")
    func createDoesNotTakeOverRenamedFile() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        try Self.prepareSecret(plain)
        let expected = try runAsNobody(["/usr/bin/python3", "-c", Self.createOverRenamed, plain, plain])
        #expect(expected.stdout == "refused \(EACCES)\n", "\(expected.stderr)")
        try withVanishMount(options: ["allow_other"], prepare: Self.prepareSecret) { m in
            // Eight tries, as the campaign made: each must be refused.
            for _ in 0..<8 {
                let actual = try runAsNobody(["/usr/bin/python3", "-c", Self.createOverRenamed, m.mountpoint, m.source])
                #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
                let owner = try sh("stat -c '%U %a' d/x && cat d/x", cwd: m.source)
                #expect(owner.stdout == "root 600\nroot-only\n")
                guard try sh("mv d/x d/secret", cwd: m.source).ok else { throw TestFailure("cannot put the secret back") }
            }
        }
    }

    /// As nobody, for `seconds`: one thread makes and removes `d/new`
    /// through `view`, another renames root's non-empty directory `d/root`
    /// onto `d/new` on `source` whenever it can, and back.
    static let mkdirRace = """
        import os, sys, threading, time
        view, source, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
        end = time.monotonic() + seconds
        def make():
            while time.monotonic() < end:
                for f in (lambda: os.mkdir(view + "/d/new"), lambda: os.rmdir(view + "/d/new")):
                    try: f()
                    except OSError: pass
        def swap():
            while time.monotonic() < end:
                try:
                    os.rename(source + "/d/root", source + "/d/new")
                    os.rename(source + "/d/new", source + "/d/root")
                except OSError:
                    pass
        ts = [threading.Thread(target=make), threading.Thread(target=swap)]
        for t in ts: t.start()
        for t in ts: t.join()
        """

    @Test("a directory renamed over a fresh mkdir is never given to its maker (issue 49, attack 2)")
    func mkdirDoesNotChownSwappedDirectory() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("install -d -m 777 d && install -d -m 700 d/root && echo x > d/root/f && chmod 755 .", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let inode = try sh("stat -c %i d/root", cwd: m.source).stdout
            let r = try runAsNobody(["/usr/bin/python3", "-c", Self.mkdirRace, m.mountpoint, m.source, "3"])
            #expect(r.ok, "\(r.stderr)")
            // Wherever the race left it, root's directory is still root's.
            let found = try sh("find d -inum \(inode.trimmingCharacters(in: .whitespacesAndNewlines)) -printf '%u %m\\n'",
                               cwd: m.source)
            #expect(found.stdout == "root 700\n", "\(found.stderr)")
            let inside = try sh("find d -name f -printf '%u\\n'", cwd: m.source)
            #expect(inside.stdout == "root\n")
        }
    }

    @Test("entries nobody makes are made as nobody, and a directory closed on the source refuses them")
    func makesAsCaller() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("install -d -m 777 open closed && chmod 755 .", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // The kernel has seen `closed` open to all; then root closes it on the source.
            _ = try runAsNobody(["/bin/ls", "-ld", "closed"], cwd: m.mountpoint)
            guard try sh("chmod 755 closed", cwd: m.source).ok else { throw TestFailure("chmod") }
            let made = try runAsNobody(["/bin/sh", "-c", """
                touch open/f && mkdir open/d && ln -s f open/l && mkfifo open/p && ln open/f open/h || exit 1
                for step in 'touch closed/f' 'mkdir closed/d' 'ln -s f closed/l' 'mkfifo closed/p' 'ln open/f closed/h'; do
                  if sh -c "$step" 2>/dev/null; then echo "$step: ok"; else echo "$step: denied"; fi
                done
                """], cwd: m.mountpoint)
            #expect(made.ok, "\(made.stderr)")
            #expect(made.stdout == """
                touch closed/f: denied
                mkdir closed/d: denied
                ln -s f closed/l: denied
                mkfifo closed/p: denied
                ln open/f closed/h: denied

                """)
            let owners = try sh("stat -c '%U %G' open/f open/d open/l open/p && ls closed | wc -l", cwd: m.source)
            #expect(owners.stdout == String(repeating: "nobody nogroup\n", count: 4) + "0\n")
        }
    }

    @Test("a directory exchanged onto a name being renamed moves only where its mover could move it (issue 49)")
    func exchangeDuringRename() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("""
                chmod 755 . && install -d -m 777 shared && install -d -m 755 shared/R && install -d -o nobody other
                for f in 1 2 3; do echo x > shared/R/$f; done
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // Natively nobody cannot move root's 0755 R to another directory (its ".." would change).
            try whileNobodyExchanges("A", "R", in: m.backing("shared"), scratch: m.base) {
                for i in 0..<50 {
                    _ = try runAsNobody(["/bin/sh", "-c", "mkdir -p shared/A 2>/dev/null; mv shared/A other/A\(i) 2>/dev/null; true"],
                                        cwd: m.mountpoint)
                }
            }
            let moved = try sh("find other -name 1 -o -name 2 -o -name 3 | wc -l", cwd: m.source)
            #expect(moved.stdout == "0\n", "root's files moved into nobody's directory: \(moved.stdout)")
            #expect(try sh("find shared -name 1 -o -name 2 -o -name 3 | wc -l", cwd: m.source).stdout == "3\n")
        }
    }
}
