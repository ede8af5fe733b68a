import CFuse
import FUSEKit
import LinuxSyscalls

/// Tells the kernel about entries the filesystem removed or brought back on
/// its own (`vanish rm`, a restore), so every process sees the change at
/// once. Never from a request handler: libfuse may deadlock when a handler
/// notifies its own session. One thread, started with the session, sends
/// them in order. (A Dispatch queue started a thread for the first
/// notification of each mount, and `vanish rm` waited about 0.3 ms for it.)
final class EntryInvalidations: Sendable {
    /// Sends one notice about `name` in `parent` (an empty name: drop
    /// `parent`'s own attributes).
    typealias Invalidate = @Sendable (_ parent: fuse_ino_t, _ name: ContiguousArray<CChar>, _ notice: EntryNotice) -> Void

    private struct Pending {
        let parent: fuse_ino_t
        let name: ContiguousArray<CChar>
        var notice = EntryNotice.invalidate
    }
    private struct State {
        var queue: [Pending] = []
        var sending = false
        /// Notices queued and sent so far, for the waits of `send` and `expire`.
        var queued: UInt64 = 0
        var sent: UInt64 = 0
        var invalidate: Invalidate?
        /// The sending thread runs (from the kernel's INIT on).
        var running = false

        /// Queues `notice` if anything sends them; returns its ticket (what
        /// `sent` will have reached once it is sent).
        mutating func enqueue(_ notice: Pending) -> UInt64? {
            guard invalidate != nil else { return nil }
            queue.append(notice)
            queued += 1
            return queued
        }
    }
    private let state = Guarded(State())

    func start() {
        state.withLock { $0.running = true }
        spawnThread("vanish-notify") { [self] in run() }
    }

    /// Tells the kernel `name` in `parent` may now exist (a restore) and
    /// waits until it was told, so whoever asked for the restore finds the
    /// name next, not a negative entry the kernel still remembers: false if
    /// that took longer than `timeout` (someone holds the
    /// parent's lock), and the notice goes through after.
    func send(parent: fuse_ino_t, name: ContiguousArray<CChar>, timeout: Duration) -> Bool {
        guard let ticket = state.update({ $0.enqueue(Pending(parent: parent, name: name)) }) else { return true }
        return waitUntilSent(ticket, deadline: Condition.now() &+ timeout.nanoseconds)
    }

    /// Tells the kernel `name` in `parent` is gone and waits until it has
    /// expired the entry, for a request handler that must not answer
    /// before: false if that took longer than `timeout`.
    ///
    /// Expiring is quick: dropping the entry prunes every cached entry
    /// below it while the parent's lock is held (112 ms for a cached
    /// 20k-file tree), so that is queued after, off the caller's path. The
    /// kernel must still drop them: it would keep their inodes, and their
    /// fds here would keep the deleted files' space. Kernels before 6.2
    /// do not know expire-only and drop the entry at once.
    ///
    /// The handler cannot send it itself, and it is an invalidation rather
    /// than a delete notice: the caller of the request (a setxattr) holds
    /// the entry's inode lock until it is answered, and a delete notice
    /// takes that lock. An invalidation takes only the parent's, which
    /// someone may hold while waiting for the entry's lock (an rmdir of it
    /// at that very moment): the timeout ends that wait, the handler
    /// answers, and the invalidation goes through after.
    func expire(parent: fuse_ino_t, name: ContiguousArray<CChar>, timeout: Duration) -> Bool {
        guard let ticket = state.update({ $0.enqueue(Pending(parent: parent, name: name, notice: .expire)) }) else {
            return true
        }
        return waitUntilSent(ticket, deadline: Condition.now() &+ timeout.nanoseconds)
    }

