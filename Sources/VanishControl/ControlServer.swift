import CLinux
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import VanishClient
import VanishEvents
import VanishFS

/// The mount's control socket: `vanish trash`, `vanish restore` and
/// `vanish events` talk to the daemon through it. Each peer is identified
/// by SO_PEERCRED, and everything it sees or does is checked against those
/// credentials, never the daemon's own.
public final class ControlServer: Sendable {
    public let path: String
    private let mount: MountControl
    private let log: Logger
    private let listener: Int32
    /// `stop` writes to this pipe to wake the control thread's poll.
    private let wakeReader: Int32
    private let wakeWriter: Int32
    private let state = Mutex<(connections: Int, perUser: [uid_t: Int], stopped: Bool)>((0, [:], false))
    /// More peers than this at once are turned away.
    static let maxConnections = 128
    /// Most connections one user other than root and the daemon's own may
    /// hold; all such users together leave `reserved` for those two, so
    /// nobody can lock root out by holding connections open.
    static let maxPerUser = 16
    static let reserved = 16
    /// A peer must send its request within this many seconds of connecting.
    static let requestTimeout = Duration.seconds(5)
    /// A peer reading its answer is dropped after this long without taking
    /// a byte: the socket wakes a writer only once half its buffer is free,
    /// so a slow reader makes progress in steps seconds apart.
    static let answerIdleTimeout = Duration.seconds(30)
    /// Requests being answered, by user (see `Lanes`).
    private let lanes = Mutex(Lanes())

    /// Answers are made off the control thread, one lane per user: a lane
    /// answers its user's requests one after another on a thread of its own,
    /// so a user's long request (a restore of 50,000 entries) delays only
    /// that user's next ones, never another user's. The control thread only
    /// reads requests and writes answers, without blocking.
    private struct Lanes {
        /// Requests waiting, by lane (uid; nil: a peer without credentials).
        var waiting: [uid_t?: [Job]] = [:]
        /// Lanes with a thread answering.
        var busy: Set<uid_t?> = []
        /// Answers made, by peer, for the control thread to send.
        var done: [Int: [UInt8]] = [:]
    }

    private struct Job: @unchecked Sendable {
        let peer: Int
        let operation: ControlProtocol.Operation?
        let request: JSON
        let credentials: Credentials
    }

