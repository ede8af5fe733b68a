import Glibc
import LinuxSyscalls
import Testing

/// `UserDatabase`, in process on scratch files in /etc's formats.
@Suite("user database")
struct UserDatabaseTests {
    @Test("users and their groups come from passwd and group lines, comments and odd lines aside; an unknown uid is nil")
    func readsFiles() throws {
        var template = Array("/tmp/vanish-users-XXXXXX".utf8CString)
        let base = try #require(mkdtemp(&template).map { String(cString: $0) })
        defer { unlink(base + "/passwd"); unlink(base + "/group"); rmdir(base) }
        func put(_ name: String, _ text: String) {
            let fd = open(base + "/" + name, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
            _ = text.utf8CString.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count - 1) }
            close(fd)
        }
        put("passwd", """
            # a comment
            root:x:0:0:root:/root:/bin/bash
            broken line
            alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash
            bob:x:1001:100::/home/bob:/bin/sh
            """)
        put("group", """
            root:x:0:
            users:x:100:alice
            alice:x:1000:
            audio:x:29:bob,alice
            video:x:44:alicex
            """)
        let alice = try #require(UserDatabase.user(1000, passwd: base + "/passwd"))
        #expect(alice.name == "alice" && alice.gid == 1000)
        #expect(UserDatabase.groups(of: "alice", primary: 1000, group: base + "/group") == [1000, 100, 29])
        let bob = try #require(UserDatabase.user(1001, passwd: base + "/passwd"))
        #expect(UserDatabase.groups(of: bob.name, primary: bob.gid, group: base + "/group") == [100, 29])
        #expect(UserDatabase.user(4242, passwd: base + "/passwd") == nil)
        #expect(UserDatabase.user(0, passwd: base + "/missing") == nil)
    }

    @Test("the system's own files: root is uid 0 with group 0")
    func systemFiles() {
        #expect(UserDatabase.user(0)?.name == "root")
        #expect(UserDatabase.groups(of: "root", primary: 0).first == 0)
    }
}
