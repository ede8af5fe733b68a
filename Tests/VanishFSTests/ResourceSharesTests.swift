import SystemPackage
import Testing
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
    @Test("a user's share and all users' are bounded; root is not counted; released fds give places back")
    func bounds() throws {
        let shares = HandleShares(fdLimit: 400)  // 100 a user, 200 all users
        for i in 0..<100 {
            try shares.take(1000)
            shares.opened(Int32(i), by: 1000)
        }
        #expect(throws: Errno.tooManyOpenFilesInSystem) { try shares.take(1000) }
        for _ in 0..<100 { try shares.take(1001) }
        #expect(throws: Errno.tooManyOpenFilesInSystem, "all users' share is spent") { try shares.take(1002) }
        for _ in 0..<1000 { try shares.take(0) }
        shares.released(7)
        try shares.take(1002)
        shares.released(7)  // already given back: nothing more
        #expect(throws: Errno.tooManyOpenFilesInSystem) { try shares.take(1003) }
    }
}
