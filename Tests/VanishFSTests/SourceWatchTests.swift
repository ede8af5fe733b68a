import Foundation
import Glibc
import Testing
import VanishTestSupport

/// With `cache=auto` a root daemon watches the source's filesystem, so the
/// kernel may keep names, attributes and listings for an hour and still
/// shows every change other programs make behind the mount at once.
@Suite("changes behind the mount", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct SourceWatchTests {
    /// `stat -c FORMAT NAME` run in `dir` (an error's text when it fails).
    func stat(_ format: String, _ name: String, in dir: String) throws -> String {
        let r = try sh("stat -c \(format) \(name) 2>&1", cwd: dir)
        return r.ok ? r.stdout : "error"
    }

    /// Waits until `name` looks the same through the mount as on the backing directory.
    func waitForSame(_ m: VanishMount, _ format: String, _ name: String) throws {
        try waitFor("\(name) (\(format)) through the mount to match the source", timeout: 5) {
            try stat(format, name, in: m.mountpoint) == stat(format, name, in: m.source)
        }
    }

    @Test("every kind of change behind the mount shows through it at once, though the kernel keeps what it was told an hour",
          arguments: [[String](), ["passthrough=off"]])
    func changesShow(options: [String]) throws {
        try withVanishMount(options: options, prepare: { src in
            let r = try sh("mkdir -p d/e && echo one > d/f && echo a > d/a && echo g > d/gone", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let status = try statusJSON(m)
            #expect(status["cache_seconds"] as? Double == 3600, "\(status)")
            // The kernel caches all of it: attributes, names, absent names, data, a listing.
            #expect(try sh("stat d/f d/e d/a d/gone >/dev/null; ls d; cat d/f; stat d/new", cwd: m.mountpoint).stdout
                        == "a\ne\nf\ngone\none\n")
            let behind = try sh("""
                echo two >> d/f && chmod 700 d/e && echo n > d/new && rm d/gone && mv d/a d/b \
                && touch -d @1000000000 d/b && ln d/b d/link
                """, cwd: m.source)
            #expect(behind.ok, "\(behind.stderr)")
            try waitForSame(m, "%s.%Y", "d/f")
            #expect(try sh("cat d/f", cwd: m.mountpoint).stdout == "one\ntwo\n")
            try waitForSame(m, "%a", "d/e")
            try waitForSame(m, "%s", "d/new")
            try waitForSame(m, "%n", "d/gone")
            try waitForSame(m, "%n", "d/a")
            try waitForSame(m, "%Y.%h", "d/b")
            try waitFor("the listing to show the changes", timeout: 5) {
                try sh("ls d", cwd: m.mountpoint).stdout == "b\ne\nf\nlink\nnew\n"
            }
        }
    }

    @Test("a file written through the mount, then by another program behind it, shows the later write",
          arguments: [[String](), ["noevents"]])
    func writeBehindAfterWriteThrough(options: [String]) throws {
        try withVanishMount(options: options) { m in
            // Through the mount (passthrough), then at once behind it: the
            // writer's own modify events, read after its close, are skipped,
            // another program's are not.
            #expect(try sh("printf one > w && printf 1 > v", cwd: m.mountpoint).ok)
            #expect(try sh("echo two >> w", cwd: m.source).ok)
            try waitForSame(m, "%s.%Y", "w")
            // Again after the kernel asked for its attributes.
            #expect(try stat("%s", "v", in: m.mountpoint) == "1\n")
            #expect(try sh("echo 22 >> v", cwd: m.source).ok)
            try waitForSame(m, "%s.%Y", "v")
            #expect(try sh("cat w v", cwd: m.mountpoint).stdout == "onetwo\n122\n")
        }
    }

    @Test("a filesystem mounted inside the source, which the watch does not cover, keeps the one-second cache")
    func nestedKeepsShortCache() throws {
        try withVanishMount(prepare: { src in
            guard try run(["mkdir", src + "/inner"]).ok,
                  try run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", src + "/inner"]).ok,
                  try sh("echo one > inner/f", cwd: src).ok else { throw TestFailure("prepare") }
        }) { m in
            #expect(try stat("%s", "inner/f", in: m.mountpoint) == "4\n")
            #expect(try sh("echo two >> inner/f && mkdir inner/made", cwd: m.source).ok)
            try waitForSame(m, "%s", "inner/f")
            try waitForSame(m, "%F", "inner/made")
        }
    }

    @Test("-o nowatch: the kernel keeps names and attributes one second")
    func noWatch() throws {
        try withVanishMount(options: ["nowatch"]) { m throws in
            #expect(try statusJSON(m)["cache_seconds"] as? Double == 1)
        }
    }
}
