import Foundation
import Glibc
import Testing
import VanishTestSupport

/// allow_other mounts served by a root daemon: other users get exactly what
/// the modes and ACLs grant them, and what they create is theirs.
@Suite("permissions", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct PermissionsTests {
    /// Runs `script` as nobody in `cwd`.
    func asNobody(_ script: String, cwd: String) throws -> ProcessResult {
        try runAsNobody(["/bin/sh", "-c", script], cwd: cwd)
    }

    /// The same checks as nobody on a plain directory and on the mount.
    func permissionScript() -> String {
        """
        for step in 'cat private' 'cat public' 'echo x > public' 'echo x > private' 'touch newfile' \
                    'mkdir newdir' 'rm public' 'mv public moved' 'ls locked' 'cat locked/f' \
                    'touch open/mine' 'rm open/theirs' 'rm open/mine' 'chmod 777 public' 'chown nobody public' \
                    'ln public open/hard' 'setfattr -n user.x -v 1 public' 'truncate -s 0 public' \
                    'cat acl-denied' 'cat acl-granted' 'touch acl-dir/mine' 'ls acl-dir' \
                    'mv shared/sub shared/renamed' 'mv shared/renamed shared/sub' 'mv shared/sub open/sub'; do
          if sh -c "$step" 2>/dev/null; then echo "$step: ok"; else echo "$step: denied"; fi
        done
        """
    }

    func prepare(_ dir: String) throws {
        let r = try sh("""
            set -e
            echo secret > private && chmod 600 private
            echo hello > public && chmod 644 public
            mkdir locked && echo x > locked/f && chmod 700 locked
            mkdir open && chmod 1777 open && echo t > open/theirs
            echo no > acl-denied && chmod 644 acl-denied && setfacl -m u:nobody:--- acl-denied
            echo yes > acl-granted && chmod 600 acl-granted && setfacl -m u:nobody:r-- acl-granted
            mkdir acl-dir && chmod 700 acl-dir && setfacl -m u:nobody:rwx acl-dir
            mkdir shared && chmod 777 shared && mkdir shared/sub && chmod 700 shared/sub
            chmod 755 .
            """, cwd: dir)
        guard r.ok else { throw TestFailure(r.stderr) }
    }

    @Test("nobody gets the same answers on the mount as on a plain directory")
    func parityAsNobody() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        try prepare(plain)
        let expected = try asNobody(permissionScript(), cwd: plain)
        try withVanishMount(options: ["allow_other"], prepare: prepare) { m in
            let actual = try asNobody(permissionScript(), cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout)
            #expect(expected.stdout.contains("cat private: denied"))
            #expect(expected.stdout.contains("rm open/theirs: denied"))
            // POSIX ACLs count, not just the mode bits.
            #expect(expected.stdout.contains("cat acl-denied: denied"))
            #expect(expected.stdout.contains("cat acl-granted: ok"))
            #expect(expected.stdout.contains("touch acl-dir/mine: ok"))
            // Issue 22, item 18: another user's 0700 directory renamed within a 0777 one
            // (allowed), and moved to another directory (its '..' changes: refused).
            #expect(expected.stdout.contains("mv shared/sub shared/renamed: ok"))
            #expect(expected.stdout.contains("mv shared/sub open/sub: denied"))
        }
    }

    @Test("entries made by another user belong to that user, setgid directories pass on their group")
    func ownership() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            _ = try sh("mkdir shared && chgrp daemon shared && chmod 2777 shared && mkdir open && chmod 777 open",
                       cwd: src)
        }) { m in
            let r = try asNobody("""
                umask 027
                touch open/file && mkdir open/dir && ln -s file open/link && mkfifo open/fifo
                touch shared/file && mkdir shared/dir
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            let owners = try sh("stat -c '%n %U %G %a' open/file open/dir open/link open/fifo shared/file shared/dir",
                                cwd: m.source)
            #expect(owners.stdout == """
                open/file nobody nogroup 640
                open/dir nobody nogroup 750
                open/link nobody nogroup 777
                open/fifo nobody nogroup 640
                shared/file nobody daemon 640
                shared/dir nobody daemon 2750

                """)
        }
    }

    /// What `touch`, `mkdir`, `mkfifo` and `open(O_TMPFILE)` make under
    /// several umasks, in a plain directory and in one with a default ACL,
    /// which decides in the umask's place. xfstests generic/099 and 319.
    func umaskScript() -> String {
        """
        for m in 022 077 722 000; do
          umask $m
          for d in plain acl; do
            touch $d/f$m && mkdir $d/d$m && mkfifo $d/p$m || exit 1
            /usr/bin/python3 -c 'import os, sys; print(oct(os.fstat(os.open(sys.argv[1], os.O_TMPFILE | os.O_RDWR, 0o666)).st_mode))' $d
            echo "$m $d: $(stat -c %a $d/f$m $d/d$m $d/p$m | tr '\n' ' ') $(getfacl -cn $d/f$m $d/d$m | tr '\n' ' ')"
          done
        done
        """
    }

    func prepareUmaskDirectories(_ dir: String) throws {
        let r = try sh("mkdir plain acl && chmod 777 plain acl && setfacl -d --set u::rwx,g::rwx,o::-,u:daemon:r-x,m::rwx acl",
                       cwd: dir)
        guard r.ok else { throw TestFailure(r.stderr) }
    }

    @Test("new entries get the caller's umask, or the directory's default ACL in its place, as on a plain directory",
          arguments: [false, true])
    func umaskAndDefaultACLs(asNobody: Bool) throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        try prepareUmaskDirectories(plain)
        let run = { (dir: String) throws -> ProcessResult in
            asNobody ? try self.asNobody(self.umaskScript(), cwd: dir) : try sh(self.umaskScript(), cwd: dir)
        }
        let expected = try run(plain)
        #expect(expected.ok, "\(expected.stderr)")
        // The fixture: the ACL, not the umask, decides in acl/.
        #expect(expected.stdout.contains("722 acl: 660 770 660"), "\(expected.stdout)")
        #expect(expected.stdout.contains("022 plain: 644 755 644"), "\(expected.stdout)")
        try withVanishMount(options: asNobody ? ["allow_other"] : [], prepare: prepareUmaskDirectories) { m in
            let actual = try run(m.mountpoint)
            #expect(actual.ok, "\(actual.stderr)")
            #expect(actual.stdout == expected.stdout)
        }
    }

    @Test("trusted.* attribute names are listed to root only, as on the backing filesystem")
    func trustedNames() throws {
        let prepareXattrs = { (dir: String) throws in
            let r = try sh("""
                echo x > f && chmod 644 f && setfattr -n trusted.secret-name -v 1 f && setfattr -n user.plain -v 2 f
                """, cwd: dir)
            guard r.ok else { throw TestFailure(r.stderr) }
        }
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        try prepareXattrs(plain)
        // listxattr itself: getfattr -d would hide names it then cannot read.
        let script = "/usr/bin/python3 -c 'import os; print(sorted(os.listxattr(\"f\")))'; getfattr -d -m - f"
        let expected = try asNobody(script, cwd: plain)
        #expect(!expected.stdout.contains("trusted.") && expected.stdout.contains("user.plain"), "the fixture: \(expected.stdout)")
        try withVanishMount(options: ["allow_other"], prepare: prepareXattrs) { m in
            let actual = try asNobody(script, cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout)
            #expect(try sh("getfattr -d -m - f", cwd: m.mountpoint).stdout.contains("trusted.secret-name"))
        }
    }

    /// ramfs keeps no xattrs, so ACL reads answer EOPNOTSUPP (as GlusterFS
    /// mounted without `acl` does); the kernel's ACL check on the mount
    /// (allow_other asks for it) handed that error to anyone but the owner.
    @Test("on a file system that keeps no ACLs, as the source or inside it, nobody works in their directory and root lists it",
          arguments: [true, false])
    func filesystemWithoutACLs(asSource: Bool) throws {
        let base = try makeTempDirectory()
        defer { removeTree(base) }
        // Declared after the base, so the ramfs goes first.
        var ramfs = ""
        defer {
            for _ in 0..<4 where !ramfs.isEmpty && mountType(at: ramfs) != nil { _ = try? run(["umount", "-l", ramfs]) }
        }
        func mountRamfs(at dir: String) throws {
            mkdir(dir, 0o755)
            guard try run(["mount", "-t", "ramfs", "ramfs", dir]).ok else { throw TestFailure("mounting ramfs at \(dir)") }
            ramfs = dir
            chmod(dir, 0o755)
            #expect(try sh("mkdir own && chown nobody:nogroup own", cwd: dir).ok)
        }
        if asSource { try mountRamfs(at: base + "/fs") }
        try withVanishMount(options: ["allow_other"], prepareExisting: asSource ? ramfs : nil, prepare: { src in
            if !asSource { try mountRamfs(at: src + "/sub") }
        }) { m in
            let dir = asSource ? "own" : "sub/own"
            let made = try asNobody("echo x > \(dir)/f && mkdir \(dir)/d && ls \(dir)", cwd: m.mountpoint)
            #expect(made.ok && made.stdout == "d\nf\n", "\(made.stderr)")
            let listed = try sh("ls -l \(dir) | wc -l && cat \(dir)/f", cwd: m.mountpoint)
            #expect(listed.ok && listed.stdout == "3\nx\n", "\(listed.stderr)")
            #expect(try m.unmount() == 0)
        }
    }

    @Test("without allow_other other users cannot enter the mount at all")
    func privateByDefault() throws {
        try withVanishMount { m in
            let r = try asNobody("ls .", cwd: "/")
            #expect(r.ok)
            let denied = try asNobody("ls \(shellQuote(m.mountpoint))", cwd: "/")
            #expect(!denied.ok)
        }
    }
}