    /// Serves `socket` (listening already) for the mount `mount`.
    package init(socket: ControlSocket, mount: MountControl, logger: Logger) throws(Failure) {
        path = socket.path
        listener = socket.listener
        self.mount = mount
        log = logger
        var pipeFDs: [Int32] = [-1, -1]
        guard pipe(&pipeFDs) == 0 else {
            let e = errno
            socket.discard()
            throw Failure("cannot make the control socket's wake-up pipe: \(String(cString: strerror(e)))")
        }
        for end in pipeFDs { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        (wakeReader, wakeWriter) = (pipeFDs[0], pipeFDs[1])
    }

    /// A directory for control sockets: /run/vanish for root, the user's
    /// runtime directory (or /tmp/vanish-UID) otherwise; made owner-only
    /// for users, searchable by all for root (the socket's mode decides).
    public static func socketDirectory() -> String {
        let uid = getuid()
        var dir: String
        if uid == 0 {
            dir = "/run/vanish"
            mkdir(dir, 0o755)
        } else if let env = getenv("XDG_RUNTIME_DIR"), case let runtime = String(cString: env), access(runtime, W_OK) == 0 {
            dir = runtime + "/vanish"
            mkdir(dir, 0o700)
        } else {
            dir = "/tmp/vanish-\(uid)"
            mkdir(dir, 0o700)
        }
        var st = stat()
        // Never use a directory someone else planted, or could write in.
        if lstat(dir, &st) != 0 || st.st_uid != uid || st.st_mode & S_IFMT != S_IFDIR || st.st_mode & 0o022 != 0 {
            // A fresh owner-only directory nobody can have planted (mkdtemp).
            var template = Array("/tmp/vanish-\(uid)-XXXXXX".utf8CString)
            if let made = mkdtemp(&template) { dir = String(cString: made) }
        }
        return dir
    }

    /// Removes the sockets in `dir` that nobody listens on any more (their
    /// daemons were killed before they could remove them): a connection to
    /// such a socket is refused. Returns how many went.
    @discardableResult
    public static func removeStaleSockets(in dir: String) -> Int {
        guard let d = opendir(dir) else { return 0 }
        defer { closedir(d) }
        var removed = 0
        while let e = readdir(d) {
            let name = withUnsafePointer(to: e.pointee.d_name) { String(cString: UnsafeRawPointer($0).assumingMemoryBound(to: CChar.self)) }
            guard name.hasSuffix(".sock") else { continue }
            let path = dir + "/" + name
            var st = stat()
            guard lstat(path, &st) == 0, st.st_mode & S_IFMT == S_IFSOCK, st.st_uid == getuid() else { continue }
            let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
            guard fd >= 0 else { continue }
            let rc = ControlClient.withAddress(path) { connect(fd, $0, $1) }
            let refused = rc == -1 && errno == ECONNREFUSED
            close(fd)
            if refused && unlink(path) == 0 { removed += 1 }
        }
        return removed
    }

    deinit { close(wakeWriter) }

    /// Why the socket could not be set up.
    public struct Failure: Error, CustomStringConvertible {
        public let description: String
        package init(_ description: String) { self.description = description }
    }

    /// Starts accepting (after any fork: threads don't survive it), with a
    /// small process that removes the socket file once this one is gone:
    /// after a SIGKILL it would be left for the next mount to sweep.
    public func start() {
        spawnThread("vanish-control") { [self] in serveLoop() }
        let argv = CommandLine.unsafeArgv
        let first = argv[0]
        let last = argv[Int(CommandLine.argc) - 1]
        let length = first.flatMap { f in last.map { UnsafeRawPointer($0) - UnsafeRawPointer(f) + strlen($0) + 1 } } ?? 0
        if vanish_fork_unlinker(path, first, length) < 0 {
            log.warning("no process to remove the control socket if the daemon is killed",
                        metadata: ["error": "\(String(cString: strerror(errno)))"])
        }
    }

    /// Stops accepting and removes the socket file, then gives the peers
    /// being served up to 2 s to finish: event streams, whose journal has
    /// closed by now, still owe their subscribers the `end` line.
    public func stop() {
        state.withLock { $0.stopped = true }
        var byte: UInt8 = 1
        _ = Glibc.write(wakeWriter, &byte, 1)
        unlink(path)
        for _ in 0..<200 where state.withLock({ $0.connections }) > 0 { usleep(10_000) }
    }

    /// A peer the control thread serves: reading its request, then writing
    /// the answer (an event stream moves to a thread of its own instead).
    private struct Peer {
        let conn: Connection
        /// The account it counts as (`SubordinateIDs`), for limits and lanes; not for rights.
        let uid: uid_t?
        /// Names it to its lane's answer.
        let serial: Int
        var input: [UInt8] = []
        var output: [UInt8] = []
        var sent = 0
        /// Its request is in its user's lane: neither read nor timed out meanwhile.
        var waiting = false
        /// It is dropped at this time (`Condition.now()` ns) if not done.
        var deadline: UInt64
        var answering: Bool { !output.isEmpty }
    }

    /// The control thread: one poll loop accepts peers, reads their
    /// requests, answers them and writes the answers, all without blocking,
    /// so idle or slow peers hold no thread; each has `requestTimeout`
    /// to send its request and `answerIdleTimeout` for each part of the answer it reads.
    /// Only an event stream, which lasts, gets a thread.
    private func serveLoop() {
        var peers: [Peer] = []
        var accepting = Acceptance()
        defer {
            for p in peers { finished(p.uid) }
            close(listener)
            close(wakeReader)
            if accepting.spare >= 0 { close(accepting.spare) }
        }
        var serial = 0
        while !state.withLock({ $0.stopped }) {
            // Answers the lanes made since the last pass go out now.
            let answers = lanes.withLock { l in
                defer { l.done = [:] }
                return l.done
            }
            for i in peers.indices where peers[i].waiting {
                guard let output = answers[peers[i].serial] else { continue }
                peers[i].waiting = false
                peers[i].output = output
                peers[i].deadline = Condition.now() + ControlServer.answerIdleTimeout.nanoseconds
            }
            let listening = Condition.now() >= accepting.pausedUntil
            var fds = [pollfd(fd: listening ? listener : -1, events: Int16(POLLIN), revents: 0),
                       pollfd(fd: wakeReader, events: Int16(POLLIN), revents: 0)]
            for p in peers {
                // A peer waiting for its answer is not polled (-1): what it sends meanwhile waits.
                fds.append(pollfd(fd: p.waiting ? -1 : p.conn.fd, events: Int16(p.answering ? POLLOUT : POLLIN), revents: 0))
            }
            let now = Condition.now()
            let next = (peers.filter { !$0.waiting }.map(\.deadline) + (listening ? [] : [accepting.pausedUntil])).min()
                .map { Int32(clamping: Duration.between(now, $0).roundedUpMilliseconds + 1) } ?? -1
            let n = poll(&fds, nfds_t(fds.count), next)
            if n < 0 && errno != EINTR {
                log.error("control socket stopped serving", metadata: ["errno": "\(errno)"])
                return
            }
            if fds[1].revents & Int16(POLLIN) != 0 {
                var drain = [UInt8](repeating: 0, count: 64)
                _ = Glibc.read(wakeReader, &drain, drain.count)
            }
            let at = Condition.now()
            var kept: [Peer] = []
            // Fair to users: one request of each user is read and answered
            // per pass; a user's further requests wait for the next pass,
            // so one user's many connections delay another's by one answer.
            var served: Set<uid_t> = []
            for (i, var p) in peers.enumerated() {
                // Each branch either keeps the peer or lets it go (and counts it gone) once.
                if p.waiting {
                    kept.append(p)
                } else if fds[i + 2].revents != 0 && !p.answering, let uid = p.uid, served.contains(uid) {
                    kept.append(p)
                } else if fds[i + 2].revents != 0 {
                    if !p.answering, let uid = p.uid { served.insert(uid) }
                    if p.answering ? writeSome(&p) : readSome(&p) { kept.append(p) }
                } else if at < p.deadline {
                    kept.append(p)
                } else if p.answering {
                    finished(p.uid)
                } else {
                    refuse(p, "expected one JSON object on one line within \(ControlServer.requestTimeout.components.seconds) s", EINVAL)
                }
            }
            peers = kept
            if fds[0].revents & Int16(POLLIN) != 0, let p = acceptPeer(serial: serial, &accepting) {
                peers.append(p)
                serial &+= 1
            }
        }
    }

    /// What lets the control thread accept when the daemon has no
    /// descriptor left. A peer accept cannot take stays queued, and poll
    /// reports the listener readable at once, pass after pass: the thread
    /// spun and the peer (root's `trash list` too) waited for ever.
    struct Acceptance {
        /// Given up to accept a peer then, which is told so and closed.
        var spare = open("/dev/null", O_RDONLY | O_CLOEXEC)
        /// Where even that failed: the listener rests until then (`Condition.now()` ns).
        var pausedUntil: UInt64 = 0
        static let pause = Duration.milliseconds(100)
    }

    /// Accepts one peer, or turns it away when it would pass a limit.
    private func acceptPeer(serial: Int, _ accepting: inout Acceptance) -> Peer? {
        let fd = accept(listener, nil, nil)
        guard fd >= 0 else {
            guard errno == EMFILE || errno == ENFILE else { return nil }
            if accepting.spare >= 0 {
                close(accepting.spare)
                let turned = accept(listener, nil, nil)
                if turned >= 0 {
                    // A fresh socket's buffer always takes one short line.
                    Connection(fd: turned).write(["error": JSON("the mount is out of file descriptors; try again later"),
                                                  "errno": JSON(EMFILE)])
                }
                accepting.spare = open("/dev/null", O_RDONLY | O_CLOEXEC)
                if turned >= 0 { return nil }
            }
            accepting.pausedUntil = Condition.now() + Acceptance.pause.nanoseconds
            return nil
        }
        _ = fcntl(fd, F_SETFD, FD_CLOEXEC)
        _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)
        let peerUID = Connection.peerUID(fd)
        let privileged = peerUID == 0 || peerUID == getuid()
        // Limits and lanes are per account: one with subordinate uids is one user here.
        let uid = peerUID.map { SubordinateIDs.shared.owner(of: $0) }
        let refusal: String? = state.withLock { s in
            if s.connections >= ControlServer.maxConnections { return "too many connections to this mount's control socket" }
            if !privileged, let uid {
                if s.perUser[uid, default: 0] >= ControlServer.maxPerUser {
                    return "too many connections from this user (\(ControlServer.maxPerUser) at most)"
                }
                let others = s.perUser.filter { $0.key != 0 && $0.key != getuid() }.values.reduce(0, +)
                if others >= ControlServer.maxConnections - ControlServer.reserved {
                    return "too many connections to this mount's control socket"
                }
            }
            s.connections += 1
            if let uid { s.perUser[uid, default: 0] += 1 }
            return nil
        }
        let conn = Connection(fd: fd)
        if let refusal {
            // A fresh socket's buffer always takes one short line.
            conn.write(["error": JSON(refusal + "; try again later"), "errno": JSON(EAGAIN)])
            return nil
        }
        return Peer(conn: conn, uid: uid, serial: serial, deadline: Condition.now() + ControlServer.requestTimeout.nanoseconds)
    }

