import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import Testing
import VanishClient
@testable import VanishControl
@testable import VanishFS
@testable import VanishGraveyard

/// The control plane's decisions, in process: who may reach what, which
/// entries a restore brings back, what `vanish status` says to whom.
@Suite("control plane")
struct ControlPlaneTests {
    static func entry(_ path: String, uid: UInt32 = 1000, at deleted: UInt64, kind: TrashRecord.Kind = .file,
                      bytes: UInt64? = 4096) -> TrashEntry {
        TrashEntry(id: "e\(deleted)", shard: 0, deleted: deleted,
                   record: TrashRecord(path: Array(path.utf8), uid: uid, gid: uid, bytes: bytes, kind: kind))
    }

    @Test("a directory's restore plan takes the newest deletion of each path inside it, parents first")
    func newestInside() {
        let entries = [
            Self.entry("d/a", at: 1), Self.entry("d/sub/b", at: 2), Self.entry("d/a", at: 3),
            Self.entry("d/sub", at: 4, kind: .directory), Self.entry("dd/x", at: 5), Self.entry("d", at: 6, kind: .directory),
        ]
        let plan = UndoWindow.newest(inside: Array("d".utf8), of: entries)
        #expect(plan.map { String(decoding: $0.record.path, as: UTF8.self) }.sorted() == ["d/a", "d/sub", "d/sub/b"])
        #expect(plan.first { $0.record.path == Array("d/a".utf8) }?.deleted == 3, "the latest d/a")
        #expect(plan.last?.record.path == Array("d/sub/b".utf8), "children after their parents")
        #expect(!UndoWindow.isInside(Array("dd/x".utf8), Array("d".utf8)))
        #expect(!UndoWindow.isInside(Array("d".utf8), Array("d".utf8)))
    }

    @Test("restore destinations may not be the root, contain . or .. or a NUL byte, or enter the state directory",
          arguments: ["", "/", "a/../b", "./a", "a/.", ".vanish", ".vanish/graveyard/x", "..\0/out", "a/b\0c"])
    func badDestinations(_ target: String) {
        #expect(throws: RestoreError.self) { try UndoWindow.destination(Array(target.utf8)) }
    }

