import CLinux
import Glibc

/// Starts a detached POSIX thread running `body` (no Foundation `Thread`:
/// the daemon and the CLI do not link Foundation). `name` (at most 15
/// bytes kept, prctl PR_SET_NAME) is what `top -H`, `ps -L` and perf show,
/// so a busy background thread can be told from the request workers.
/// `stackSize` (bytes), if given, replaces the default (RLIMIT_STACK's,
/// 8 MiB here): for a thread that recurses once per level of a tree.
public func spawnThread(_ name: StaticString, stackSize: Int? = nil, _ body: @escaping @Sendable () -> Void) {
    final class Box {
        let name: StaticString
        let body: @Sendable () -> Void
        init(_ n: StaticString, _ b: @escaping @Sendable () -> Void) { name = n; body = b }
    }
    var tid = pthread_t()
    let arg = Unmanaged.passRetained(Box(name, body)).toOpaque()
    var attr = pthread_attr_t()
    pthread_attr_init(&attr)
    defer { pthread_attr_destroy(&attr) }
    if let stackSize { pthread_attr_setstacksize(&attr, stackSize) }
    let rc = pthread_create(&tid, &attr, { raw in
        let box = Unmanaged<Box>.fromOpaque(raw!).takeRetainedValue()
        // Not a request thread, whoever started it: the kernel's slice (see `-o slice=`).
        _ = vanish_thread_set_slice(0)
        box.name.withUTF8Buffer { utf8 in
            // The kernel keeps 15 bytes and a NUL; a StaticString promises no NUL.
            var buffer = (UInt64(0), UInt64(0))
            withUnsafeMutableBytes(of: &buffer) { out in
                out.copyMemory(from: UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(utf8).prefix(15)))
                _ = vanish_set_thread_name(out.baseAddress!.assumingMemoryBound(to: CChar.self))
            }
        }
        box.body()
        return nil
    }, arg)
    if rc == 0 { pthread_detach(tid) } else { Unmanaged<Box>.fromOpaque(arg).release() }
}

/// A mutex and a condition variable (pthread_mutex_t, pthread_cond_t on
/// CLOCK_MONOTONIC), for threads that wait for a state change with a
/// deadline. Both live in allocated memory: pthread objects must not move.
public final class Condition: @unchecked Sendable {
    private let mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
    private let cond = UnsafeMutablePointer<pthread_cond_t>.allocate(capacity: 1)

    public init() {
        pthread_mutex_init(mutex, nil)
        var attr = pthread_condattr_t()
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(cond, &attr)
        pthread_condattr_destroy(&attr)
    }

    deinit {
        pthread_cond_destroy(cond)
        pthread_mutex_destroy(mutex)
        cond.deallocate()
        mutex.deallocate()
    }

    public func lock() { pthread_mutex_lock(mutex) }
    public func unlock() { pthread_mutex_unlock(mutex) }
    public func broadcast() { pthread_cond_broadcast(cond) }

    /// With the lock held: waits for a broadcast (pthread_cond_wait).
    public func wait() { pthread_cond_wait(cond, mutex) }

    /// With the lock held: waits for a broadcast until `deadline`
    /// (`Condition.now()` nanoseconds); false once the deadline has passed.
    public func wait(until deadline: UInt64) -> Bool {
        var ts = timespec(tv_sec: Int(deadline / 1_000_000_000), tv_nsec: Int(deadline % 1_000_000_000))
        return pthread_cond_timedwait(cond, mutex, &ts) != ETIMEDOUT
    }

    /// CLOCK_MONOTONIC in nanoseconds: the clock `wait(until:)` measures by.
    /// Add a `Duration`'s `nanoseconds` to it for a deadline.
    public static func now() -> UInt64 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return Sys.nanoseconds(ts)
    }
}