    /// Reads what `p` sent; once its request is in, answers it. False when it is done with.
    private func readSome(_ p: inout Peer) -> Bool {
        var chunk = [UInt8](repeating: 0, count: 4096)
        let n = chunk.withUnsafeMutableBytes { recv(p.conn.fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
        if n < 0 && (errno == EAGAIN || errno == EINTR) { return true }
        if n > 0 { p.input += chunk[..<n] }
        let line = p.input.firstIndex(of: 0x0A).map { Array(p.input[..<$0]) }
        guard line != nil || n <= 0 || p.input.count >= 65536 else { return true }
        let request = JSON.parse(line ?? p.input).flatMap { $0.object != nil ? $0 : nil }
        guard let request, let peer = p.conn.peer() else {
            refuse(p, "expected one JSON object on one line within \(ControlServer.requestTimeout.components.seconds) s", EINVAL)
            return false
        }
        let operation = request["op"]?.string.flatMap(ControlProtocol.Operation.init(rawValue:))
        if operation == .events {
            // A stream lasts: it gets a thread, and blocking writes to its subscriber.
            let (conn, uid) = (p.conn, p.uid)
            _ = fcntl(conn.fd, F_SETFL, fcntl(conn.fd, F_GETFL) & ~O_NONBLOCK)
            spawnThread("vanish-events") { [self] in
                streamEvents(conn, request, peer)
                finished(uid)
            }
            return false
        }
        p.waiting = true
        submit(Job(peer: p.serial, operation: operation, request: request, credentials: peer), lane: p.uid)
        return true
    }

    /// Queues `job` in its user's lane, starting the lane's thread if it has none.
    private func submit(_ job: Job, lane: uid_t?) {
        let start = lanes.withLock { l in
            l.waiting[lane, default: []].append(job)
            return l.busy.insert(lane).inserted
        }
        guard start else { return }
        spawnThread("vanish-ctl-lane") { [self] in
            while let job = lanes.withLock({ l -> Job? in
                guard var queue = l.waiting[lane], !queue.isEmpty else {
                    l.waiting[lane] = nil
                    l.busy.remove(lane)
                    return nil
                }
                let job = queue.removeFirst()
                l.waiting[lane] = queue
                return job
            }) {
                let output = Array((answer(job.operation, job.request, job.credentials).serialized + "\n").utf8)
                lanes.withLock { $0.done[job.peer] = output }
                var byte: UInt8 = 1
                _ = Glibc.write(wakeWriter, &byte, 1)
            }
        }
    }

    /// Writes what the socket takes of `p`'s answer. False once all is sent or the peer is gone.
    private func writeSome(_ p: inout Peer) -> Bool {
        while p.sent < p.output.count {
            let n = p.output[p.sent...].withUnsafeBytes {
                Glibc.send(p.conn.fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL) | Int32(MSG_DONTWAIT))
            }
            if n < 0 {
                if errno == EINTR { continue }
                if errno == EAGAIN { return true }
                break
            }
            p.sent += n
            // A slow reader of a long answer is not idle: its time counts from the last byte it took.
            p.deadline = Condition.now() + ControlServer.answerIdleTimeout.nanoseconds
        }
        finished(p.uid)
        return false
    }

    /// Tells a peer why it is dropped (if its socket takes it) and lets it go.
    private func refuse(_ p: Peer, _ why: String, _ errno: Int32) {
        let line: JSON = ["error": JSON(why), "errno": JSON(errno)]
        _ = p.conn.send(Array((line.serialized + "\n").utf8), wait: false)
        finished(p.uid)
    }

    /// A peer that counted against the limits is gone.
    private func finished(_ uid: uid_t?) {
        state.withLock { s in
            s.connections -= 1
            if let uid {
                s.perUser[uid, default: 1] -= 1
                if s.perUser[uid] == 0 { s.perUser[uid] = nil }
            }
        }
    }

    /// The answer to a request other than `events`.
    private func answer(_ operation: ControlProtocol.Operation?, _ request: JSON, _ peer: Credentials) -> JSON {
        switch operation {
        case .trashList:
            let kept = UndoWindow(mount: mount).trash(for: peer)
            let shadowed = mount.shadowed(kept)
            let entries = kept.map { e -> JSON in
                var o: [String: JSON] = ["id": JSON(e.id), "deleted_ns": JSON(e.deleted), "uid": JSON(e.record.uid),
                                         "gid": JSON(e.record.gid), "kind": JSON(e.record.kind.name)]
                // Its path is in a directory deleted after it: restoring that one brings back its own.
                if shadowed.contains(e.id) { o["shadowed"] = JSON(true) }
                if let held = e.record.held { o["held"] = JSON(held.explanation) }
                // A held entry holds what its deleter could not remove, and a
                // directory not theirs may be one they cannot list: its measure
                // (taken with the daemon's rights) is root's to see, as `du`
                // would show them.
                guard peer.uid == 0 || (e.record.held == nil && (e.record.kind != .directory || mount.owner(of: e) == peer.uid)) else {
                    PathBytes(e.record.path).put(into: &o, key: "path")
                    return .object(o)
                }
                if let b = e.record.bytes { o["bytes"] = JSON(b) }
                if let size = mount.apparentSize(of: e) { o["size"] = JSON(size) }
                if let inside = mount.contents(of: e), inside.files + inside.directories > 0 {
                    o["files_inside"] = JSON(inside.files)
                    o["directories_inside"] = JSON(inside.directories)
                }
                PathBytes(e.record.path).put(into: &o, key: "path")
                return .object(o)
            }
            return ["ok": true, "entries": .array(entries)]
        case .trashEmpty:
            let ids = (request["ids"]?.array ?? []).compactMap(\.string)
            let paths = (request["paths"]?.array ?? []).compactMap { PathBytes.get($0, key: "path")?.bytes }
            let olderThan = request["older_than_ns"]?.uint64
            let (chosen, unknown) = UndoWindow(mount: mount).choose(ids: ids, paths: paths, olderThan: olderThan,
                                                                               for: peer)
            let (count, bytes) = mount.letGo(chosen)
            if count > 0 { log.info("trash emptied", metadata: ["uid": "\(peer.uid)", "entries": "\(count)"]) }
            return ["ok": true, "emptied": JSON(count), "bytes": JSON(bytes),
                    "unknown": .array(unknown.map { u -> JSON in
                        var o: [String: JSON] = [:]
                        PathBytes(u).put(into: &o, key: "name")
                        return .object(o)
                    })]
        case .restore:
            let id = request["id"]?.string
            let path = PathBytes.get(request, key: "path")
            let to = PathBytes.get(request, key: "to")
            do {
                let restored = try UndoWindow(mount: mount).restore(id: id, path: path?.bytes, to: to?.bytes, as: peer)
                log.info("restored", metadata: ["uid": "\(peer.uid)", "entries": "\(restored.count)"])
                return ["ok": true, "restored": .array(restored.map { p -> JSON in
                    var o: [String: JSON] = [:]
                    PathBytes(p).put(into: &o, key: "path")
                    return .object(o)
                })]
            } catch {
                return ["error": JSON(error.description), "errno": JSON(error.errno)]
            }
        case .events, nil:
            let known = ControlProtocol.Operation.allCases.map(\.rawValue).joined(separator: ", ")
            return ["error": JSON("unknown request; this daemon knows: \(known)"), "errno": JSON(EINVAL)]
        }
    }
}

extension ControlServer {
    static let streamScope = """
        changes made through this mount only; on a source other clients share, follow each client's \
        mount, and rescan (--snapshot) after a reset
        """

