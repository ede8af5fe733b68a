import CFuse
import CLinux
import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Records what each step of a syscall script returned, so a run on a plain
/// directory and a run on the mount can be compared line by line.
struct Trace {
    var lines: [String] = []
    let dir: Int32

    mutating func step(_ label: String, _ result: Int) {
        lines.append("\(label): \(result < 0 ? errnoName(errno) : "ok")")
    }
    mutating func value(_ label: String, _ v: String) { lines.append("\(label) = \(v)") }

    mutating func stat(_ label: String, _ name: String) {
        var st = Glibc.stat()
        if fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) < 0 { step("stat \(label)", -1); return }
        value("stat \(label)", describe(st))
    }

    mutating func fstat(_ label: String, _ fd: Int32) {
        var st = Glibc.stat()
        if Glibc.fstat(fd, &st) < 0 { step("fstat \(label)", -1); return }
        value("fstat \(label)", describe(st))
    }

    func describe(_ st: Glibc.stat) -> String {
        "mode=\(String(st.st_mode, radix: 8)) nlink=\(st.st_nlink) size=\(st.st_size) uid=\(st.st_uid) gid=\(st.st_gid)"
    }

    mutating func read(_ label: String, _ fd: Int32, at offset: Int = 0, count: Int = 64) {
        var buf = [UInt8](repeating: 0, count: count)
        let n = pread(fd, &buf, count, off_t(offset))
        if n < 0 { step("read \(label)", -1) } else { value("read \(label)", String(decoding: buf[..<n], as: UTF8.self)) }
    }

    mutating func write(_ label: String, _ fd: Int32, _ text: String, at offset: Int? = nil) {
        let n = text.withCString { p in offset.map { pwrite(fd, p, strlen(p), off_t($0)) } ?? Glibc.write(fd, p, strlen(p)) }
        step("write \(label)", n)
    }
}

func errnoName(_ e: Int32) -> String {
    let names: [Int32: String] = [EEXIST: "EEXIST", ENOENT: "ENOENT", ENOTEMPTY: "ENOTEMPTY", EISDIR: "EISDIR",
                                  ENOTDIR: "ENOTDIR", ELOOP: "ELOOP", EINVAL: "EINVAL", EACCES: "EACCES",
                                  EPERM: "EPERM", ENODATA: "ENODATA", EBADF: "EBADF", EXDEV: "EXDEV",
                                  ERANGE: "ERANGE", ENXIO: "ENXIO", ESTALE: "ESTALE", EMFILE: "EMFILE"]
    return names[e] ?? "errno \(e)"
}

