import Foundation
import Glibc
import Testing
import VanishTestSupport

/// File handles of the mount (name_to_handle_at, NFS) behave as the backing
/// filesystem's: they open their file after the kernel forgot its inode and
/// after a remount, go stale when the file is deleted, and never reach the
/// graveyard or what lies outside the source.
@Suite("file handles of the mount", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct FileHandleTests {
    /// name_to_handle_at / open_by_handle_at for the tests, through ctypes.
    /// `get PATH` prints the handle; `open MOUNT HANDLE` prints `OK`, the
    /// opened file's path and its content (a directory: its sorted names),
    /// or `ERR errno`; `forge BACKING` prints the handle the mount gives the
    /// backing file at BACKING: node id (generation << 32 | number), FUSE generation 0.
    static let helper = """
        import ctypes, os, struct, sys
        libc = ctypes.CDLL(None, use_errno=True)
        class FH(ctypes.Structure):
            _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("data", ctypes.c_ubyte * 128)]
        def get(path):
            h = FH(); h.bytes = 128; mount_id = ctypes.c_int()
            if libc.name_to_handle_at(-100, path.encode(), ctypes.byref(h), ctypes.byref(mount_id), 0) != 0:
                sys.exit("name_to_handle_at: " + os.strerror(ctypes.get_errno()))
            return h.type, bytes(h.data[:h.bytes])
        cmd = sys.argv[1]
        if cmd == "get":
            t, b = get(sys.argv[2]); print("%d:%s" % (t, b.hex()))
        elif cmd == "forge":
            t, b = get(sys.argv[2]); ino = os.lstat(sys.argv[2]).st_ino
            if len(b) == 8: gen = struct.unpack("=I", b[4:8])[0]
            elif t == 1: gen = struct.unpack("=I", b[0:4])[0]
            else: gen = struct.unpack("=I", b[8:12])[0]
            node = gen << 32 | ino
            print("129:" + struct.pack("=III", node >> 32, node & 0xffffffff, 0).hex())
        else:
            t, h = sys.argv[3].split(":"); b = bytes.fromhex(h)
            fh = FH(); fh.bytes = len(b); fh.type = int(t); ctypes.memmove(fh.data, b, len(b))
            m = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
            fd = libc.open_by_handle_at(m, ctypes.byref(fh), os.O_RDONLY)
            if fd < 0: print("ERR %d" % ctypes.get_errno()); sys.exit(0)
            path = os.readlink("/proc/self/fd/%d" % fd)
            try: body = os.read(fd, 100).decode()
            except IsADirectoryError: body = " ".join(sorted(os.listdir(fd)))
            print("OK %s %s" % (path, body))
        """

    /// `helper`, written into a test's own directory (which goes with it).
    struct Helper {
        let script: String

        init(in dir: String) throws {
            script = dir + "/handles.py"
            try FileHandleTests.helper.write(toFile: script, atomically: true, encoding: .utf8)
        }

        func handle(_ path: String) throws -> String {
            let r = try run(["python3", script, "get", path])
            guard r.ok else { throw TestFailure(r.stderr) }
            return r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        }

        func forged(_ backingPath: String) throws -> String {
            let r = try run(["python3", script, "forge", backingPath])
            guard r.ok else { throw TestFailure(r.stderr) }
            return r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        }

        /// What opening `handle` on `mountpoint` gives: `OK path content` or `ERR errno`.
        func open(_ mountpoint: String, _ handle: String) throws -> String {
            try run(["python3", script, "open", mountpoint, handle]).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        }
    }

    /// Drops the kernel's dentries and inodes, and waits until the daemon
    /// was told it forgot every inode of the mount.
    func forget(_ m: VanishMount) throws {
        try waitFor("the kernel to forget the mount's inodes") {
            _ = try sh("sync; echo 2 > /proc/sys/vm/drop_caches")
            return try statusJSON(m)["known_inodes"] as? Int == 0
        }
    }

    /// A fresh filesystem of `type` mounted for the test, and the helper in it.
    func withBacking(_ type: String, _ body: (String, Helper) throws -> Void) throws {
        if type != "tmpfs" { return try withLoopFilesystem(type) { dir in try body(dir, Helper(in: dir)) } }
        let dir = try makeTempDirectory()
        defer {
            _ = try? run(["umount", "-l", dir])
            removeTree(dir)
        }
        guard try run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", dir]).ok else { throw TestFailure("tmpfs") }
        try body(dir, Helper(in: dir))
    }

    @Test("a handle opens its file after the kernel forgot it and after a remount", arguments: ["tmpfs", "ext4", "xfs"])
    func outlivesCacheAndMount(fs: String) throws {
        try withBacking(fs) { dir, h in
            let src = dir + "/src"
            guard try sh("mkdir -p src/d/e && echo hello > src/d/e/f && ln -s f src/d/e/l", cwd: dir).ok else {
                throw TestFailure("prepare")
            }
            let m = try VanishMount(existingSource: src)
            defer { m.close() }
            let file = try h.handle(m.path("d/e/f")), directory = try h.handle(m.path("d/e"))
            #expect(try h.open(m.mountpoint, file).hasSuffix(" hello"))
            try forget(m)
            #expect(try h.open(m.mountpoint, file).hasSuffix(" hello"))
            // A directory is put back in the tree ("..", then its name in the parent's listing).
            #expect(try h.open(m.mountpoint, directory) == "OK \(m.path("d/e")) f l")
            // Found by handle, then by name: one node, which events and renames know by its name.
            #expect(try sh("mv d/e/f d/e/g && cat d/e/g", cwd: m.mountpoint).stdout == "hello\n")
            try m.unmount()

            let again = try VanishMount(existingSource: src)
            defer { again.close() }
            #expect(try h.open(again.mountpoint, file).hasSuffix(" hello"))
            #expect(try h.open(again.mountpoint, directory) == "OK \(again.path("d/e")) g l")
        }
    }

    @Test("a handle of a file or directory deleted through the mount is stale, as on the backing filesystem",
          arguments: [[String](), ["keep=1h"]])
    func deletedIsStale(options: [String]) throws {
        try withBacking("ext4") { dir, h in
            let src = dir + "/src"
            guard try sh("mkdir -p src/t/u src/r && echo x > src/f && echo y > src/t/u/v && echo z > native", cwd: dir).ok else {
                throw TestFailure("prepare")
            }
            // The backing filesystem itself: a deleted file's handle is stale.
            let native = try h.handle(dir + "/native")
            _ = try sh("rm native", cwd: dir)
            _ = try sh("sync; echo 2 > /proc/sys/vm/drop_caches")
            #expect(try h.open(dir, native) == "ERR \(ESTALE)")

            let m = try VanishMount(options: options, existingSource: src)
            defer { m.close() }
            let file = try h.handle(m.path("f")), tree = try h.handle(m.path("t/u")), empty = try h.handle(m.path("r"))
            let ino = try sh("stat -c %i f", cwd: src).stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            #expect(try sh("rm f && rmdir r", cwd: m.mountpoint).ok)
            #expect(try run([vanishBinary, "rm", "-r", m.path("t")]).ok)
            if !options.isEmpty {
                // Kept for the undo window: the file is alive in the graveyard, which the handle must not
                // reach (its burial lands once its directory has been quiet for a moment).
                try waitFor("the file in the graveyard") {
                    try sh("find .vanish -inum \(ino)", cwd: src).stdout.contains("graveyard")
                }
            }
            try forget(m)
            #expect(try h.open(m.mountpoint, file) == "ERR \(ESTALE)")
            #expect(try h.open(m.mountpoint, tree) == "ERR \(ESTALE)")
            #expect(try h.open(m.mountpoint, empty) == "ERR \(ESTALE)")
        }
    }

    @Test("a forged handle never reaches the state directory or a directory outside the source")
    func forgedStaysInside() throws {
        try withBacking("ext4") { dir, h in
            let src = dir + "/src"
            guard try sh("mkdir -p src/inside outside && echo secret > outside/s", cwd: dir).ok else {
                throw TestFailure("prepare")
            }
            let m = try VanishMount(options: ["keep=1h"], existingSource: src)
            defer { m.close() }
            guard try sh("mkdir gone && rmdir gone", cwd: m.mountpoint).ok else { throw TestFailure("rmdir") }
            let shard = try sh("dirname $(find .vanish -path '*graveyard/*/*' -print -quit)", cwd: src).stdout
                .trimmingCharacters(in: .whitespacesAndNewlines)
            #expect(shard.contains("graveyard/"))
            let handles = try [src + "/inside", src + "/.vanish", src + "/" + shard, dir + "/outside"].map(h.forged)
            try forget(m)
            #expect(try h.open(m.mountpoint, handles[0]) == "OK \(m.path("inside"))")
            for handle in handles.dropFirst() { #expect(try h.open(m.mountpoint, handle) == "ERR \(ESTALE)", "\(handle)") }
        }
    }
}
