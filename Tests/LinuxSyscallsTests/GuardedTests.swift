import Glibc
import LinuxSyscalls
import Testing

/// `Guarded`: a state reached only under its lock, and waits for it to change.
@Suite("guarded state")
struct GuardedTests {
    @Test("a waiter wakes when another thread's update makes its condition true, and takes its turn under the lock")
    func waitsForUpdate() {
        let queue = Guarded([Int]())
        let done = Guarded(0)
        spawnThread("test-consumer") {
            for _ in 0..<100 {
                let item = queue.wait(until: { !$0.isEmpty }) { q, _ in q.removeFirst() }
                done.update { $0 += item }
            }
        }
        for i in 1...100 { queue.update { $0.append(i) } }
        let finished = done.wait(until: { $0 == 5050 }, deadline: Condition.now() &+ Duration.seconds(30).nanoseconds)
        #expect(finished, "the consumer took every item once")
        #expect(queue.withLock { $0.isEmpty })
    }

    @Test("a wait with a deadline returns false once it passes, and its body sees the condition unmet")
    func deadline() {
        let flag = Guarded(false)
        let start = Condition.now()
        let (ready, seen) = flag.wait(until: { $0 }, deadline: start &+ Duration.milliseconds(20).nanoseconds) { s, ready in
            (ready, s)
        }
        #expect(!ready && !seen)
        #expect(Condition.now() &- start >= Duration.milliseconds(20).nanoseconds)
        #expect(!flag.wait(until: { $0 }, deadline: Condition.now()))
        flag.update { $0 = true }
        #expect(flag.wait(until: { $0 }, deadline: Condition.now()), "already true: no wait")
    }
}
