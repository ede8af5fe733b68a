import Glibc
import LinuxSyscalls
import SystemPackage
import Testing

/// `OwnedDescriptor`: closed once, on every path, unless handed on.
@Suite("owned descriptors")
struct OwnedDescriptorTests {
    /// A file of this test's own, so a descriptor number another test's
    /// open reuses is never taken for ours.
    private final class Scratch {
        let path: String
        let dev: dev_t
        let ino: ino_t
        init() throws {
            var template = Array("/tmp/vanish-owned-XXXXXX".utf8CString)
            let fd = mkstemp(&template)
            #expect(fd >= 0)
            path = template.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
            var st = stat()
            fstat(fd, &st)
            dev = st.st_dev
            ino = st.st_ino
            close(fd)
        }
        deinit { unlink(path) }
        /// Whether `fd` is open on this file.
        func isOpen(_ fd: Int32) -> Bool {
            var st = stat()
            return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino
        }
    }

    @Test("a descriptor is closed when its owner goes out of scope, and when an error is thrown past it")
    func closesOnEveryPath() throws {
        let file = try Scratch()
        var seen: Int32 = -1
        do {
            let fd = try Sys.opened(file.path, O_RDONLY)
            seen = fd.raw
            #expect(file.isOpen(seen))
        }
        #expect(!file.isOpen(seen), "closed at the end of its scope")

        func failsAfterOpening() throws(Errno) -> Int32 {
            let fd = try Sys.opened(file.path, O_RDONLY)
            seen = fd.raw
            _ = try Sys.lstatat(AT_FDCWD, "/nonexistent/vanish-owned-test")
            return fd.take()
        }
        #expect(throws: Errno.noSuchFileOrDirectory) { try failsAfterOpening() }
        #expect(seen >= 0 && !file.isOpen(seen), "closed as the error left the function")
    }

    @Test("take() hands the descriptor on open, and its new owner closes it")
    func takeKeepsItOpen() throws {
        let file = try Scratch()
        let fd = try Sys.opened(file.path, O_RDONLY).take()
        #expect(file.isOpen(fd))
        do { let owner = OwnedDescriptor(fd); _ = owner.raw }
        #expect(!file.isOpen(fd))
    }
}
