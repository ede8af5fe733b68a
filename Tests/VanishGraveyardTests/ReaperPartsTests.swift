import Foundation
import Glibc
import LinuxSyscalls
import Synchronization
import Testing
@testable import VanishGraveyard
import VanishTestSupport

/// The reaper's parts, in process: what a deletion adds up to, the rate
/// limit, how workers step aside for requests through the mount, stuck
/// entries, the workers' wakeups and the warden's view of free space.
@Suite("reaper parts")
struct ReaperPartsTests {
    @Test("a tree's tally is reported once, when its last piece is freed, with everything its pieces freed")
    func tallies() {
        var t = ReapTallies()
        #expect(t.origin(of: "tree", isPiece: false) == "tree")
        t.split("piece-1", from: "tree")
        t.split("piece-2", from: "tree")
        #expect(t.origin(of: "piece-1", isPiece: true) == "tree")
        #expect(t.origin(of: "stranger", isPiece: true) == nil, "a piece left from before a restart belongs to no deletion")
        // The tree's own top goes first; its pieces are still open.
        #expect(t.add(Freed(files: 2, directories: 1, dataBytes: 10, diskBytes: 8192), to: "tree", entry: "tree", done: true) == nil)
        #expect(t.add(Freed(files: 3), to: "tree", entry: "piece-1", done: false) == nil, "half of a piece: still open")
        #expect(t.add(Freed(files: 1, directories: 1), to: "tree", entry: "piece-1", done: true) == nil)
        #expect(t.freedByOrigin["tree"] == Freed(files: 6, directories: 2, dataBytes: 10, diskBytes: 8192))
        let total = t.add(Freed(files: 4, directories: 1, dataBytes: 5, diskBytes: 4096), to: "tree", entry: "piece-2", done: true)
        #expect(total == Freed(files: 10, directories: 3, dataBytes: 15, diskBytes: 12288))
        #expect(t.pieces.isEmpty && t.freedByOrigin.isEmpty, "nothing of the tree is kept once it is reported")
        #expect(t.add(Freed(files: 1), to: "tree", entry: "tree", done: true) == nil, "reported once only")
    }

    @Test("a single entry is reported when it is done, not before")
    func singleEntry() {
        var t = ReapTallies()
        #expect(t.origin(of: "file", isPiece: false) == "file")
        #expect(t.add(Freed(files: 1, diskBytes: 4096), to: "file", entry: "file", done: true) == Freed(files: 1, diskBytes: 4096))
    }