    /// Streams journal lines to a subscriber until it goes away or the mount
    /// ends: from after its cursor (or a `reset` first, when the cursor cannot
    /// be served), or from now; with `snapshot`, every existing entry first.
    func streamEvents(_ conn: Connection, _ request: JSON, _ peer: Credentials) {
        guard let journal = mount.journal else {
            conn.write(["error": "this mount records no events (mounted read-only or with -o noevents)", "errno": JSON(ENOTSUP)])
            return
        }
        let types = request["types"]?.array.map { Set($0.compactMap(\.string)) }
        let prefixes = request["paths"]?.array?.compactMap { item -> [UInt8]? in
            guard let s = item.string else { return nil }
            return Array(s.utf8.drop { $0 == 0x2F }.reversed().drop { $0 == 0x2F }.reversed())
        }
        // Said first, so a consumer of a shared source knows to follow every client.
        guard conn.write(["type": JSON(EventType.stream.rawValue), "instance": JSON(journal.instance),
                          "client": mount.clientName.map { JSON($0) } ?? .null, "scope": "client",
                          "note": JSON(ControlServer.streamScope)]) else { return }
        let since = request["since"]?.string
        var reader = journal.reader(after: since)
        if reader == nil {
            reader = journal.reader(after: nil)
            let newest = journal.lastSeq
            let why = since.map { cursor -> String in
                guard let place = EventCursor(cursor), place.instance == journal.instance else { return "it is from another mount instance" }
                // A seq this journal never gave out is no lost history.
                if place.sequence > newest {
                    return "it is ahead of this journal, whose newest event is \(journal.instance):\(newest)"
                }
                return "the journal no longer holds events after it"
            }
            guard conn.write(["type": JSON(EventType.reset.rawValue), "instance": JSON(journal.instance), "cursor": JSON(journal.cursor(reader!.next - 1)),
                              "reason": JSON("cursor \(since ?? "") cannot be served: \(why ?? "")")]) else { return }
        }
        guard let reader else { return }
        if request["snapshot"]?.bool == true {
            // The reader already stands before anything that happens during the
            // scan, so nothing falls between the listing and the live events.
            let start = journal.cursor(reader.next - 1)
            guard conn.write(["type": JSON(EventType.scanStarted.rawValue), "instance": JSON(journal.instance), "cursor": JSON(start)]) else { return }
            var alive = true
            var count = 0
            TreeWalk.walk(mount, as: peer.uid == 0 ? nil : peer) { path, st, id in
                if let prefixes, !prefixes.contains(where: { ControlServer.isWithin(path, $0) }) { return true }
                var o: [String: JSON] = ["type": JSON(EventType.exists.rawValue), "kind": JSON(ControlServer.kind(st.st_mode)), "id": JSON(id),
                                         "size": JSON(st.st_size), "mode": JSON(st.st_mode & 0o7777),
                                         "owner_uid": JSON(st.st_uid), "owner_gid": JSON(st.st_gid)]
                PathBytes(path).put(into: &o, key: "path")
                count += 1
                alive = conn.write(.object(o))
                return alive
            }
            guard alive, conn.write(["type": JSON(EventType.scanCompleted.rawValue), "instance": JSON(journal.instance), "cursor": JSON(start),
                                     "entries": JSON(count)]) else { return }
        }
        let filtered = types != nil || prefixes != nil || peer.uid != 0
        var sight = Sight(peer: peer, root: mount.backingRoot)
        // Live delivery is background work: it must not take the CPU from
        // the handlers, whose every preempting wakeup costs a request.
        becomeBackgroundThread(nice: 5)
        while true {
            guard var run = reader.readRun(timeout: 1) else {
                // Said in so many words, so a subscriber tells this from a daemon that died.
                conn.write(["type": JSON(EventType.end.rawValue), "instance": JSON(journal.instance),
                            "reason": "the mount is going away: this stream ends here"])
                return
            }
            if let gap = reader.takeGap() {
                let reset: JSON = ["type": JSON(EventType.reset.rawValue), "instance": JSON(journal.instance), "cursor": JSON(journal.cursor(gap.upperBound)),
                                   "reason": JSON("the subscriber fell behind: the journal dropped events before they were read"),
                                   "skipped_from": JSON(gap.lowerBound), "skipped_to": JSON(gap.upperBound),
                                   "skipped": JSON(gap.count)]
                guard conn.write(reset) else { return }
            }
            if run.isEmpty {
                if conn.peerClosed() { return }
                continue
            }
            if filtered {
                var kept: [UInt8] = []
                var start = 0
                while let nl = run[start...].firstIndex(of: 0x0A) {
                    let line = Array(run[start...nl])
                    if let shown = visible(line, types: types, prefixes: prefixes, sight: &sight) { kept += shown }
                    start = nl + 1
                }
                run = kept
            }
            if !run.isEmpty && !conn.send(run) { return }
        }
    }

