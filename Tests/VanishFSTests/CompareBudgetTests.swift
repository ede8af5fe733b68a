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
