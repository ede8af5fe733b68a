import Foundation
import Glibc
import Testing
import VanishTestSupport

/// How many requests of `opcode` (READ, WRITE, ...) a `-d` daemon's log shows.
private func requests(_ opcode: String, in log: String) -> Int {
    log.components(separatedBy: "opcode: \(opcode) (").count - 1
}

/// Opens of one file in every combination the kernel's passthrough rules
/// tell apart (a reader's read-only backing then a writer, an appender
/// first, shared mmap, O_TRUNC), each checked against the backing file.
private let mixedOpens = """
    import os, mmap, sys
    M, S = sys.argv[1], sys.argv[2]
    p, b = M + "/f", S + "/f"
    with open(p, "wb") as f: f.write(b"a" * 10000)
    r = os.open(p, os.O_RDONLY)
    w = os.open(p, os.O_WRONLY)
    os.pwrite(w, b"BBBB", 0)
    assert os.pread(r, 4, 0) == b"BBBB", "reader sees the writer"
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(a, b"END")
    for fd in (a, w, r): os.close(fd)
    assert open(b, "rb").read()[-3:] == b"END" and os.path.getsize(p) == 10003, "append"
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    rw = os.open(p, os.O_RDWR)
    os.pwrite(rw, b"XY", 0)
    os.write(a, b"Z")
    os.close(a); os.close(rw)
    d = open(b, "rb").read()
    assert d[:2] == b"XY" and d[-1:] == b"Z" and len(d) == 10004, "an appender first does not make others append"
    fd = os.open(p, os.O_RDWR)
    m = mmap.mmap(fd, 4096); m[0:5] = b"mmap!"; m.flush(); m.close(); os.close(fd)
    assert open(b, "rb").read(5) == b"mmap!", "shared mmap"
    fd = os.open(p, os.O_RDWR | os.O_TRUNC); os.write(fd, b"12345"); os.fsync(fd); os.close(fd)
    assert os.stat(p).st_size == 5 and open(b, "rb").read() == b"12345", "O_TRUNC"
    print("ok")
    """

