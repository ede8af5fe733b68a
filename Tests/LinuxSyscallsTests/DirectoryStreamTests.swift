import Glibc
import LinuxSyscalls
import SystemPackage
import Testing

/// `Sys.openDirectory` and `Sys.names`, in process on a scratch directory.
@Suite("directory streams")
struct DirectoryStreamTests {
    /// Descriptors this process holds on `base` or below it: other tests'
    /// threads open and close their own meanwhile, never these.
    func openDescriptors(on base: String) -> Int {
        guard let d = opendir("/proc/self/fd") else { return -1 }
        defer { closedir(d) }
        var n = 0
        var target = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
        while let e = readdir(d) {
            let name = withUnsafeBytes(of: e.pointee.d_name) { String(cString: $0.bindMemory(to: CChar.self).baseAddress!) }
            let r = readlink("/proc/self/fd/" + name, &target, target.count - 1)
            guard r > 0 else { continue }
            if String(decoding: target[..<r].map { UInt8(bitPattern: $0) }, as: UTF8.self).hasPrefix(base) { n += 1 }
        }
        return n
    }

    @Test("a directory opens as a stream; a symlink to one, a file or nothing is refused with errno; no descriptor is left either way")
    func openDirectory() throws {
        var template = Array("/tmp/vanish-dirstream-XXXXXX".utf8CString)
        let base = try #require(mkdtemp(&template).map { String(cString: $0) })
        defer { _ = try? Sys.names(in: AT_FDCWD, base).forEach { unlink(base + "/" + $0) }; rmdir(base + "/d"); rmdir(base) }
        #expect(mkdir(base + "/d", 0o755) == 0)
        #expect(close(open(base + "/f", O_CREAT | O_WRONLY, 0o644)) == 0)
        #expect(symlink("d", base + "/link") == 0)
        for _ in 0..<200 {
            let dp = try Sys.openDirectory(AT_FDCWD, base)
            closedir(dp)
            // O_NOFOLLOW with O_DIRECTORY: a symlink is not a directory.
            #expect(throws: Errno.notDirectory) { _ = try Sys.openDirectory(AT_FDCWD, base + "/link") }
            #expect(throws: Errno.notDirectory) { _ = try Sys.openDirectory(AT_FDCWD, base + "/f") }
            #expect(throws: Errno.noSuchFileOrDirectory) { _ = try Sys.openDirectory(AT_FDCWD, base + "/none") }
        }
        #expect(openDescriptors(on: base) == 0)
        #expect(try Sys.names(in: AT_FDCWD, base).sorted() == ["d", "f", "link"])
    }

    @Test("a stream adopts its descriptor: closedir closes it, and a descriptor that is no directory is closed on the refusal")
    func adopting() throws {
        // High numbers, which no other thread's open takes meanwhile (the lowest free number is given).
        func high(_ fd: Int32) -> Int32 {
            defer { close(fd) }
            return fcntl(fd, F_DUPFD_CLOEXEC, 15_000)
        }
        for _ in 0..<200 {
            let dir = high(open("/tmp", O_RDONLY | O_DIRECTORY))
            try #require(dir >= 15_000)
            closedir(try Sys.directoryStream(adopting: dir))
            #expect(fcntl(dir, F_GETFD) == -1)
            let file = high(open("/proc/self/stat", O_RDONLY))
            try #require(file >= 15_000)
            #expect(throws: Errno.notDirectory) { _ = try Sys.directoryStream(adopting: file) }
            #expect(fcntl(file, F_GETFD) == -1 && errno == EBADF)
        }
    }

    @Test("disk bytes are st_blocks in 512-byte units, whatever the block size")
    func diskBytes() {
        var st = stat()
        st.st_blocks = 8
        st.st_blksize = 65536
        #expect(Sys.diskBytes(st) == 4096)
    }
}
