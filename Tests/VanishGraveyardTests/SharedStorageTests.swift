import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Vanish on every client of one shared volume: a real GlusterFS replica-2
/// volume on two local bricks, mounted by two clients, a Vanish mount over each.
@Suite("shared storage (GlusterFS)", .serialized, .enabled(if: GlusterAvailability.shouldRun))
struct SharedStorageTests {
    /// How many paths each top-level name has.
    private func tops(_ paths: [String]) -> [String: Int] {
        paths.reduce(into: [:]) { $0[String($1.split(separator: "/").first ?? ""), default: 0] += 1 }
    }

    private func status(_ m: VanishMount) throws -> [String: Any] {
        let r = try run([vanishBinary, "status", "--json", m.mountpoint])
        guard r.ok, let o = try JSONSerialization.jsonObject(with: Data(r.stdout.utf8)) as? [String: Any] else {
            throw TestFailure("status: \(r.stderr)")
        }
        return o
    }

    /// Graveyard entries of `client`, seen from a client mount of the volume.
    private func entries(_ client: String, on volumeMount: String) throws -> Int {
        let r = try sh("find .vanish/clients/\(client)/graveyard -mindepth 2 -maxdepth 2 ! -name '.*' 2>/dev/null | wc -l",
                       cwd: volumeMount)
        return Int(r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? -1
    }

    /// keep/ (30 files), and the trees t1, t2 (30 files g1..g30 each), made through the first client.
    private func fill(_ v: GlusterVolume) throws {
        let r = try sh("""
            mkdir -p keep t1/a t2/a && for i in $(seq 1 30); do
                echo k$i > keep/k$i; echo $i > t1/a/g$i; echo $i > t2/a/g$i; done
            """, cwd: v.clients[0])
        guard r.ok else { throw TestFailure("filling the volume: \(r.stderr)") }
    }

    private func keepIsWhole(_ dir: String) throws -> Bool {
        try sh("for i in $(seq 1 30); do [ \"$(cat keep/k$i)\" = k$i ] || exit 1; done", cwd: dir).ok
    }

    @Test("two clients delete at once, each into its own graveyard; a SIGKILLed client's graveyard is adopted with its undo records, and restored from the survivor")
    func concurrentDeletesAndAdoption() throws {
        try withGlusterVolume { v in
            try fill(v)
            let a = try VanishMount(options: ["client=alpha", "lease=4s", "keep=1h"], existingSource: v.clients[0])
            defer { a.close() }
            let b = try VanishMount(options: ["client=beta", "lease=4s", "keep=1h"], existingSource: v.clients[1])
            defer { b.close() }
            let ra = try spawn(["/bin/rm", "-rf", a.path("t1")]), rb = try spawn(["/bin/rm", "-rf", b.path("t2")])
            var sa: Int32 = 0, sb: Int32 = 0
            waitpid(ra, &sa, 0)
            waitpid(rb, &sb, 0)
            #expect(sa == 0 && sb == 0, "rm -rf through both mounts at once")
            // rm -rf empties a/ and removes it (one entry with the files still queued in it; any landed
            // before are entries of their own), then the top, each in its client's own graveyard.
            let pa = try trashPaths(a), pb = try trashPaths(b)
            #expect(pa.contains("t1") && pa.contains("t1/a") && tops(pa) == ["t1": pa.count]
                    && pb.contains("t2") && pb.contains("t2/a") && tops(pb) == ["t2": pb.count],
                    "each client holds its own deletions: \(pa) \(pb)")
            #expect(try entries("alpha", on: v.clients[1]) == pa.count && entries("beta", on: v.clients[1]) == pb.count)
            // The lease thread looks at the others every lease/4 (1 s here); status shows what it saw.
            try waitFor("status to show alpha's graveyard", timeout: 20) {
                let others = try status(b)["other_clients"] as? [[String: Any]] ?? []
                return others.first { $0["client"] as? String == "alpha" }?["pending_entries"] as? Int == pa.count
            }

            // A change through the other client is, on this one's stream, a rescan of its directory.
            let log = b.base + "/events.jsonl"
            let subscriber = try spawn(["/bin/sh", "-c", "exec \(shellQuote(vanishBinary)) events --json \(shellQuote(b.mountpoint)) >\(shellQuote(log))"])
            defer { kill(subscriber, SIGTERM); waitpid(subscriber, nil, 0) }
            func events() -> [[String: Any]] {
                ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").split(separator: "\n").compactMap {
                    (try? JSONSerialization.jsonObject(with: Data($0.utf8))) as? [String: Any]
                }
            }
            try waitFor("the subscriber's first line") { events().first?["type"] as? String == "stream" }
            #expect(events().first?["client"] as? String == "beta")
            #expect(try sh("stat keep >/dev/null", cwd: b.mountpoint).ok)
            #expect(try sh("echo new > keep/new", cwd: a.mountpoint).ok)
            do {
                try waitFor("beta to notice keep changed", timeout: 30) {
                    _ = try sh("stat keep >/dev/null", cwd: b.mountpoint)
                    return events().contains { $0["type"] as? String == "rescan" && $0["path"] as? String == "keep" }
                }
            } catch {
                // What each side saw, for the next one to read this failure.
                let seen = try sh("stat -c '%n %y' keep; stat -c '%n %y' \(shellQuote(v.clients[1]))/keep", cwd: b.mountpoint)
                throw TestFailure("\(error): \(seen.stdout)\(seen.stderr) events: \(events().suffix(5))")
            }
            #expect(!events().contains { ($0["path"] as? String ?? "").hasPrefix("keep/") }, "never a made-up event")

            kill(a.pid, SIGKILL)
            try b.waitForLog("adopted the graveyard", timeout: 60)
            #expect(try tops(trashPaths(b)) == ["t1": pa.count, "t2": pb.count], "the undo records moved with the entries")
            #expect(try entries("alpha", on: v.clients[1]) == 0 && entries("beta", on: v.clients[1]) == pa.count + pb.count)
            let restored = try run([vanishBinary, "restore", b.path("t1")])
            #expect(restored.ok, "\(restored.stderr)")
            #expect(try sh("cat t1/a/g7 && ls t1/a | wc -l", cwd: v.clients[1]).stdout == "7\n30\n")
            #expect(try keepIsWhole(v.clients[1]) && sh("cat keep/new", cwd: v.clients[1]).stdout == "new\n")
        }
    }

    @Test("the survivor drains a killed client's backlog: the trees' data is gone from the bricks, nothing else is lost")
    func survivorDrains() throws {
        try withGlusterVolume { v in
            try fill(v)
            // A slow reaper on the client to be killed, so its graveyard still holds the tree.
            let a = try VanishMount(options: ["client=alpha", "lease=4s", "reap_rate=1"], existingSource: v.clients[0])
            defer { a.close() }
            let b = try VanishMount(options: ["client=beta", "lease=4s"], existingSource: v.clients[1])
            defer { b.close() }
            #expect(try sh("rm -rf t1", cwd: a.mountpoint).ok && sh("rm -rf t2", cwd: b.mountpoint).ok)
            #expect(try entries("alpha", on: v.clients[1]) >= 1)
            kill(a.pid, SIGKILL)
            try b.waitForLog("adopted the graveyard", timeout: 60)
            try waitForReaper(b)
            #expect(try entries("alpha", on: v.clients[1]) == 0 && entries("beta", on: v.clients[1]) == 0)
            for brick in v.bricks {
                let left = try sh("find . -path ./.glusterfs -prune -o -name 'g[0-9]*' -print | wc -l", cwd: brick)
                #expect(left.stdout == "0\n", "the trees' files are freed on \(brick)")
                #expect(try keepIsWhole(brick), "keep/ is whole on \(brick)")
            }
            #expect(try keepIsWhole(v.clients[1]))
        }
    }

    @Test("vanish reap --adopt hands a gone client's graveyard to the mount of this client; unknown clients are refused")
    func adoptByHand() throws {
        try withGlusterVolume { v in
            try fill(v)
            let a = try VanishMount(options: ["client=alpha", "keep=1h"], existingSource: v.clients[0])
            defer { a.close() }
            #expect(try sh("rm -rf t1", cwd: a.mountpoint).ok)
            let kept = try trashPaths(a).count
            #expect(try a.unmount() == 0)
            // A lease far longer than the test: only the command adopts here.
            let b = try VanishMount(options: ["client=beta", "lease=1h", "keep=1h"], existingSource: v.clients[1])
            defer { b.close() }
            let unknown = try run([vanishBinary, "reap", "--client", "beta", "--adopt", "gamma", v.clients[1]])
            #expect(!unknown.ok && unknown.stderr.contains("no client gamma"), "\(unknown.stderr)")
            let r = try run([vanishBinary, "reap", "--client", "beta", "--adopt", "alpha", v.clients[1]])
            #expect(r.ok && r.stdout.contains("adopted alpha's graveyard (\(kept) entries)"), "\(r.stdout) \(r.stderr)")
            try waitFor("the mount to take in the adopted entries", timeout: 30) {
                (try? tops(trashPaths(b))) == ["t1": kept]
            }
            #expect(try entries("alpha", on: v.clients[1]) == 0)
            #expect(try run([vanishBinary, "restore", b.path("t1")]).ok)
            #expect(try sh("ls t1/a | wc -l", cwd: b.mountpoint).stdout == "30\n")
        }
    }

    /// A one-client volume with `own/`, nobody's, and an allow_other mount over it.
    private func withNobodysDirectory(_ body: (GlusterVolume, VanishMount) throws -> Void) throws {
        try withGlusterVolume(clients: 1) { v in
            #expect(try sh("mkdir own && chown nobody:nogroup own", cwd: v.clients[0]).ok)
            let m = try VanishMount(options: ["allow_other"], existingSource: v.clients[0])
            defer { m.close() }
            try body(v, m)
            #expect(try m.unmount() == 0)
        }
    }

    /// A GlusterFS client mounted without `acl` answers EOPNOTSUPP for ACLs;
    /// the kernel's ACL check on the mount (allow_other asks for it) passed
    /// that on as the error of every access by anyone but the owner.
    @Test("on a volume that keeps no ACLs, another user works in their directory and root lists it, as on the volume")
    func volumeWithoutACLs() throws {
        try withNobodysDirectory { v, m in
            let made = try runAsNobody(["sh", "-c", "echo x > own/f && mkdir own/d && ls own"], cwd: m.mountpoint)
            #expect(made.ok && made.stdout == "d\nf\n", "\(made.stderr)")
            let listed = try sh("ls -l own | wc -l && cat own/f", cwd: m.mountpoint)
            #expect(listed.ok && listed.stdout == "3\nx\n", "\(listed.stderr)")
            // setfacl fails there as it does on the volume itself.
            let native = try run(["setfacl", "-m", "u:nobody:rwx", v.clients[0] + "/own"])
            let mounted = try run(["setfacl", "-m", "u:nobody:rwx", m.path("own")])
            #expect(!native.ok && !mounted.ok, "\(native.stderr) \(mounted.stderr)")
        }
    }

    /// With passthrough the kernel opens the volume's file again as the
    /// caller, and GlusterFS checks that opener against the file's mode.
    @Test("another user's open(O_CREAT) with a mode that grants them nothing gives a usable handle, as on the volume")
    func restrictiveCreateOnVolume() throws {
        try withNobodysDirectory { _, m in
            let script = """
                import os
                for mode, flags in [(0, os.O_RDWR), (0o200, os.O_RDWR), (0o400, os.O_WRONLY), (0o400, os.O_RDWR)]:
                    fd = os.open(f"own/m{mode:o}-{flags}", os.O_CREAT | flags, mode)
                    os.write(fd, b"xy")
                    os.ftruncate(fd, 1)
                    os.close(fd)
                print("ok")
                """
            let r = try runAsNobody(["/usr/bin/python3", "-c", script], cwd: m.mountpoint)
            #expect(r.stdout == "ok\n", "\(r.stderr)")
            #expect(try sh("cat own/m0-2 own/m200-2 own/m400-1 own/m400-2", cwd: m.mountpoint).stdout == "xxxx")
        }
    }

    @Test("on a network volume the log of answered unlinks stays on this machine, and unlinks answered before a SIGKILL are done by the next mount")
    func answeredUnlinksOnNetworkVolume() throws {
        try withGlusterVolume(clients: 1) { v in
            let client = "killed\(getpid())"
            #expect(try sh("mkdir d && for i in $(seq 1 200); do echo $i > d/f$i; done", cwd: v.clients[0]).ok)
            let a = try VanishMount(options: ["client=\(client)"], existingSource: v.clients[0])
            defer { a.close() }
            let local = try sh("ls /var/lib/vanish | grep -c '^unlinks-\(client)-'").stdout
            #expect(local == "1\n", "the log is on this machine")
            #expect(access(v.clients[0] + "/.vanish/clients/\(client)/unlinks", F_OK) != 0, "not on the volume")
            // Answered at once; their renames land a moment later, or, killed first, at the next mount.
            #expect(try sh("rm -f d/f* && kill -KILL \(a.pid)", cwd: a.mountpoint).ok)
            #expect(try a.waitForExit() == 128 + SIGKILL)
            a.close()
            let b = try VanishMount(options: ["client=\(client)"], existingSource: v.clients[0])
            defer { b.close() }
            #expect(try sh("ls d | wc -l", cwd: b.mountpoint).stdout == "0\n", "every answered unlink is done")
            try waitForReaper(b)
            #expect(try sh("ls d | wc -l", cwd: v.clients[0]).stdout == "0\n")
            // A clean end leaves nothing pending, and no log behind.
            #expect(try b.unmount() == 0)
            #expect(try sh("ls /var/lib/vanish | grep -c '^unlinks-\(client)-'").stdout == "0\n")
        }
    }
}