@Suite("passthrough", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct PassthroughTests {
    @Test("file data goes from the kernel to the backing file without the daemon; passthrough=off sends it through")
    func bypassesDaemon() throws {
        for mode in ["auto", "off"] {
            try withVanishMount(options: ["passthrough=\(mode)"], arguments: ["-d"]) { m in
                let r = try sh("""
                    set -e
                    dd if=/dev/urandom of=f bs=64k count=64 status=none
                    cat f f > /dev/null
                    cmp f \(shellQuote(m.backing("f")))
                    """, cwd: m.mountpoint)
                #expect(r.ok, "\(r.stderr)")
                let log = m.log
                #expect(log.contains("passthrough=\(mode == "auto" ? "on" : "off by option")"), "\(log.prefix(2000))")
                let status = try run([vanishBinary, "status", m.mountpoint])
                #expect(status.stdout.contains(mode == "auto" ? "file data:        passthrough"
                                                              : "file data:        through the daemon; passthrough off by option"),
                        "\(status.stdout)")
                #expect(status.stdout.contains("kernel features:  \(mode == "auto" ? "passthrough," : "")parallel_dirops,killpriv_v2,direct_io_mmap"))
                if mode == "auto" {
                    #expect(requests("READ", in: log) == 0 && requests("WRITE", in: log) == 0)
                } else {
                    #expect(requests("READ", in: log) > 0 && requests("WRITE", in: log) > 0)
                }
            }
        }
    }

    @Test("readers, writers, appenders, mmap and O_TRUNC on one file at once", arguments: ["auto", "off"])
    func mixedOpensOfOneFile(mode: String) throws {
        try withVanishMount(options: ["passthrough=\(mode)"]) { m in
            let r = try run(["python3", "-c", mixedOpens, m.mountpoint, m.source])
            #expect(r.ok && r.stdout == "ok\n", "\(r.stderr)")
        }
    }

    @Test("fio verifies buffered, O_DIRECT and mmap I/O", arguments: ["auto", "off"])
    func fioVerify(mode: String) throws {
        try #require(which("fio") != nil, "fio is not installed (apt-get install fio)")
        try withVanishMount(options: ["passthrough=\(mode)"]) { m in
            for (engine, direct) in [("psync", 0), ("psync", 1), ("mmap", 0)] {
                // Two jobs, each writing its own file at random and reading every block back.
                let r = try run(["fio", "--name=v\(engine)\(direct)", "--directory=\(m.mountpoint)", "--rw=randwrite",
                                 "--bs=4k", "--size=8m", "--ioengine=\(engine)", "--direct=\(direct)",
                                 "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0",
                                 "--numjobs=2", "--output-format=terse"], cwd: m.base)
                #expect(r.ok, "\(engine) direct=\(direct): \(r.stderr)")
            }
        }
    }

    @Test("a deleted file's space comes back after its last close: after rm, after vanish rm -r, after the unmount")
    func deletedOpenFilesGiveSpaceBack() throws {
        try withVanishMountOnTmpfs(size: "256m") { m in try deletedOpenFilesGiveSpaceBack(m) }
    }

    private func deletedOpenFilesGiveSpaceBack(_ m: VanishMount) throws {
        try m.waitForLog("passthrough=on")
        /// Holds `path` open (through the mount) in another process until killed.
        func hold(_ path: String) throws -> pid_t {
            let pid = try spawn(["/bin/sh", "-c", "exec 3<\(shellQuote(path)) && exec sleep 600"])
            try waitFor("\(path) held open") { (try? sh("ls -l /proc/\(pid)/fd | grep -c \(shellQuote(path))").stdout) == "1\n" }
            return pid
        }
        func stop(_ pid: pid_t) { kill(pid, SIGKILL); var s: Int32 = 0; waitpid(pid, &s, 0) }
        func write(_ relative: String) throws {
            let r = try sh("mkdir -p \"$(dirname \(relative))\" && dd if=/dev/urandom of=\(relative) bs=1M count=48 status=none",
                           cwd: m.mountpoint)
            guard r.ok else { throw TestFailure(r.stderr) }
        }

        // rm, then the last close.
        try write("a")
        var before = freeBytes(m.source)
        var holder = try hold(m.path("a"))
        #expect(unlink(m.path("a")) == 0)
        try waitForReaper(m)
        #expect(freeBytes(m.source) < before + (24 << 20), "held while open")
        stop(holder)
        try waitFor("a's 48 MiB to come back", timeout: 30) { freeBytes(m.source) >= before + (44 << 20) }

        // vanish rm -r of a tree holding an open file.
        try write("tree/sub/b")
        before = freeBytes(m.source)
        holder = try hold(m.path("tree/sub/b"))
        #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
        try waitForReaper(m)
        stop(holder)
        try waitFor("b's 48 MiB to come back", timeout: 30) { freeBytes(m.source) >= before + (44 << 20) }

        // A file still open when the mount goes away.
        try write("c")
        before = freeBytes(m.source)
        holder = try hold(m.path("c"))
        #expect(unlink(m.path("c")) == 0)
        #expect(try run(["fusermount3", "-uz", m.mountpoint]).ok)
        stop(holder)
        #expect(try m.waitForExit(timeout: 60) == 0)
        try waitFor("c's 48 MiB to come back", timeout: 30) { freeBytes(m.source) >= before + (44 << 20) }
    }

    @Test("a write or truncate by another user clears setuid and setgid, as natively; root's writes keep them",
          arguments: ["auto", "off"])
    func writesClearSetID(mode: String) throws {
        try withVanishMount(options: ["allow_other", "passthrough=\(mode)"]) { m in
            for (i, perms) in [0o4777, 0o2777, 0o6777, 0o2767].enumerated() {
                let name = m.path("s\(i)")
                #expect(close(open(name, O_CREAT | O_WRONLY, 0o600)) == 0)
                #expect(chmod(name, mode_t(perms)) == 0)
                let w = try runAsNobody(["/bin/sh", "-c", "echo x >> \(shellQuote(name))"])
                #expect(w.ok, "\(w.stderr)")
                // setgid without group execute goes too: nobody is not in the file's group.
                let expected = perms == 0o2767 ? 0o767 : 0o777
                #expect(try statMode(m.backing("s\(i)")) == expected, "mode \(String(perms, radix: 8))")
            }
            let f = m.path("s0")
            #expect(chmod(f, 0o4777) == 0)
            #expect(try sh("echo y >> \(shellQuote(f))").ok)
            #expect(try statMode(m.backing("s0")) == 0o4777, "root keeps setuid")
            #expect(try runAsNobody(["truncate", "-s", "1", f]).ok)
            #expect(try statMode(m.backing("s0")) == 0o777, "truncate by nobody")
            // Root holds the file open in passthrough while nobody writes through an open of its own.
            #expect(chmod(f, 0o4777) == 0)
            let fd = open(f, O_RDWR)
            defer { close(fd) }
            #expect(try runAsNobody(["/bin/sh", "-c", "echo z >> \(shellQuote(f))"]).ok)
            #expect(try statMode(m.backing("s0")) == 0o777, "nobody beside root's open")
            #expect(try String(contentsOfFile: m.backing("s0"), encoding: .utf8) == "xz\n")
        }
    }

    /// Writes through a shared mapping of a passthrough file reach the
    /// backing file behind the kernel's FUSE side, whose copy of the mtime
    /// stays valid (the mapping marks only the atime stale). close() waits
    /// for FLUSH, not for RELEASE (which comes later, and here not at all
    /// while a duplicate of the fd is open), so FLUSH drops that copy. GNU
    /// stat asks statx for the mtime alone, as xfstests generic/080 does
    /// right after its writer exits.
    @Test("after writes through a shared mapping, stat shows the new mtime as soon as close returns, as natively",
          arguments: ["io_uring=on", "io_uring=off"])
    func mappedWritesShowAtClose(channel: String) throws {
        func mtime(_ path: String) throws -> String {
            let r = try run(["stat", "-c", "%.9Y", path])
            guard r.ok else { throw TestFailure(r.stderr) }
            return r.stdout
        }
        // Made before the mount: no RELEASE of its maker may land later and drop the kernel's copy.
        func make(_ dir: String) throws {
            guard FileManager.default.createFile(atPath: dir + "/mapped", contents: Data(count: 4096)) else {
                throw TestFailure("create in \(dir)")
            }
        }
        func moves(_ dir: String) throws -> String {
            let path = dir + "/mapped"
            let before = try mtime(path)
            // Wait for the clock file systems stamp with to pass the mtime,
            // so the write cannot get the same stamp.
            var st = stat(), now = timespec()
            stat(path, &st)
            repeat { clock_gettime(CLOCK_REALTIME_COARSE, &now) }
            while (now.tv_sec, now.tv_nsec) <= (st.st_mtim.tv_sec, st.st_mtim.tv_nsec)
            let fd = open(path, O_RDWR)
            guard fd >= 0, let map = mmap(nil, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), map != MAP_FAILED else {
                throw TestFailure("map: \(errno)")
            }
            let duplicate = dup(fd)
            defer { munmap(map, 4096); close(duplicate) }
            map.storeBytes(of: 0x41, as: UInt8.self)
            close(fd)
            return try mtime(path) != before ? "mtime moved" : "mtime kept"
        }
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        try make(plain)
        #expect(try moves(plain) == "mtime moved")
        try withVanishMount(options: [channel], prepare: make) { m in
            let status = try run([vanishBinary, "status", m.mountpoint])
            #expect(status.stdout.contains("file data:        passthrough"), "\(status.stdout)")
            #expect(try moves(m.mountpoint) == "mtime moved")
        }
    }
}