    /// What of `line` the subscriber may read: the line itself, a line
    /// rewritten to what they could see (a move into their sight is a
    /// `created`, out of it a `deleted`), or nil. Another user's change is
    /// shown only if its path was visible to others when it happened (the
    /// journal marks it otherwise) and still is to this subscriber; reaped
    /// entries and trusted.* attribute names only to root.
    private func visible(_ line: [UInt8], types: Set<String>?, prefixes: [[UInt8]]?, sight: inout Sight) -> [UInt8]? {
        if let types {
            // Journal lines carry their type at a fixed place: most lines a
            // type filter drops need no parsing at all.
            let type = line.withUnsafeBytes { EventLine.type(of: $0).map { String(decoding: $0, as: UTF8.self) } }
            if let type, !types.contains(type) { return nil }
        }
        let peer = sight.peer
        if prefixes == nil && peer.uid == 0 { return line }
        guard let parsed = JSON.parse(line), var o = parsed.object else { return nil }
        if let types, !types.contains(o["type"]?.string ?? "") { return nil }
        let paths = ControlServer.pathFields.compactMap { PathBytes.get(parsed, key: $0)?.bytes }
        if let prefixes {
            // Lifecycle events (no path) always pass; a move counts at either end.
            if !paths.isEmpty && !paths.contains(where: { p in prefixes.contains { ControlServer.isWithin(p, $0) } }) { return nil }
        }
        guard peer.uid != 0 else { return line }
        let type = o["type"]?.string
        if o["uid"]?.int == Int(peer.uid) { return ownChange(line, parsed, &o, type: type, sight: &sight) }
        if type == EventType.reaped.rawValue || type == EventType.shortened.rawValue { return nil }
        if o["xattr"]?.string?.hasPrefix("trusted.") == true { return nil }
        func seen(_ key: String) -> Bool? {
            guard let p = PathBytes.get(parsed, key: key)?.bytes else { return nil }
            return o[key + "_private"]?.bool != true && sight.mayObserve(p)
        }
        let pathSeen = seen("path"), fromSeen = seen("from")
        var rewritten = false
        func drop(_ key: String) {
            for k in [key, key + "_b64", key + "_private", key + "_id"] { o[k] = nil }
            rewritten = true
        }
        switch (pathSeen, fromSeen) {
        case (false, false), (false, nil), (nil, false): return nil
        case (true, false):
            // Moved in from where they could not see: for them it appears.
            drop("from")
            if type == EventType.renamed.rawValue { o["type"] = JSON(EventType.created.rawValue) }
        case (false, true):
            // Moved out of their sight: for them it is gone.
            guard type == EventType.renamed.rawValue else { return nil }
            for k in ["path", "path_b64"] { o[k] = o["from" + k.dropFirst(4)] }
            drop("from")
            o["path_private"] = nil
            o["type"] = JSON(EventType.deleted.rawValue)
        default: break
        }
        for key in ["target", "copied_from"] where seen(key) == false { drop(key) }
        return rewritten ? Array((JSON.object(o).serialized + "\n").utf8) : line
    }