    /// Tells the kernel, without waiting, that `name` in `parent`, expired
    /// before, was the node `child` and is deleted: it drops the entry and
    /// what it caches below it, and watchers see `DELETE`. Only once the
    /// request that deleted it is answered: the notice takes the entry's
    /// inode lock, which that request's caller holds until then. Queued
    /// any earlier, the notifying thread could wait in the kernel for that
    /// lock while the answer is still to come, and a daemon killed right
    /// then never exited (its last thread stuck there, the mount hung
    /// until aborted through fusectl).
    func deleted(parent: fuse_ino_t, name: ContiguousArray<CChar>, child: fuse_ino_t) {
        _ = state.update { $0.enqueue(Pending(parent: parent, name: name, notice: .delete(child: child))) }
    }

    /// Tells the kernel to drop the attributes it keeps for `ino` (a mode
    /// the daemon changed on its own) and (`wait`) waits until it was told,
    /// up to a second, so the caller's next stat shows the change. Dropping
    /// attributes takes no lock the caller may hold.
    func attributes(of ino: fuse_ino_t, wait: Bool = true) {
        guard let ticket = state.update({ $0.enqueue(Pending(parent: ino, name: [])) }), wait else { return }
        _ = waitUntilSent(ticket, deadline: Condition.now() &+ Duration.seconds(1).nanoseconds)
    }

    /// Tells the kernel, without waiting, that `name` in `parent` changed
    /// behind the mount (made, removed or moved there by another program).
    func changedBehind(parent: fuse_ino_t, name: ContiguousArray<CChar>) {
        _ = state.update { $0.enqueue(Pending(parent: parent, name: name)) }
    }

    /// Waits until `ticket` notices were sent; false if `deadline` came first.
    private func waitUntilSent(_ ticket: UInt64, deadline: UInt64) -> Bool {
        if state.withLock({ $0.sent >= ticket }) { return true }
        Workers.mayBlock()
        return state.wait(until: { $0.sent >= ticket }, deadline: deadline)
    }

    /// How each notice reaches the kernel through `notifier`.
    static func sender(_ notifier: Notifier) -> Invalidate {
        { parent, name, notice in
            // A negative offset drops the attributes and keeps the page cache.
            if name.isEmpty { _ = notifier.invalidateInode(parent, offset: -1); return }
            name.withUnsafeBufferPointer {
                switch notice {
                case .expire:
                    _ = notifier.expireEntry(parent: parent, name: $0.baseAddress!, length: $0.count - 1)
                case .delete(let child)
                    where notifier.deleteEntry(parent: parent, child: child, name: $0.baseAddress!, length: $0.count - 1) == 0:
                    break
                case .invalidate, .delete:
                    _ = notifier.invalidateEntry(parent: parent, name: $0.baseAddress!, length: $0.count - 1)
                }
            }
            // The parent's cached listing too: the kernel drops it with the
            // entry only when it still had that entry (it may have forgotten it).
            _ = notifier.invalidateInode(parent)
        }
    }

    /// Sets what sends them (`nil`: nothing more is sent). Returns once
    /// every notice queued before has been sent, so the session can be
    /// destroyed after.
    func setInvalidator(_ f: Invalidate?) {
        state.update { s in
            // A session that ended before the kernel's INIT never started the
            // sender: nothing queued can be sent, and nothing needs to be.
            if !s.running {
                s.queue.removeAll()
                s.sent = s.queued
            }
        }
        state.wait(until: { $0.queue.isEmpty && !$0.sending }) { s, _ in s.invalidate = f }
    }

    private func run() {
        while true {
            let (next, f) = state.wait(until: { !$0.queue.isEmpty }) { s, _ in
                s.sending = true
                return (s.queue.removeFirst(), s.invalidate)
            }
            f?(next.parent, next.name, next.notice)
            state.update { s in
                s.sending = false
                s.sent += 1
            }
        }
    }
}

/// What the kernel is told about an entry the filesystem changed on its own.
enum EntryNotice: Sendable, Equatable {
    /// Drop the entry and every cached entry below it.
    case invalidate
    /// Mark the entry expired: the next lookup of it asks the daemon.
    case expire
    /// The entry, node `child`, was deleted: as `invalidate`, and
    /// inotify watchers see a delete (else it is only invalidated).
    case delete(child: fuse_ino_t)
}
