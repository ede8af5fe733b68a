import CLinux
import Dispatch
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// This client's lease on its state, and the watch on the other clients'.
///
/// The lease is a small file, `.vanish/clients/<id>/lease`, rewritten every
/// quarter of the lease length (at most 5 s apart) with a new beat count. Another client judges
/// a lease by its own monotonic clock, never by the file's times: a lease
/// whose contents have not changed for a whole lease length since this
/// client first saw them has expired, whatever the clocks of the machines
/// say. Its graveyard is then claimed (`Graveyard.claim`), absorbed and
/// reaped here. A client seen for the first time is given a full lease
/// length from then, so a survivor that restarts waits once before adopting.
public final class ClientLeases: @unchecked Sendable {
    public static let fileName = "lease"
    /// What a status report says about another client.
    public struct Peer: Sendable {
        public var client: ClientID
        /// Seconds since this client last saw its lease change (since it first looked, if never).
        public var silentSeconds: Double
        public var expired: Bool
        /// Entries waiting in its graveyard.
        public var entries: Int
    }

    public let graveyard: Graveyard
    /// ns without a beat after which a client is taken for gone.
    public let length: UInt64
    private let leaseFD: Int32
    private var beat: UInt64 = 0
    /// What the lease thread and the mount share.
    private struct State {
        var adopting: Bool
        /// The last contents seen of each other client's lease, and when
        /// (monotonic ns) they were first seen so.
        var seen: [ClientID: (contents: [UInt8], since: UInt64)] = [:]
        var stopping = false
        var lastPeers: [Peer] = []
        var running = false
    }
    private let state: Guarded<State>
    private let done = DispatchSemaphore(value: 0)
    /// Called on the lease thread with the shard of each entry adopted.
    public var landed: (@Sendable (Int) -> Void)?
    /// Called on the lease thread after a graveyard was claimed (client, entries moved in).
    public var adopted: (@Sendable (ClientID, Int) -> Void)?

    /// Opens (or makes) this client's lease file. `adopting`: take over the
    /// graveyards of clients whose lease expired (a serving mount does; a
    /// `vanish reap` does only when told which).
    public init(graveyard: Graveyard, length: UInt64, adopting: Bool) throws(Errno) {
        self.graveyard = graveyard
        self.length = max(length, Duration.seconds(1).nanoseconds)
        state = Guarded(State(adopting: adopting))
        leaseFD = try Sys.openat(graveyard.stateFD, ClientLeases.fileName, O_RDWR | O_CREAT | O_NOFOLLOW, 0o600)
        renew()
    }

    deinit { Sys.close(leaseFD) }

    /// Writes the next beat: host, pid and a count, whole in one pwrite.
    public func renew() {
        beat &+= 1
        var host = [CChar](repeating: 0, count: 256)
        gethostname(&host, host.count - 1)
        let hostName = String(decoding: host.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        let line = Array("\(hostName) pid=\(getpid()) beat=\(beat)\n".utf8)
        _ = line.withUnsafeBytes { pwrite(leaseFD, $0.baseAddress, $0.count, 0) }
        _ = ftruncate(leaseFD, off_t(line.count))
    }

    /// Starts the lease thread: renew, look at the others, adopt, absorb.
    public func start() {
        state.withLock { $0.running = true }
        spawnThread("vanish-lease") { [self] in
            while true {
                renew()
                tick()
                let deadline = Condition.now() &+ ClientLeases.period(length)
                if state.wait(until: { $0.stopping }, deadline: deadline) { break }
            }
            done.signal()
        }
    }

    /// No more adopting (the mount ended): only the lease is kept.
    public func stopAdopting() {
        state.withLock { $0.adopting = false }
    }

    /// How often the lease is renewed and the others looked at: four times a
    /// length, and at least every 5 s, so what `vanish reap --adopt` claimed
    /// for this mount is soon taken in.
    static func period(_ length: UInt64) -> UInt64 { min(length / 4, Duration.seconds(5).nanoseconds) }

    /// Stops the lease thread (the lease then expires on its own).
    public func stop() {
        let wasRunning = state.update { s in
            s.stopping = true
            defer { s.running = false }
            return s.running
        }
        if wasRunning { done.wait() }
    }

    /// One look: absorbs what was adopted (also by `vanish reap --adopt`),
    /// then claims and absorbs the graveyards of expired clients.
    public func tick() {
        absorb()
        let peers = observe()
        let adopts = state.withLock { s in
            s.lastPeers = peers
            return s.adopting
        }
        guard adopts else { return }
        for peer in peers where peer.expired && peer.entries > 0 {
            if (try? graveyard.claim(peer.client)) == true {
                let n = absorb()
                adopted?(peer.client, n)
            }
        }
    }

    @discardableResult
    private func absorb() -> Int {
        guard graveyard.hasIncoming else { return 0 }
        return graveyard.absorbAdopted { [landed] shard in landed?(shard) }
    }

    /// The other clients as the lease thread last saw them (at most 5 s
    /// ago): what `vanish status` shows, without scanning the volume in a
    /// request handler.
    public var peers: [Peer] { state.withLock { $0.lastPeers } }

    /// Reads every other client's lease and updates what was seen.
    public func observe() -> [Peer] {
        let now = Condition.now()
        var peers: [Peer] = []
        for other in graveyard.clients() where other != graveyard.client {
            let contents = readLease(other)
            let entry = state.withLock { s in
                var entry = s.seen[other] ?? (contents, now)
                if entry.contents != contents { entry = (contents, now) }
                s.seen[other] = entry
                return entry
            }
            let silent = now &- entry.since
            peers.append(Peer(client: other, silentSeconds: Duration.nanoseconds(silent).inSeconds, expired: silent >= length,
                              entries: graveyard.pendingEntries(of: other)))
        }
        return peers
    }

    private func readLease(_ other: ClientID) -> [UInt8] {
        guard let dir = try? Graveyard.openDirectory(graveyard.sharedFD, [Graveyard.clientsDirectoryName, other.name]) else {
            return []
        }
        guard let fd = try? Sys.opened(dir.raw, ClientLeases.fileName, O_RDONLY | O_NOFOLLOW) else { return [] }
        var buffer = [UInt8](repeating: 0, count: 512)
        let n = read(fd.raw, &buffer, buffer.count)
        return n > 0 ? Array(buffer[..<n]) : []
    }
}
