import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import VanishGraveyard

/// Unlinks answered before their rename into the graveyard has landed.
///
/// An unlink through the mount checks the entry (it exists, is not a
/// directory, has one link, is not open), replies, and only then renames it
/// into the graveyard. Usually that rename does not happen at once: the
/// burial is queued on its directory, because `rm -rf` is about to remove
/// that directory too, and then the directory goes to the graveyard with
/// every file still queued in it, one rename for all of them (see
/// `Deleter.removeDirectory`). On ext4 the renames were a
/// third of the daemon's time in `rm -rf` through the mount, mostly spent
/// on the graveyard directories' locks and entries.
///
/// A queued burial lands on its own once its directory has been quiet for
/// `quiet` or it has waited `maxAge`, sent by one
/// flusher thread; when an entry is made in its directory (`landQueue`);
/// and at once when anything needs it. Nobody may see a name whose burial
/// is pending: `BackingNamespace`, the only owner of this type, lands or
/// waits for them on every way a handler reaches the backing directory
/// (by name, by directory, all).
/// Names are tracked by a 64-bit hash of (directory, name): a collision only
/// lands a burial early or makes someone wait for nothing.
///
/// Each answered unlink is written to `intents` before its answer, so a
/// daemon killed before the burial lands has it finished by the next mount
/// (`Deleter.finishInterruptedUnlinks`); the log is emptied
/// when nothing is pending. For the intents' paths to stay true, a
/// directory is renamed only once no burial is pending (`BackingNamespace.renaming`).
final class DeferredBurials: @unchecked Sendable {
    /// Which name a burial is of: its directory and a hash of (directory,
    /// name); and who unlinked it.
    struct Key: Hashable {
        let nameHash: UInt64
        let directory: InodeKey
        let uid: uid_t
    }

    /// A begun burial: from `begin` until it is consumed its name is hidden
    /// from every reader of the backing directory. Consumed by exactly one
    /// of `queue` (the queue ends it when the burial lands), `end` (its
    /// handler landed it, or it did not happen); the compiler refuses a
    /// second use, and one dropped unconsumed ends as `end` does.
    struct Ticket: ~Copyable {
        let key: Key
        /// No other burial was pending in the directory.
        let first: Bool
        private let owner: Unmanaged<DeferredBurials>

        fileprivate init(key: Key, first: Bool, owner: DeferredBurials) {
            self.key = key
            self.first = first
            self.owner = Unmanaged.passUnretained(owner)
        }

        /// The burial is over: landed by its handler, or it did not happen.
        consuming func end() {}

        /// Its claim on the name passes to the queue.
        fileprivate consuming func handOver() -> Key {
            let key = self.key
            discard self
            return key
        }

        deinit { owner.takeUnretainedValue().end(key) }
    }

    /// What landing a queued burial needs to know of the file.
    struct File {
        let st: stat
        /// Unlink it where it is instead (it is empty: nothing to free later).
        let inPlace: Bool
        /// When the unlink came (wall clock, ns): the entry's deletion time.
        let deleted: UInt64
    }

    /// An answered unlink waiting in its directory's queue.
    struct Queued {
        let key: Key
        let file: File
        let directory: Inode
        let name: ContiguousArray<CChar>
        let caller: Caller
        /// Its trash record, made when the unlink came (an undo window keeps it).
        let record: TrashRecord?
        /// `Condition.now()` when it was queued.
        let since: UInt64
    }

    /// A directory quiet this long will not be removed next (`rm -rf` comes
    /// back for it within milliseconds): its queued burials land.
    static let quiet = Duration.milliseconds(100)
    /// No burial waits longer, however busy its directory stays.
    static let maxAge = Duration.seconds(1)
    /// Beyond this many queued, an unlink's handler lands its own burial.
    static let queueLimit = 32768

    private let cond = Condition()
    // Guarded by `cond`. Sized at mount: see `InodeTable.lock`.
    private var names = [UInt64: Int32](minimumCapacity: 64)
    private var directories = [InodeKey: Int32](minimumCapacity: 64)
    private var queues = [InodeKey: [Queued]](minimumCapacity: 64)
    private var queuedCount = 0
    /// Begun burials not (yet) queued, by unlinker: answered or about to be.
    private var unqueued = [uid_t: Int32](minimumCapacity: 8)
    /// The latest unlink (wall clock, ns) in each directory with burials
    /// pending, as `latestUnlink` has shown it: never earlier than before.
    private var latest = [InodeKey: UInt64](minimumCapacity: 64)
    private var waiters = 0
    private var flusherStarted = false
    /// The flusher sleeps without a deadline (nothing was queued).
    private var flusherIdle = false
    private var stopping = false
    private var land: (@Sendable (Queued) -> Void)?
    /// Told of each directory burials landed in.
    private var landed: (@Sendable (Inode) -> Void)?
    /// Burials pending, readable without the lock: the fast path of every
    /// check is one load of this.
    private let outstanding = Atomic<Int>(0)
    /// Disk bytes of the queued burials that carry trash records: space the
    /// undo window will hold once they land (changed under the lock).
    private let keptBytesQueued = Atomic<UInt64>(0)
    /// The log of answered unlinks, emptied here when none is pending.
    let intents: UnlinkIntents?