/// A state, the mutex that guards it and a condition variable to wait for
/// it to change: the state is reached only with the lock held, so what
/// "guarded by" said in a comment is the type. For threads that wait for
/// one another (a queue and its worker), not for the request path's
/// short sections (`Lock`).
public final class Guarded<State>: @unchecked Sendable {
    private let condition = Condition()
    // Behind a pointer, as in `Lock`.
    private let state = UnsafeMutablePointer<State>.allocate(capacity: 1)

    public init(_ initial: State) { state.initialize(to: initial) }

    deinit {
        state.deinitialize(count: 1)
        state.deallocate()
    }

    /// Reads or changes the state with the lock held, waking no one.
    public func withLock<R, E: Error>(_ body: (inout State) throws(E) -> R) throws(E) -> R {
        condition.lock()
        defer { condition.unlock() }
        return try body(&state.pointee)
    }

    /// Changes the state with the lock held and wakes every waiter.
    public func update<R, E: Error>(_ body: (inout State) throws(E) -> R) throws(E) -> R {
        condition.lock()
        defer {
            condition.broadcast()
            condition.unlock()
        }
        return try body(&state.pointee)
    }

    /// Waits until `ready` holds (or `deadline`, `Condition.now()` ns,
    /// passes), then runs `body` with the lock still held, passing whether
    /// `ready` held, and wakes every waiter.
    public func wait<R>(until ready: (State) -> Bool, deadline: UInt64? = nil,
                        then body: (inout State, _ ready: Bool) -> R) -> R {
        condition.lock()
        defer {
            condition.broadcast()
            condition.unlock()
        }
        while !ready(state.pointee) {
            if let deadline {
                if !condition.wait(until: deadline) { break }
            } else {
                condition.wait()
            }
        }
        return body(&state.pointee, ready(state.pointee))
    }

    /// Waits until `ready` holds; false if `deadline` passed first.
    public func wait(until ready: (State) -> Bool, deadline: UInt64? = nil) -> Bool {
        wait(until: ready, deadline: deadline) { _, ready in ready }
    }
}

/// A mutex over `Value`: glibc's default pthread mutex, a plain futex.
///
/// For locks the request path takes many times per request. The standard
/// library's `Mutex` is a priority-inheritance futex that first spins: with
/// more handler threads than cores the holder is often descheduled, the
/// spinning burns the core it needs, and each wait goes through the
/// kernel's rt_mutex (docs/decisions.md).
public final class Lock<Value: ~Copyable>: @unchecked Sendable {
    @usableFromInline let mutex = UnsafeMutablePointer<pthread_mutex_t>.allocate(capacity: 1)
    // Behind a pointer: an inout access to a stored property of a class
    // costs a dynamic exclusivity check per call.
    @usableFromInline let value = UnsafeMutablePointer<Value>.allocate(capacity: 1)

    public init(_ initial: consuming Value) {
        pthread_mutex_init(mutex, nil)
        value.initialize(to: initial)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
        value.deinitialize(count: 1)
        value.deallocate()
    }

    /// Inlinable, so callers in other modules get it specialized.
    @inlinable @inline(__always)
    public func withLock<R, E: Error>(_ body: (inout Value) throws(E) -> R) throws(E) -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body(&value.pointee)
    }
}

extension Sys {
    /// When thread (or process) `tid` started, in clock ticks since boot
    /// (field 22 of /proc/TID/stat): with the id, it names one thread for
    /// good, where the id alone may be reused. nil if it is gone.
    public static func startTime(of tid: pid_t) -> UInt64? {
        guard let bytes = fileBytes("/proc/\(tid)/stat"),
              let close = bytes.lastIndex(of: 0x29) else { return nil }  // ')': the name may hold spaces
        // Field 3 starts after ") "; starttime is field 22.
        var field = 2
        var value: UInt64 = 0
        var i = close + 1
        while i < bytes.count {
            let b = bytes[i]
            if b == 0x20 {
                if field == 22 { return value }
                field += 1
            } else if field == 22 {
                guard b >= 0x30 && b <= 0x39 else { return nil }
                value = value &* 10 &+ UInt64(b - 0x30)
            }
            i += 1
        }
        return nil
    }
}
