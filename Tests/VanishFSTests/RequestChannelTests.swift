import Foundation
import Glibc
import Synchronization
import Testing
import VanishTestSupport

/// How requests reach the daemon: over io_uring where the kernel offers it
/// (the fuse module's enable_uring, which mount-scripts/install turns on),
/// else /dev/fuse. The whole suite runs over io_uring when the switch is on;
/// these tests pin down the choice, the fallback and the teardown.
@Suite("requests over io_uring or /dev/fuse", .serialized, .enabled(if: FUSEAvailability.shouldRunAsRoot))
struct RequestChannelTests {
    static let kernelSwitch = "/sys/module/fuse/parameters/enable_uring"

    static func switchValue() -> String? {
        (try? String(contentsOfFile: kernelSwitch, encoding: .utf8))?.trimmingCharacters(in: .whitespacesAndNewlines)
    }

    static func setSwitch(_ value: String) throws {
        try (value + "\n").write(toFile: kernelSwitch, atomically: false, encoding: .utf8)
    }

    /// Runs `body` with the kernel offering io_uring (root turns the switch
    /// on, and back as it was after). Mounts other tests make meanwhile may
    /// use it too: the suite passes over either channel.
    static func withKernelOffering(_ body: () throws -> Void) throws {
        guard let saved = switchValue() else {
            Issue.record("this kernel has no \(kernelSwitch) (FUSE over io_uring needs Linux 6.14+)")
            return
        }
        defer { try? setSwitch(saved) }
        try setSwitch("Y")
        try body()
    }

    func requests(_ m: VanishMount) throws -> [String: Any] {
        try statusJSON(m)["requests"] as? [String: Any] ?? [:]
    }

    /// The daemon's threads named `vanish-ring-N`.
    func ringThreads(_ m: VanishMount) -> Int {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(m.pid)/task")) ?? []
        return tasks.filter {
            ((try? String(contentsOfFile: "/proc/\(m.pid)/task/\($0)/comm", encoding: .utf8)) ?? "").hasPrefix("vanish-ring-")
        }.count
    }

    /// Work that crosses every kind of request the transport rewrites or
    /// routes: creates, tmpfiles, statx birth times, passthrough opens and
    /// daemon-served data, renames, links, xattrs, a listing, unlinks.
    static let work = """
        set -e
        mkdir -p d/e && for i in $(seq 1 300); do echo $i > d/e/f$i; done
        mv d/e/f1 d/f1 && ln d/f1 d/hard && ln -s f1 d/soft && setfattr -n user.k -v v d/f1
        python3 -c 'import ctypes, os; fd = os.open("d", os.O_TMPFILE | os.O_WRONLY); os.write(fd, b"t"); assert ctypes.CDLL(None).linkat(-100, f"/proc/self/fd/{fd}".encode(), -100, b"d/tmp", 0x400) == 0'
        dd if=/dev/urandom of=big bs=64k count=64 status=none && md5sum big | cut -c1-8 > big.sum
        [ "$(md5sum big | cut -c1-8)" = "$(cat big.sum)" ]
        [ "$(stat -c %W d/f1)" != 0 ] && getfattr -n user.k --only-values d/f1 && echo
        ls d/e | wc -l && cat d/soft d/tmp && echo && rm -rf d/e && ls d
        """

    @Test("where the kernel offers io_uring, requests come over it, served by threads on their CPUs; io_uring=off keeps /dev/fuse", arguments: [[], ["passthrough=off"]])
    func bothChannels(_ extra: [String]) throws {
        try Self.withKernelOffering { try bothChannelsOffered(extra) }
    }

    func bothChannelsOffered(_ extra: [String]) throws {
        var outputs: [String] = []
        for channel in ["io_uring=auto", "io_uring=off"] {
            try withVanishMount(options: [channel] + extra) { m in
                let r = try sh(Self.work, cwd: m.mountpoint)
                #expect(r.ok, "\(channel): \(r.stderr)")
                outputs.append(r.stdout)
                let req = try requests(m)
                if channel == "io_uring=off" {
                    #expect(req["channel"] as? String == "/dev/fuse" && req["why"] as? String == "off by -o io_uring=off")
                    #expect(ringThreads(m) == 0)
                } else {
                    #expect(req["channel"] as? String == "io_uring", "\(req)")
                    let cpus = Int(sysconf(Int32(_SC_NPROCESSORS_CONF)))
                    #expect(req["queues"] as? Int == cpus)
                    #expect(ringThreads(m) >= 2 * cpus && ringThreads(m) == req["threads"] as? Int)
                }
            }
        }
        // The same work on a plain directory.
        let plain = try makeTempDirectory()
        defer { try? FileManager.default.removeItem(atPath: plain) }
        let native = try sh(Self.work, cwd: plain)
        #expect(native.ok && native.stdout == "v\n299\n1\nt\nf1\nhard\nsoft\ntmp\n", "\(native.stdout)\(native.stderr)")
        #expect(outputs == [native.stdout, native.stdout], "\(outputs)")
    }

