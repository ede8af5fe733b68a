import Foundation
import Glibc
import Testing
import VanishClient
import VanishTestSupport

/// A `vanish events --json` subscriber writing to a file; stopped and reaped by `stop()`.
final class Subscriber {
    let pid: pid_t
    let output: String

    /// `asNobody`: the subscriber runs as nobody (a copy of the binary in the mount's base, which nobody can reach).
    init(_ m: VanishMount, _ arguments: [String] = [], name: String = "events", asNobody: Bool = false) throws {
        output = m.base + "/\(name).jsonl"
        var binary = vanishBinary
        var prefix: [String] = []
        if asNobody {
            binary = m.base + "/vanish-for-nobody"
            guard try run(["cp", vanishBinary, binary]).ok else { throw TestFailure("cannot copy the binary") }
            prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        }
        let cmd = (prefix + [binary, "events", "--json"] + arguments + [m.mountpoint]).map(shellQuote).joined(separator: " ")
        pid = try spawn(["/bin/sh", "-c", "exec \(cmd) >\(shellQuote(output)) 2>&1"])
        // Subscribed once the daemon has seen the connection: wait for a marker event to arrive.
    }

    private var parsed: [[String: Any]] = []
    private var consumed: UInt64 = 0

    /// Every event written so far. Reads only what arrived since the last
    /// call: re-parsing a 100,000-event file every few milliseconds took a
    /// core from the daemon under test.
    var events: [[String: Any]] {
        guard let file = FileHandle(forReadingAtPath: output) else { return parsed }
        defer { try? file.close() }
        try? file.seek(toOffset: consumed)
        guard let data = try? file.readToEnd(), let lastNL = data.lastIndex(of: 0x0A) else { return parsed }
        let complete = data[data.startIndex...lastNL]
        consumed += UInt64(complete.count)
        for line in complete.split(separator: 0x0A) {
            guard let e = (try? JSONSerialization.jsonObject(with: Data(line))) as? [String: Any] else { continue }
            // The stream's own first line says whose changes follow; it is no change itself.
            if e["type"] as? String == "stream" && parsed.isEmpty && header == nil { header = e } else { parsed.append(e) }
        }
        return parsed
    }

    /// The stream's first line (`"type":"stream"`), once it arrived.
    private(set) var header: [String: Any]?

    /// Waits until an event satisfies `match`.
    func waitFor(_ what: String, timeout: Double = 15, _ match: @escaping ([String: Any]) -> Bool) throws {
        try VanishTestSupport.waitFor(what, timeout: timeout) { events.contains(where: match) }
    }

    /// Waits for the subscriber to exit by itself; its exit status.
    func exitStatus(timeout: Double = 30) throws -> Int32 {
        var status: Int32 = 0
        try VanishTestSupport.waitFor("the subscriber to exit", timeout: timeout) { waitpid(pid, &status, WNOHANG) == pid }
        exited = true
        return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
    }
    private var exited = false

    func stop() {
        guard !exited else { return }
        kill(pid, SIGTERM)
        var status: Int32 = 0
        waitpid(pid, &status, 0)
    }
}

/// A subscriber of `m`'s events (as root), attached; the caller stops it.
/// `vanish events` on a terminal (script's pty), its screen collected in `out`; stop it with kill.
func terminalEvents(_ m: VanishMount, _ extra: [String], out: String) throws -> pid_t {
    let cmd = ([vanishBinary, "events"] + extra + [m.mountpoint]).map(shellQuote).joined(separator: " ")
    return try spawn(["/bin/sh", "-c", "exec script -q -f -e -c \(shellQuote(cmd)) /dev/null > \(shellQuote(out))"])
}

func attachedSubscriber(_ m: VanishMount) throws -> Subscriber {
    let s = try Subscriber(m)
    do { try attach(s, m) } catch { s.stop(); throw error }
    return s
}

/// Makes the subscriber provably attached: touches a marker until its event shows.
func attach(_ s: Subscriber, _ m: VanishMount) throws {
    var n = 0
    try waitFor("the subscriber to attach") {
        n += 1
        _ = try sh("touch .attach-\(n) && rm .attach-\(n)", cwd: m.mountpoint)
        return s.events.contains { ($0["path"] as? String ?? "").hasPrefix(".attach-") }
    }
}

/// The (type, path) pairs after the attach markers, without reaper events.
func changes(_ s: Subscriber) -> [String] {
    s.events.filter { !($0["path"] as? String ?? "").hasPrefix(".attach-") && $0["type"] as? String != "reaped" }
        .map { e in
            var d = "\(e["type"] as? String ?? "?") \(e["path"] as? String ?? "")"
            if let from = e["from"] as? String ?? e["target"] as? String { d += " <- \(from)" }
            return d
        }
}

