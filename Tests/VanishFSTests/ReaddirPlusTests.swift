import Foundation
import Glibc
import Testing
import VanishTestSupport

/// `readdirplus=walk` (the default): listings carry attributes only where
/// the walk stats what it lists. Whatever a listing carries, what programs
/// see must be what the source holds.
@Suite("readdirplus fitted to the walk", .serialized, .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct ReaddirPlusTests {
    /// 10 directories of 30 files, each file a size of its own.
    static func makeWalkTree(_ src: String) throws {
        for d in 0..<10 {
            let dir = src + "/tree/d\(d)"
            try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
            for f in 0..<30 {
                try Data(repeating: 0x61, count: d * 30 + f).write(to: URL(fileURLWithPath: dir + "/f\(f)"))
            }
        }
    }

    static func knownInodes(_ m: VanishMount) throws -> Int {
        try #require(try statusJSON(m)["known_inodes"] as? Int)
    }

    static let statWalk = "find tree -printf '%P %s %M %n %U\\n' | sort"

    @Test("a names-only walk leaves the files unknown to the kernel; a stat walk lists them as the source has them")
    func namesThenStats() throws {
        try withVanishMount(prepare: { try Self.makeWalkTree($0) }) { m in
            let names = try sh("find tree -name no-such-name", cwd: m.mountpoint)
            #expect(names.ok && names.stdout.isEmpty, "\(names.stderr)")
            #expect(try Self.knownInodes(m) < 30, "find -name made the kernel instantiate the files")
            let expected = try sh(Self.statWalk, cwd: m.source)
            let actual = try sh(Self.statWalk, cwd: m.mountpoint)
            #expect(actual.ok && actual.stdout == expected.stdout, "\(actual.stderr)")
            #expect(try Self.knownInodes(m) >= 300)
            // The same again, now that listings near here carry attributes.
            _ = try sh("echo 3 > /proc/sys/vm/drop_caches", cwd: m.mountpoint)
            #expect(try sh(Self.statWalk, cwd: m.mountpoint).stdout == expected.stdout)
        }
    }

    @Test("once files of a directory are looked up, listings of the directories near it carry attributes")
    func attributesNearLookups() throws {
        try withVanishMount(prepare: { try Self.makeWalkTree($0) }) { m in
            #expect(try sh("ls tree/d1 > /dev/null", cwd: m.mountpoint).ok)
            let before = try Self.knownInodes(m)
            #expect(before < 30, "a first listing carries names only")
            // A stat in d0 marks d0 and the directories above it.
            #expect(try sh("cat tree/d0/f0 > /dev/null && ls tree/d2 > /dev/null", cwd: m.mountpoint).ok)
            #expect(try Self.knownInodes(m) >= before + 30, "d2, beside d0, was listed with attributes")
        }
    }

    @Test("a listing with attributes shows files changed or made behind the mount (cache=auto) as they are now",
          arguments: [[], ["readdirplus=always"]])
    func changedBehindTheMount(options: [String]) throws {
        try withVanishMount(options: options, prepare: { try Self.makeWalkTree($0) }) { m in
            #expect(try sh(Self.statWalk, cwd: m.mountpoint).ok)
            // Behind the mount: one file grows, one is made, one goes.
            try Data(repeating: 0x62, count: 5000).write(to: URL(fileURLWithPath: m.backing("tree/d3/f1")))
            try Data(repeating: 0x62, count: 7).write(to: URL(fileURLWithPath: m.backing("tree/d3/new")))
            #expect(unlink(m.backing("tree/d3/f2")) == 0)
            let expected = try sh(Self.statWalk, cwd: m.source).stdout
            // cache=auto keeps what the kernel knows for a second at most.
            try waitFor("the mount to show the source's changes", timeout: 5) {
                try sh(Self.statWalk, cwd: m.mountpoint).stdout == expected
            }
        }
    }

    @Test("names renamed while a directory is being listed are stat'ed as they are now")
    func renamesDuringWalk() throws {
        try withVanishMount(prepare: { try Self.makeWalkTree($0) }) { m in
            let r = try run(["python3", "-c", """
                import os, sys
                root = sys.argv[1]
                d = os.path.join(root, "tree", "d4")
                it = os.scandir(d)
                first = [next(it) for _ in range(5)]
                # Swap two files and move a third while the listing is open.
                os.rename(os.path.join(d, "f10"), os.path.join(d, "tmp"))
                os.rename(os.path.join(d, "f11"), os.path.join(d, "f10"))
                os.rename(os.path.join(d, "tmp"), os.path.join(d, "f11"))
                os.rename(os.path.join(d, "f12"), os.path.join(root, "tree", "moved"))
                rest = list(it)
                for e in first + rest:
                    try:
                        print(e.name, os.lstat(e.path).st_size)
                    except FileNotFoundError:
                        print(e.name, "gone")
                print("moved", os.lstat(os.path.join(root, "tree", "moved")).st_size)
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            for line in r.stdout.split(separator: "\n") {
                let parts = line.split(separator: " ")
                guard parts.count == 2 else { continue }
                let path = parts[0] == "moved" ? "tree/moved" : "tree/d4/\(parts[0])"
                var st = stat()
                let backing = lstat(m.backing(path), &st) == 0 ? "\(st.st_size)" : "gone"
                #expect(String(parts[1]) == backing, "\(path)")
            }
            #expect(r.stdout.contains("f10 \(4 * 30 + 11)") && r.stdout.contains("f11 \(4 * 30 + 10)"), "\(r.stdout)")
        }
    }

    @Test("nobody's walks see what nobody sees natively, names-only and stat'ing, in a tree with a closed directory")
    func permissions() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        func prepare(_ src: String) throws {
            try Self.makeWalkTree(src)
            chmod(src + "/tree/d5", 0o700)
            chmod(src + "/tree/d6", 0o711)
            chmod(src + "/tree/d7/f3", 0o600)
        }
        try prepare(plain)
        chmod(plain, 0o755)
        let script = "find tree -name 'f1*' 2>&1 | sort; \(Self.statWalk) 2>&1; cat tree/d6/f1 tree/d7/f3 2>&1 | wc -c; ls tree/d6 2>&1"
        let expected = try runAsNobody(["/bin/sh", "-c", script], cwd: plain)
        try withVanishMount(options: ["allow_other"], prepare: prepare) { m in
            let actual = try runAsNobody(["/bin/sh", "-c", script], cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout.replacingOccurrences(of: plain, with: m.mountpoint), "\(actual.stderr)")
        }
    }
}