    /// The subscriber's own change: they named its paths themselves, but for
    /// what the kernel sends by handle (a write, a truncate, a change of
    /// attributes through a descriptor), a new link's target and a copy's source, the path is
    /// the file's last-known name, perhaps one another user gave it since
    /// in a directory the subscriber cannot list (a hard link root made to
    /// their file): such a name, private when the change happened, shows
    /// only if they may see it now.
    private func ownChange(_ line: [UInt8], _ parsed: JSON, _ o: inout [String: JSON], type: String?,
                           sight: inout Sight) -> [UInt8]? {
        func hidden(_ key: String, unmarked: Bool = false) -> Bool {
            guard unmarked || o[key + "_private"]?.bool == true, let p = PathBytes.get(parsed, key: key)?.bytes else { return false }
            return !sight.mayObserve(p)
        }
        if ControlServer.byHandle.contains(type ?? ""), hidden("path") { return nil }
        // A new link's `target` is the file's last-known name too (the kernel
        // sends LINK by inode), unmarked: judged by what they may list now.
        var drops: [String] = []
        if type == EventType.linked.rawValue && hidden("target", unmarked: true) { drops.append("target") }
        if hidden("copied_from") { drops.append("copied_from") }
        guard !drops.isEmpty else { return line }
        for key in drops {
            for k in [key, key + "_b64", key + "_private", key + "_id"] { o[k] = nil }
        }
        return Array((JSON.object(o).serialized + "\n").utf8)
    }

