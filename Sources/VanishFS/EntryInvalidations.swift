import CFuse
import LinuxSyscalls

/// Tells the kernel about entries the filesystem removed or brought back on
/// its own (`vanish rm`, a restore), so every process sees the change at
/// once. Never from a request handler: libfuse may deadlock when a handler
/// notifies its own session. One thread, started with the session, sends
/// them in order. (A Dispatch queue started a thread for the first
/// notification of each mount, and `vanish rm` waited about 0.3 ms for it.)
final class EntryInvalidations: @unchecked Sendable {
    typealias Invalidate = @Sendable (_ parent: fuse_ino_t, _ child: fuse_ino_t, _ name: ContiguousArray<CChar>) -> Void

    private struct Pending {
        let parent: fuse_ino_t
        let child: fuse_ino_t
        let name: ContiguousArray<CChar>
    }
    private let condition = Condition()
    private var queue: [Pending] = []
    private var sending = false
    private var invalidate: Invalidate?

    func start() {
        spawnThread { [self] in run() }
    }

    /// Queues one notice: `name` in `parent` is gone (`child` its node) or,
    /// with `child` 0, may now exist.
    func send(parent: fuse_ino_t, child: fuse_ino_t, name: ContiguousArray<CChar>) {
        condition.lock()
        queue.append(Pending(parent: parent, child: child, name: name))
        condition.broadcast()
        condition.unlock()
    }

    /// Sets what sends them (`nil`: nothing more is sent). Returns once
    /// every notice queued before has been sent, so the session can be
    /// destroyed after.
    func setInvalidator(_ f: Invalidate?) {
        condition.lock()
        while !queue.isEmpty || sending { condition.wait() }
        invalidate = f
        condition.unlock()
    }

    private func run() {
        condition.lock()
        while true {
            while queue.isEmpty { condition.wait() }
            let next = queue.removeFirst()
            let f = invalidate
            sending = true
            condition.unlock()
            f?(next.parent, next.child, next.name)
            condition.lock()
            sending = false
            condition.broadcast()
        }
    }
}
