import CFuse
import FUSEKit
import LinuxSyscalls

/// Tells the kernel about entries the filesystem removed or brought back on
/// its own (`vanish rm`, a restore), so every process sees the change at
/// once. Never from a request handler: libfuse may deadlock when a handler
/// notifies its own session. A thread started with the session sends them,
/// in order for each parent. (A Dispatch queue started a thread for the
/// first notification of each mount, and `vanish rm` waited about 0.3 ms.)
///
/// A notice waits in the kernel for its parent's inode lock, which any
/// process that may read the directory can hold for as long as it likes (a
/// getdents into a page of its own FUSE mount that never arrives). So a
/// notice still in the kernel after `stuckAfter` gets a sender thread of
/// its own: the others go on with every other parent, and notices for the
/// held parent wait behind it, as calls on that directory would natively.
/// Up to `mostSenders`; spare senders end once they are idle. Each notice
/// is charged to the user whose action caused it, who may have at most
/// `mostPerUser` in the kernel at once: one user holding many directories
/// their own actions changed holds back only their own notices.
final class EntryInvalidations: Sendable {
    /// Sends one notice about `name` in `parent` (an empty name: drop
    /// `parent`'s own attributes).
    typealias Invalidate = @Sendable (_ parent: fuse_ino_t, _ name: ContiguousArray<CChar>, _ notice: EntryNotice) -> Void

    static let stuckAfter = Duration.milliseconds(100)
    static let mostSenders = 64
    static let mostPerUser = 4
    /// Charged for a change whose causer is not known (a program behind the mount that is gone).
    static let unknownUser = UInt32.max

    private struct Pending {
        let parent: fuse_ino_t
        let name: ContiguousArray<CChar>
        var notice = EntryNotice.invalidate
        var uid = EntryInvalidations.unknownUser
        var ticket: UInt64 = 0
    }
    private struct State {
        var queue: [Pending] = []
        /// Parents of the notices in the kernel now, when each went in, and whose.
        var inFlight: [(parent: fuse_ino_t, since: UInt64, uid: UInt32)] = []
        /// Notices queued so far, and sent: every ticket up to `sent`, and
        /// those in `sentLater` (sent while an earlier one was held).
        var queued: UInt64 = 0
        var sent: UInt64 = 0
        var sentLater = Set<UInt64>()
        var invalidate: Invalidate?
        /// The sending threads run (from the kernel's INIT on).
        var running = false
        var senders = 0
        var idle = 0

        /// Queues `notice` if anything sends them; returns its ticket.
        mutating func enqueue(_ notice: Pending) -> UInt64? {
            guard invalidate != nil else { return nil }
            queued += 1
            var n = notice
            n.ticket = queued
            queue.append(n)
            return queued
        }

        func isSent(_ ticket: UInt64) -> Bool { ticket <= sent || sentLater.contains(ticket) }

        /// The first queued notice whose parent has none in the kernel and
        /// whose user has fewer than `mostPerUser` there (dropping attributes
        /// takes no lock: never held).
        func sendable() -> Int? {
            if inFlight.isEmpty { return queue.isEmpty ? nil : 0 }
            return queue.firstIndex { p in
                !inFlight.contains { $0.parent == p.parent }
                    && (p.name.isEmpty || inFlight.count(where: { $0.uid == p.uid }) < EntryInvalidations.mostPerUser)
            }
        }

        mutating func markSent(_ ticket: UInt64) {
            guard ticket == sent + 1 else { sentLater.insert(ticket); return }
            sent = ticket
            while sentLater.remove(sent + 1) != nil { sent += 1 }
        }

        /// Whether a notice waits to be sent while every sender has been
        /// in the kernel since before `before`.
        func needsSender(before: UInt64) -> Bool {
            idle == 0 && senders < EntryInvalidations.mostSenders && sendable() != nil
                && inFlight.allSatisfy { $0.since < before }
        }
    }
    private let state = Guarded(State())

