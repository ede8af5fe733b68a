import Foundation
import Glibc
import Testing
import VanishTestSupport

/// The control socket takes a peer's groups from the socket (as they were
/// at connect), never from `/proc/PID`, which by the time of the request
/// may be another process's: nobody connects, hands the socket to a child
/// and exits, and a process in a group nobody is not in gets that pid.
@Suite("control socket peer credentials", .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct PeerCredentialsTests {
    @Test("a reused pid lends nobody no groups: a snapshot never lists a directory only the group may search")
    func reusedPid() throws {
        let group = "daemon"
        guard let gr = getgrnam(group) else { throw TestFailure("no group \(group)") }
        let gid = gr.pointee.gr_gid
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("mkdir -m 750 secret && chgrp \(group) secret && touch secret/inside-name", cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let socket = try #require(try statusJSON(m)["socket"] as? String)
            let helper = m.base + "/peer.py", go = m.base + "/go", out = m.base + "/snapshot"
            try """
                import os, socket, sys, time
                path, go, out = sys.argv[1:4]
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                if os.fork():
                    os._exit(0)  # the connecting process goes: its pid is free
                while not os.path.exists(go):
                    time.sleep(0.005)
                s.sendall(b'{"op":"events","snapshot":true}\\n')
                data = b""
                while b"scan-completed" not in data:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                with open(out + ".part", "wb") as f:
                    f.write(data)
                os.rename(out + ".part", out)
                """.write(toFile: helper, atomically: true, encoding: .utf8)
            chmod(m.base, 0o777)
            let connecting = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                                        "/usr/bin/python3", helper, socket, go, out])
            var status: Int32 = 0
            waitpid(connecting, &status, 0)
            // A process in the group takes the freed pid (the next fork after ns_last_pid).
            var holder: pid_t = 0
            for _ in 0..<50 {
                try "\(connecting - 1)".write(toFile: "/proc/sys/kernel/ns_last_pid", atomically: false, encoding: .utf8)
                let p = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--groups=\(gid)", "--",
                                   "/bin/sleep", "120"])
                if p == connecting { holder = p; break }
                kill(p, SIGKILL)
                waitpid(p, &status, 0)
            }
            defer { if holder > 0 { kill(holder, SIGKILL); waitpid(holder, &status, 0) } }
            try #require(holder == connecting, "the freed pid went to another process 50 times")
            try waitFor("the holder to be in the group") {
                (try? String(contentsOfFile: "/proc/\(holder)/status", encoding: .utf8))?.contains("Groups:\t\(gid)") == true
            }
            _ = FileManager.default.createFile(atPath: go, contents: nil)
            try waitFor("the snapshot") { access(out, F_OK) == 0 }
            let snapshot = try String(contentsOfFile: out, encoding: .utf8)
            #expect(snapshot.contains("scan-completed"), "\(snapshot)")
            #expect(!snapshot.contains("inside-name"), "nobody saw into the group's directory: \(snapshot)")
        }
    }
}
