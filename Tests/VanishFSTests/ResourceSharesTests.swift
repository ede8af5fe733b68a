import Foundation
import Glibc
import LinuxSyscalls
import SystemPackage
import Testing
import VanishTestSupport
@testable import VanishFS

/// The per-user budget for reading files back to tell copies, in process.
@Suite("compare budget")
struct CompareBudgetTests {
    @Test("a user's burst is their own: spent, it refuses them and no one else")
    func perUser() {
        let budget = CompareBudget()
        let burst = Int(CompareBudget.burst)
        #expect(budget.take(burst, for: 65534))
        // Refill at 128 MiB/s: far less than half the burst comes back meanwhile.
        #expect(!budget.take(burst / 2, for: 65534))
        #expect(budget.take(burst, for: 0), "root's bucket is untouched")
        #expect(budget.take(burst, for: 1000), "another user's too")
        #expect(!budget.take(burst + 1, for: 1001), "no one gets more than the burst at once")
    }
}

/// Open-handle shares, in process.
@Suite("handle shares")
struct HandleSharesUnitTests {
    @Test("a user's share and all users' are bounded, then each user's floor up to the ceiling; root is not counted; released fds give places back")
    func bounds() throws {
        let shares = HandleShares(fdLimit: 400, accounts: SubordinateIDs(path: "/nonexistent"))
        #expect(shares.perUser == 100 && shares.allUsers == 200 && shares.floor == 25 && shares.ceiling == 300)
        for i in 0..<100 {
            try shares.take(1000)
            shares.opened(Int32(i), by: 1000)
        }
        #expect(throws: Errno.tooManyOpenFilesInSystem) { try shares.take(1000) }
        for _ in 0..<100 { try shares.take(1001) }
        // All users' half is spent: another user still has its floor.
        for _ in 0..<25 { try shares.take(1002) }
        #expect(throws: Errno.tooManyOpenFilesInSystem, "past its floor") { try shares.take(1002) }
        for _ in 0..<1000 { try shares.take(0) }
        for uid: uid_t in [1003, 1004, 1005] { for _ in 0..<25 { try shares.take(uid) } }
        #expect(throws: Errno.tooManyOpenFilesInSystem, "the ceiling") { try shares.take(1006) }
        shares.released(7)
        try shares.take(1006)
        shares.released(7)  // already given back: nothing more
        #expect(throws: Errno.tooManyOpenFilesInSystem) { try shares.take(1007) }
    }

    @Test("one account's subordinate uids share its share")
    func accounts() throws {
        let base = try makeTempDirectory()
        defer { removeTree(base) }
        _ = FileManager.default.createFile(atPath: base + "/passwd", contents: Data("mal:x:1002:1002::/:/bin/sh\n".utf8))
        _ = FileManager.default.createFile(atPath: base + "/subuid", contents: Data("mal:165536:65536\n".utf8))
        let shares = HandleShares(fdLimit: 1024, accounts: SubordinateIDs(path: base + "/subuid", passwd: base + "/passwd"))
        func takeAll(_ uid: uid_t) -> Int {
            var n = 0
            while (try? shares.take(uid)) != nil { n += 1 }
            return n
        }
        #expect(takeAll(165_536) == shares.perUser)
        #expect(takeAll(1002) == 0, "mal's own uid is past mal's share")
        #expect(takeAll(231_071) == 0, "and so is the last uid of the range")
        #expect(takeAll(231_072) == shares.perUser, "the next uid is no one's")
    }
}