    func start() {
        state.withLock { $0.running = true }
        startSender()
        spawnThread("vanish-notifywatch", stackSize: 64 << 10) { [self] in watch() }
    }

    private func startSender() {
        state.withLock { $0.senders += 1 }
        spawnThread("vanish-notify", stackSize: 256 << 10) { [self] in run() }
    }

    /// Tells the kernel `name` in `parent` may now exist (a restore) and
    /// waits until it was told, so whoever asked for the restore finds the
    /// name next, not a negative entry the kernel still remembers: false if
    /// that took longer than `timeout` (someone holds the
    /// parent's lock), and the notice goes through after.
    func send(parent: fuse_ino_t, name: ContiguousArray<CChar>, by uid: UInt32, timeout: Duration) -> Bool {
        guard let ticket = state.update({ $0.enqueue(Pending(parent: parent, name: name, uid: uid)) }) else { return true }
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
    func expire(parent: fuse_ino_t, name: ContiguousArray<CChar>, by uid: UInt32, timeout: Duration) -> Bool {
        guard let ticket = state.update({ $0.enqueue(Pending(parent: parent, name: name, notice: .expire, uid: uid)) }) else {
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
    func deleted(parent: fuse_ino_t, name: ContiguousArray<CChar>, child: fuse_ino_t, by uid: UInt32) {
        _ = state.update { $0.enqueue(Pending(parent: parent, name: name, notice: .delete(child: child), uid: uid)) }
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
    /// behind the mount (made, removed or moved there by another program,
    /// run by `uid` if known).
    func changedBehind(parent: fuse_ino_t, name: ContiguousArray<CChar>, by uid: UInt32 = EntryInvalidations.unknownUser) {
        _ = state.update { $0.enqueue(Pending(parent: parent, name: name, uid: uid)) }
    }

    /// Waits until `ticket` notices were sent; false if `deadline` came first.
    private func waitUntilSent(_ ticket: UInt64, deadline: UInt64) -> Bool {
        if state.withLock({ $0.isSent(ticket) }) { return true }
        Workers.mayBlock()
        return state.wait(until: { $0.isSent(ticket) }, deadline: deadline)
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
                s.sentLater.removeAll()
            }
        }
        state.wait(until: { $0.queue.isEmpty && $0.inFlight.isEmpty }) { s, _ in s.invalidate = f }
    }

    private func run() {
        while true {
            state.update { $0.idle += 1 }
            let next: (Pending, Invalidate?)? = state.wait(until: { s in
                s.sendable() != nil || (s.idle > 1 && s.senders > 1)
            }) { s, _ in
                s.idle -= 1
                guard let i = s.sendable() else {
                    // A spare, with another sender idle: it ends.
                    s.senders -= 1
                    return nil
                }
                let p = s.queue.remove(at: i)
                s.inFlight.append((p.parent, Condition.now(), p.uid))
                return (p, s.invalidate)
            }
            guard let (notice, f) = next else { return }
            f?(notice.parent, notice.name, notice.notice)
            state.update { s in
                if let i = s.inFlight.firstIndex(where: { $0.parent == notice.parent }) { s.inFlight.remove(at: i) }
                s.markSent(notice.ticket)
            }
        }
    }

    /// Gives a notice that waits behind senders held in the kernel a sender
    /// of its own.
    private func watch() {
        let stuck = UInt64(Self.stuckAfter.nanoseconds)
        while true {
            // Something waits while every sender is busy: give them `stuckAfter`.
            _ = state.wait(until: { s in s.idle == 0 && s.sendable() != nil && s.senders < Self.mostSenders })
            let since = state.withLock { s in s.inFlight.map(\.since).max() ?? Condition.now() }
            let held = !state.wait(until: { s in !s.needsSender(before: since &+ 1) },
                                   deadline: since &+ stuck)
            if held { startSender() }
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