    init(intents: UnlinkIntents?) {
        self.intents = intents
    }

    /// Whether no burial is pending (the hot paths' check).
    @inline(__always)
    var isEmpty: Bool { outstanding.load(ordering: .acquiring) == 0 }

    var count: Int { outstanding.load(ordering: .acquiring) }

    /// Disk bytes queued burials will keep in the undo window once they land.
    var keptBytes: UInt64 { keptBytesQueued.load(ordering: .relaxed) }

    /// Starts the flusher; `land` renames one queued burial (it must not
    /// end its ticket: that is done here), `landed` hears of each directory
    /// burials landed in. Without a flusher nothing is queued.
    func start(land: @escaping @Sendable (Queued) -> Void, landed: @escaping @Sendable (Inode) -> Void) {
        cond.lock()
        self.land = land
        self.landed = landed
        flusherStarted = true
        cond.unlock()
        spawnThread("vanish-bury") { [self] in flush() }
    }

    /// Marks `name` in `dir` as on its way to the graveyard; call before
    /// replying to the unlink, and `queue` or `end` the ticket after.
    func begin(_ dir: Inode, _ name: UnsafePointer<CChar>, by uid: uid_t) -> Ticket {
        let key = Key(nameHash: Self.hash(dir.key, name), directory: dir.key, uid: uid)
        cond.lock()
        names[key.nameHash, default: 0] += 1
        directories[key.directory, default: 0] += 1
        unqueued[uid, default: 0] += 1
        let first = directories[key.directory] == 1
        outstanding.add(1, ordering: .releasing)
        cond.unlock()
        return Ticket(key: key, first: first, owner: self)
    }

    /// Queues a begun burial of `file` on its directory, which lands it and
    /// ends its ticket. The ticket comes back when it should land now instead
    /// (no flusher, or the queue is full).
    func queue(_ ticket: consuming Ticket, _ file: File, in dir: Inode, name: UnsafePointer<CChar>,
               caller: Caller, record: TrashRecord?) -> Ticket? {
        let copy = Inode.copyName(name)
        cond.lock()
        guard flusherStarted, !stopping, queuedCount < Self.queueLimit else {
            cond.unlock()
            return ticket
        }
        let item = Queued(key: ticket.handOver(), file: file, directory: dir, name: copy, caller: caller,
                          record: record, since: Condition.now())
        defer { cond.unlock() }
        Self.release(&unqueued, item.key.uid)
        latest[dir.key] = max(latest[dir.key] ?? 0, file.deleted)
        queues[dir.key, default: []].append(item)
        queuedCount += 1
        if let bytes = record?.bytes { keptBytesQueued.add(bytes, ordering: .relaxed) }
        // An idle flusher needs a deadline; a busy one already wakes before
        // this burial is due (waking it anyway, when creates keep emptying
        // the queue, cost two context switches per unlink). A waiter for
        // this name must take it rather than wait.
        if flusherIdle || waiters > 0 { cond.broadcast() }
        return nil
    }

    /// Ends a ticket (`Ticket.end`, or one dropped).
    fileprivate func end(_ key: Key) {
        cond.lock()
        Self.release(&unqueued, key.uid)
        release(key)
        cond.unlock()
    }

    /// When the latest answered unlink in the directory `dir` came (wall
    /// clock, ns), while burials are pending there; nil when none is. An
    /// unlink between its answer and its queue counts as now. Never earlier
    /// than what it said before for the same pending burials.
    func latestUnlink(in dir: InodeKey) -> UInt64? {
        if isEmpty { return nil }
        cond.lock()
        defer { cond.unlock() }
        guard let pending = directories[dir] else { return nil }
        if Int(pending) > queues[dir]?.count ?? 0 { latest[dir] = max(latest[dir] ?? 0, Sys.wallClockNow()) }
        return latest[dir]
    }

    /// Whether `name` in the directory `dir` has a burial pending: an
    /// answered unlink whose name is still in the backing directory.
    func isPending(_ dir: InodeKey, _ name: UnsafePointer<CChar>) -> Bool {
        if isEmpty { return false }
        let h = Self.hash(dir, name)
        cond.lock()
        defer { cond.unlock() }
        return names[h] != nil
    }

