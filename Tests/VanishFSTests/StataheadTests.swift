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
        try #require(try statusJSON(m)["statahead_entries"] as? Int)
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

    @Test("a names-only walk reads nothing ahead", arguments: [[], ["readdirplus=never"]])
    func namesOnly(options: [String]) throws {
        try withVanishMount(options: options, prepare: { src in
            for d in 0..<20 { try Self.makeBigDirectory(src + "/tree/d\(d)") }
        }) { m throws in
            #expect(try sh("find tree -name no-such-name", cwd: m.mountpoint).ok)
            #expect(try sh("ls -R tree > /dev/null", cwd: m.mountpoint).ok)
            #expect(try Self.statahead(m) == 0)
        }
    }

    /// 30 directories of 20 files, each file a size of its own.
    static func makeTree(_ src: String) throws {
        for d in 0..<30 {
            let dir = src + "/tree/d\(d)"
            try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
            for f in 0..<20 {
                try Data(repeating: 0x62, count: d * 20 + f).write(to: URL(fileURLWithPath: dir + "/f\(f)"))
            }
        }
    }

    static let statWalk = "find tree -printf '%P %s %M %n %U\\n' | sort"

    @Test("a stat walk of a tree warms the directories ahead of it, and prints what the source holds")
    func treeWalk() throws {
        try withVanishMount(prepare: Self.makeTree) { m throws in
            let expected = try sh(Self.statWalk, cwd: m.source)
            _ = try sh("echo 3 > /proc/sys/vm/drop_caches")
            let actual = try sh(Self.statWalk, cwd: m.mountpoint)
            #expect(actual.ok && actual.stdout == expected.stdout, "\(actual.stderr)")
            // Most of the 30 directories were read before the walk got there.
            #expect(try Self.statahead(m) >= 200)
        }
    }

    @Test("directories renamed and files made behind the mount ahead of a walk are shown as they are now")
    func treeChangesDuringWalk() throws {
        try withVanishMount(prepare: Self.makeTree) { m throws in
            let r = try run(["python3", "-c", """
                import os, sys
                mnt, src = sys.argv[1], sys.argv[2]
                seen, order, changed = {}, [], False
                for top, dirs, files in os.walk(os.path.join(mnt, "tree")):
                    if not order:
                        order = list(dirs)  # the order the walk enters them
                    for f in files:
                        p = os.path.join(top, f)
                        seen[os.path.relpath(p, mnt)] = os.lstat(p).st_size
                    if files and not changed:
                        changed = True
                        # The last three the walk enters, still ahead of it: one
                        # moves away, one file grows and one is made behind the mount.
                        os.rename(os.path.join(mnt, "tree", order[-1]), os.path.join(mnt, "moved"))
                        with open(os.path.join(src, "tree", order[-2], "f0"), "ab") as f: f.write(b"z" * 1000)
                        with open(os.path.join(src, "tree", order[-3], "new"), "wb") as f: f.write(b"n" * 7)
                        print("grown", order[-2])
                for k in sorted(seen): print(k, seen[k])
                """, m.mountpoint, m.source])
            #expect(r.ok, "\(r.stderr)")
            // Every file the walk stat'ed is as the source holds it now.
            for line in r.stdout.split(separator: "\n") {
                let parts = line.split(separator: " ")
                guard parts.count == 2, parts[0] != "grown" else { continue }
                var st = stat()
                #expect(lstat(m.backing(String(parts[0])), &st) == 0 && "\(st.st_size)" == parts[1], "\(line)")
            }
            #expect(r.stdout.contains("/new 7\n"), "the walk found the file made behind the mount: \(r.stdout)")
            let grown = r.stdout.split(separator: "\n").first { $0.hasPrefix("grown ") }.map { $0.dropFirst(6) } ?? ""
            #expect(r.stdout.contains("tree/\(grown)/f0 \(1000 + 20 * (Int(grown.dropFirst()) ?? 0))\n"), "\(r.stdout)")
        }
    }

    @Test("nothing is read ahead in directories the caller may not search; nobody sees what nobody sees natively")
    func permissions() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        func prepare(_ src: String) throws {
            try Self.makeBigDirectory(src + "/big")
            // Readable but not searchable: names can be listed, not looked up.
            chmod(src + "/big", 0o744)
            try Self.makeBigDirectory(src + "/closed")
            chmod(src + "/closed", 0o700)
        }
        let warmed = try Self.nobodyParity(script: "\(Self.longListing) 2>&1; ls -ln closed 2>&1; echo $?",
                                           options: ["readdirplus=never"], prepare: prepare)
        #expect(warmed == 0)
    }

    @Test("a stat walk by nobody warms no directory nobody may not read")
    func walkPermissions() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root to become nobody")
        func prepare(_ src: String) throws {
            try Self.makeTree(src)
            // Among 30 open directories of 20 files, closed ones of 600.
            for c in 0..<3 {
                try Self.makeBigDirectory(src + "/tree/closed\(c)")
                chmod(src + "/tree/closed\(c)", 0o700)
            }
        }
        let warmed = try Self.nobodyParity(script: "\(Self.statWalk) 2>&1", options: [], prepare: prepare)
        // The open directories hold 600 files in all; any closed one warmed would add 600.
        #expect(warmed > 0 && warmed <= 600, "\(warmed) entries read ahead")
    }

    /// Runs `script` as nobody in a plain directory and in a mount (with
    /// `allow_other` and `options`) of a source prepared alike, expects both
    /// to print the same, and returns the entries statahead read on the mount.
    static func nobodyParity(script: String, options: [String], prepare: @escaping (String) throws -> Void) throws -> Int {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        try prepare(plain)
        chmod(plain, 0o755)
        let expected = try runAsNobody(["/bin/sh", "-c", script], cwd: plain)
        return try withVanishMount(options: ["allow_other"] + options, prepare: prepare) { m in
            let actual = try runAsNobody(["/bin/sh", "-c", script], cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout.replacingOccurrences(of: plain, with: m.mountpoint))
            return try Self.statahead(m)
        }
    }

    /// Looks up the 2,000 files of `big` in the backing listing's order
    /// (`forward`) or the reverse, with no listing through the mount.
    @Test("lookups in the listing's order are read ahead; in another order, reading ahead stops soon",
          arguments: [true, false])
    func lookupOrder(forward: Bool) throws {
        try withVanishMount(prepare: { src in
            try FileManager.default.createDirectory(atPath: src + "/big", withIntermediateDirectories: true)
            for f in 0..<2000 { #expect(FileManager.default.createFile(atPath: src + "/big/f\(f)", contents: nil)) }
        }) { m throws in
            let r = try run(["python3", "-c", """
                import os, sys
                src, mnt, forward = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
                names = os.listdir(os.path.join(src, "big"))
                for name in (names if forward else reversed(names)):
                    os.lstat(os.path.join(mnt, "big", name))
                """, m.source, m.mountpoint, forward ? "1" : "0"])
            #expect(r.ok, "\(r.stderr)")
            let read = try Self.statahead(m)
            if forward {
                #expect(read >= 1000, "\(read) of 2,000 read ahead")
            } else {
                // Stopped after 64 lookups it had not read, a window (128) ahead at most.
                #expect(read <= 500, "\(read) of 2,000 read ahead")
            }
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
