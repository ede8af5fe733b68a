import Foundation
import Glibc
import Testing
import VanishTestSupport

/// concurrent_model.py beside this file: four processes change the tree at
/// once (in shared directories and their own), each checking every result
/// against a model of its own entries. It found that the in-band `vanish rm`
/// answered before the kernel had dropped the path, and that a new file
/// given a freed inode number was taken by the kernel for the old file
/// (link(2) of it failed with ENOENT; with `sync_unlink`, in most runs).
@Suite("concurrent model check", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct ConcurrentModelTests {
    struct Mode: CustomTestStringConvertible, Sendable {
        var options: [String] = []
        var arguments: [String] = []
        /// Script flags beyond `--vanish`.
        var checks: [String] = []
        var testDescription: String {
            let all = (options + arguments + checks).joined(separator: " ")
            return all.isEmpty ? "defaults" : all
        }
    }

    static let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .appendingPathComponent("concurrent_model.py").path

    @Test("random concurrent changes match each worker's model, and the mount shows what the source holds",
          arguments: [Mode(), Mode(options: ["sync_unlink"]), Mode(options: ["cache=always"]),
                      Mode(arguments: ["--keep", "1h"]),
                      // Re-linking only where the kernel gets no readdirplus
                      // attributes: with them it can fail (see the README).
                      Mode(options: ["readdirplus=never"], checks: ["--relink"])])
    func modelCheck(_ mode: Mode) throws {
        try withVanishMount(options: mode.options, arguments: mode.arguments) { m in
            for seed in 1...2 {
                let r = try run(["python3", ConcurrentModelTests.script, m.mountpoint, "4", "2000", "\(seed)", "--vanish"]
                                + mode.checks)
                #expect(r.ok, "\(r.stdout)\(r.stderr)")
            }
            let mounted = try sh("find . | sort", cwd: m.mountpoint).stdout
            let backing = try sh("find . -path ./.vanish -prune -o -print | sort", cwd: m.source).stdout
            #expect(mounted == backing)
        }
    }

    @Test("lookups and listings of one directory at once, beside creates, unlinks and renames in it",
          arguments: [["cache=never"], []])
    func parallelLookups(options: [String]) throws {
        try withVanishMount(options: options, prepare: { src in
            mkdir(src + "/d", 0o755)
            for i in 0..<2000 { _ = FileManager.default.createFile(atPath: src + "/d/k\(i)", contents: Data(count: i % 7)) }
        }) { m in
            try m.waitForLog("granted=passthrough,parallel_dirops")
            // Six readers stat and list the stable names (and some never made)
            // while two writers make, rename and remove their own names there.
            let r = try run(["python3", "-c", """
                import multiprocessing as mp, os, random, sys
                d = sys.argv[1]
                def reader(w, q):
                    rnd, bad = random.Random(w), []
                    for i in range(3000):
                        k = rnd.randrange(2000)
                        if rnd.random() < 0.1:
                            try: os.stat(f"{d}/none{k}"); bad.append(f"none{k} exists")
                            except FileNotFoundError: pass
                        elif i % 500 == 0:
                            names = set(os.listdir(d))
                            if not all(f"k{j}" in names for j in range(2000)): bad.append("listing lost a k name")
                        elif os.stat(f"{d}/k{k}").st_size != k % 7: bad.append(f"k{k} has the wrong size")
                    q.put(bad[:5])
                def writer(w, q):
                    bad = []
                    for i in range(1500):
                        a, b = f"{d}/w{w}_{i}", f"{d}/w{w}_{i}r"
                        with open(a, "wb") as f: f.write(b"x" * (i % 5))
                        os.rename(a, b)
                        if os.stat(b).st_size != i % 5: bad.append(f"{b} wrong size")
                        os.unlink(b)
                        if os.path.lexists(b): bad.append(f"{b} still there")
                    q.put(bad[:5])
                q = mp.Queue()
                ps = [mp.Process(target=reader, args=(w, q)) for w in range(6)]
                ps += [mp.Process(target=writer, args=(w, q)) for w in range(2)]
                for p in ps: p.start()
                bad = [b for _ in ps for b in q.get()]
                for p in ps: p.join()
                left = [n for n in os.listdir(d) if n.startswith("w")]
                print("\\n".join(bad + [f"left: {n}" for n in left]) or "ok")
                """, m.path("d")])
            #expect(r.ok && r.stdout == "ok\n", "\(r.stdout)\(r.stderr)")
        }
    }
}