    /// Ends the burials of files that left with their directory.
    fileprivate func end(_ taken: [Queued]) {
        cond.lock()
        for q in taken { release(q.key) }
        cond.unlock()
    }

    /// Returns once `name` in `dir` has no burial pending, landing a queued one.
    @inline(__always)
    func waitForName(_ dir: Inode, _ name: UnsafePointer<CChar>) {
        if isEmpty { return }
        let h = Self.hash(dir.key, name)
        cond.lock()
        while names[h] != nil {
            if let i = queues[dir.key]?.firstIndex(where: { $0.key.nameHash == h }) {
                let q = queues[dir.key]!.remove(at: i)
                if queues[dir.key]!.isEmpty { queues[dir.key] = nil }
                let one = [q]
                uncount(one)
                landNow(one)
            } else {
                park()
            }
        }
        cond.unlock()
    }

    /// Returns once no entry of the directory `key` has a burial pending,
    /// landing its queued ones.
    @inline(__always)
    func waitForDirectory(_ key: InodeKey) {
        if isEmpty { return }
        cond.lock()
        while directories[key] != nil {
            if let q = takeQueue(key) { landNow(q) } else { park() }
        }
        cond.unlock()
    }

    /// Burials taken from a directory's queue for its rmdir: each must land,
    /// or go with the directory into the graveyard, exactly once. The type
    /// keeps that: its only exits are `land` and `wentWithDirectory`, and
    /// one dropped without either asserts in a debug build (and lands them).
    struct Taken: ~Copyable {
        let items: [Queued]
        private let owner: Unmanaged<DeferredBurials>
        /// Set by either exit, so `deinit` knows the burials were seen to.
        private var over = false

        fileprivate init(_ items: [Queued], owner: DeferredBurials) {
            self.items = items
            self.owner = Unmanaged.passUnretained(owner)
        }

        var isEmpty: Bool { items.isEmpty }

        /// Renames each into the graveyard now, one by one.
        consuming func land() {
            over = true
            if !items.isEmpty { owner.takeUnretainedValue().land(items) }
        }

        /// Lands those `alone` picks, one by one; the rest stay taken.
        consuming func landing(where alone: (Queued) -> Bool) -> Taken {
            over = true
            var rest: [Queued] = [], now: [Queued] = []
            for q in items { if alone(q) { now.append(q) } else { rest.append(q) } }
            if !now.isEmpty { owner.takeUnretainedValue().land(now) }
            return Taken(rest, owner: owner.takeUnretainedValue())
        }

        /// They went into the graveyard with their directory: their burials are over.
        consuming func wentWithDirectory() {
            over = true
            if !items.isEmpty { owner.takeUnretainedValue().end(items) }
        }

        deinit {
            guard !over else { return }
            assertionFailure("burials taken from a directory were neither landed nor buried with it")
            if !items.isEmpty { owner.takeUnretainedValue().land(items) }
        }
    }

    /// For rmdir: takes the burials queued in the directory `key` (to land or
    /// to bury with it), once none of its other burials is in flight.
    func takeDirectory(_ key: InodeKey) -> Taken {
        if isEmpty { return Taken([], owner: self) }
        cond.lock()
        defer { cond.unlock() }
        var taken: [Queued] = []
        while true {
            if let q = takeQueue(key) { taken += q }
            // What is still counted beyond the taken ones is being landed elsewhere.
            if Int(directories[key] ?? 0) <= taken.count { return Taken(taken, owner: self) }
            park()
        }
    }

    /// A directory that gets a new entry is in use, not being emptied by
    /// `rm -rf`: lands what is queued in it (called after the reply), so it
    /// does not keep up to `maxAgeNanoseconds` of removed names that every
    /// lookup and create in it must search past. (A create-rename-unlink
    /// loop made ext4's directory search a tenth of the daemon's time.)
    func landQueue(of dir: Inode) {
        if isEmpty { return }
        cond.lock()
        if let q = takeQueue(dir.key) { landNow(q) }
        cond.unlock()
    }

    /// Lands burials taken with `takeDirectory` one by one.
    fileprivate func land(_ taken: [Queued]) {
        cond.lock()
        landNow(taken)
        cond.unlock()
    }

    /// Lands every burial queued now, without waiting for those still in
    /// their handlers: an answered unlink is then in place.
    func landQueued() {
        if isEmpty { return }
        cond.lock()
        for key in Array(queues.keys) {
            if let q = takeQueue(key) { landNow(q) }
        }
        cond.unlock()
    }