    @Test("while the kernel does not offer io_uring, mounts use /dev/fuse and say why; io_uring=on turns the switch on, as root only")
    func fallbackAndSwitch() throws {
        guard let saved = Self.switchValue() else {
            Issue.record("this kernel has no \(Self.kernelSwitch)")
            return
        }
        defer { try? Self.setSwitch(saved) }
        try Self.setSwitch("N")
        try withVanishMount { m in
            let req = try requests(m)
            #expect(req["channel"] as? String == "/dev/fuse")
            #expect((req["why"] as? String ?? "").contains("enable_uring is N"), "\(req)")
            #expect(ringThreads(m) == 0)
            #expect(try sh("touch a && ls", cwd: m.mountpoint).stdout == "a\n")
            #expect(try run([vanishBinary, "status", m.mountpoint]).stdout.contains("requests:         /dev/fuse: the kernel does not offer it"))
        }
        // An ordinary user cannot turn it on, and is told so.
        let base = try makeTempDirectory()
        defer { try? FileManager.default.removeItem(atPath: base) }
        chmod(base, 0o755)
        let binary = base + "/vanish"
        #expect(try run(["cp", vanishBinary, binary]).ok)
        let refused = try runAsNobody([binary, "mount", "-o", "io_uring=on", base, base])
        #expect(refused.status == 1 && refused.stderr.contains("only root can"), "\(refused.stderr)")
        #expect(Self.switchValue() == "N")
        // Root's io_uring=on turns it on, and the mount uses it.
        try withVanishMount(options: ["io_uring=on"]) { m in
            let req = try requests(m)
            #expect(Self.switchValue() == "Y")
            #expect(req["channel"] as? String == "io_uring")
            let made = try sh("touch a && ls", cwd: m.mountpoint)
            #expect(made.stdout == "a\n")
        }
    }

    @Test("over io_uring the forgets of rm -rf come in batches, not a read (and a wake-up from inside the unlink) each (issue 50)")
    func forgetsInBatches() throws {
        try Self.withKernelOffering {
            try withVanishMount(prepare: { src in
                let r = try sh("mkdir t && for i in $(seq 1 3000); do : > t/f$i; done", cwd: src)
                guard r.ok else { throw TestFailure(r.stderr) }
            }) { m in
                #expect(try requests(m)["channel"] as? String == "io_uring")
                #expect(try sh("rm -rf t", cwd: m.mountpoint).ok)
                // Each unlinked file's inode is evicted and forgotten; the forgets come within a few milliseconds.
                try waitFor("the files' forgets") { (try requests(m)["forgets"] as? Int ?? 0) >= 3000 }
                let req = try requests(m)
                let forgets = req["forgets"] as? Int ?? 0, reads = req["forget_reads"] as? Int ?? 0
                #expect(reads > 0 && reads * 4 <= forgets, "\(reads) reads for \(forgets) forgets")
            }
        }
    }

    /// Asks for an absent xattr `count` times from CPU 0, in one process, or
    /// in two that take turns through pipes (each request's caller is not
    /// the last one's). Every getxattr is a round trip: the kernel caches none.
    static let turns = """
        import os, sys
        path, count, takers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        os.sched_setaffinity(0, {0})
        def ask():
            try: os.getxattr(path, "user.absent")
            except OSError: pass
        if takers == 1:
            for _ in range(count): ask()
            sys.exit(0)
        (a_r, a_w), (b_r, b_w) = os.pipe(), os.pipe()
        child = os.fork()
        mine, theirs = (b_r, a_w) if child == 0 else (a_r, b_w)
        if child != 0: os.write(theirs, b"x")
        for _ in range(count // 2):
            os.read(mine, 1)
            ask()
            os.write(theirs, b"x")
        if child == 0: os._exit(0)
        os.waitpid(child, 0)
        """

    @Test("over io_uring a thread watches for the next request only while one caller makes call after call (issue 50)")
    func watchesForOneCaller() throws {
        try Self.withKernelOffering {
            try withVanishMount(prepare: { src in _ = FileManager.default.createFile(atPath: src + "/f", contents: nil) }) { m in
                let req = try requests(m)
                #expect(req["channel"] as? String == "io_uring")
                guard (req["spin_microseconds"] as? Int ?? 0) > 0 else {
                    Issue.record("the ring's threads do not watch after a reply: \(req)")
                    return
                }
                func watches(_ takers: Int) throws -> Int {
                    let before = try requests(m)["watches"] as? Int ?? 0
                    let r = try run(["/usr/bin/python3", "-c", Self.turns, m.path("f"), "400", String(takers)])
                    #expect(r.ok, "\(r.stderr)")
                    return (try requests(m)["watches"] as? Int ?? 0) - before
                }
                // One caller: its next call usually comes while the thread watches.
                let alone = try watches(1)
                #expect(alone >= 300, "\(alone) of 400 replies watched for one caller")
                // Two callers taking turns: a watching thread, runnable but not
                // running, would hold the other's request behind every busy task.
                let sharing = try watches(2)
                #expect(sharing <= 20, "\(sharing) of 400 replies watched for two callers taking turns")
            }
        }
    }

    @Test("a daemon on io_uring stops cleanly on unmount and on SIGTERM, its threads joined, nothing left mounted")
    func teardown() throws {
        try Self.withKernelOffering { try teardownOffered() }
    }

    func teardownOffered() throws {
        for how in ["unmount", "SIGTERM"] {
            let m = try VanishMount()
            defer { m.close() }
            #expect(try requests(m)["channel"] as? String == "io_uring")
            // Requests in flight when the stop comes; the caller leaves once the file is gone.
            #expect(try sh("touch probe", cwd: m.mountpoint).ok)
            let probe = shellQuote(m.path("probe"))
            let busy = try spawn(["/bin/sh", "-c", "while :; do stat \(probe) >/dev/null 2>&1 || exit 0; done"])
            defer { kill(busy, SIGKILL); waitpid(busy, nil, 0) }
            if how == "unmount" {
                // Lazy: a stat in the middle of its path walk holds the mount, and a
                // plain unmount racing it fails with EBUSY, as on any filesystem.
                #expect(try m.unmount(lazy: true) == 0)
            } else {
                kill(m.pid, SIGTERM)
                #expect(try m.waitForExit() == 0)
            }
            #expect(mountType(at: m.mountpoint) == nil, "\(how): the mount is gone")
            var status: Int32 = 0
            #expect(waitpid(busy, &status, 0) == busy, "\(how): the caller got its answer and left")
        }
    }
}
