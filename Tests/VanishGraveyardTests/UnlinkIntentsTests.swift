import Glibc
import Testing
import VanishGraveyard
import VanishTestSupport

/// The log of answered unlinks, in-process on a scratch directory.
@Suite("unlink intents log")
struct UnlinkIntentsTests {
    /// A fresh state directory and a file's stat to write intents for.
    private func withLog(_ body: (UnlinkIntents, Int32, stat) throws -> Void) throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        close(open(dir + "/file", O_CREAT | O_WRONLY, 0o644))
        var st = stat()
        #expect(lstat(dir + "/file", &st) == 0)
        let log = try UnlinkIntents(stateFD: fd)
        // What a mount does once it has read the log: a new generation.
        log.clear()
        try body(log, fd, st)
    }

    private func record(_ log: UnlinkIntents, _ st: stat, _ path: String, inPlace: Bool = false,
                        unkept: Bool = false) throws {
        try Array(path.utf8).withUnsafeBufferPointer {
            try log.record(st, deleted: 42, uid: 1000, gid: 100, inPlace: inPlace, unkept: unkept, path: $0)
        }
    }

    @Test("intents read back in order, with every field, any bytes in the path")
    func roundTrip() throws {
        try withLog { log, _, st in
            try record(log, st, "a/b")
            try record(log, st, "dir/new\nline \u{FF}", inPlace: true)
            try record(log, st, "c.swp", unkept: true)
            let read = log.intents()
            #expect(read.count == 3)
            #expect(read.first?.path == Array("a/b".utf8))
            #expect(read[1].path == Array("dir/new\nline \u{FF}".utf8))
            #expect(read.first?.inPlace == false && read[1].inPlace == true && read.last?.inPlace == false)
            #expect(read.first?.unkept == false && read[1].unkept == false && read.last?.unkept == true)
            #expect(read.first?.deleted == 42 && read.first?.uid == 1000 && read.first?.gid == 100)
            #expect(read.allSatisfy { $0.matches(st) })
        }
    }

    @Test("a file changed since its intent (renamed, re-created) does not match it")
    func identity() throws {
        try withLog { log, fd, st in
            try record(log, st, "file")
            usleep(10_000)
            #expect(renameat(fd, "file", fd, "moved") == 0 && renameat(fd, "moved", fd, "file") == 0)
            var now = stat()
            #expect(fstatat(fd, "file", &now, AT_SYMLINK_NOFOLLOW) == 0)
            #expect(log.intents().first?.matches(now) == false)
        }
    }

    @Test("a torn record, or a slot never written, skips only itself; the next mount reads what was there")
    func damage() throws {
        try withLog { log, fd, st in
            try record(log, st, "one")
            try record(log, st, "two")
            try record(log, st, "three")
            let file = openat(fd, UnlinkIntents.fileName, O_WRONLY)
            defer { close(file) }
            // A byte of the first record's header changed (its checksum fails), and
            // the second's magic gone, as if its writer was killed before writing it.
            #expect(pwrite(file, [0xFF], 1, 8 + 20) == 1)
            #expect(pwrite(file, [0, 0, 0, 0], 4, 8 + 64 + 8) == 4)
            #expect(log.intents().map { String(decoding: $0.path, as: UTF8.self) } == ["three"])
            // A new session (a remount) finds the same, and writes nothing before emptying the log.
            let again = try UnlinkIntents(stateFD: fd)
            #expect(again.intents().count == 1)
            #expect(throws: (any Error).self) { try record(again, st, "early") }
            again.clear()
            #expect(again.intents().isEmpty)
        }
    }

    @Test("emptied on request, and when idle once it has grown")
    func compaction() throws {
        try withLog { log, _, st in
            try record(log, st, "x")
            log.compactIfLarge()
            #expect(log.intents().count == 1, "a small log is left alone")
            for i in 0..<2_000 { try record(log, st, "some/longer/path/\(i)") }
            log.compactIfLarge()
            #expect(log.intents().isEmpty)
            try record(log, st, "y")
            #expect(log.intents().count == 1)
            log.clear()
            #expect(log.intents().isEmpty)
        }
    }
}