    /// Event types whose path the kernel may send by handle, not by a name the caller gave.
    static let byHandle: Set<String> = [EventType.written.rawValue, EventType.truncated.rawValue,
                                        EventType.attributes.rawValue]

    /// Every event field that names a path in the mount: each must be one
    /// the subscriber could see, or the event is not theirs to read.
    static let pathFields = ["path", "from", "target", "copied_from"]

    /// One subscriber's view: whether they could see a path, remembered
    /// per directory for a second, so a burst of events in one deep
    /// directory costs one walk down to it, not one per event.
    struct Sight {
        let peer: Credentials
        let root: Int32
        private var verdicts: [[UInt8]: (seen: Bool, at: UInt64)] = [:]
        static let remembered = 4096
        static let lifetime = Duration.seconds(1).nanoseconds

        init(peer: Credentials, root: Int32) {
            self.peer = peer
            self.root = root
        }

        mutating func mayObserve(_ path: [UInt8]) -> Bool {
            if peer.uid == 0 { return true }
            let directory = path.lastIndex(of: 0x2F).map { Array(path[..<$0]) } ?? []
            let now = Condition.now()
            if let v = verdicts[directory], now &- v.at < Sight.lifetime { return v.seen }
            if verdicts.count >= Sight.remembered { verdicts.removeAll(keepingCapacity: true) }
            let seen = peer.mayObserve(path, under: root)
            verdicts[directory] = (seen, now)
            return seen
        }
    }

