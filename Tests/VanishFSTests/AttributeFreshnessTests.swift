import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Changes made through the mount that the kernel does not see itself (a
/// passthrough mmap write, inode flags, ACLs) reach its attribute cache at
/// once, however long it may keep attributes.
@Suite("attributes after changes through the mount", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct AttributeFreshnessTests {
    /// The same `stat -c FORMAT` through the mount and on the backing file.
    func both(_ m: VanishMount, _ format: String, _ name: String) throws -> (String, String) {
        (try sh("stat -c \(format) \(name)", cwd: m.mountpoint).stdout, try sh("stat -c \(format) \(name)", cwd: m.source).stdout)
    }

    @Test("a shared mmap write moves mtime; chattr moves ctime; an ACL changes the mode", arguments: ["cache=auto", "cache=always"])
    func fresh(cache: String) throws {
        try withVanishMount(options: [cache], prepare: { src in
            let r = try sh("head -c 4096 /dev/zero > mapped && echo x > flagged && echo y > acl && chmod 600 acl", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            // An old mtime the kernel caches, then a write through a shared mapping.
            #expect(try sh("touch -m -d @1000000000 mapped && stat -c %Y mapped", cwd: m.mountpoint).stdout == "1000000000\n")
            let map = try sh("""
                python3 -c "import mmap; f = open('mapped', 'r+b'); m = mmap.mmap(f.fileno(), 4096); m[0:4] = b'abcd'; m.flush(); m.close(); f.close()"
                """, cwd: m.mountpoint)
            #expect(map.ok, "\(map.stderr)")
            let (mtime, backingMtime) = try both(m, "%Y", "mapped")
            #expect(mtime == backingMtime && mtime != "1000000000\n", "\(mtime) \(backingMtime)")

            _ = try sh("stat -c %Z flagged", cwd: m.mountpoint)
            #expect(try sh("touch -d @1000000000 flagged && chattr +A flagged", cwd: m.mountpoint).ok)
            let (ctime, backingCtime) = try both(m, "%Z.%z", "flagged")
            #expect(ctime == backingCtime, "\(ctime) \(backingCtime)")

            _ = try sh("stat -c %a acl", cwd: m.mountpoint)
            #expect(try sh("setfacl -m o::r acl", cwd: m.mountpoint).ok)
            let (mode, backingMode) = try both(m, "%a", "acl")
            #expect(mode == "604\n" && mode == backingMode, "\(mode) \(backingMode)")
            #expect(try sh("setfacl -b acl && chmod 640 acl && setfacl -x o acl 2>/dev/null; setfacl -m g::--- acl", cwd: m.mountpoint).ok)
            let (after, backingAfter) = try both(m, "%a", "acl")
            #expect(after == backingAfter, "\(after) \(backingAfter)")
        }
    }

    /// tmpfs counts a directory's entries in its size, as btrfs and XFS do,
    /// and an unlinked file leaves the backing directory only when its
    /// queued burial lands, after the kernel was given the size (for an
    /// hour under the source watch).
    @Test("a directory's size and times follow its backing directory once unlinked files' burials land")
    func directoryAfterLanding() throws {
        try withVanishMountOnTmpfs(size: "16m", prepare: { src in
            guard try sh("mkdir d && touch d/a d/b d/a-much-longer-name", cwd: src).ok else { throw TestFailure("prepare") }
        }) { m throws in
            #expect(try sh("stat -c %s d && rm d/a d/a-much-longer-name && stat -c %s d", cwd: m.mountpoint).ok)
            try waitFor("the burials to land") { try sh("ls -A d", cwd: m.source).stdout == "b\n" }
            try waitFor("the mount to show the backing directory's size and times") {
                let (shown, backing) = try both(m, "%s.%Y.%Z", "d")
                return shown == backing
            }
        }
    }

    @Test("sed -i keeps a 644 file's mode on a mount only its owner may use")
    func sedInPlace() throws {
        try withVanishMount(prepare: { src in
            guard try sh("printf 'a\\nb\\n' > f && chmod 644 f", cwd: src).ok else { throw TestFailure("prepare") }
        }) { m throws in
            #expect(try sh("sed -i s/a/A/ f && stat -c %a f && cat f", cwd: m.mountpoint).stdout == "644\nA\nb\n")
            #expect(try sh("stat -c %a f", cwd: m.source).stdout == "644\n")
        }
    }
}
