import Glibc
import LinuxSyscalls
import Testing

/// `SubordinateIDs`, in process on scratch files in /etc/subuid's format.
@Suite("subordinate uids")
struct SubordinateIDsTests {
    final class Files {
        let base: String
        init() throws {
            var template = Array("/tmp/vanish-subuid-XXXXXX".utf8CString)
            base = try #require(mkdtemp(&template).map { String(cString: $0) })
        }
        deinit { unlink(base + "/passwd"); unlink(base + "/subuid"); rmdir(base) }
        func put(_ name: String, _ text: String) {
            let fd = open(base + "/" + name + ".new", O_WRONLY | O_CREAT | O_TRUNC, 0o644)
            _ = text.utf8CString.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count - 1) }
            close(fd)
            rename(base + "/" + name + ".new", base + "/" + name)
        }
    }

    @Test("a uid of a range counts as the account that owns it, named or numbered; root's ranges and odd lines count for nothing")
    func owners() throws {
        let f = try Files()
        f.put("passwd", """
            root:x:0:0:root:/root:/bin/bash
            alice:x:1000:1000::/home/alice:/bin/bash
            mal:x:1002:1002::/home/mal:/bin/bash
            """)
        f.put("subuid", """
            alice:100000:65536
            1002:165536:65536
            root:300000:65536
            ghost:400000:10
            broken
            mal:500000:0
            """)
        let ids = SubordinateIDs(path: f.base + "/subuid", passwd: f.base + "/passwd")
        #expect(ids.owner(of: 100_000) == 1000)
        #expect(ids.owner(of: 165_535) == 1000)
        #expect(ids.owner(of: 165_536) == 1002)
        #expect(ids.owner(of: 231_071) == 1002)
        #expect(ids.owner(of: 231_072) == 231_072, "past the last range")
        #expect(ids.owner(of: 300_001) == 300_001, "root's range is not root")
        #expect(ids.owner(of: 400_001) == 400_001, "an owner the user database does not know")
        #expect(ids.owner(of: 1000) == 1000 && ids.owner(of: 0) == 0 && ids.owner(of: 99_999) == 99_999)
    }

    @Test("a changed file is read again within about a second; a missing one maps nothing")
    func rereads() throws {
        let f = try Files()
        f.put("passwd", "mal:x:1002:1002::/home/mal:/bin/bash\n")
        let ids = SubordinateIDs(path: f.base + "/subuid", passwd: f.base + "/passwd")
        #expect(ids.owner(of: 165_536) == 165_536)
        f.put("subuid", "mal:165536:65536\n")
        func now() -> Int {
            var ts = timespec()
            clock_gettime(CLOCK_MONOTONIC, &ts)
            return ts.tv_sec * 1_000_000_000 + ts.tv_nsec
        }
        let deadline = now() + 5_000_000_000
        while ids.owner(of: 165_536) != 1002 && now() < deadline { usleep(10_000) }
        #expect(ids.owner(of: 165_536) == 1002)
    }
}
