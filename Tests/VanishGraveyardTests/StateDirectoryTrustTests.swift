import Foundation
import Glibc
import Testing
import VanishGraveyard
import VanishTestSupport

/// A state directory another user made (in a source they may write, before
/// root's first mount) is never trusted: no log of theirs is replayed, no
/// graveyard of theirs receives root's deletions.
@Suite("state directory trust", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct StateDirectoryTrustTests {
    /// A world-writable sticky source, as /tmp, holding root's private data.
    private func withSharedSource(_ body: (_ base: String, _ source: String) throws -> Void) throws {
        let base = try makeTempDirectory()
        defer { unmountAndRemove(base + "/mnt", base: base) }
        chmod(base, 0o755)
        let r = try sh("""
            mkdir -m 1777 src && mkdir mnt && mkdir -m 700 src/rootdata && echo data > src/rootdata/important.db
            """, cwd: base)
        guard r.ok else { throw TestFailure(r.stderr) }
        try body(base, base + "/src")
    }

    /// nobody plants `.vanish` with the marker, an old-layout unlink log
    /// naming root's file, and the graveyard of the client id root will use.
    private func plant(in source: String) throws {
        let state = source + "/.vanish"
        let r = try runAsNobody(["/bin/sh", "-c", """
            mkdir -m 777 .vanish && touch .vanish/VANISH-STATE-DIRECTORY
            mkdir -p -m 777 .vanish/clients/test/graveyard
            for i in $(seq 0 63); do mkdir -m 777 .vanish/clients/test/graveyard/$(printf %02x $i); done
            """], cwd: source)
        guard r.ok else { throw TestFailure(r.stderr) }
        // The log is written with Vanish's own code, as a previous Vanish of
        // nobody's would have, then handed to nobody.
        var st = stat()
        guard lstat(source + "/rootdata/important.db", &st) == 0 else { throw TestFailure("no victim") }
        let fd = open(state, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let log = try UnlinkIntents(stateFD: fd)
        log.clear()
        try Array("rootdata/important.db".utf8).withUnsafeBufferPointer {
            try log.record(st, deleted: 1, uid: 0, gid: 0, inPlace: true, path: $0)
        }
        guard try run(["chown", "-R", "nobody:nogroup", state]).ok else { throw TestFailure("chown") }
    }

    @Test("root's mount refuses a state directory nobody planted, and replays nothing from it")
    func plantedStateDirectory() throws {
        try withSharedSource { base, source in
            try plant(in: source)
            let m = try run([vanishBinary, "mount", "-o", "client=test", source, base + "/mnt"])
            #expect(m.status == 1, "\(m.stdout)\(m.stderr)")
            #expect(m.stderr.contains("not private"), "\(m.stderr)")
            #expect(mountType(at: base + "/mnt") == nil)
            #expect(access(source + "/rootdata/important.db", F_OK) == 0, "root's file was deleted by nobody's log")
            let reap = try run([vanishBinary, "reap", "--client", "test", source])
            #expect(reap.status == 1, "\(reap.stdout)\(reap.stderr)")
            #expect(access(source + "/rootdata/important.db", F_OK) == 0)
        }
    }

    @Test("an in-place mount refuses a planted state directory where it is, before moving it anywhere (issue 49)")
    func plantedStateDirectoryInPlace() throws {
        try withSharedSource { _, source in
            try plant(in: source)
            let m = try run([vanishBinary, "mount", "-o", "client=test", source])
            defer { if mountType(at: source) != nil { _ = try? run(["fusermount3", "-u", source]) } }
            #expect(m.status == 1, "\(m.stdout)\(m.stderr)")
            #expect(m.stderr.contains("not private") && !m.stderr.contains("chown"), "\(m.stderr)")
            #expect(mountType(at: source) == nil)
            #expect(try sh("stat -c %U .vanish", cwd: source).stdout == "nobody\n", "the planted directory stays where it was")
            let carried = try sh("find /var/lib/vanish/in-place -maxdepth 2 -name .vanish -user nobody 2>/dev/null")
            #expect(carried.stdout.isEmpty, "moved into root's state base: \(carried.stdout)")
            #expect(access(source + "/rootdata/important.db", F_OK) == 0)
        }
    }

    @Test("a state directory of root's with a client directory nobody made in it is refused")
    func plantedClientDirectory() throws {
        try withSharedSource { base, source in
            let r = try sh("""
                mkdir -m 777 .vanish && touch .vanish/VANISH-STATE-DIRECTORY
                install -d -o nobody -m 777 .vanish/clients .vanish/clients/test
                """, cwd: source)
            #expect(r.ok)
            let m = try run([vanishBinary, "mount", "-o", "client=test", source, base + "/mnt"])
            #expect(m.status == 1, "\(m.stdout)\(m.stderr)")
            #expect(m.stderr.contains(".vanish"), "\(m.stderr)")
            // Made private, it is taken.
            #expect(try sh("chown -R root:root .vanish && chmod -R go= .vanish", cwd: source).ok)
            let ok = try run([vanishBinary, "mount", "-o", "client=test", source, base + "/mnt"])
            #expect(ok.ok, "\(ok.stderr)")
        }
    }

    @Test("a new state directory is private to the daemon's user")
    func newStateDirectoryIsPrivate() throws {
        try withSharedSource { base, source in
            let m = try run([vanishBinary, "mount", "-o", "client=test", source, base + "/mnt"])
            #expect(m.ok, "\(m.stderr)")
            let modes = try sh("stat -c '%a %U' .vanish .vanish/clients .vanish/clients/test .vanish/clients/test/graveyard",
                               cwd: source)
            #expect(modes.stdout == "700 root\n700 root\n700 root\n700 root\n")
        }
    }
}