    /// Lands the queued burials `uid` made that go to their trash, and no
    /// one else's: listing one's own trash folder in a loop must not land
    /// another user's `rm -rf` file by file instead of keeping each
    /// directory whole. `answered`: first waits until each burial `uid`
    /// began is queued or over (its unlink may be answered already), for
    /// a listing through the control socket, which the unlink's handler
    /// can still be ahead of.
    func landQueued(keptFor uid: uid_t, answered: Bool = false) {
        if isEmpty { return }
        cond.lock()
        while answered && unqueued[uid] != nil { park() }
        for key in Array(queues.keys) {
            guard let q = queues[key], q.contains(where: { Self.isKept($0, for: uid) }) else { continue }
            if q.allSatisfy({ Self.isKept($0, for: uid) }) {
                if let all = takeQueue(key) { landNow(all) }
                continue
            }
            let mine = q.filter { Self.isKept($0, for: uid) }
            queues[key] = q.filter { !Self.isKept($0, for: uid) }
            uncount(mine)
            landNow(mine)
        }
        cond.unlock()
    }

    /// The queued burials with trash records, by unlinker (for the status).
    func queuedKeptByUser() -> [uid_t: Int] {
        if isEmpty { return [:] }
        cond.lock()
        defer { cond.unlock() }
        var counts: [uid_t: Int] = [:]
        for q in queues.values { for item in q where item.record != nil { counts[item.caller.uid, default: 0] += 1 } }
        return counts
    }

    private static func isKept(_ q: Queued, for uid: uid_t) -> Bool { q.record != nil && q.caller.uid == uid }

    /// Returns once every burial begun so far has landed.
    func drain() {
        if isEmpty { return }
        cond.lock()
        while outstanding.load(ordering: .relaxed) > 0 {
            if let key = queues.keys.first, let q = takeQueue(key) { landNow(q) } else { park() }
        }
        cond.unlock()
    }

    /// Lands everything and stops the flusher (the session has ended).
    func stop() {
        cond.lock()
        stopping = true
        cond.broadcast()
        cond.unlock()
        drain()
    }

    // MARK: With the lock held

    private func takeQueue(_ key: InodeKey) -> [Queued]? {
        guard let q = queues.removeValue(forKey: key) else { return nil }
        uncount(q)
        return q
    }

    /// Takes `items`, out of their queue, off the counts.
    private func uncount(_ items: [Queued]) {
        queuedCount -= items.count
        let bytes = items.reduce(UInt64(0)) { $0 &+ ($1.record?.bytes ?? 0) }
        if bytes > 0 { keptBytesQueued.subtract(bytes, ordering: .relaxed) }
    }

    /// Lands `items` with the lock released meanwhile, then ends their tickets.
    private func landNow(_ items: [Queued]) {
        let land = self.land, landed = self.landed
        cond.unlock()
        for q in items { land?(q) }
        // The items of one call share a directory, or come in runs of one.
        var last: Inode?
        for q in items where q.directory !== last {
            last = q.directory
            landed?(q.directory)
        }
        cond.lock()
        for q in items { release(q.key) }
    }

    private func release(_ key: Key) {
        Self.release(&names, key.nameHash)
        Self.release(&directories, key.directory)
        if directories[key.directory] == nil { latest[key.directory] = nil }
        // Under the lock, so no unlink can begin (and write its intent) meanwhile.
        if outstanding.subtract(1, ordering: .releasing).newValue == 0 { intents?.compactIfLarge() }
        if waiters > 0 { cond.broadcast() }
    }

    /// Sleeps until a burial ends or is queued.
    private func park() {
        Workers.mayBlock()
        waiters += 1
        cond.wait()
        waiters -= 1
    }

    /// The flusher: lands each directory's queue once the directory has been
    /// quiet long enough, or its oldest burial has waited too long.
    private func flush() {
        cond.lock()
        while !stopping {
            guard queuedCount > 0 else {
                flusherIdle = true
                cond.wait()
                flusherIdle = false
                continue
            }
            let now = Condition.now()
            var due: [InodeKey] = []
            var next = UInt64.max
            for (key, q) in queues {
                let at = min(q.last!.since &+ Self.quiet.nanoseconds, q.first!.since &+ Self.maxAge.nanoseconds)
                if at <= now { due.append(key) } else { next = min(next, at) }
            }
            for key in due {
                if let q = takeQueue(key) { landNow(q) }
            }
            if due.isEmpty { _ = cond.wait(until: next) }
        }
        cond.unlock()
    }

    private static func release<K: Hashable>(_ counts: inout [K: Int32], _ key: K) {
        guard let n = counts[key] else { return }
        if n <= 1 { counts[key] = nil } else { counts[key] = n - 1 }
    }

    /// FNV-1a over the directory's identity and the name.
    @inline(__always)
    static func hash(_ dir: InodeKey, _ name: UnsafePointer<CChar>) -> UInt64 {
        var h = FNV1a()
        h.add(UInt64(dir.dev))
        h.add(UInt64(dir.ino))
        h.add(cString: name)
        return h.value
    }
}