    @Test("a restore is in place only at the same path and, for a directory, in the directory it left; an entry recorded as a file never is")
    func inPlace() throws {
        var template = Array("/tmp/vanish-inplace.XXXXXX".utf8CString)
        let dir = String(cString: try #require(mkdtemp(&template)))
        defer { rmdir(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let (st, birth) = try Sys.fstatWithBirth(fd)
        let path = Array("a/x".utf8)
        let file = TrashRecord(path: path, uid: 1, gid: 1, bytes: 0, kind: .file)
        // A directory exchanged onto a file's name before its burial carries a file's record.
        #expect(!MountControl.isInPlace(file, fd, path))
        let legacy = TrashRecord(path: path, uid: 1, gid: 1, bytes: nil, kind: .directory)
        #expect(MountControl.isInPlace(legacy, fd, path), "directory records from before version 4 go by the path")
        var here = legacy
        here.from = TrashRecord.Origin(inode: UInt64(st.st_ino), birth: birth)
        #expect(MountControl.isInPlace(here, fd, path))
        #expect(!MountControl.isInPlace(here, fd, Array("a/y".utf8)))
        var elsewhere = legacy
        elsewhere.from = TrashRecord.Origin(inode: UInt64(st.st_ino) + 1, birth: birth)
        #expect(!MountControl.isInPlace(elsewhere, fd, path), "another directory at that path")
    }

    @Test("a destination splits into its directory and its name")
    func destinationParts() throws {
        let (dir, leaf) = try UndoWindow.destination(Array("/a//b/c".utf8))
        #expect(dir == [Array("a".utf8), Array("b".utf8)])
        #expect(leaf == Array("c".utf8))
        #expect(try UndoWindow.destination(Array("x.vanish".utf8)).leaf == Array("x.vanish".utf8))
    }

    @Test("credentials: owner, group and other bits decide, as generic_permission; root needs an x bit only to execute")
    func modeBits() {
        var st = stat()
        st.st_uid = 1000
        st.st_gid = 100
        st.st_mode = S_IFREG | 0o640
        let owner = Credentials(uid: 1000, gid: 1000, groups: [])
        let member = Credentials(uid: 1001, gid: 1001, groups: [100])
        let other = Credentials(uid: 1002, gid: 1002, groups: [])
        let root = Credentials(uid: 0, gid: 0, groups: [])
        #expect(owner.modeBitsGrant(st, 6) && !owner.modeBitsGrant(st, 1))
        #expect(member.modeBitsGrant(st, 4) && !member.modeBitsGrant(st, 2))
        #expect(!other.modeBitsGrant(st, 4))
        #expect(root.modeBitsGrant(st, 6) && !root.modeBitsGrant(st, 1))
        st.st_mode = S_IFREG | 0o604
        #expect(!member.modeBitsGrant(st, 4), "the group bits apply to a member even when other's would grant more")
    }

    /// A fresh directory under /tmp that other users may search; the caller removes it.
    static func scratchDirectory() throws -> String {
        var template = Array("/tmp/vanish-control-XXXXXX".utf8CString)
        guard let made = mkdtemp(&template) else { throw Errno(rawValue: errno) }
        let base = String(cString: made)
        chmod(base, 0o755)
        return base
    }

    @Test("credentials: the kernel decides for another user, ACLs included, where the daemon can take on their identity",
          .enabled(if: geteuid() == 0, "needs root"))
    func permitsAsTheKernelDoes() throws {
        let base = try Self.scratchDirectory()
        defer { _ = try? run(["/bin/rm", "-rf", base]) }
        mkdir(base + "/closed", 0o755)
        mkdir(base + "/open", 0o755)
        #expect(try run(["/usr/bin/setfacl", "-m", "u:nobody:---", base + "/closed"]) == 0)
        #expect(try run(["/usr/bin/setfacl", "-m", "u:nobody:rwx", base + "/open"]) == 0)
        let nobody = Credentials(uid: 65534, gid: 65534, groups: [])
        for (name, list, write) in [("closed", false, false), ("open", true, true)] {
            let fd = try Sys.open(base + "/" + name, O_RDONLY | O_DIRECTORY)
            defer { Sys.close(fd) }
            let st = try Sys.fstat(fd)
            #expect(nobody.modeBitsGrant(st, 5) && !nobody.modeBitsGrant(st, 2), "the mode bits alone say r-x")
            #expect(nobody.permits(fd, 5) == list, "\(name): list")
            #expect(nobody.permits(fd, 3) == write, "\(name): write")
        }
    }

    @Test("another user reaches a directory only through directories they may search, never through a symlink")
    func openDirectoryAsAnotherUser() throws {
        let base = try Self.scratchDirectory()
        defer { _ = try? run(["/bin/rm", "-rf", base]) }
        mkdir(base + "/open", 0o755)
        mkdir(base + "/open/inner", 0o755)
        mkdir(base + "/closed", 0o700)
        mkdir(base + "/closed/inner", 0o755)
        symlink("open", base + "/link")
        let root = try Sys.open(base, O_RDONLY | O_DIRECTORY)
        defer { Sys.close(root) }
        let user = Credentials(uid: 4242, gid: 4242, groups: [])
        let fd = try user.openDirectory([Array("open".utf8), Array("inner".utf8)], under: root, needing: 5)
        Sys.close(fd)
        #expect(throws: Errno.permissionDenied) {
            try user.openDirectory([Array("closed".utf8), Array("inner".utf8)], under: root, needing: 5)
        }
        #expect(throws: Errno.permissionDenied, "writing needs w on the last directory") {
            try user.openDirectory([Array("open".utf8)], under: root, needing: 3)
        }
        #expect(throws: Errno.notDirectory) { try user.openDirectory([Array("link".utf8)], under: root, needing: 5) }
        #expect(user.mayObserve(Array("open/inner/file".utf8), under: root))
        #expect(!user.mayObserve(Array("closed/inner/file".utf8), under: root))
        #expect(Credentials(uid: 0, gid: 0, groups: []).mayObserve(Array("closed/inner/file".utf8), under: root))
    }

    static func facts(_ restorable: [TrashEntry], pending: Int, stuck: Int = 0, rate: Double = 0,
                      work: Int? = nil) -> StatusFacts {
        StatusFacts(
            place: .init(source: "/src\"x", stateDirectory: "/src/.vanish", graveyard: true, socket: "/run/vanish/x.sock",
                         log: "syslog", client: "host-0123456789ab", leaseSeconds: 60, otherClients: []),
            reaping: .init(pendingEntries: pending, stuckEntries: stuck, putBack: 0,
                           remainingWork: work ?? max(0, pending - restorable.count - stuck), holdingBytes: 0,
                           statistics: .zero, pace: Reaper.Pace(filesPerSecond: rate, entriesPerSecond: rate), idle: false,
                           yields: false, workers: 2, freeBytes: 1 << 30),
            undoWindow: .init(restorable: restorable, count: restorable.count,
                              bytes: restorable.reduce(0) { $0 + ($1.record.bytes ?? 0) } + 100, shortened: nil,
                              keepSeconds: 3600, keepMinAgeSeconds: 5, keepExclude: ["*.swp"]),
            serving: .init(knownInodes: 7, stataheadEntries: 0, cachedFDs: 3, fdCacheLimit: 100, kernelFeatures: "passthrough",
                           passthrough: "on", spinMicroseconds: 50, cacheSeconds: 3600, fileHandles: "exportable",
                           requests: RequestChannel.State(ring: true, queues: 2, depth: 8, threads: 3, bufferBytes: 1 << 24,
                                                          spinMicroseconds: 50)))
    }

    @Test("status: a user sees counts of their own deletions only; root sees all, with measured sizes")
    func statusPerUser() throws {
        let restorable = [Self.entry("a", uid: 1000, at: 1), Self.entry("b", uid: 1001, at: 2),
                          Self.entry("c", uid: 1001, at: 3)]
        let f = Self.facts(restorable, pending: 10, rate: 4)
        let mine = try #require(JSON.parse(Array(StatusReport.json(f, for: 1000).utf8)))
        #expect(mine["restorable_entries"]?.int == 1)
        #expect(mine["restorable_bytes"]?.int == 4096)
        #expect(mine["pending_entries"]?.int == 8, "the others' kept entries leave the backlog")
        #expect(mine["source"]?.string == "/src\"x")
        let all = try #require(JSON.parse(Array(StatusReport.json(f, for: 0).utf8)))
        #expect(all["restorable_entries"]?.int == 3)
        #expect(all["restorable_bytes"]?.int == 3 * 4096 + 100)
        #expect(all["eta_seconds"]?.int == 2, "7 files due at 4 a second")
        #expect(all["keep_seconds"]?.double == 3600)
        #expect(all["requests"]?["channel"]?.string == "io_uring" && all["requests"]?["queues"]?.int == 2)
        #expect(all["requests"]?["why"] == .null && all["requests"]?["buffer_bytes"]?.int == 1 << 24)
    }

    @Test("status: the estimate is the work left at the recent pace; unknown (null) while nothing has been reaped yet or a tree's size is unknown, and 0 with nothing due")
    func statusEstimate() throws {
        let unknown = try #require(JSON.parse(Array(StatusReport.json(Self.facts([], pending: 5), for: 0).utf8)))
        #expect(unknown["eta_seconds"] == .null)
        // One tree of 4,005 files and directories, 1,000 of them a second: not one entry a second.
        let tree = try #require(JSON.parse(Array(StatusReport.json(Self.facts([], pending: 1, rate: 1000, work: 4005), for: 0).utf8)))
        #expect(tree["eta_seconds"]?.int == 5 && tree["pending_entries"]?.int == 1)
        var sizeless = Self.facts([], pending: 1, rate: 1000)
        sizeless.reaping.remainingWork = nil
        #expect(try #require(JSON.parse(Array(StatusReport.json(sizeless, for: 0).utf8)))["eta_seconds"] == .null)
        let none = try #require(JSON.parse(Array(StatusReport.json(Self.facts([], pending: 2, stuck: 2), for: 0).utf8)))
        #expect(none["eta_seconds"]?.int == 0)
    }
}

/// Runs a program and waits for it.
@discardableResult
private func run(_ argv: [String]) throws -> Int32 {
    var pid: pid_t = 0
    var cargs = argv.map { strdup($0) } + [nil]
    defer { cargs.forEach { free($0) } }
    guard posix_spawn(&pid, argv[0], nil, nil, &cargs, environ) == 0 else { throw Errno(rawValue: errno) }
    var status: Int32 = 0
    waitpid(pid, &status, 0)
    return status
}
