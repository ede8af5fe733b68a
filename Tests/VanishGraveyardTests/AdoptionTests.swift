import Foundation
import Glibc
import Testing
import VanishGraveyard
import VanishTestSupport

/// Per-client state, claims and absorption, in-process on a scratch
/// directory (the GlusterFS suite drives the same through real mounts).
@Suite("client state and adoption")
struct AdoptionTests {
    private func withRoot(_ body: (String, Int32) throws -> Void) throws {
        let dir = try makeTempDirectory()
        defer { removeTree(dir) }
        let fd = open(dir, O_RDONLY | O_DIRECTORY)
        defer { close(fd) }
        try body(dir, fd)
    }

    /// One graveyard per client name, in the scratch root `fd`.
    private func graveyards(_ fd: Int32, _ names: String...) throws -> [Graveyard] {
        try names.map { try Graveyard(rootFD: fd, client: client($0)) }
    }

    private func client(_ name: String) throws -> ClientID { try ClientID(name) }

    /// Files (`f`) and a tree (`d/x`) deleted into `g`, `f` with a trash record.
    private func bury(in g: Graveyard, _ dir: String, _ fd: Int32, prefix: String) throws {
        close(open(dir + "/\(prefix)f", O_CREAT | O_WRONLY, 0o644))
        mkdir(dir + "/\(prefix)d", 0o755)
        close(open(dir + "/\(prefix)d/x", O_CREAT | O_WRONLY, 0o644))
        let record = TrashRecord(path: Array("\(prefix)f".utf8), uid: 1000, gid: 100, bytes: 0, kind: .file)
        try g.bury(fd, "\(prefix)f", record: record)
        try g.bury(fd, "\(prefix)d")
    }