/// The syscall script: regular use, edge cases and error paths.
func parityScript(root: String) -> [String] {
    let dir = open(root, O_RDONLY | O_DIRECTORY)
    defer { close(dir) }
    var t = Trace(dir: dir)
    umask(0o022)

    // Directories and their errors.
    t.step("mkdir d", Int(mkdirat(dir, "d", 0o755)))
    t.step("mkdir d again", Int(mkdirat(dir, "d", 0o755)))
    t.step("rmdir missing", Int(unlinkat(dir, "missing", AT_REMOVEDIR)))
    t.step("mkdir d/sub", Int(mkdirat(dir, "d/sub", 0o700)))
    t.stat("d/sub", "d/sub")
    t.step("rmdir non-empty d", Int(unlinkat(dir, "d", AT_REMOVEDIR)))
    t.step("unlink dir d", Int(unlinkat(dir, "d", 0)))

    // Creating files: O_EXCL, O_TRUNC, O_APPEND.
    let f = openat(dir, "f", O_RDWR | O_CREAT | O_EXCL, 0o644)
    t.step("create f excl", Int(f))
    t.step("create f excl again", Int(openat(dir, "f", O_RDWR | O_CREAT | O_EXCL, 0o644)))
    t.write("f", f, "hello world")
    t.read("f", f)
    let fa = openat(dir, "f", O_WRONLY | O_APPEND)
    t.write("f append", fa, "!")
    close(fa)
    t.fstat("f", f)
    t.read("f after append", f)
    close(f)
    let ft = openat(dir, "f", O_RDWR | O_TRUNC)
    t.fstat("f after O_TRUNC", ft)
    t.write("f rewrite", ft, "abcdef")
    close(ft)
    t.step("rmdir file", Int(unlinkat(dir, "f", AT_REMOVEDIR)))
    t.step("mkdir under file", Int(mkdirat(dir, "f/x", 0o755)))
    t.step("open dir for write", Int(openat(dir, "d", O_WRONLY)))
    t.step("open missing", Int(openat(dir, "nope", O_RDONLY)))

    // Reading and writing through a handle whose name was unlinked.
    let u = openat(dir, "unlinked", O_RDWR | O_CREAT, 0o600)
    t.write("unlinked", u, "still here")
    t.step("unlink unlinked", Int(unlinkat(dir, "unlinked", 0)))
    t.stat("unlinked name", "unlinked")
    t.read("unlinked via fd", u)
    t.write("unlinked more", u, " and more", at: 10)
    t.read("unlinked again", u)
    t.fstat("unlinked", u)
    t.step("ftruncate unlinked", Int(ftruncate(u, 5)))
    t.read("unlinked truncated", u)
    close(u)

    // Renaming over an open file: the old handle keeps the old data.
    let g = openat(dir, "g", O_RDWR | O_CREAT, 0o644)
    t.write("g old", g, "old")
    let h = openat(dir, "h", O_RDWR | O_CREAT, 0o644)
    t.write("h new", h, "new")
    close(h)
    t.step("rename h over g", Int(renameat(dir, "h", dir, "g")))
    t.read("g old handle", g)
    let g2 = openat(dir, "g", O_RDONLY)
    t.read("g new handle", g2)
    close(g); close(g2)
    t.stat("h gone", "h")

    // Hard links.
    t.step("link f f2", Int(linkat(dir, "f", dir, "f2", 0)))
    t.stat("f", "f")
    t.stat("f2", "f2")
    t.step("unlink f", Int(unlinkat(dir, "f", 0)))
    t.stat("f2 after unlink f", "f2")
    let f2 = openat(dir, "f2", O_RDONLY)
    t.read("f2", f2)
    close(f2)
    t.step("link onto existing", Int(linkat(dir, "f2", dir, "g", 0)))

    // renameat2 flags.
    t.step("noreplace onto existing", Int(vanish_renameat2(dir, "f2", dir, "g", VANISH_RENAME_NOREPLACE)))
    t.step("noreplace to new", Int(vanish_renameat2(dir, "f2", dir, "f3", VANISH_RENAME_NOREPLACE)))
    t.step("exchange f3 g", Int(vanish_renameat2(dir, "f3", dir, "g", VANISH_RENAME_EXCHANGE)))
    let gx = openat(dir, "g", O_RDONLY)
    t.read("g after exchange", gx)
    close(gx)
    t.step("exchange with missing", Int(vanish_renameat2(dir, "g", dir, "missing", VANISH_RENAME_EXCHANGE)))
    t.step("rename dir into itself", Int(renameat(dir, "d", dir, "d/sub/x")))
    t.step("rename file over dir", Int(renameat(dir, "g", dir, "d")))
    t.step("mkdir e", Int(mkdirat(dir, "e", 0o755)))
    t.step("rename dir over non-empty dir", Int(renameat(dir, "e", dir, "d")))
    t.step("rename dir over file", Int(renameat(dir, "e", dir, "g")))
    t.step("rename missing", Int(renameat(dir, "missing", dir, "m2")))
    t.step("rename into missing dir", Int(renameat(dir, "g", dir, "missing/g")))
    t.step("rename onto itself", Int(renameat(dir, "g", dir, "g")))
    t.stat("g after rename onto itself", "g")
    t.step("rename dir over empty dir", Int(renameat(dir, "d/sub", dir, "e")))
    t.stat("e", "e")
    t.step("rename across dirs", Int(renameat(dir, "f3", dir, "d/f3")))
    t.stat("d/f3", "d/f3")

    // Symlinks are never followed by the daemon.
    t.step("symlink", Int(symlinkat("g", dir, "sl")))
    t.step("symlink loop", Int(symlinkat("loop", dir, "loop")))
    t.step("open loop", Int(openat(dir, "loop", O_RDONLY)))
    t.step("open nofollow", Int(openat(dir, "sl", O_RDONLY | O_NOFOLLOW)))
    var link = [CChar](repeating: 0, count: 64)
    let n = readlinkat(dir, "sl", &link, 63)
    t.value("readlink", n < 0 ? errnoName(errno) : String(decoding: link[..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self))
    t.step("readlink regular", readlinkat(dir, "g", &link, 63))
    t.stat("sl", "sl")

    // Attributes.
    t.step("chmod", Int(fchmodat(dir, "g", 0o640, 0)))
    var times = (timespec(tv_sec: 1_000_000, tv_nsec: 0), timespec(tv_sec: 2_000_000, tv_nsec: 5))
    t.step("utimensat", Int(withUnsafePointer(to: &times) {
        utimensat(dir, "g", UnsafeRawPointer($0).assumingMemoryBound(to: timespec.self), 0)
    }))
    var omit = (timespec(tv_sec: 0, tv_nsec: VANISH_UTIME_OMIT), timespec(tv_sec: 3_000_000, tv_nsec: 0))
    t.step("utimensat omit atime", Int(withUnsafePointer(to: &omit) {
        utimensat(dir, "g", UnsafeRawPointer($0).assumingMemoryBound(to: timespec.self), 0)
    }))
    var st = Glibc.stat()
    fstatat(dir, "g", &st, 0)
    t.value("times", "\(st.st_atim.tv_sec) \(st.st_mtim.tv_sec)")
    t.step("truncate grow", Int(truncate(root + "/g", 100)))
    t.stat("g", "g")

    // Extended attributes.
    t.step("setxattr", Int(setxattr(root + "/g", "user.k", "v1", 2, 0)))
    t.step("setxattr create existing", Int(setxattr(root + "/g", "user.k", "v2", 2, Int32(XATTR_CREATE))))
    t.step("setxattr replace missing", Int(setxattr(root + "/g", "user.z", "v", 1, Int32(XATTR_REPLACE))))
    var xbuf = [CChar](repeating: 0, count: 16)
    let xn = getxattr(root + "/g", "user.k", &xbuf, 16)
    t.value("getxattr", xn < 0 ? errnoName(errno) : String(decoding: xbuf[..<xn].map { UInt8(bitPattern: $0) }, as: UTF8.self))
    t.step("getxattr small buffer", getxattr(root + "/g", "user.k", &xbuf, 1))
    t.step("getxattr missing", getxattr(root + "/g", "user.missing", &xbuf, 16))
    t.step("removexattr", Int(removexattr(root + "/g", "user.k")))
    t.step("removexattr again", Int(removexattr(root + "/g", "user.k")))

    // Special files.
    t.step("mkfifo", Int(mkfifoat(dir, "fifo", 0o600)))
    t.stat("fifo", "fifo")
    t.step("mknod socket", Int(mknodat(dir, "sock", S_IFSOCK | 0o600, 0)))
    t.stat("sock", "sock")

    // Sparse files: fallocate, SEEK_DATA/SEEK_HOLE, copy_file_range.
    let s = openat(dir, "sparse", O_RDWR | O_CREAT, 0o644)
    t.step("fallocate", Int(vanish_fallocate(s, 0, 0, 1 << 20)))
    t.step("punch hole", Int(vanish_fallocate(s, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 512 << 10)))
    t.value("seek data", "\(lseek(s, 0, VANISH_SEEK_DATA))")
    t.value("seek hole", "\(lseek(s, 0, VANISH_SEEK_HOLE))")
    t.write("sparse tail", s, "tail", at: 1 << 20)
    t.fstat("sparse", s)
    let c = openat(dir, "copy", O_RDWR | O_CREAT, 0o644)
    var inOff: off_t = 1 << 20, outOff: off_t = 0
    t.value("copy_file_range", "\(vanish_copy_file_range(s, &inOff, c, &outOff, 4, 0))")
    t.read("copy", c)
    close(s); close(c)

    // Device nodes (root may make them; the mount is nodev, so only their metadata is compared).
    t.step("mknod char device", Int(mknodat(dir, "null", S_IFCHR | 0o600, dev_t((1 << 8) | 3))))
    var dev = Glibc.stat()
    if fstatat(dir, "null", &dev, AT_SYMLINK_NOFOLLOW) == 0 { t.value("device", "\(dev.st_rdev >> 8),\(dev.st_rdev & 0xff)") }

    // O_DIRECT with aligned buffers, and the sync calls.
    let d = openat(dir, "direct", O_RDWR | O_CREAT | VANISH_O_DIRECT, 0o644)
    t.step("open O_DIRECT", Int(d))
    var aligned: UnsafeMutableRawPointer?
    posix_memalign(&aligned, 4096, 8192)
    let buffer = aligned!
    memset(buffer, 0x41, 8192)
    t.value("O_DIRECT write", "\(pwrite(d, buffer, 8192, 0))")
    memset(buffer, 0, 8192)
    t.value("O_DIRECT read", "\(pread(d, buffer, 4096, 4096)) \(buffer.load(fromByteOffset: 4095, as: UInt8.self))")
    free(buffer)
    // Databases map a file they also read with O_DIRECT: a shared mapping
    // must work, and what is written through it must reach the file.
    let map = mmap(nil, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, d, 0)
    t.step("mmap shared O_DIRECT", map == MAP_FAILED ? -1 : 0)
    if let map, map != MAP_FAILED {
        memcpy(map, "mapped", 6)
        t.step("msync", Int(msync(map, 4096, MS_SYNC)))
        munmap(map, 4096)
    }
    // Read back through a second, buffered handle (an unaligned read on the
    // O_DIRECT one would fail; with passthrough even after fcntl clears the
    // flag, which the README notes).
    let buffered = openat(dir, "direct", O_RDONLY)
    t.read("after mmap", buffered, count: 8)
    close(buffered)
    t.step("fsync", Int(Glibc.fsync(d)))
    t.step("fdatasync", Int(fdatasync(d)))
    close(d)
    let dirFD = openat(dir, "d", O_RDONLY | O_DIRECTORY)
    t.step("fsyncdir", Int(Glibc.fsync(dirFD)))
    close(dirFD)

    // More fallocate modes.
    let z = openat(dir, "zero", O_RDWR | O_CREAT, 0o644)
    t.write("zero data", z, String(repeating: "z", count: 8192))
    t.step("zero range", Int(vanish_fallocate(z, FALLOC_FL_ZERO_RANGE, 0, 4096)))
    t.read("after zero range", z, at: 4090, count: 12)
    t.step("keep size", Int(vanish_fallocate(z, FALLOC_FL_KEEP_SIZE, 0, 1 << 20)))
    t.fstat("zero", z)
    close(z)

    // access(2), statfs.
    t.step("access rw", Int(faccessat(dir, "g", R_OK | W_OK, 0)))
    t.step("access x", Int(faccessat(dir, "g", X_OK, 0)))
    t.step("access missing", Int(faccessat(dir, "missing", F_OK, 0)))
    var vfs = statvfs()
    t.step("statvfs", Int(statvfs(root, &vfs)))
    t.value("statvfs", "bsize=\(vfs.f_bsize) namemax=\(vfs.f_namemax)")

    // Listing.
    t.value("listing", listing(root))
    return t.lines
}

func listing(_ path: String) -> String {
    ((try? FileManager.default.contentsOfDirectory(atPath: path)) ?? ["<error>"]).sorted().joined(separator: ",")
}

@Suite("POSIX parity", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct ParityTests {
    @Test("the same syscalls give the same results on a plain directory and on the mount")
    func sameResults() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let expected = parityScript(root: plain)
        try withVanishMount { m in
            let actual = parityScript(root: m.mountpoint)
            #expect(actual.count == expected.count)
            for (a, e) in zip(actual, expected) { #expect(a == e) }
            let status = try m.unmount()
            #expect(status == 0)
            // And what the mount did landed in the backing directory, deferred
            // unlinks included (plus the state directory, which the mount never shows).
            #expect(listing(m.source) == ".vanish," + listing(plain))
        }
    }

    @Test("new files, directories, fifos and symlinks get the modes they get natively, under umask 0, 002 and 022")
    func creationModes() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let script = """
            for u in 0 002 022; do
              umask $u && mkdir u$u && cd u$u
              for mode in 0620 0642 0777 0600 4755 2775; do
                python3 -c "import os; os.close(os.open('f$mode', os.O_CREAT | os.O_WRONLY, 0o$mode))"
                python3 -c "import os; os.close(os.open('r$mode', os.O_CREAT | os.O_RDONLY, 0o$mode))"
                mkdir -m $mode d$mode; mkfifo -m $mode p$mode
              done
              ln -s target l && cd ..
            done
            find . -mindepth 2 -printf '%P %M\n' | sort
            """
        let expected = try sh(script, cwd: plain)
        #expect(expected.ok, "\(expected.stderr)")
        try withVanishMount(options: ["allow_other"]) { m in
            let actual = try sh(script, cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
        }
        try withVanishMount { m in
            let actual = try sh(script, cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
        }
    }

    /// `chown(path, -1, -1)` changes no owner, yet Linux file systems move the
    /// ctime; the kernel sends FUSE a SETATTR with no field set for it.
    @Test("chown, lchown and fchown to -1, -1 move the ctime on the mount as on a plain directory")
    func chownToNobodyMovesCtime() throws {
        func ctimes(_ root: String) -> [String] {
            let dir = open(root, O_RDONLY | O_DIRECTORY)
            defer { close(dir) }
            mkdirat(dir, "d", 0o755)
            close(openat(dir, "f", O_CREAT | O_WRONLY, 0o644))
            symlinkat("f", dir, "l")
            let fd = openat(dir, "o", O_CREAT | O_RDWR, 0o644)
            defer { close(fd) }
            let changes: [(String, () -> Int32)] = [
                ("chown d", { fchownat(dir, "d", uid_t.max, gid_t.max, 0) }),
                ("chown f", { fchownat(dir, "f", uid_t.max, gid_t.max, 0) }),
                ("lchown l", { fchownat(dir, "l", uid_t.max, gid_t.max, AT_SYMLINK_NOFOLLOW) }),
                ("fchown o", { fchown(fd, uid_t.max, gid_t.max) }),
            ]
            return changes.map { label, change in
                let name = String(label.split(separator: " ")[1])
                var before = Glibc.stat(), after = Glibc.stat()
                fstatat(dir, name, &before, AT_SYMLINK_NOFOLLOW)
                // Wait for the clock file systems stamp with to pass the ctime,
                // so a change cannot get the same stamp.
                var now = timespec()
                repeat { clock_gettime(CLOCK_REALTIME_COARSE, &now) }
                while (now.tv_sec, now.tv_nsec) <= (before.st_ctim.tv_sec, before.st_ctim.tv_nsec)
                let r = change()
                fstatat(dir, name, &after, AT_SYMLINK_NOFOLLOW)
                let moved = (after.st_ctim.tv_sec, after.st_ctim.tv_nsec) > (before.st_ctim.tv_sec, before.st_ctim.tv_nsec)
                return "\(label): \(r == 0 ? "ok" : errnoName(errno)), ctime \(moved ? "moved" : "kept")"
            }
        }
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let expected = ctimes(plain)
        #expect(expected.allSatisfy { $0.hasSuffix("ok, ctime moved") }, "\(expected)")
        try withVanishMount { m in #expect(ctimes(m.mountpoint) == expected) }
    }

    /// Device nodes: like every FUSE mount, Vanish mounts nosuid,nodev unless
    /// told otherwise (the README says so); root's `-o dev,suid` gives what a
    /// plain directory gives.
    @Test("device nodes cannot be opened on a default mount, and open as natively with -o dev,suid")
    func deviceNodes() throws {
        let script = """
            import os, stat
            os.mknod("null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            try:
                with open("null", "w") as f: f.write("x")
                print("device: ok")
            except OSError as e:
                print("device:", e.errno)
            """
        try withVanishMount { m in
            let r = try run(["python3", "-c", script], cwd: m.mountpoint)
            #expect(r.stdout == "device: \(EACCES)\n", "\(r.stderr)")
        }
        guard getuid() == 0 else { return }  // only root may lift nodev
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let native = try run(["python3", "-c", script], cwd: plain)
        try withVanishMount(options: ["dev", "suid"]) { m in
            let r = try run(["python3", "-c", script], cwd: m.mountpoint)
            #expect(r.stdout == native.stdout, "\(r.stderr)")
        }
    }

    /// statx through the mount, birth time included: the kernel asks for a
    /// birth time with FUSE_STATX, which libfuse 3.14 does not know; the
    /// transport brings it as a GETATTR and writes the reply as a statx.
    /// `stat` asks for it, so every field it prints is compared with the
    /// backing file's, for each kind of file, through a path and an open fd.
    @Test("statx through the mount gives every field the backing file has, birth time included, also with requests spliced in",
          arguments: [false, true])
    func statxFields(spliced: Bool) throws {
        if spliced {
            try #require(getuid() == 0, "raising pipe-max-size needs root")
            try withSplicedRequests { try statxFields(spliced: false) }
            return
        }
        try withVanishMount { m in
            #expect(try sh("""
                echo data > f && mkdir d && ln -s f l && mkfifo p && ln f f2
                if [ "$(id -u)" = 0 ]; then mknod c c 1 3 && mknod b b 259 70000; fi
                """, cwd: m.source).ok)
            let format = "%n %s %b %B %o %h %u %g %f %t %T %i %X %Y %Z %w"
            let names = ["f", "d", "l", "p", "f2", "."] + (getuid() == 0 ? ["c", "b"] : [])
            for name in names {
                let backing = try run(["stat", "-c", format, name], cwd: m.source)
                let mounted = try run(["stat", "-c", format, name], cwd: m.mountpoint)
                #expect(backing.ok && mounted.stdout == backing.stdout, "\(name): \(mounted) against \(backing)")
                #expect(!backing.stdout.hasSuffix(" -\n"), "the backing filesystem has birth times")
            }
            // Through an open file (the fd's own handle), after a write through it.
            let r = try run(["/bin/sh", "-c", "exec 3>>f && echo more >&3 && stat -L -c '\(format)' /proc/self/fd/3"],
                            cwd: m.mountpoint)
            let backing = try run(["stat", "-c", format, "f"], cwd: m.source)
            #expect(r.stdout.split(separator: " ").dropFirst() == backing.stdout.split(separator: " ").dropFirst(), "\(r)")
        }
    }

    /// Inode flags (FS_IOC_GETFLAGS/SETFLAGS, which the kernel sends as
    /// ioctls after its own owner and CAP_LINUX_IMMUTABLE checks): lsattr and
    /// chattr on files and directories give what a plain directory gives,
    /// for root and for nobody, and an immutable file refuses unlink, rename
    /// and append through the mount as natively; other ioctls are ENOTTY.
    @Test("lsattr and chattr give what they give on a plain directory, for root and for nobody")
    func inodeFlags() throws {
        try #require(getuid() == 0, "chattr +i needs root")
        let plain = try makeTempDirectory()
        defer { _ = try? run(["chattr", "-R", "-i", plain]); removeTree(plain) }
        chmod(plain, 0o755)
        let rootScript = """
            echo x > f && mkdir d && chattr +A f && chattr +A d && lsattr -d f d | cut -c1-22
            chattr +i f; rm -f f; echo "rm $?"; mv f f2; echo "mv $?"; (echo y >> f) 2>/dev/null; echo "append $?"
            lsattr f | cut -c1-22; chattr -i f && rm f && echo removed
            mkdir -m 777 open
            python3 -c 'import fcntl, os; fd = os.open("d", os.O_RDONLY)
            try: fcntl.ioctl(fd, 0x5401, bytes(64)); print("TCGETS ok")
            except OSError as e: print("TCGETS", e.errno)'
            """
        let nobodyScript = """
            cd open && echo n > mine && chattr +A mine; echo "own +A $?"; chattr +i mine 2>/dev/null; echo "own +i $?"
            lsattr mine | cut -c1-22; chattr +A ../d 2>/dev/null; echo "other's $?"
            """
        let nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "/bin/sh", "-c", nobodyScript]
        let expectedRoot = try sh(rootScript, cwd: plain)
        let expectedNobody = try run(nobody, cwd: plain)
        #expect(expectedRoot.stdout.contains("-------A") && expectedNobody.ok, "\(expectedRoot) \(expectedNobody)")
        try withVanishMount(options: ["allow_other"]) { m in
            let root = try sh(rootScript, cwd: m.mountpoint)
            #expect(root.stdout == expectedRoot.stdout, "\(root.stderr)")
            let other = try run(nobody, cwd: m.mountpoint)
            #expect(other.stdout == expectedNobody.stdout, "\(other.stderr)")
            // The flags are the backing files' own.
            #expect(try run(["lsattr", "-d", m.source + "/d"]).stdout.hasPrefix("-------A"))
        }
    }

    /// O_TMPFILE reaches the daemon although libfuse 3.14 does not know the
    /// request (the transport hands it over as a create of "/"): a file with
    /// no name, written, read, given a name by linkat through /proc and with
    /// AT_EMPTY_PATH, in its own directory and another; not linkable with
    /// O_EXCL; gone with its last close when never linked.
    static let tmpfileScript = """
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        AT_FDCWD, AT_SYMLINK_FOLLOW, AT_EMPTY_PATH = -100, 0x400, 0x1000
        def link(fd, path):
            r = libc.linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), AT_FDCWD, path.encode(), AT_SYMLINK_FOLLOW)
            return "ok" if r == 0 else f"errno {ctypes.get_errno()}"
        def fstat(fd):
            st = os.fstat(fd)
            return f"nlink={st.st_nlink} mode={oct(st.st_mode)} size={st.st_size}"
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o640)
        os.write(fd, b"hello")
        print("made", fstat(fd), os.pread(fd, 5, 0), sorted(os.listdir(".")))
        print("link", link(fd, "named"), fstat(fd), sorted(os.listdir(".")))
        os.write(fd, b" more")
        os.close(fd)
        print("named", open("named").read())
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_EXCL, 0o600)
        print("O_EXCL link", link(fd, "excl"))
        os.close(fd)
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)
        os.write(fd, b"x" * 100000)
        os.close(fd)
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)
        r = libc.linkat(fd, b"", AT_FDCWD, b"empty-path", AT_EMPTY_PATH)
        print("AT_EMPTY_PATH", "ok" if r == 0 else f"errno {ctypes.get_errno()}")
        os.close(fd)
        try:
            os.open(".", os.O_TMPFILE | os.O_RDONLY, 0o600)
            print("read-only: ok")
        except OSError as e:
            print("read-only:", e.errno)
        os.mkdir("sub")
        fd = os.open("sub", os.O_TMPFILE | os.O_RDWR, 0o600)
        print("link out of its directory", link(fd, "moved"))
        os.close(fd)
        os.chmod("sub", 0o500)
        try:
            os.open("sub", os.O_TMPFILE | os.O_RDWR, 0o600)
            print("in a read-only directory: ok")
        except OSError as e:
            print("in a read-only directory:", e.errno)
        print("listing", sorted(os.listdir(".")))
        """

    @Test("O_TMPFILE files are made, written, linked and dropped as in a plain directory, also with requests spliced in",
          arguments: [false, true])
    func tmpfile(spliced: Bool) throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let asNobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "/usr/bin/python3", "-c", Self.tmpfileScript]
        let expected = try run(["/usr/bin/python3", "-c", Self.tmpfileScript], cwd: plain)
        #expect(expected.ok, "\(expected.stderr)")
        if spliced {
            // libfuse splices requests in only while a pipe can hold its
            // whole 1 MiB buffer; past the default pipe-max-size it reads them.
            try #require(getuid() == 0, "raising pipe-max-size needs root")
            try withSplicedRequests {
                try withVanishMount { m in
                    let actual = try run(["/usr/bin/python3", "-c", Self.tmpfileScript], cwd: m.mountpoint)
                    #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
                    #expect(listing(m.source) == ".vanish," + listing(plain))
                }
            }
            return
        }
        try withVanishMount(options: ["allow_other"]) { m in
            let actual = try run(["/usr/bin/python3", "-c", Self.tmpfileScript], cwd: m.mountpoint)
            #expect(actual.stdout == expected.stdout, "\(actual.stderr)")
            #expect(listing(m.source) == ".vanish," + listing(plain))
            // Another user's nameless file belongs to them, and a directory
            // they may not write refuses it, as natively.
            guard getuid() == 0 else { return }
            chmod(plain, 0o755)
            for dir in [plain, m.mountpoint] {
                #expect(try run(["mkdir", "-m", "777", dir + "/open"]).ok)
            }
            let native = try run(asNobody, cwd: plain + "/open")
            #expect(native.ok, "\(native.stderr)")
            let mounted = try run(asNobody, cwd: m.mountpoint + "/open")
            #expect(mounted.stdout == native.stdout, "\(mounted.stderr)")
            var st = stat()
            #expect(lstat(m.source + "/open/named", &st) == 0 && st.st_uid == 65534)
        }
    }

    @Test("the same script works in every cache and readdirplus mode, with and without passthrough, write-back caching, clone_fd and sync_unlink")
    func cacheModes() throws {
        let plain = try makeTempDirectory()
        defer { removeTree(plain) }
        let expected = parityScript(root: plain)
        for opts in [["cache=never"], ["cache=never", "passthrough=off"], ["cache=always"], ["passthrough=off"],
                     ["writeback"], ["clone_fd", "threads=3"], ["readdirplus=auto", "sync_unlink"], ["readdirplus=never"], ["readdirplus=always"]] {
            try withVanishMount(options: opts) { m in
                // With cache=never and passthrough=off every file is direct_io,
                // and shared mappings of it work through FUSE_DIRECT_IO_ALLOW_MMAP.
                let actual = parityScript(root: m.mountpoint)
                for (a, e) in zip(actual, expected) { #expect(a == e, "with \(opts)") }
                #expect(actual.count == expected.count)
            }
        }
    }
}