@Suite("event stream", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct EventStreamTests {
    @Test("a writer that exits with its file open still has its name on the written event (its RELEASE comes after it is gone)")
    func shortLivedWriter() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "the name is kept where the daemon has the process connector (root)")
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let script = "import os,sys\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)\nos.write(fd, b'x')\nos._exit(0)\n"
            for i in 0..<40 { #expect(try run(["python3", "-c", script, m.path("p\(i)")]).ok) }
            try s.waitFor("the last written event") { $0["type"] as? String == "written" && $0["path"] as? String == "p39" }
            let written = s.events.filter { $0["type"] as? String == "written" && ($0["path"] as? String ?? "").hasPrefix("p") }
            #expect(written.count == 40)
            let nameless = written.filter { ($0["comm"] as? String ?? "").isEmpty }
            #expect(nameless.isEmpty, "\(nameless.count) of \(written.count) without a command name: \(nameless.prefix(3))")
            #expect(written.allSatisfy { ($0["comm"] as? String ?? "").hasPrefix("python") }, "\(written.prefix(3))")
        }
    }

    @Test("on a terminal: a short first line, the time, the program, renames that replaced a file marked, and the reaper's lines only with --all")
    func terminalLines() throws {
        try withVanishMount { m in
            var screens: [(pid: pid_t, out: String)] = []
            defer {
                for s in screens {
                    kill(s.pid, SIGTERM)
                    var st: Int32 = 0
                    waitpid(s.pid, &st, 0)
                }
            }
            for extra in [[], ["--all"]] {
                let out = m.base + "/screen\(screens.count)"
                screens.append((try terminalEvents(m, extra, out: out), out))
                try waitFor("the first line") { ((try? String(contentsOfFile: out, encoding: .utf8)) ?? "").contains("watching ") }
            }
            #expect(try sh("echo a > a && echo b > b && mv a b && rm b", cwd: m.mountpoint).ok)
            try waitForReaper(m)
            let all = screens[1].out
            try waitFor("the reaped line with --all") {
                ((try? String(contentsOfFile: all, encoding: .utf8)) ?? "").contains(" reaped 1 file, ")
            }
            let plain = try String(contentsOfFile: screens[0].out, encoding: .utf8)
            let first = plain.split(whereSeparator: \.isNewline).first.map(String.init) ?? ""
            #expect(first == "watching \(m.mountpoint) (Ctrl-C to stop; --json for every field)", "\(plain)")
            let renamed = try #require(plain.split(whereSeparator: \.isNewline).first { $0.contains(" renamed ") }.map(String.init))
            #expect(renamed.contains("a → b") && renamed.contains("(replacing what was there)") && renamed.contains("by mv["), "\(renamed)")
            #expect(renamed.range(of: #"^\d\d:\d\d:\d\d renamed"#, options: .regularExpression) != nil, "\(renamed)")
            #expect(plain.contains(" deleted ") && !plain.contains(" reaped "), "\(plain)")
        }
    }

    @Test("shell sequences give exactly the expected events, in order")
    func shellSequences() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try sh("""
                mkdir -p src/sub && printf a > src/sub/f && cp -r src dst
                mv dst/sub/f other && echo old > t && echo new > n && mv n t
                chmod 600 t && chown 65534:65534 t && touch -d @0 t && setfattr -n user.k -v v t && ln t t2
                exec 3>w; exec 4>>w; printf 1 >&3; printf 2 >&4; exec 3>&- 4>&-
                rm -rf src
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("the last delete") { $0["type"] as? String == "deleted" && $0["path"] as? String == "src" }
            let expected = [
                "created src", "created src/sub", "created src/sub/f", "written src/sub/f",
                "created dst", "created dst/sub", "created dst/sub/f", "written dst/sub/f",
                "renamed other <- dst/sub/f",
                "created t", "written t", "created n", "written n", "renamed t <- n",
                "attributes t", "attributes t", "attributes t", "attributes t", "linked t2 <- t",
                "created w", "written w",
                "deleted src/sub/f", "deleted src/sub", "deleted src",
            ]
            #expect(changes(s) == expected)
            // Rename over a file says it replaced one; ids follow the file across the rename.
            let rename = try #require(s.events.first { $0["type"] as? String == "renamed" && $0["path"] as? String == "t" })
            #expect(rename["replaced"] as? Bool == true)
            let createdN = try #require(s.events.first { $0["type"] as? String == "created" && $0["path"] as? String == "n" })
            #expect(rename["id"] as? String == createdN["id"] as? String)
            #expect((rename["id"] as? String ?? "").count > 8)
            // What each attributes event changed: mode, then owner, then times, then an xattr.
            let changed = s.events.filter { $0["type"] as? String == "attributes" && $0["path"] as? String == "t" }
                .map { $0["changed"] as? String ?? "" }
            #expect(changed.count == 4 && changed[0].contains("mode") && changed[1].contains("uid")
                    && changed[1].contains("gid") && changed[2].contains("mtime") && changed[3].contains("xattr"), "\(changed)")
            // Who did it.
            #expect(rename["comm"] as? String == "mv")
            #expect(rename["uid"] as? Int == Int(getuid()))
            // Sequence numbers strictly increase.
            let seqs = s.events.compactMap { $0["seq"] as? Int }
            #expect(seqs == seqs.sorted() && Set(seqs).count == seqs.count)
        }
    }

    @Test("an O_TMPFILE file is created when linkat names it and written at its last close; one never named is no event")
    func tmpfileEvents() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try run(["python3", "-c", """
                import ctypes, os
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)
                os.write(fd, b"never named")
                os.close(fd)
                fd = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)
                os.write(fd, b"data")
                assert libc.linkat(-100, f"/proc/self/fd/{fd}".encode(), -100, b"made", 0x400) == 0
                os.write(fd, b" more")
                os.close(fd)
                open("end", "w").close()
                """], cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("the end marker") { $0["path"] as? String == "end" }
            #expect(changes(s) == ["created made", "written made", "created end"])
        }
    }

    @Test("chattr is an attributes event that says the flags changed; lsattr is none")
    func inodeFlagEvents() throws {
        try withVanishMount { m in
            #expect(try sh("echo x > f", cwd: m.mountpoint).ok)
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            #expect(try sh("lsattr f && chattr +A f && : > end", cwd: m.mountpoint).ok)
            try s.waitFor("the end marker") { $0["path"] as? String == "end" }
            #expect(changes(s) == ["attributes f", "created end"])
            let event = try #require(s.events.first { $0["type"] as? String == "attributes" && $0["path"] as? String == "f" })
            #expect(event["changed"] as? String == "flags")
            #expect(event["comm"] as? String == "chattr")
        }
    }

    @Test("each event names the program that made it, also after the process execs another or renames itself")
    func commandAfterExec() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            // The shell creates a (the redirection), then the same process becomes mv.
            #expect(try run(["/bin/sh", "-c", "cd \(shellQuote(m.mountpoint)) && : > a && exec mv a b"]).ok)
            try s.waitFor("the rename") { $0["type"] as? String == "renamed" && $0["path"] as? String == "b" }
            let created = try #require(s.events.first { $0["type"] as? String == "created" && $0["path"] as? String == "a" })
            let renamed = try #require(s.events.first { $0["type"] as? String == "renamed" && $0["path"] as? String == "b" })
            #expect(created["pid"] as? Int == renamed["pid"] as? Int)
            #expect(created["comm"] as? String == "sh")
            #expect(renamed["comm"] as? String == "mv")
            // A name is not remembered past a rename either (PR_SET_NAME, or a write to /proc/self/comm).
            #expect(try run(["/bin/sh", "-c", "cd \(shellQuote(m.mountpoint)) && : > c && printf renamed > /proc/self/comm && : > d"]).ok)
            try s.waitFor("d") { $0["type"] as? String == "created" && $0["path"] as? String == "d" }
            let before = try #require(s.events.first { $0["type"] as? String == "created" && $0["path"] as? String == "c" })
            let after = try #require(s.events.first { $0["type"] as? String == "created" && $0["path"] as? String == "d" })
            #expect(before["comm"] as? String == "sh")
            #expect(after["comm"] as? String == "renamed")
            // Rename, create, rename, create...: each event carries the name of the moment.
            #expect(try run(["/bin/sh", "-c", "cd \(shellQuote(m.mountpoint)) && for i in $(seq 200); do printf n$i > /proc/self/comm; : > f$i; done"]).ok)
            try s.waitFor("f200") { $0["type"] as? String == "created" && $0["path"] as? String == "f200" }
            let stale = s.events.filter { e in
                guard e["type"] as? String == "created", let path = e["path"] as? String, path.hasPrefix("f") else { return false }
                return e["comm"] as? String != "n" + path.dropFirst()
            }.count
            #expect(stale == 0)
        }
    }

    @Test("git checkout of another branch gives exactly the worktree changes it made")
    func gitCheckout() throws {
        try withVanishMount(prepare: { src in
            let r = try sh("""
                git init -q -b main r && cd r && git config user.email t@t && git config user.name t
                echo a > a.txt && echo b > b.txt && mkdir d && echo c > d/c.txt && git add -A && git commit -qm one
                git checkout -qb other && echo a2 > a.txt && git rm -q b.txt && echo n > d/n.txt
                git add -A && git commit -qm two && git checkout -q main
                """, cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try run(["git", "-C", m.path("r"), "checkout", "-q", "other"])
            #expect(r.ok, "\(r.stderr)")
            // Git's last step: its index is replaced by one rename of the lock
            // file. Waiting for anything earlier raced with the rest of the
            // stream still on its way to the subscriber.
            try s.waitFor("the index rename") {
                $0["type"] as? String == "renamed" && $0["path"] as? String == "r/.git/index"
                    && $0["from"] as? String == "r/.git/index.lock"
            }
            // Git removes what the branch lacks or changes, then writes files in index order.
            let worktree = changes(s).filter { !$0.contains("r/.git") }
            #expect(worktree == ["deleted r/b.txt", "deleted r/a.txt", "created r/a.txt", "written r/a.txt",
                                 "created r/d/n.txt", "written r/d/n.txt"])
            // Every change names git as its cause.
            let caused = s.events.filter { e in (e["path"] as? String).map { !$0.hasPrefix(".attach-") } ?? false }
            #expect(!caused.isEmpty && caused.allSatisfy { $0["comm"] as? String == "git" })
            // And the files hold the other branch.
            #expect(try String(contentsOfFile: m.path("r/a.txt"), encoding: .utf8) == "a2\n")
            #expect(!FileManager.default.fileExists(atPath: m.path("r/b.txt")))
        }
    }

    /// Issue 22, item 3: `written` fired at the close of one copy of a dup'ed fd.
    @Test("written comes once, after the file's last writable handle is released (dup, a second open)",
          arguments: [[], ["passthrough=off"]])
    func writtenAfterLastWriter(options: [String]) throws {
        try withVanishMount(options: options) { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            // Each step leaves a marker file, so the stream shows what came before it.
            let script = """
                import os
                def mark(n): os.close(os.open(f"mark{n}", os.O_CREAT | os.O_WRONLY))
                fd = os.open("f", os.O_CREAT | os.O_WRONLY, 0o644)
                copy = os.dup(fd)
                os.write(fd, b"one")
                os.close(fd)
                mark(1)
                other = os.open("f", os.O_WRONLY | os.O_APPEND)
                os.write(copy, b"two")
                os.close(copy)
                mark(2)
                os.write(other, b"three")
                os.close(other)
                mark(3)
                """
            let r = try run(["python3", "-c", script], cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("the last marker") { $0["path"] as? String == "mark3" }
            try s.waitFor("the written event") { $0["type"] as? String == "written" && $0["path"] as? String == "f" }
            let seen = changes(s).filter { !$0.hasPrefix("written mark") }
            // The writing session ends with the last writer: mark2 comes before it.
            let f = seen.firstIndex(of: "written f"), mark2 = seen.firstIndex(of: "created mark2")
            #expect(seen.filter { $0 == "written f" }.count == 1, "\(seen)")
            #expect(f != nil && mark2 != nil && f! > mark2!, "\(seen)")
            let event = try #require(s.events.first { $0["type"] as? String == "written" })
            #expect(event["size"] as? Int == 11)
        }
    }

    @Test("passthrough writes are written events; a reader, an unused writable open or a touch is none")
    func passthroughWrites() throws {
        try withVanishMount { m in
            try m.waitForLog("passthrough=on")
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try sh("""
                set -e
                echo data > a
                cat a > /dev/null
                python3 -c "import os; os.close(os.open('a', os.O_RDWR))"
                touch a
                dd if=/dev/zero of=a bs=1k count=4 conv=notrunc status=none && touch -d @0 a
                : > end
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("end") { $0["path"] as? String == "end" }
            #expect(changes(s) == ["created a", "written a", "attributes a", "written a", "attributes a", "created end"],
                    "daemon: \(m.log.split(separator: "\n").filter { $0.contains("without waiting") })")
        }
    }

    @Test("another user's stream names nothing they could not see, in any path field (a copy's source, a move's origin)")
    func otherUsersSeeOnlyVisibleNames() throws {
        try withVanishMount(options: ["allow_other"]) { m in
            #expect(try sh("mkdir -m 700 private && mkdir -m 777 pub && echo secret > private/SECRET", cwd: m.mountpoint).ok)
            let s = try Subscriber(m, asNobody: true)
            defer { s.stop() }
            // The mount's root is readable to nobody: the usual markers show.
            try attach(s, m)
            #expect(try sh("cp private/SECRET pub/copy && mv private/SECRET pub/moved && touch pub/end", cwd: m.mountpoint).ok)
            try s.waitFor("pub/end") { $0["path"] as? String == "pub/end" }
            let leaked = s.events.filter { e in e.values.contains { "\($0)".contains("SECRET") } }
            #expect(leaked.isEmpty, "\(leaked)")
        }
    }

    @Test("a directory an ACL closes to nobody (its mode bits would let them in) keeps its names from nobody's stream and snapshot",
          arguments: [false, true])
    func aclClosedDirectoriesStayClosed(snapshot: Bool) throws {
        try withVanishMount(options: ["allow_other"]) { m in
            let closed = try sh("mkdir -m 755 closed pub && chmod 777 pub && echo secret > closed/SECRET-1 && setfacl -m u:nobody:--- closed",
                                cwd: m.mountpoint)
            #expect(closed.ok, "\(closed.stderr)")
            // As on any filesystem: nobody cannot list it.
            let ls = try run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "ls", m.path("closed")])
            #expect(!ls.ok && ls.stderr.contains("Permission denied"), "\(ls)")
            let s = try Subscriber(m, snapshot ? ["--snapshot"] : [], asNobody: true)
            defer { s.stop() }
            try attach(s, m)
            #expect(try sh("echo x > closed/SECRET-2 && mv closed/SECRET-1 closed/SECRET-3 && rm closed/SECRET-2 && touch pub/end",
                           cwd: m.mountpoint).ok)
            try s.waitFor("pub/end") { $0["path"] as? String == "pub/end" }
            let leaked = s.events.filter { e in e.values.contains { "\($0)".contains("SECRET") } }
            #expect(leaked.isEmpty, "\(leaked)")
        }
    }

    @Test("cp names the file it copied from (copy_file_range)")
    func copies() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            #expect(try sh("echo data > orig && cp orig copy", cwd: m.mountpoint).ok)
            try s.waitFor("the copy") { $0["type"] as? String == "written" && $0["path"] as? String == "copy" }
            let orig = try #require(s.events.first { $0["type"] as? String == "created" && $0["path"] as? String == "orig" })
            let copy = try #require(s.events.first { $0["type"] as? String == "written" && $0["path"] as? String == "copy" })
            #expect(copy["copied_from"] as? String == "orig")
            #expect(copy["copied_from_id"] as? String == orig["id"] as? String)
            #expect(copy["id"] as? String != orig["id"] as? String)
        }
    }

    @Test("a file copy_file_range only began is no copy: cat with more after it, a partial copy",
          arguments: [[], ["passthrough=off"]])
    func partialCopies(options: [String]) throws {
        try withVanishMount(options: options) { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try sh("""
                set -e
                printf 'hello world\n' > a.txt
                printf 'extra\n' | cat a.txt - > b.txt
                cat a.txt > c.txt
                python3 -c "import os; i = os.open('a.txt', os.O_RDONLY); o = os.open('d.txt', os.O_WRONLY | os.O_CREAT, 0o644); os.copy_file_range(i, o, 5)"
                python3 -c "import os; i = os.open('a.txt', os.O_RDONLY); o = os.open('e.txt', os.O_WRONLY | os.O_CREAT, 0o644); os.copy_file_range(i, o, 12); os.pwrite(o, b'H', 0)"
                : > end
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("end") { $0["path"] as? String == "end" }
            try s.waitFor("e.txt written") { $0["type"] as? String == "written" && $0["path"] as? String == "e.txt" }
            func written(_ name: String) -> [String: Any]? {
                s.events.last { $0["type"] as? String == "written" && $0["path"] as? String == name }
            }
            #expect(written("b.txt")?["copied_from"] == nil, "\(String(describing: written("b.txt")))")
            #expect(written("c.txt")?["copied_from"] as? String == "a.txt", "\(String(describing: written("c.txt")))")
            #expect(written("d.txt")?["copied_from"] == nil, "\(String(describing: written("d.txt")))")
            #expect(written("e.txt")?["copied_from"] == nil, "\(String(describing: written("e.txt")))")
        }
    }

    @Test("each program's events come in the order it made its changes, with four programs at once")
    func causalOrderPerProcess() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let script = m.base + "/order.py"
            try """
                import os, sys
                os.chdir(sys.argv[1])
                me = sys.argv[2]
                for i in range(400):
                    with open("t-%s-%d" % (me, i), "w") as f:
                        f.write("x")
                    os.close(os.open("n-%s-%d" % (me, i), os.O_CREAT | os.O_WRONLY, 0o644))
                    os.rename("t-%s-%d" % (me, i), "t-%s-%d.done" % (me, i))
                """.write(toFile: script, atomically: true, encoding: .utf8)
            let programs = try (0..<4).map { try spawn(["/usr/bin/python3", script, m.mountpoint, "p\($0)"]) }
            for p in programs { var st: Int32 = 0; waitpid(p, &st, 0); #expect(st == 0) }
            #expect(try sh(": > end", cwd: m.mountpoint).ok)
            try s.waitFor("end", timeout: 60) { $0["path"] as? String == "end" }
            // Where each file's written, the next name's created and its rename stand in the stream.
            var position: [String: Int] = [:]
            for (i, e) in s.events.enumerated() {
                guard let type = e["type"] as? String, let path = e["path"] as? String else { continue }
                position["\(type) \(path)"] = i
            }
            var late = 0
            for p in 0..<4 {
                for i in 0..<400 {
                    guard let written = position["written t-p\(p)-\(i)"] else { late += 1; continue }
                    if let created = position["created n-p\(p)-\(i)"], created < written { late += 1 }
                    if let renamed = position["renamed t-p\(p)-\(i).done"], renamed < written { late += 1 }
                }
            }
            #expect(late == 0, "\(late) of 3,200 written events came after their program's next change")
        }
    }

    /// Issue 22, item 4: only copy_file_range was recognized.
    @Test("read-then-write copies name their source; a changed copy or a pipe does not",
          arguments: [[], ["passthrough=off"]])
    func readWriteCopies(options: [String]) throws {
        try withVanishMount(options: options) { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try sh("""
                set -e
                head -c 3000000 /dev/urandom > orig
                cp --reflink=never orig plain
                dd if=orig of=dd bs=64k status=none
                python3 -c "import shutil; shutil.copyfileobj(open('orig','rb'), open('py','wb'))"
                python3 -c "d = open('orig','rb').read(); open('changed','wb').write(d[:-1] + b'!')"
                cat orig | cat > piped
                : > end
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("end") { $0["path"] as? String == "end" }
            try s.waitFor("the last copy") { $0["type"] as? String == "written" && $0["path"] as? String == "piped" }
            func source(_ path: String) -> String? {
                s.events.last { $0["type"] as? String == "written" && $0["path"] as? String == path }?["copied_from"] as? String
            }
            #expect(source("plain") == "orig")
            #expect(source("py") == "orig")
            #expect(source("dd") == "orig")
            #expect(source("changed") == nil)
            #expect(source("piped") == nil)
        }
    }

    @Test("a change behind the mount becomes one rescan of its directory, never a made-up event; the mount's own changes none")
    func changesBehindTheMount() throws {
        // cache=never: every stat reaches the daemon, which reads the directory's mtime each time.
        try withVanishMount(options: ["cache=never"]) { m in
            #expect(try sh("mkdir d && touch d/a && stat d >/dev/null", cwd: m.mountpoint).ok)
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            #expect(try sh("touch d/own && mv d/own d/own2 && rm d/a && mkdir d/sub && touch -d @5 d && stat d >/dev/null",
                           cwd: m.mountpoint).ok)
            #expect(try sh("touch d/behind", cwd: m.source).ok)
            #expect(try sh("stat d >/dev/null && stat d >/dev/null && touch end", cwd: m.mountpoint).ok)
            try s.waitFor("end") { $0["path"] as? String == "end" }
            let rescans = s.events.filter { $0["type"] as? String == "rescan" }
            #expect(rescans.compactMap { $0["path"] as? String } == ["d"], "\(rescans)")
            #expect(!s.events.contains { ($0["path"] as? String ?? "").contains("behind") })
            #expect(s.events.contains { $0["type"] as? String == "created" && $0["path"] as? String == "d/own" })
        }
    }

    @Test("a directory the kernel learned from a listing or a mkdir, changed behind the mount, is a rescan too")
    func changesBehindDirectoriesNeverStatted() throws {
        // The kernel answers the stats right after from what the listing and
        // the mkdir told it: the daemon's first stat of each comes after the
        // change, which must still be measured from what the kernel was told.
        // ls -ld, not stat(1): stat asks for the birth time, which the kernel
        // does not keep, so each of its calls reaches the daemon.
        try withVanishMount(options: ["nowatch", "readdirplus=always"], prepare: { src in mkdir(src + "/listed", 0o755) }) { m in
            #expect(try sh("ls -l >/dev/null && mkdir made && ls -ld listed made >/dev/null", cwd: m.mountpoint).ok)
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            #expect(try sh("touch listed/behind made/behind", cwd: m.source).ok)
            func rescanned() -> Set<String> {
                Set(s.events.filter { $0["type"] as? String == "rescan" }.compactMap { $0["path"] as? String })
            }
            // The kernel keeps attributes 1 s with cache=auto; a stat after that reaches the daemon.
            try waitFor("rescans of both directories", timeout: 15) {
                _ = try sh("ls -ld listed made >/dev/null", cwd: m.mountpoint)
                return rescanned().isSuperset(of: ["listed", "made"])
            }
            #expect(rescanned() == ["listed", "made"])
        }
    }

    @Test("--path sends only events under that directory; a move counts at either end")
    func pathFilter() throws {
        try withVanishMount(prepare: { src in mkdir(src + "/a", 0o755); mkdir(src + "/b", 0o755) }) { m in
            let s = try Subscriber(m, ["--path", "a"])
            defer { s.stop() }
            var n = 0
            try waitFor("the subscriber to attach") {
                n += 1
                _ = try sh("touch a/.attach-\(n)", cwd: m.mountpoint)
                return s.events.contains { ($0["path"] as? String ?? "").hasPrefix("a/.attach-") }
            }
            #expect(try sh("touch a/x b/y && mv b/y a/z && mv a/x b/x && touch b/w", cwd: m.mountpoint).ok)
            try s.waitFor("the move out of a") { $0["path"] as? String == "b/x" }
            #expect(try sh("touch a/end", cwd: m.mountpoint).ok)
            // The last event expected: touch's times, after its create.
            try s.waitFor("a/end's times") { $0["path"] as? String == "a/end" && $0["type"] as? String == "attributes" }
            let seen = s.events.filter { !($0["path"] as? String ?? "").hasPrefix("a/.attach-") }
                .map { "\($0["type"] as? String ?? "") \($0["path"] as? String ?? "")\(($0["from"] as? String).map { " <- " + $0 } ?? "")" }
            // touch creates, then sets the times.
            #expect(seen == ["created a/x", "attributes a/x", "renamed a/z <- b/y", "renamed b/x <- a/x",
                             "created a/end", "attributes a/end"])
        }
    }

    @Test("vanish rm is one event for the whole tree")
    func treeDelete() throws {
        try withVanishMount(prepare: { src in try makeTreeForEvents(src + "/tree") }) { m in
            let s = try Subscriber(m, ["--type", "deleted,reaped"])
            defer { s.stop() }
            try attach(s, m)
            #expect(try run([vanishBinary, "rm", "-r", m.path("tree")]).ok)
            try s.waitFor("the tree delete") { $0["path"] as? String == "tree" }
            let deletes = s.events.filter { $0["type"] as? String == "deleted" && !($0["path"] as? String ?? "").hasPrefix(".attach-") }
            #expect(deletes.count == 1)
            #expect(deletes.first?["tree"] as? Bool == true)
            // Once freed, the whole tree is counted in one reaped event: 3 files of 2 bytes; tree, a and a/b.
            let entry = try #require(deletes.first?["entry"] as? String)
            try s.waitFor("the tree to be reaped") { $0["type"] as? String == "reaped" && $0["entry"] as? String == entry }
            let reaped = s.events.filter { $0["type"] as? String == "reaped" && $0["entry"] as? String == entry }
            #expect(reaped.count == 1)
            #expect(reaped.first?["files"] as? Int == 3)
            #expect(reaped.first?["directories"] as? Int == 3)
            #expect(reaped.first?["data_bytes"] as? Int == 6)
            #expect((reaped.first?["disk_bytes"] as? Int ?? 0) >= 3 * 512)
        }
    }

    @Test("a one-step delete its deleter could not empty is deleted, then restored with the reason kept")
    func keptTree() throws {
        try withVanishMount(options: ["allow_other"], prepare: { src in
            let r = try sh("chmod 755 . && install -d -o nobody nb nb/A && install -d -m 1777 nb/A/t && echo x > nb/A/t/f",
                           cwd: src)
            guard r.ok else { throw TestFailure(r.stderr) }
        }) { m in
            let s = try Subscriber(m, ["--type", "deleted,restored"])
            defer { s.stop() }
            try attach(s, m)
            let binary = m.base + "/vanish"
            #expect(try run(["cp", vanishBinary, binary]).ok)
            _ = try runAsNobody([binary, "rm", "-r", m.path("nb/A")])
            try s.waitFor("the tree to be put back") { $0["type"] as? String == "restored" && $0["path"] as? String == "nb/A" }
            let kept = s.events.first { $0["type"] as? String == "restored" }
            #expect((kept?["reason"] as? String)?.hasPrefix("kept") == true, "\(String(describing: kept))")
            #expect(kept?["uid"] as? Int == 65534)
            let status = try run([vanishBinary, "status", "--json", m.mountpoint]).stdout
            #expect(JSON.parse(status)?["put_back_entries"]?.int == 1, "\(status)")
        }
    }

    @Test("a subscriber resumes from its cursor with nothing lost or repeated; a stale cursor gets reset")
    func resume() throws {
        try withVanishMount { m in
            let first = try Subscriber(m, name: "first")
            try attach(first, m)
            #expect(try sh("touch a b", cwd: m.mountpoint).ok)
            try first.waitFor("b") { $0["path"] as? String == "b" && $0["type"] as? String == "created" }
            first.stop()
            let last = try #require(first.events.last)
            let cursor = "\(last["instance"] as! String):\(last["seq"] as! Int)"
            #expect(try sh("touch c d", cwd: m.mountpoint).ok)
            let second = try Subscriber(m, ["--since", cursor], name: "second")
            defer { second.stop() }
            try second.waitFor("d") { $0["path"] as? String == "d" && $0["type"] as? String == "created" }
            let paths = second.events.filter { $0["type"] as? String == "created" }.compactMap { $0["path"] as? String }
            #expect(paths == ["c", "d"])
            #expect(second.events.first?["seq"] as? Int == (last["seq"] as! Int) + 1)
            // Each stream first says whose changes it carries: this client's.
            let header = try #require(second.header, "the stream's first line says its scope")
            #expect(header["scope"] as? String == "client" && (header["client"] as? String)?.isEmpty == false)
            #expect(header["instance"] as? String == last["instance"] as? String)

            let stale = try Subscriber(m, ["--since", "0123456789abcdef:5"], name: "stale")
            defer { stale.stop() }
            try stale.waitFor("reset") { $0["type"] as? String == "reset" }
            #expect(stale.events.first?["type"] as? String == "reset")
            // A cursor this journal never reached is not history it lost: the reset says so.
            let instance = last["instance"] as! String
            let ahead = try Subscriber(m, ["--since", "\(instance):999999"], name: "ahead")
            defer { ahead.stop() }
            try ahead.waitFor("reset") { $0["type"] as? String == "reset" }
            let reason = ahead.events.first?["reason"] as? String ?? ""
            #expect(reason.contains("ahead of this journal, whose newest event is \(instance):") && !reason.contains("no longer holds"),
                    "\(reason)")
        }
    }

    @Test("a snapshot lists everything, then continues live without a gap")
    func snapshot() throws {
        try withVanishMount(prepare: { src in
            mkdir(src + "/dir", 0o755)
            for i in 0..<50 { _ = FileManager.default.createFile(atPath: src + "/dir/f\(i)", contents: Data("x".utf8)) }
        }) { m in
            // A writer keeps creating files during the scan.
            let writer = try spawn(["/bin/sh", "-c", "for i in $(seq 1 200); do touch \(shellQuote(m.path("dir")))/w$i; done"])
            let s = try Subscriber(m, ["--snapshot"])
            defer { s.stop() }
            var status: Int32 = 0
            waitpid(writer, &status, 0)
            try s.waitFor("the scan to finish") { $0["type"] as? String == "scan-completed" }
            try s.waitFor("the last write") { $0["path"] as? String == "dir/w200" }
            let seen = Set(s.events.filter { ["exists", "created"].contains($0["type"] as? String ?? "") }
                .compactMap { $0["path"] as? String })
            for i in 0..<50 { #expect(seen.contains("dir/f\(i)")) }
            for i in 1...200 { #expect(seen.contains("dir/w\(i)"), "dir/w\(i) missing") }
            #expect(!seen.contains(".vanish"))
        }
    }

    @Test("a 100,000-file burst loses nothing while another subscriber is stopped")
    func burst() throws {
        try withVanishMount { m in
            let live = try Subscriber(m, ["--type", "created"], name: "live")
            let stopped = try Subscriber(m, ["--type", "created"], name: "stopped")
            defer { live.stop(); kill(stopped.pid, SIGCONT); stopped.stop() }
            try attach(live, m)
            try attach(stopped, m)
            kill(stopped.pid, SIGSTOP)
            let r = try run(["python3", "-c", """
                import os, sys
                root = sys.argv[1]
                for d in range(100):
                    os.mkdir(os.path.join(root, f"d{d}"))
                    for i in range(1000):
                        os.close(os.open(os.path.join(root, f"d{d}", f"f{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            func count(_ s: Subscriber) -> Int {
                s.events.filter { ($0["path"] as? String ?? "").hasPrefix("d") }.count
            }
            try live.waitFor("all creations", timeout: 300) { $0["path"] as? String == "d99/f999" }
            #expect(count(live) == 100_100)
            kill(stopped.pid, SIGCONT)
            try stopped.waitFor("the stopped subscriber to catch up", timeout: 300) { $0["path"] as? String == "d99/f999" }
            #expect(count(stopped) == 100_100)
        }
    }

    @Test("a subscriber that falls behind more than the journal keeps is told what it missed (a reset with the range), never a silent jump")
    func laggingSubscriberGetsReset() throws {
        try withVanishMount(options: ["events_max_bytes=1M"]) { m in
            let s = try Subscriber(m, name: "lagging")
            defer { kill(s.pid, SIGCONT); s.stop() }
            try attach(s, m)
            kill(s.pid, SIGSTOP)
            // About 60,000 events, 15 MB of journal: far past the 1 MiB it keeps.
            let r = try run(["python3", "-c", """
                import os, sys
                d = os.path.join(sys.argv[1], "churn")
                os.mkdir(d)
                for i in range(15000):
                    p = os.path.join(d, f"f{i}")
                    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
                    os.chmod(p, 0o600)
                    os.rename(p, p + ".r")
                    os.unlink(p + ".r")
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            kill(s.pid, SIGCONT)
            #expect(try sh("touch end", cwd: m.mountpoint).ok)
            try s.waitFor("the end marker", timeout: 300) { $0["path"] as? String == "end" }
            var previous: Int?
            var announced: ClosedRange<Int>?
            var resets = 0
            var silent: [String] = []
            for e in s.events {
                if e["type"] as? String == "reset" {
                    resets += 1
                    if let from = e["skipped_from"] as? Int, let to = e["skipped_to"] as? Int { announced = from...to }
                    continue
                }
                guard let seq = e["seq"] as? Int else { continue }
                if let p = previous, seq != p + 1 {
                    if announced != (p + 1)...(seq - 1) { silent.append("\(p) -> \(seq) (announced \(String(describing: announced)))") }
                }
                announced = nil
                previous = seq
            }
            #expect(resets > 0, "the journal kept everything: the test did not lag far enough")
            #expect(silent.isEmpty, "jumps without a reset: \(silent.prefix(5))")
        }
    }

    @Test("while the journal cannot be written (a full disk) the daemon's memory stays bounded, and subscribers get a reset for what was dropped")
    func fullDiskDropsWithReset() throws {
        try #require(FUSEAvailability.isRoot || FUSEAvailability.isCI, "needs root for a tmpfs source")
        try withVanishMountOnTmpfs(size: "64m") { m in
            let s = try Subscriber(m, name: "full")
            defer { s.stop() }
            try attach(s, m)
            #expect(try sh("touch x", cwd: m.mountpoint).ok)
            _ = try sh("dd if=/dev/zero of=fill bs=1M status=none; sync", cwd: m.source)
            #expect(freeBytes(m.source) < 64 << 10, "the disk is full")
            func rss() throws -> Int {
                let status = try String(contentsOfFile: "/proc/\(m.pid)/status", encoding: .utf8)
                let line = try #require(status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") })
                return Int(line.split(separator: " ").dropFirst().first ?? "0") ?? 0
            }
            let before = try rss()
            // 300,000 events (about 75 MB of journal) with nowhere to write them.
            let r = try run(["python3", "-c", """
                import os, sys
                x = os.path.join(sys.argv[1], "x")
                for i in range(300000): os.chmod(x, 0o600 if i % 2 else 0o644)
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            let grown = try rss() - before
            // Bounded by the writer's buffers (tens of MB), not ~250 bytes an event.
            #expect(grown < 48 << 10, "the daemon grew \(grown) KiB")
            #expect(unlink(m.backing("fill")) == 0)
            #expect(try sh("touch end", cwd: m.mountpoint).ok)
            try s.waitFor("the end marker", timeout: 120) { $0["path"] as? String == "end" }
            let resets = s.events.filter { $0["type"] as? String == "reset" }
            #expect(resets.contains { ($0["skipped"] as? Int ?? 0) > 0 }, "no reset for the dropped events")
            var previous: Int?
            var announced: ClosedRange<Int>?
            var silent = 0
            for e in s.events {
                guard let seq = e["seq"] as? Int else { continue }
                if e["type"] as? String == "reset", let from = e["skipped_from"] as? Int, let to = e["skipped_to"] as? Int {
                    // The journal's own reset stands in place of the last number it skipped.
                    if let p = previous, from != p + 1 { silent += 1 }
                    announced = nil
                    previous = to
                    continue
                }
                if let p = previous, seq != p + 1, announced != (p + 1)...(seq - 1) { silent += 1 }
                announced = nil
                previous = seq
            }
            #expect(silent == 0, "jumps in seq without a reset")
        }
    }

    @Test("a subscriber is told how its stream ended: an end line at an unmount (exit 0), an error when the daemon dies (exit 1)")
    func streamEnd() throws {
        let clean = try VanishMount()
        defer { clean.close() }
        let s = try Subscriber(clean, name: "clean")
        defer { s.stop() }
        try attach(s, clean)
        #expect(try clean.unmount() == 0)
        #expect(try s.exitStatus() == 0)
        #expect(s.events.last?["type"] as? String == "end", "\(s.events.suffix(2))")

        let crashed = try VanishMount()
        defer { crashed.close() }
        let c = try Subscriber(crashed, name: "crashed")
        defer { c.stop() }
        try attach(c, crashed)
        kill(crashed.pid, SIGKILL)
        _ = try crashed.waitForExit()
        #expect(try c.exitStatus() == 1)
        let said = try String(contentsOfFile: c.output, encoding: .utf8)
        #expect(said.contains("crashed or was killed"), "\(said.suffix(300))")
    }

    @Test("names with newlines and invalid UTF-8 round-trip")
    func oddNames() throws {
        try withVanishMount { m in
            let s = try attachedSubscriber(m)
            defer { s.stop() }
            let r = try run(["python3", "-c", """
                import os, sys
                os.close(os.open(os.path.join(sys.argv[1].encode(), b"new\\nline"), os.O_CREAT | os.O_WRONLY))
                os.close(os.open(os.path.join(sys.argv[1].encode(), b"bad\\xff\\xfe"), os.O_CREAT | os.O_WRONLY))
                """, m.mountpoint])
            #expect(r.ok, "\(r.stderr)")
            try s.waitFor("the odd names") { ($0["path_b64"] as? String) != nil }
            try s.waitFor("the newline name") { $0["path"] as? String == "new\nline" }
            let bad = try #require(s.events.first { $0["path_b64"] != nil })
            let bytes = [UInt8](Data(base64Encoded: bad["path_b64"] as! String)!)
            #expect(bytes == Array("bad".utf8) + [0xFF, 0xFE])
        }
    }
}

func makeTreeForEvents(_ dir: String) throws {
    let r = try sh("mkdir -p \(shellQuote(dir))/a/b && for i in 1 2 3; do echo $i > \(shellQuote(dir))/a/b/f$i; done")
    guard r.ok else { throw TestFailure(r.stderr) }
}