/// The kernel's rules for privilege bits on another user's change, which
/// the daemon owns since KILLPRIV_V2: the same script as nobody on a plain
/// directory and on the mount, each mode read right after the change
/// (through the kernel's attribute cache on the mount).
@Suite("privilege bits as another user", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct PrivilegeBitsTests {
    static func prepare(_ dir: String) throws {
        let r = try sh("""
            for p in 4777 6666 2767 2766; do touch f$p && chmod $p f$p; done
            chgrp nogroup f2766
            touch fall && chmod 6666 fall
            touch acl && chown nobody acl && chmod 2777 acl
            touch mine && chown nobody:nogroup mine && chmod 2777 mine
            """, cwd: dir)
        guard r.ok else { throw TestFailure(r.stderr) }
    }

    static let script = """
        stat -c '%n %a' f* acl mine >/dev/null
        for p in 4777 6666 2767 2766; do printf x >> f$p; stat -c '%n %a' f$p; done
        fallocate -l 4096 fall; stat -c '%n %a' fall
        setfacl -m u:daemon:r acl; stat -c '%n %a' acl
        setfacl -m u:daemon:r mine; stat -c '%n %a' mine
        """

    @Test("writes, fallocate and ACLs by nobody clear what they clear natively, and the mount shows it at once",
          arguments: ["cache=auto", "cache=always"])
    func parity(cache: String) throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        chmod(plain, 0o755)
        try PrivilegeBitsTests.prepare(plain)
        let expected = try runAsNobody(["/bin/sh", "-c", PrivilegeBitsTests.script], cwd: plain)
        #expect(expected.stdout.contains("f2767 767") && expected.stdout.contains("acl 777"), "the fixture: \(expected.stdout)")
        try withVanishMount(options: ["allow_other", cache], prepare: PrivilegeBitsTests.prepare) { m in
            let actual = try runAsNobody(["/bin/sh", "-c", PrivilegeBitsTests.script], cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
        }
    }
}

private func statMode(_ path: String) throws -> Int {
    var st = stat()
    guard stat(path, &st) == 0 else { throw TestFailure("stat \(path): \(errno)") }
    return Int(st.st_mode & 0o7777)
}