    static func isWithin(_ path: [UInt8], _ dir: [UInt8]) -> Bool {
        dir.isEmpty || path == dir || (path.count > dir.count && path[dir.count] == 0x2F && Array(path[..<dir.count]) == dir)
    }

    static func kind(_ mode: mode_t) -> String { FileID.kindName(mode) }
}

/// One accepted peer.
final class Connection: Sendable {
    let fd: Int32
    init(fd: Int32) { self.fd = fd }
    deinit { close(fd) }

    /// The uid of the peer on `fd` (SO_PEERCRED), or nil.
    static func peerUID(_ fd: Int32) -> uid_t? {
        var pid: pid_t = 0, uid: uid_t = 0, gid: gid_t = 0
        return vanish_peer_credentials(fd, &pid, &uid, &gid) == 0 ? uid : nil
    }

    /// The peer's uid, gid and groups as they were when it connected, as
    /// the kernel reports them (SO_PEERCRED, SO_PEERGROUPS).
    func peer() -> Credentials? {
        var pid: pid_t = 0, uid: uid_t = 0, gid: gid_t = 0
        guard vanish_peer_credentials(fd, &pid, &uid, &gid) == 0 else { return nil }
        var groups = [gid_t](repeating: 0, count: 32)
        var n = vanish_peer_groups(fd, &groups, Int32(groups.count))
        if n > groups.count {
            groups = [gid_t](repeating: 0, count: Int(n))
            n = vanish_peer_groups(fd, &groups, Int32(groups.count))
        }
        guard n >= 0, n <= groups.count else { return nil }
        return Credentials(uid: uid, gid: gid, groups: Array(groups.prefix(Int(n))))
    }

    /// True once the peer hung up (checked while no events flow).
    func peerClosed() -> Bool {
        var p = pollfd(fd: fd, events: Int16(POLLIN) | VANISH_POLLRDHUP, revents: 0)
        guard poll(&p, 1, 0) > 0 else { return false }
        if p.revents & (Int16(POLLHUP) | VANISH_POLLRDHUP | Int16(POLLERR)) != 0 { return true }
        var byte: UInt8 = 0
        return recv(fd, &byte, 1, Int32(MSG_PEEK) | Int32(MSG_DONTWAIT)) == 0
    }

    /// Writes one JSON line; false once the peer is gone.
    @discardableResult
    func write(_ object: JSON) -> Bool {
        send(Array((object.serialized + "\n").utf8))
    }

    /// Sends all of `bytes` (`wait`: blocking until the socket takes them); false once the peer is gone.
    func send(_ bytes: [UInt8], wait: Bool = true) -> Bool {
        var sent = 0
        let flags = Int32(MSG_NOSIGNAL) | (wait ? 0 : Int32(MSG_DONTWAIT))
        while sent < bytes.count {
            let n = bytes[sent...].withUnsafeBytes { Glibc.send(fd, $0.baseAddress, $0.count, flags) }
            if n < 0 {
                if errno == EINTR { continue }
                return false
            }
            sent += n
        }
        return true
    }
}

/// A control socket, bound and listening. It is made before the filesystem,
/// whose status attribute names it, and then served by a `ControlServer`.
package struct ControlSocket: Sendable {
    package let path: String
    fileprivate let listener: Int32

    /// Binds the socket at `path`; `shared` lets every local user connect
    /// (for allow_other mounts), otherwise only the daemon's user may.
    package static func listen(at path: String, shared: Bool) throws(ControlServer.Failure) -> ControlSocket {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw ControlServer.Failure("socket: \(String(cString: strerror(errno)))") }
        // Bound under another name and renamed once it listens, so a *.sock
        // that refuses connections is always a dead daemon's (see removeStaleSockets).
        let binding = path + ".new"
        unlink(binding)
        // Born owner-only, so nobody can connect before the mode is final.
        let old = umask(0o177)
        let bound = ControlClient.withAddress(binding) { bind(fd, $0, $1) }
        umask(old)
        guard let rc = bound else {
            close(fd)
            throw ControlServer.Failure("control socket path too long: \(path)")
        }
        guard rc == 0, Glibc.listen(fd, 64) == 0, !shared || chmod(binding, 0o666) == 0, rename(binding, path) == 0 else {
            let e = errno
            close(fd)
            unlink(binding)
            throw ControlServer.Failure("cannot listen on \(path): \(String(cString: strerror(e)))")
        }
        return ControlSocket(path: path, listener: fd)
    }

    /// Closes it unserved and removes its file (the mount was not made).
    package func discard() {
        close(listener)
        unlink(path)
    }
}
