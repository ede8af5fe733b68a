import Foundation
import Glibc
import Testing
import VanishTestSupport

/// The kernel keeps directory listings (FOPEN_CACHE_DIR) and negative
/// entries. Each must end exactly when the directory changes: through the
/// mount (the kernel sees it), by Vanish itself (`vanish rm`, a restore:
/// Vanish tells the kernel), or behind the mount (cache=auto: the
/// directory's mtime, once its attributes expire).
@Suite("directory listings and negative entries cached by the kernel", .serialized,
       .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct DirectoryCacheTests {
    static func fill(_ src: String) throws {
        for d in ["a", "a/sub", "a/other"] {
            try FileManager.default.createDirectory(atPath: src + "/" + d, withIntermediateDirectories: true)
        }
        for f in 0..<20 { try Data("\(f)".utf8).write(to: URL(fileURLWithPath: src + "/a/f\(f)")) }
        try Data("x".utf8).write(to: URL(fileURLWithPath: src + "/a/sub/inner"))
    }

    /// `ls -A` of `dir` (names only: ls to a pipe stats nothing).
    static func names(_ dir: String) throws -> String {
        let r = try run(["ls", "-A", dir])
        guard r.ok else { throw TestFailure("ls \(dir): \(r.stderr)") }
        return r.stdout
    }

    @Test("vanish rm and restore change a listing the kernel caches at once", arguments: ["auto", "always"])
    func ownChangesOutOfBand(cache: String) throws {
        try withVanishMount(options: ["cache=\(cache)"], arguments: ["--keep", "1h"], prepare: Self.fill) { m throws in
            let before = try Self.names(m.path("a"))
            #expect(before.contains("sub\n"))
            // Twice: the second listing comes from the kernel's cache.
            #expect(try Self.names(m.path("a")) == before)
            // `sub` was listed but never looked up: the kernel has no entry
            // for it, only the cached listing of `a`.
            #expect(try run([vanishBinary, "rm", "-r", m.path("a/sub")]).ok)
            let after = try Self.names(m.path("a"))
            #expect(!after.contains("sub\n"), "the cached listing still shows the removed directory: \(after)")
            #expect(access(m.path("a/sub"), F_OK) != 0)

            let restored = try run([vanishBinary, "restore", m.path("a/sub")])
            #expect(restored.ok, "\(restored.stderr)")
            #expect(try Self.names(m.path("a")) == before)
            #expect(try String(contentsOfFile: m.path("a/sub/inner"), encoding: .utf8) == "x")
        }
    }

    @Test("a name the kernel remembers as absent exists at once after a restore", arguments: ["auto", "always"])
    func negativeEntryThenRestore(cache: String) throws {
        try withVanishMount(options: ["cache=\(cache)"], arguments: ["--keep", "1h"], prepare: Self.fill) { m throws in
            #expect(unlink(m.path("a/f3")) == 0)
            // Looked for and not found: the kernel now caches its absence.
            #expect(access(m.path("a/f3"), F_OK) != 0 && errno == ENOENT)
            #expect(!(try Self.names(m.path("a"))).contains("f3\n"))
            #expect(try run([vanishBinary, "restore", m.path("a/f3")]).ok)
            #expect(access(m.path("a/f3"), F_OK) == 0)
            #expect(try Self.names(m.path("a")).contains("f3\n"))
            #expect(try String(contentsOfFile: m.path("a/f3"), encoding: .utf8) == "3")
        }
    }

    @Test("a restore shows in a cached listing whose entries the kernel has forgotten", arguments: ["auto", "always"])
    func restoreIntoForgottenEntries(cache: String) throws {
        try withVanishMount(options: ["cache=\(cache)"], arguments: ["--keep", "1h"], prepare: Self.fill) { m throws in
            #expect(unlink(m.path("a/f3")) == 0)
            // One process keeps `a` open (so the kernel keeps its inode and its
            // cached listing) while the kernel drops every unused entry below
            // it: the restore then names an entry the kernel no longer has.
            let r = try run(["python3", "-c", """
                import os, subprocess, sys
                mnt, vanish = sys.argv[1], sys.argv[2]
                fd = os.open(mnt + "/a", os.O_RDONLY | os.O_DIRECTORY)
                first = sorted(os.listdir(fd))
                assert "f3" not in first and sorted(os.listdir(fd)) == first, first
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("2\\n")
                subprocess.run([vanish, "restore", mnt + "/a/f3"], check=True)
                after = sorted(os.listdir(fd))
                assert "f3" in after, after
                """, m.mountpoint, vanishBinary])
            #expect(r.ok, "\(r.stderr)")
        }
    }

    @Test("changes through the mount show in the next listing", arguments: ["auto", "always"])
    func changesThroughTheMount(cache: String) throws {
        try withVanishMount(options: ["cache=\(cache)"], prepare: Self.fill) { m throws in
            _ = try Self.names(m.path("a"))
            _ = try Self.names(m.path("a"))
            let r = try sh("touch a/new && mv a/f1 a/moved && rm a/f2 && mkdir a/d && rmdir a/other && ln a/f4 a/hard",
                           cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(try Self.names(m.path("a")) == (try Self.names(m.backing("a"))))
        }
    }

    @Test("with cache=auto a listing catches up with changes behind the mount")
    func changesBehindTheMount() throws {
        try withVanishMount(prepare: Self.fill) { m throws in
            _ = try Self.names(m.path("a"))
            _ = try Self.names(m.path("a"))
            try Data("new".utf8).write(to: URL(fileURLWithPath: m.backing("a/made-behind")))
            #expect(unlink(m.backing("a/f5")) == 0)
            let expected = try Self.names(m.backing("a"))
            // The kernel trusts the directory's attributes for 1 s, then sees its new mtime.
            try waitFor("the listing to show the source's changes", timeout: 5) {
                try Self.names(m.path("a")) == expected
            }
        }
    }
}
