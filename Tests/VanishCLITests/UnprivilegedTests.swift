import Foundation
import Glibc
import Testing
import VanishTestSupport

/// An ordinary user mounts through the setuid fusermount3, as on a desktop.
@Suite("unprivileged daemon", .serialized, .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root to become nobody"))
struct UnprivilegedTests {
    @Test("nobody mounts, uses and unmounts its own directory; the fd limit is its own")
    func nobodyMounts() throws {
        try withFUSEDeviceOpenToAll { try nobodyMountsOwnDirectory() }
    }

    @Test("a background mount's log lands: syslog where a socket listens, else a file of the user's, said once and in status (issue 51)")
    func logLands() throws {
        try withFUSEDeviceOpenToAll {
            let base = try makeTempDirectory()
            let (src, mnt) = (base + "/src", base + "/mnt")
            defer { unmountAndRemove(mnt, base: base) }
            chmod(base, 0o755)
            #expect(try sh("mkdir src mnt state && chown nobody:nogroup src mnt state && cp \(shellQuote(vanishBinary)) vanish",
                           cwd: base).ok)
            var environment = try nobodyRuntimeDirectory(in: base)
            environment["XDG_STATE_HOME"] = base + "/state"
            environment["PATH"] = "/usr/bin:/bin:/usr/sbin:/sbin"
            var st = stat()
            let syslog = stat("/dev/log", &st) == 0 && st.st_mode & S_IFMT == S_IFSOCK
            let file = base + "/state/vanish/vanish.log"
            let up = try runAsNobody([base + "/vanish", "mount", src, mnt], environment: environment)
            #expect(up.ok, "\(up.stderr)")
            let status = try runAsNobody([base + "/vanish", "status", mnt], environment: environment)
            if syslog {
                #expect(up.stderr.isEmpty, "\(up.stderr)")
                #expect(status.stdout.contains("log:              syslog"), "\(status.stdout)")
            } else {
                #expect(up.stderr == "vanish: no syslog socket (/dev/log): the daemon logs to \(file)\n", "\(up.stderr)")
                #expect(status.stdout.contains("log:              \(file)\n"), "\(status.stdout)")
                try waitFor("the daemon's first lines in \(file)") {
                    (try? String(contentsOfFile: file, encoding: .utf8))?.contains("mounted") == true
                }
                // Said once: the next mount finds the file there.
                #expect(try runAsNobody([base + "/vanish", "unmount", mnt], environment: environment).ok)
                let again = try runAsNobody([base + "/vanish", "mount", src, mnt], environment: environment)
                #expect(again.ok && again.stderr.isEmpty, "\(again)")
            }
            #expect(try runAsNobody([base + "/vanish", "unmount", mnt], environment: environment).ok)
        }
    }

    @Test("an ordinary user's mount that fails for want of /dev/fuse says so, in one message (issue 51)")
    func noDeviceHint() throws {
        let base = try makeTempDirectory()
        defer { removeTree(base) }
        chmod(base, 0o755)
        #expect(try sh("mkdir src mnt && chown nobody:nogroup src mnt && cp \(shellQuote(vanishBinary)) vanish", cwd: base).ok)
        // A 0600 /dev/fuse in a mount namespace of this test's own, whatever the machine's mode.
        let r = try sh("""
            exec unshare -m sh -c 'mknod fuse c 10 229 && chmod 600 fuse && mount --bind fuse /dev/fuse &&
              exec setpriv --reuid=nobody --regid=nogroup --clear-groups -- ./vanish mount src mnt'
            """, cwd: base)
        #expect(r.status == 1)
        #expect(r.stderr.contains("/dev/fuse is not open to you"), "\(r.stderr)")
        #expect(mountType(at: base + "/mnt") == nil)
    }

    func nobodyMountsOwnDirectory() throws {
        let base = try makeTempDirectory()
        let (src, mnt) = (base + "/src", base + "/mnt")
        defer { unmountAndRemove(mnt, base: base) }
        mkdir(src, 0o755); mkdir(mnt, 0o755)
        chmod(base, 0o755)
        #expect(try run(["chown", "nobody:nogroup", src, mnt]).ok)
        // The binary must be reachable by nobody (the build tree may be in root's home).
        let binary = base + "/vanish"
        #expect(try run(["cp", vanishBinary, binary]).ok)

        let m = try runAsNobody(["/bin/sh", "-c", "ulimit -n 512 && exec \(binary) mount -o readahead=64 \(src) \(mnt)"],
                                environment: try nobodyRuntimeDirectory(in: base))
        #expect(m.ok, "\(m.stderr)")
        #expect(mountType(at: mnt) == "fuse.vanish")
        // Passthrough needs CAP_SYS_ADMIN: nobody's file data goes through the daemon, and status says why.
        let status = try runAsNobody([binary, "status", mnt])
        #expect(status.stdout.contains("file data:        through the daemon; passthrough off: registering backing files needs CAP_SYS_ADMIN"),
                "\(status.stdout)\(status.stderr)")
        // FUSE over io_uring needs no privilege: where the kernel offers it, nobody's daemon uses it too.
        if (try? String(contentsOfFile: "/sys/module/fuse/parameters/enable_uring", encoding: .utf8)) == "Y\n" {
            #expect(status.stdout.contains("requests:         io_uring"), "\(status.stdout)")
        }
        // Only root may raise a mount's readahead; anyone may lower it (the INIT reply does: the
        // status request above waited for it, since the kernel holds every request until INIT).
        // (From mountinfo: root may not stat a mount another user made without allow_other.)
        let device = try sh("awk '$5 == \"\(mnt)\" { d = $3 } END { print d }' /proc/self/mountinfo")
            .stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        #expect(try String(contentsOfFile: "/sys/class/bdi/\(device)/read_ahead_kb", encoding: .utf8) == "64\n")
        // Root itself is kept out of a mount another user made without allow_other.
        let rootDenied = try run(["ls", mnt])
        #expect(!rootDenied.ok)
        let use = try runAsNobody(["/bin/sh", "-c", """
            set -e
            cd \(mnt)
            for i in $(seq 1 2000); do echo $i > f$i; done
            ls | wc -l && cat f1999 && mkdir d && mv f1 d/ && ln -s f2 l && cat l && rm -f f* l && rm -r d && ls | wc -l
            """])
        #expect(use.ok, "\(use.stderr)")
        #expect(use.stdout == "2000\n1999\n2\n0\n")
        // A read-only tree (as Go's module cache is) is put back as rm -r
        // leaves it (all of it: rm -r fails on it even for its owner); made writable, it goes.
        let readOnly = try runAsNobody(["/bin/sh", "-c", """
            set -e
            cd \(mnt)
            mkdir -p cache/ro/sub && echo x > cache/ro/f && echo y > cache/ro/sub/g
            chmod 000 cache/ro/sub && chmod 555 cache/ro
            \(binary) rm -r cache
            timeout 60 \(binary) status --wait . > /dev/null
            cat cache/ro/f
            chmod -R u+rwx cache
            \(binary) rm -r cache
            timeout 60 \(binary) status --wait . > /dev/null
            find \(src)/.vanish/clients/*/graveyard -mindepth 2 | wc -l
            """])
        #expect(readOnly.ok, "\(readOnly.stderr)")
        #expect(readOnly.stdout == "x\n0\n")
        let u = try runAsNobody([binary, "unmount", mnt])
        #expect(u.ok, "\(u.stderr)")
        #expect(mountType(at: mnt) == nil)
    }
}