    private func entries(_ dir: String, _ client: String) throws -> Int {
        let r = try sh("find .vanish/clients/\(client)/graveyard -mindepth 2 -maxdepth 2 ! -name '.*' | wc -l", cwd: dir)
        return Int(r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? -1
    }

    @Test("client ids: safe path components only; the default is stable and differs by source")
    func clientIDs() throws {
        for bad in ["", ".hidden", "a/b", "a b", String(repeating: "x", count: 65), "..", "é"] {
            #expect(throws: ClientIDError.self, "\(bad)") { try ClientID(bad) }
        }
        #expect(try ClientID("host-1.example_2").name == "host-1.example_2")
        let a = ClientID.local(source: "/srv/a"), b = ClientID.local(source: "/srv/b")
        #expect(a == ClientID.local(source: "/srv/a"))
        #expect(a != b)
        #expect((try? ClientID(a.name)) == a, "the default is a valid id")
    }

    @Test("each client has its own graveyard; a claim takes another's whole, once, and absorbing moves entries and records in")
    func claimAndAbsorb() throws {
        try withRoot { dir, fd in
            let g = try graveyards(fd, "alpha", "beta", "gamma")
            let (alpha, beta, gamma) = (g[0], g[1], g[2])
            try bury(in: alpha, dir, fd, prefix: "a")
            try bury(in: beta, dir, fd, prefix: "b")
            #expect(try entries(dir, "alpha") == 2 && entries(dir, "beta") == 2)
            #expect(Set(beta.clients().map(\.name)) == ["alpha", "beta", "gamma"])
            #expect(beta.pendingEntries(of: try client("alpha")) == 2)

            #expect(try beta.claim(client("alpha")))
            #expect(try !gamma.claim(client("alpha")), "a graveyard is claimed once")
            #expect(try !beta.claim(client("beta")), "never its own")
            #expect(beta.hasIncoming)
            var landed: [Int] = []
            #expect(beta.absorbAdopted { landed.append($0) } == 2)
            #expect(landed.count == 2 && !beta.hasIncoming)
            #expect(try entries(dir, "beta") == 4)
            #expect(access(dir + "/.vanish/clients/alpha/graveyard", F_OK) != 0)
            #expect(beta.restorable.map { String(decoding: $0.record.path, as: UTF8.self) }.sorted() == ["af", "bf"])
            let r = try sh("find .vanish/clients/beta/graveyard -name x | wc -l", cwd: dir)
            #expect(r.stdout == "2\n", "both trees, whole")
            // The claimed client starts again with an empty graveyard of its own.
            let again = try Graveyard(rootFD: fd, client: client("alpha"))
            #expect(try entries(dir, "alpha") == 0 && again.restorable.isEmpty)
        }
    }

    @Test("an entry whose record cannot be read yet waits for a later absorb; one whose record is old and damaged comes without it")
    func recordNotYetReadable() throws {
        try withRoot { dir, fd in
            let g = try graveyards(fd, "alpha", "beta")
            let (alpha, beta) = (g[0], g[1])
            try bury(in: alpha, dir, fd, prefix: "a")
            #expect(try beta.claim(client("alpha")))
            // As a network volume's other client may show it: the record's name, not yet its data.
            let find = try sh("find .vanish/clients/beta/graveyard/incoming -mindepth 3 -name '.*' -type f", cwd: dir)
            let sidecar = dir + "/" + find.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
            let data = try #require(FileManager.default.contents(atPath: sidecar))
            #expect(truncate(sidecar, 0) == 0)
            #expect(beta.absorbAdopted { _ in } == 1, "the tree, which has no record, moves")
            #expect(beta.hasIncoming && beta.restorable.isEmpty)
            #expect(FileManager.default.createFile(atPath: sidecar, contents: data))
            #expect(beta.absorbAdopted { _ in } == 1)
            #expect(!beta.hasIncoming)
            #expect(beta.restorable.map { String(decoding: $0.record.path, as: UTF8.self) } == ["af"])

            // A record still unreadable long after it was written is damaged: the entry comes without it.
            try bury(in: beta, dir, fd, prefix: "b")
            let gamma = try Graveyard(rootFD: fd, client: client("gamma"))
            #expect(try gamma.claim(client("beta")))
            let old = try sh("find .vanish/clients/gamma/graveyard/incoming -mindepth 3 -name '.*' -type f", cwd: dir)
            let damaged = old.stdout.split(separator: "\n").map { dir + "/" + $0 }
            #expect(damaged.count == 2)
            for path in damaged {
                #expect(truncate(path, 0) == 0)
                var times = [timespec(tv_sec: time(nil) - 3600, tv_nsec: 0), timespec(tv_sec: time(nil) - 3600, tv_nsec: 0)]
                #expect(utimensat(AT_FDCWD, path, &times, 0) == 0)
            }
            #expect(gamma.absorbAdopted { _ in } == 4)
            #expect(!gamma.hasIncoming && gamma.restorable.isEmpty)
        }
    }

    @Test("a graveyard claimed with adoptions it never absorbed brings those along")
    func nestedAdoption() throws {
        try withRoot { dir, fd in
            let g = try graveyards(fd, "alpha", "beta", "delta")
            let (alpha, beta, delta) = (g[0], g[1], g[2])
            try bury(in: delta, dir, fd, prefix: "d")
            try bury(in: alpha, dir, fd, prefix: "a")
            #expect(try alpha.claim(client("delta")))
            // alpha dies before absorbing; beta takes alpha's graveyard, delta's inside it.
            #expect(try beta.claim(client("alpha")))
            #expect(beta.absorbAdopted { _ in } == 4)
            #expect(try entries(dir, "beta") == 4)
            #expect(beta.restorable.count == 2)
            let left = try sh("find .vanish/clients/beta/graveyard -name incoming | wc -l", cwd: dir)
            #expect(left.stdout == "0\n")
        }
    }

    @Test("a state directory from before per-client directories moves into the first client's")
    func legacyLayout() throws {
        try withRoot { dir, fd in
            #expect(try sh("""
                (umask 077 && mkdir -p .vanish/graveyard/07/0-0-1/sub .vanish/events/abc && touch .vanish/VANISH-STATE-DIRECTORY)
                echo data > .vanish/graveyard/07/0-0-1/sub/f && touch .vanish/unlinks
                """, cwd: dir).ok)
            _ = try Graveyard(rootFD: fd, client: client("first"))
            #expect(access(dir + "/.vanish/graveyard", F_OK) != 0)
            #expect(access(dir + "/.vanish/clients/first/graveyard/07/0-0-1/sub/f", F_OK) == 0)
            #expect(access(dir + "/.vanish/clients/first/events/abc", F_OK) == 0)
            #expect(access(dir + "/.vanish/clients/first/unlinks", F_OK) == 0)
        }
    }

    @Test("a lease expires by the observer's clock after a whole length without a beat, and lives again with one")
    func leases() throws {
        try withRoot { _, fd in
            let alpha = try ClientLeases(graveyard: Graveyard(rootFD: fd, client: client("alpha")), length: 1_000_000_000,
                                         adopting: false)
            let beta = try ClientLeases(graveyard: Graveyard(rootFD: fd, client: client("beta")), length: 1_000_000_000,
                                        adopting: true)
            let first = beta.observe()
            #expect(first.map(\.client.name) == ["alpha"])
            #expect(first.first?.expired == false, "a client first seen gets a whole length")
            try waitFor("alpha's lease to expire", timeout: 10) { beta.observe().first?.expired == true }
            alpha.renew()
            #expect(beta.observe().first?.expired == false)
        }
    }
}
