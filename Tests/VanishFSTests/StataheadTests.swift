import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Statahead reads a directory ahead of programs that look up what they
/// listed. It only warms the backing filesystem: what programs see must be
/// what the source holds, and it must start only for walks that look files
/// up, in directories the caller may search.
@Suite("statahead", .serialized, .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct StataheadTests {
    /// `dir` with 600 files, each a size of its own.
    static func makeBigDirectory(_ dir: String) throws {
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
        for f in 0..<600 {
            try Data(repeating: 0x61, count: f).write(to: URL(fileURLWithPath: dir + "/f\(f)"))
        }
    }

    static func statahead(_ m: VanishMount) throws -> Int {
        let r = try run([vanishBinary, "status", "--json", m.mountpoint])
        let json = try JSONSerialization.jsonObject(with: Data(r.stdout.utf8)) as? [String: Any]
        return try #require(json?["statahead_entries"] as? Int, "\(r.stdout)")
    }

    static let longListing = "ls -ln --time-style=+%s big"

    // readdirplus=never: every stat after a listing is a LOOKUP, the
    // pattern statahead is for; the default mode sends attributes instead
    // once a directory's files are looked up.
    @Test("ls -l of a listing sent without attributes: read ahead, and shown as the source holds it")
    func longListing() throws {
        try withVanishMount(options: ["readdirplus=never"], prepare: { try Self.makeBigDirectory($0 + "/big") }) { m throws in
            let expected = try sh(Self.longListing, cwd: m.source)
            _ = try sh("echo 3 > /proc/sys/vm/drop_caches")
            let actual = try sh(Self.longListing, cwd: m.mountpoint)
            #expect(actual.ok && actual.stdout == expected.stdout, "\(actual.stderr)")
            #expect(try Self.statahead(m) > 0, "nothing was read ahead")
        }
    }

    @Test("a names-only walk reads nothing ahead")
    func namesOnly() throws {
        try withVanishMount(options: ["readdirplus=never"], prepare: { src in
            for d in 0..<20 { try Self.makeBigDirectory(src + "/tree/d\(d)") }
        }) { m throws in
            #expect(try sh("find tree -name no-such-name", cwd: m.mountpoint).ok)
            #expect(try sh("ls -R tree > /dev/null", cwd: m.mountpoint).ok)
            #expect(try Self.statahead(m) == 0)
        }
    }

    @Test("nothing is read ahead in directories the caller may not search; nobody sees what nobody sees natively")
    func permissions() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        func prepare(_ src: String) throws {
            try Self.makeBigDirectory(src + "/big")
            // Readable but not searchable: names can be listed, not looked up.
            chmod(src + "/big", 0o744)
            try Self.makeBigDirectory(src + "/closed")
            chmod(src + "/closed", 0o700)
        }
        try prepare(plain)
        chmod(plain, 0o755)
        let script = "\(Self.longListing) 2>&1; ls -ln closed 2>&1; echo $?"
        let expected = try runAsNobody(["/bin/sh", "-c", script], cwd: plain)
        try withVanishMount(options: ["allow_other", "readdirplus=never"], prepare: prepare) { m in
            let actual = try runAsNobody(["/bin/sh", "-c", script], cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout.replacingOccurrences(of: plain, with: m.mountpoint))
            #expect(try Self.statahead(m) == 0)
        }
    }

    @Test("names renamed, and files made behind the mount (cache=auto), during a read-ahead walk are shown as they are now")
    func changesDuringWalk() throws {
        try withVanishMount(options: ["readdirplus=never"], prepare: { try Self.makeBigDirectory($0 + "/big") }) { m throws in
            let r = try run(["python3", "-c", """
                import os, sys
                mnt, src = sys.argv[1], sys.argv[2]
                d, behind = os.path.join(mnt, "big"), os.path.join(src, "big")
                names = [e.name for e in os.scandir(d)]
                out = []
                for i, name in enumerate(names):
                    if i == 50:
                        # Through the mount: swap two names further on, move one away.
                        os.rename(os.path.join(d, "f500"), os.path.join(d, "tmp"))
                        os.rename(os.path.join(d, "f501"), os.path.join(d, "f500"))
                        os.rename(os.path.join(d, "tmp"), os.path.join(d, "f501"))
                        os.rename(os.path.join(d, "f502"), os.path.join(mnt, "moved"))
                        # Behind the mount: one grows, one is made.
                        with open(os.path.join(behind, "f503"), "ab") as f: f.write(b"z" * 1000)
                        with open(os.path.join(behind, "new"), "wb") as f: f.write(b"n" * 7)
                    try:
                        out.append(f"{name} {os.lstat(os.path.join(d, name)).st_size}")
                    except FileNotFoundError:
                        out.append(f"{name} gone")
                print("\\n".join(out))
                """, m.mountpoint, m.source])
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout.contains("f500 501\n") && r.stdout.contains("f501 500\n"), "\(r.stdout)")
            #expect(r.stdout.contains("f502 gone\n"))
            #expect(r.stdout.contains("f503 1503\n"), "a file grown behind the mount, never looked up before")
            #expect(try Self.statahead(m) > 0)
            // The file made behind the mount, once the listing's second is over.
            try waitFor("the mount to list the file made behind it", timeout: 5) {
                try sh("ls -ln big/new", cwd: m.mountpoint).stdout.contains(" 7 ")
            }
        }
    }
}