    @Test("the rate limit gives the first deletion its slot at once and makes the next wait, unless a stop comes")
    func rateLimit() {
        let limiter = RateLimiter(perSecond: 1)
        #expect(limiter.take(unless: { Issue.record("the first slot is now: nothing to wait for"); return true }))
        let asked = Atomic<Int>(0)
        #expect(!limiter.take(unless: { asked.add(1, ordering: .relaxed); return true }),
                "the next slot is a second away: a stop ends the wait")
        #expect(asked.load(ordering: .relaxed) == 1)
    }

    @Test("a worker steps aside only while requests come, never past a stop, and not when space is short")
    func foregroundGate() {
        let requests = Atomic<UInt64>(0)
        let quiet = ForegroundGate(requests: { requests.load(ordering: .relaxed) }, maxPause: 50_000_000,
                                   turns: ForegroundTurns(), urgent: { false })
        #expect(!quiet.mayWait)
        var idle = quiet
        let idleWent = idle.wait(unless: { Issue.record("a quiet mount is not waited for"); return true })
        #expect(idleWent)

        var busy = quiet
        requests.add(1, ordering: .relaxed)
        #expect(busy.mayWait)
        let busyWent = busy.wait(unless: { true })
        #expect(!busyWent, "a stop never waits for the mount to go quiet")

        var urgent = ForegroundGate(requests: { requests.load(ordering: .relaxed) }, maxPause: 50_000_000,
                                    turns: ForegroundTurns(), urgent: { true })
        requests.add(1, ordering: .relaxed)
        let urgentWent = urgent.wait(unless: { Issue.record("short of space: no stepping aside"); return true })
        #expect(urgentWent)
    }

    @Test("on a busy mount the workers share one deletion turn per interval")
    func turns() {
        let turns = ForegroundTurns()
        // A second: the monotonic clock has run that long since boot, and the two asks come within it.
        let second = Duration.seconds(1).nanoseconds
        #expect(turns.take(every: second))
        #expect(!turns.take(every: second), "one turn per interval, whichever worker asks")
    }

    @Test("progress adds what each deletion freed and counts entries")
    func progress() {
        let p = ReapProgress()
        p.freed(Freed(files: 3, directories: 1, dataBytes: 7, diskBytes: 8192))
        p.freed(Freed(files: 2))
        p.entryDone()
        #expect(p.total == Freed(files: 5, directories: 1, dataBytes: 7, diskBytes: 8192))
        #expect(p.entries.load(ordering: .relaxed) == 1)
    }

    @Test("a deleter's identity goes into an entry's name and comes back with its groups; a record that does not match gives fewer rights",
          .enabled(if: Credentials.canSwitch, "the daemon records deleters only where it can act as them (root)"))
    func deleterIdentity() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let g = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        let who = Credentials(uid: 65534, gid: 65534, groups: [27, 4, 27])
        let id = try #require(try g.identify(who))
        #expect(try g.identify(who) == id, "one record per identity")
        #expect(try g.identify(Credentials(uid: geteuid(), gid: 0, groups: [])) == nil, "the daemon's own user needs none")
        let name = try g.withName(g.reserve(by: id)) { String(cString: $0) }
        #expect(name.count == 69)
        #expect(name.withCString { Graveyard.deletionTime($0) } != nil)
        #expect(name.withCString { DeletedBy(entryName: $0) } == id)
        let back = try #require(name.withCString { g.credentials(ofEntry: $0) })
        #expect(back.uid == 65534 && back.gid == 65534 && back.groups == [4, 27])
        // Another graveyard of the same source reads the record afresh.
        let again = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        #expect(name.withCString { again.credentials(ofEntry: $0) }?.groups == [4, 27])
        // A record changed to claim another uid is not believed: no groups at all.
        let record = try #require(try FileManager.default.contentsOfDirectory(atPath: dir + "/.vanish/clients/alpha/deleters").first)
        try "0 0 0\n".write(toFile: dir + "/.vanish/clients/alpha/deleters/" + record, atomically: false, encoding: .utf8)
        let third = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        let tampered = try #require(name.withCString { third.credentials(ofEntry: $0) })
        #expect(tampered.uid == 65534 && tampered.groups.isEmpty)
        #expect("0000000000000001-00000001-0000000001".withCString { g.credentials(ofEntry: $0) } == nil,
                "a name without a deleter is the daemon's")
    }

    @Test("the window's limits give up the largest users' oldest entries, down to a common cap, and no one else's")
    func fairEviction() {
        // root: one 1 MiB entry; nobody (65534): eight 4 MiB ones, all newer; limit 16 MiB.
        let mib: UInt64 = 1 << 20
        let items = [(uid: UInt32(0), bytes: mib)] + (0..<8).map { _ in (uid: UInt32(65534), bytes: 4 * mib) }
        #expect(FairEviction.choose(items, wanted: 33 * mib - 16 * mib) == [1, 2, 3, 4, 5], "nobody's five oldest")
        // Two users over the cap each come down to it; the small one loses nothing.
        let two = [(uid: UInt32(1), bytes: 10 * mib), (uid: UInt32(2), bytes: 10 * mib), (uid: UInt32(3), bytes: mib),
                   (uid: UInt32(1), bytes: 10 * mib), (uid: UInt32(2), bytes: 10 * mib)]
        #expect(FairEviction.choose(two, wanted: 20 * mib) == [0, 1], "each of the two big users' oldest")
        #expect(FairEviction.cap([1, 20, 20], keeping: 21) == 10)
        // Short of space with sizes unknown: at least the oldest goes.
        #expect(FairEviction.choose([(uid: 0, bytes: 0), (uid: 1, bytes: 0)], wanted: 1) == [0, 1])
        #expect(FairEviction.choose([(uid: 0, bytes: 5)], wanted: 0).isEmpty)
    }

    @Test("accounting: a tree in pieces is one deletion; the work left is what its size less its tally says, unknown for a stranger's piece")
    func accounting() {
        let a = ReapAccounting()
        a.expectTree("tree", count: 10)
        #expect(a.knowsTrees)
        #expect(a.origin(of: "tree", isPiece: false) == "tree")
        a.split("piece-1", from: "tree")
        a.split("piece-2", from: "tree")
        // Three names in the graveyard, one deletion; plus a file and a piece left from before a restart.
        #expect(a.deletions([("tree", false), ("piece-1", true), ("piece-2", true)]) == 1)
        #expect(a.deletions([("piece-1", true), ("file", false), ("old-piece", true)]) == 3)
        #expect(a.tally("tree", entry: "tree", freed: Freed(files: 3, directories: 1), done: true) == nil)
        #expect(a.remainingWork([("piece-1", true), ("piece-2", true), ("file", false)]) == 10 - 4 + 1)
        #expect(a.remainingWork([("piece-1", true), ("old-piece", true)]) == nil)
        _ = a.tally("tree", entry: "piece-1", freed: Freed(files: 2, directories: 1), done: true)
        let total = a.tally("tree", entry: "piece-2", freed: Freed(files: 2, directories: 1, diskBytes: 4096), done: true)
        #expect(total == Freed(files: 7, directories: 3, diskBytes: 4096))
        #expect(!a.knowsTrees, "a tree reported is forgotten")
        let before = a.generation
        a.buried(bytes: 8192)
        #expect(a.generation != before && a.statistics.buried == 1)
        a.progress.freed(Freed(files: 1, diskBytes: 4096))
        #expect(a.holdingBytes == 4096)
    }

    @Test("stuck entries wait for their retry while the mount serves, and for good once the reaper finishes")
    func stuckEntries() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        #expect(mkdirat(fd, "stuck", 0o755) == 0)
        let s = StuckEntries()
        #expect(s.isEmpty)
        #expect(s.stick("stuck", shard: fd), "reported the first time")
        #expect(!s.stick("stuck", shard: fd), "not again")
        var nextDue = UInt64.max
        #expect(s.holds("stuck", finishing: false, nextDue: &nextDue))
        #expect(nextDue > Sys.wallClockNow() && nextDue != .max, "its retry bounds the worker's sleep")
        #expect(s.holds("stuck", finishing: true, nextDue: &nextDue))
        #expect(!s.holds("other", finishing: false, nextDue: &nextDue))
        #expect(s.current() == ["stuck"])
        #expect(unlinkat(fd, "stuck", AT_REMOVEDIR) == 0)
        #expect(s.current().isEmpty && s.isEmpty, "one gone meanwhile is forgotten")
        _ = s.stick("again", shard: fd)
        s.unstick("again")
        #expect(s.isEmpty)
    }

    @Test("workers: a burial marks its shard for the owner only; a sleeping worker is woken, one with news does not sleep")
    func workers() {
        let w = ReaperWorkers(count: 3)
        #expect(w.shards(of: 1) & (1 << 4) != 0 && w.shards(of: 1) & (1 << 3) == 0)
        #expect(w.shards(of: 0) | w.shards(of: 1) | w.shards(of: 2) == UInt64.max >> UInt64(64 - Graveyard.shardCount), "every shard has an owner")
        _ = w.takeDirty(~0)  // all dirty at start, so a crash's leftovers are found
        w.markDirty(4)
        #expect(w.takeDirty(w.shards(of: 0)) == 0)
        #expect(w.takeDirty(w.shards(of: 1)) == 1 << 4)
        #expect(w.takeDirty(w.shards(of: 1)) == 0, "taken once")
        #expect(!w.sleep(0, until: .now() + .seconds(5)) { false }, "news since its pass: no sleep")
        final class Flag: Sendable { let value = Atomic<Bool>(false) }
        let woken = Flag()
        spawnThread("test-sleeper") {
            woken.value.store(w.sleep(1, until: .now() + .seconds(30)) { true }, ordering: .relaxed)
        }
        try? waitFor("the worker to wake", timeout: 10) {
            w.markDirty(1)
            return woken.value.load(ordering: .relaxed)
        }
        let wasWoken = woken.value.load(ordering: .relaxed)
        #expect(wasWoken, "woken well before its 30 s deadline")
        #expect(w.isIdle, "never started: idle")
    }

    @Test("the warden sees free space running out only from a fall that goes on")
    func spaceTrend() {
        var t = SpaceWarden.SpaceTrend()
        var fs = statvfs()
        fs.f_frsize = 4096
        fs.f_bavail = 1_000_000
        let first = t.runsOutSoon(fs, floor: 0, at: 1_000_000_000)
        fs.f_bavail = 900_000
        let once = t.runsOutSoon(fs, floor: 3_000_000_000, at: 1_010_000_000)
        fs.f_bavail = 800_000
        let twice = t.runsOutSoon(fs, floor: 3_000_000_000, at: 1_020_000_000)
        let stopped = t.runsOutSoon(fs, floor: 3_000_000_000, at: 1_030_000_000)
        #expect(!first)
        #expect(!once, "one fall is not a trend")
        #expect(twice, "400 MB per 10 ms, 3.3 GB left, a 3 GB floor")
        #expect(!stopped, "the fall stopped")
    }

    @Test("a directory split into pieces waits for them; one that comes back stays with it, and it is due again after the last")
    func pieceFamilies() {
        let f = PieceFamilies()
        #expect(f.isEmpty)
        #expect(f.split("t", shardFD: 7, into: [("p1", Array("a".utf8)), ("p2", Array("b".utf8))]))
        #expect("t".withCString { f.isWaiting($0) })
        #expect(f.origin(of: "p1")?.parent == "t" && f.origin(of: "p1")?.shardFD == 7 && f.origin(of: "p1")?.name == Array("a".utf8))
        #expect(f.pieceDone("p1", cameBack: false) == nil, "p2 is still out")
        #expect(f.pieceDone("p1", cameBack: false) == nil, "a piece is done once")
        #expect(f.pieceDone("p2", cameBack: true) == 7, "the last piece: t is due again in shard 7")
        #expect(!"t".withCString { f.isWaiting($0) })
        #expect("t".withCString { _ in "b".withCString { f.keeps("t", $0) } }, "b came back: never moved out again")
        #expect(!"a".withCString { f.keeps("t", $0) })
        f.forget("t")
        #expect(f.isEmpty, "nothing is left once t is gone or held")
        #expect(!f.split("u", shardFD: 7, into: []), "no pieces: nothing to wait for")
        let many = (0..<PieceFamilies.followed).map { ("q\($0)", [UInt8]()) }
        #expect(f.split("v", shardFD: 7, into: many))
        #expect(!f.split("w", shardFD: 7, into: [("x", [])]), "beyond the pieces followed, a directory does not wait")
        #expect(!"w".withCString { f.isWaiting($0) })
    }

    @Test("a directory the daemon empties hands its first subdirectory back to the shard being reaped, the rest spread")
    func firstPieceStays() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let g = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        // A chain 20 deep with a file at each level, and a top with 8 subdirectories.
        var path = dir + "/tree"
        for _ in 0..<20 {
            #expect(mkdir(path, 0o755) == 0)
            #expect(creat(path + "/f", 0o644) >= 0)
            path += "/d"
        }
        for i in 0..<7 { #expect(mkdir(dir + "/tree/w\(i)", 0o755) == 0) }
        var entry = ""
        let shard = try g.bury(fd, "tree", deletion: .now, named: { entry = String(cString: $0) })
        final class Pieces: @unchecked Sendable { var list: [(shard: Int, name: String)] = [] }
        let pieces = Pieces()
        func removeEntry(_ name: String, in shard: Int) -> [(shard: Int, name: String)] {
            pieces.list = []
            var remover = TreeRemover(graveyard: g, progress: ReapProgress(), limiter: nil, gate: nil,
                                      shouldStop: { false }, handedBack: { s, piece, _ in pieces.list.append((s, piece)) },
                                      families: PieceFamilies(), shardFD: g.shardFDs[shard], shardIndex: shard, linkDropped: nil)
            #expect(name.withCString { remover.remove(g.shardFDs[shard], $0) })
            #expect(remover.removedEntry && remover.failure == nil, "\(name): \(String(describing: remover.failure))")
            return pieces.list
        }
        let top = removeEntry(entry, in: shard)
        #expect(top.count == 8)
        #expect(top.filter { $0.shard == shard }.count >= 1, "one stays where its directory was")
        #expect(Set(top.map(\.shard)).count > 1, "the others are spread for the other workers")
        // Down the chain, each level stays in its parent's shard: one worker, no wakeup.
        var next = top
        var depth = 0
        while !next.isEmpty {
            var found: [(shard: Int, name: String)] = []
            for p in next {
                let below = removeEntry(p.name, in: p.shard)
                #expect(below.allSatisfy { $0.shard == p.shard }, "level \(depth): \(below) from shard \(p.shard)")
                found += below
            }
            next = found
            depth += 1
        }
        #expect(depth == 19, "the 19 levels below the top")
        #expect(access(dir + "/tree", F_OK) != 0)
        #expect(try graveyardCount(dir) == 0)
    }

    @Test("a piece's and an unheld entry's names keep their tree's burial time; the window still sees them as due at once")
    func burialTimeInNames() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let g = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        let t: UInt64 = 1_800_000_000_123_456_789
        func name(_ d: Graveyard.Deletion) throws -> String { try g.withUniqueName(1, time: d.nameTime) { String(cString: $0) } }
        for (d, due) in [(Graveyard.Deletion.at(t), t), (.piece(of: t), 0), (.unheld(since: t), 1)] {
            let n = try name(d)
            #expect(n.withCString { Graveyard.deletionTime($0) } == due, "\(d)")
            #expect(n.withCString { Graveyard.burialTime($0) } == t, "\(d)")
            #expect(n.withCString { Graveyard.isPiece($0) } == d.isPiece)
            // Held, it shows when its tree was deleted, never 1970.
            #expect(Graveyard.shownTime(n, due) == t)
        }
        // Names from before the marks: a piece and an unheld entry say no time.
        #expect(try name(.piece(of: nil)).withCString { Graveyard.burialTime($0) } == nil)
        #expect(try g.withUniqueName(1, time: 1) { Graveyard.burialTime($0) } == nil)
    }

    @Test("a subdirectory changed after its tree's burial is another's to free unless only its deleter could have moved it")
    func cameInLater() {
        let since: UInt64 = 1_800_000_000_000_000_000
        func dir(uid: uid_t, mode: mode_t, changed: UInt64) -> stat {
            var st = stat()
            st.st_mode = S_IFDIR | mode
            st.st_uid = uid
            st.st_ctim = timespec(tv_sec: Int(changed / 1_000_000_000), tv_nsec: Int(changed % 1_000_000_000))
            return st
        }
        let after = since + 5_000_000, before = since - 2_000_000_000
        #expect(TreeRemover.cameInLater(dir(uid: 65534, mode: 0o755, changed: after), since: since, deleter: 0))
        #expect(TreeRemover.cameInLater(dir(uid: 0, mode: 0o777, changed: after), since: since, deleter: 0),
                "root's world-writable directory: anyone could have moved it")
        #expect(TreeRemover.cameInLater(dir(uid: 1000, mode: 0o775, changed: after), since: since, deleter: 1000),
                "a group could have moved it")
        #expect(!TreeRemover.cameInLater(dir(uid: 1000, mode: 0o755, changed: after), since: since, deleter: 1000),
                "only its deleter could have moved their own directory")
        #expect(!TreeRemover.cameInLater(dir(uid: 65534, mode: 0o777, changed: before), since: since, deleter: 0),
                "unchanged since before the burial: it was in the tree")
        #expect(!TreeRemover.cameInLater(dir(uid: 65534, mode: 0o777, changed: after), since: nil, deleter: 0))
        // Stamped a tick early by the coarse clock, or by the second.
        #expect(TreeRemover.cameInLater(dir(uid: 65534, mode: 0o755, changed: since - 500_000), since: since, deleter: 0))
        #expect(TreeRemover.cameInLater(dir(uid: 65534, mode: 0o755, changed: since), since: since + 400_000_000, deleter: 0),
                "a stamp with no nanoseconds is a second's")
    }

    @Test("the change clock: with fine-grained stamps (Linux 6.13+ here), what changes after its now is stamped no earlier, what changed before, earlier")
    func changeClock() throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        let g = try Graveyard(rootFD: fd, client: try ClientID("alpha"))
        var u = utsname()
        uname(&u)
        let release = withUnsafeBytes(of: u.release) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
        let version = release.split(separator: ".").prefix(2).compactMap { Int($0.prefix { $0.isNumber }) }
        if version.count == 2 && (version[0], version[1]) >= (6, 13) {
            #expect(g.clock.fine, "multigrain timestamps on \(release)")
        }
        func changed(_ name: String) -> UInt64 {
            var st = stat()
            lstat(dir + "/" + name, &st)
            return Sys.nanoseconds(st.st_ctim)
        }
        for i in 0..<50 {
            mkdir(dir + "/before\(i)", 0o755)
            let t = g.clock.now()
            mkdir(dir + "/after\(i)", 0o755)
            let slack = g.clock.fine ? 0 : Sys.coarseClockResolution
            #expect(changed("after\(i)") &+ slack >= t, "a change after is never judged before")
            if g.clock.fine { #expect(changed("before\(i)") < t, "a change before is never judged after") }
        }
    }
}

