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
/// dictionary lookup instead of a read of /proc/PID/comm (a syscall, about
/// 2.5 µs in a handler here). The notice of an exec is queued before the
/// new program's first instruction runs, and the listener runs at the
/// highest nice level, so it has forgotten the old name long before that
/// program can reach the mount. Elsewhere every event reads /proc.
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
    private let known = Mutex(Known())
    private static let most = 4096

    private init() {
        pthread_key_create(&key) { raw in
            Unmanaged<ThreadCommandNames>.fromOpaque(raw!).release()
        }
        let fd = vanish_proc_events_open(4 << 20)
        guard fd >= 0 else { return }
        known.withLock { $0.trusted = true }
        spawnThread("vanish-procs") { [self] in listen(fd) }
    }

    /// Whether names are remembered between events (the connector is open).
    var remembers: Bool { known.withLock { $0.trusted } }

    func name(of pid: pid_t) -> String {
        if pid <= 0 { return "" }
        let (name, generation, trusted): (String?, UInt64, Bool) = known.withLock { k in
            (k.trusted ? k.names[pid] : nil, k.generation, k.trusted)
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

    private func listen(_ fd: Int32) {
        // Ahead of every handler: a name must be forgotten before its
        // process's next request can arrive.
        _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, -20)
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 64 << 10, alignment: 8)
        let changed = UnsafeMutableBufferPointer<pid_t>.allocate(capacity: 4096)
        while true {
            let n = recv(fd, buffer.baseAddress, buffer.count, 0)
            let failure = n < 0 ? errno : 0
            if failure == EINTR { continue }
            let count = n < 0 ? -1 : Int(vanish_proc_events_changed(buffer.baseAddress, Int32(n), changed.baseAddress,
                                                                    Int32(changed.count)))
            known.withLock { k in
                k.generation &+= 1
                if count < 0 {
                    // Notices were lost (ENOBUFS) or not all read: nothing remembered can be trusted.
                    k.names.removeAll(keepingCapacity: true)
                    if n < 0 && failure != ENOBUFS { k.trusted = false }
                } else {
                    for pid in changed[..<count] { k.names.removeValue(forKey: pid) }
                }
            }
            if n < 0 && failure != ENOBUFS { break }
        }
        close(fd)
        buffer.deallocate()
        changed.deallocate()
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
        var buffer: (UInt64, UInt64, UInt64, UInt64) = (0, 0, 0, 0)
        return withUnsafeMutableBytes(of: &buffer) { b -> String? in
            let n = pread(fd, b.baseAddress, b.count, 0)
            guard n > 0 else { return nil }
            // Names are at most 15 bytes: a small string, no allocation.
            return String(decoding: UnsafeRawBufferPointer(rebasing: b[..<n]).prefix { $0 != 0x0A }, as: UTF8.self)
        }
    }
}
