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
}
