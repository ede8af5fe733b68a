import Foundation
import Glibc
import Testing
import VanishTestSupport

/// stress-ng's filesystem stressors: an independent program that hammers
/// renames, links, xattrs, locks, fallocate, mmap'd and direct I/O, odd file
/// names and permission changes at once, and checks what it reads back.
@Suite("stress", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct StressTests {
    static let stressors = [
        "rename", "link", "symlink", "dentry", "dir", "xattr", "fallocate", "hdd", "lockf", "flock",
        "lockofd", "chmod", "chown", "utime", "touch", "access", "getdent", "fstat", "copy-file",
        "fpunch", "filename", "mknod", "open", "iomix", "fsize", "sync-file",
    ]

    @Test("stress-ng's filesystem stressors pass with --verify, and the daemon keeps serving",
          .enabled(if: which("stress-ng") != nil || FUSEAvailability.isCI,
                   "needs stress-ng (mount-scripts/install --deps-only installs it)"))
    func stressNG() throws {
        try withVanishMount { m in
            let work = m.path("stress")
            #expect(mkdir(work, 0o755) == 0)
            let args = ["stress-ng", "--temp-path", work, "--timeout", "15s", "--verify", "--metrics-brief",
                        "--hdd-bytes", "32M"] + StressTests.stressors.flatMap { ["--\($0)", "1"] }
            let r = try run(args, cwd: work)
            let report = r.stdout + r.stderr
            #expect(r.ok, "stress-ng exited \(r.status):\n\(report.suffix(3000))")
            #expect(report.contains("successful run completed"), "\(report.suffix(3000))")
            #expect(!report.contains(" fail"), "\(report.suffix(3000))")

            // Still serving, with the graveyard out of sight.
            #expect(mountType(at: m.mountpoint) == "fuse.vanish")
            let listing = try FileManager.default.contentsOfDirectory(atPath: m.mountpoint)
            #expect(!listing.contains(".vanish"))
            #expect(rmdir(work) == 0, "stress-ng removes what it made: \(String(cString: strerror(errno)))")

            // Everything it deleted went through the graveyard and is freed.
            let wait = try run(["timeout", "180", vanishBinary, "status", "--wait", m.mountpoint])
            #expect(wait.ok, "\(wait.stderr)")
            let left = try FileManager.default.contentsOfDirectory(atPath: m.source)
            #expect(left == [".vanish"], "\(left)")
            let graves = try run(["find", m.backing(".vanish/clients"), "-mindepth", "4", "-path", "*/graveyard/*"])
            #expect(graves.ok && graves.stdout.isEmpty, "graveyard not drained: \(graves.stdout.prefix(500))")
        }
    }
}
