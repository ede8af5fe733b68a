import CFuse
import Foundation
import Synchronization
import Testing
@testable import VanishFS

/// The thread that tells the kernel of entries changed behind its back, and
/// the daemon's last wait for it before the session goes (in-process: no mount).
@Suite("entry invalidations")
struct EntryInvalidationsTests {
    /// Runs `body` on a thread of its own: whether it returned within `seconds`.
    func returns(within seconds: Double, _ body: @escaping @Sendable () -> Void) -> Bool {
        let done = DispatchSemaphore(value: 0)
        Thread.detachNewThread {
            body()
            done.signal()
        }
        return done.wait(timeout: .now() + seconds) == .success
    }

    @Test("a session that ends before the kernel's INIT, with notices queued and no sender started, lets go at once")
    func endsBeforeINIT() {
        // The invalidator is set at mount; the source watch may queue
        // notices from then on; the sender starts with INIT. A daemon whose
        // session ended first waited for ever at unmount.
        let notices = EntryInvalidations()
        notices.setInvalidator { _, _, _ in }
        notices.changedBehind(parent: fuse_ino_t(1), name: Inode.copyName("made-behind"))
        notices.attributes(of: fuse_ino_t(1), wait: false)
        #expect(returns(within: 10) { notices.setInvalidator(nil) })
    }

    @Test("once started, every notice queued is sent, in order, before the session may go")
    func sendsAllBeforeGoing() {
        let notices = EntryInvalidations()
        let sent = Mutex<[String]>([])
        notices.setInvalidator { parent, name, _ in
            let text = name.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
            sent.withLock { $0.append("\(parent)/\(text)") }
        }
        notices.start()
        for i in 1...200 {
            notices.changedBehind(parent: fuse_ino_t(i), name: Inode.copyName("n\(i)"))
        }
        #expect(returns(within: 10) { notices.setInvalidator(nil) })
        #expect(sent.withLock { $0 } == (1...200).map { "\($0)/n\($0)" })
        // Nothing is queued once the invalidator is gone.
        notices.changedBehind(parent: fuse_ino_t(1), name: Inode.copyName("late"))
        #expect(sent.withLock { $0.count } == 200)
    }
}
