import CLinux
import Glibc
import LinuxSyscalls
import Synchronization

/// The command name of the process behind a request, as it is when the
/// event happens. A process that execs keeps its pid but not its name
/// (`cmd > file` opens `file` as the shell, then runs as `cmd`), so a name
/// may be remembered only as long as nothing says it changed.
///
/// Where the kernel's process events connector is open to the daemon
/// (root), names are remembered by thread id and forgotten when that
/// thread execs, renames itself or exits: most events then cost a
/// dictionary lookup and one empty read of the connector's socket instead
/// of a read of /proc/PID/comm (about 2.5 µs in a handler here). The kernel
/// queues the notice of an exec or a rename on that socket before the
/// process runs on, so a lookup that first reads what is queued (under the
/// same lock as the names) can never return a name the process has
/// already given up, however loaded the machine. (A listener thread that
/// merely ran ahead of the handlers did, under load.) Elsewhere every
/// event reads /proc.
final class CommandNames: @unchecked Sendable {
    static let shared = CommandNames()

    private var key = pthread_key_t()
    private struct Known {
        /// Sized at mount: see `InodeTable.lock`.
        var names = [pid_t: String](minimumCapacity: 64)
        /// Counts forgetting, so a name read while a notice came is not kept.
        var generation: UInt64 = 0
        /// False without the connector, or once it failed.
        var trusted = false
    }
    private let known = Lock(Known())
    private static let most = 4096
    /// The connector's socket (-1 without one) and, guarded by `known`, the
    /// buffers its notices are read into.
    private let socket: Int32
    private let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 64 << 10, alignment: 8)
    private let changed = UnsafeMutableBufferPointer<pid_t>.allocate(capacity: 4096)

    private init() {
        pthread_key_create(&key) { raw in
            Unmanaged<ThreadCommandNames>.fromOpaque(raw!).release()
        }
        socket = vanish_proc_events_open(4 << 20)
        guard socket >= 0 else { return }
        known.withLock { $0.trusted = true }
        spawnThread("vanish-procs") { [self] in listen() }
    }

    /// Whether names are remembered between events (the connector is open).
    var remembers: Bool { known.withLock { $0.trusted } }

    func name(of pid: pid_t) -> String {
        if pid <= 0 { return "" }
        let (name, generation, trusted): (String?, UInt64, Bool) = known.withLock { k in
            guard k.trusted else { return (nil, k.generation, false) }
            forgetNoticed(&k)
            return (k.trusted ? k.names[pid] : nil, k.generation, k.trusted)
        }
        if let name { return name }
        let read = reader().name(of: pid)
        if trusted && !read.isEmpty {
            known.withLock { k in
                guard k.trusted && k.generation == generation else { return }
                if k.names.count >= CommandNames.most { k.names.removeAll(keepingCapacity: true) }
                k.names[pid] = read
            }
        }
        return read
    }

    /// This thread's /proc/PID/comm reader.
    private func reader() -> ThreadCommandNames {
        if let raw = pthread_getspecific(key) {
            return Unmanaged<ThreadCommandNames>.fromOpaque(raw).takeUnretainedValue()
        }
        let mine = ThreadCommandNames()
        pthread_setspecific(key, Unmanaged.passRetained(mine).toOpaque())
        return mine
    }

    /// Keeps the socket drained while no events come (a full socket loses
    /// notices: then nothing remembered is trusted until refilled).
    private func listen() {
        var p = pollfd(fd: socket, events: Int16(POLLIN), revents: 0)
        while known.withLock({ $0.trusted }) {
            if poll(&p, 1, -1) < 0 && errno != EINTR { break }
            known.withLock { forgetNoticed(&$0) }
        }
    }

    /// Reads every notice queued on the socket and forgets the names they
    /// change. With `known`'s lock held: that is what makes a lookup exact.
    private func forgetNoticed(_ k: inout Known) {
        while k.trusted {
            let n = recv(socket, buffer.baseAddress, buffer.count, Int32(MSG_DONTWAIT))
            if n < 0 {
                switch errno {
                case EAGAIN: return
                case EINTR: continue
                case ENOBUFS:
                    // Notices were lost: nothing remembered can be trusted.
                    k.generation &+= 1
                    k.names.removeAll(keepingCapacity: true)
                    continue
                default:
                    k.trusted = false
                    k.names.removeAll()
                    return
                }
            }
            let count = Int(vanish_proc_events_changed(buffer.baseAddress, Int32(n), changed.baseAddress,
                                                       Int32(changed.count)))
            k.generation &+= 1
            if count < 0 {
                k.names.removeAll(keepingCapacity: true)
            } else {
                for pid in changed[..<count] { k.names.removeValue(forKey: pid) }
            }
        }
    }
}

/// One handler thread's open /proc/PID/comm files, replaced round robin: a
/// name is read with one pread instead of open, read and close, and no
/// other thread can close an fd while it is read.
final class ThreadCommandNames {
    private static let slots = 8
    private var pids = [pid_t](repeating: 0, count: slots)
    private var fds = [Int32](repeating: -1, count: slots)
    private var next = 0

    deinit { for fd in fds where fd >= 0 { close(fd) } }

    func name(of pid: pid_t) -> String {
        if let i = pids.firstIndex(of: pid), fds[i] >= 0 {
            if let name = Self.read(fds[i]) { return name }
            // That process is gone (ESRCH): the pid now names another one.
            close(fds[i])
            fds[i] = -1
        }
        let fd = open("/proc/\(pid)/comm", O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return "" }
        let slot = next
        next = (next + 1) % Self.slots
        if fds[slot] >= 0 { close(fds[slot]) }
        pids[slot] = pid
        fds[slot] = fd
        return Self.read(fd) ?? ""
    }

    private static func read(_ fd: Int32) -> String? {
        withUnsafeTemporaryAllocation(byteCount: 32, alignment: 8) { b -> String? in
            let n = pread(fd, b.baseAddress, b.count, 0)
            guard n > 0 else { return nil }
            // Names are at most 15 bytes: a small string, no allocation.
            return String(decoding: UnsafeRawBufferPointer(rebasing: b[..<n]).prefix { $0 != 0x0A }, as: UTF8.self)
        }
    }
}
