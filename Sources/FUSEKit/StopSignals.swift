import CFuse
import CLinux
import Glibc
import LinuxSyscalls

/// SIGINT, SIGTERM and SIGHUP, taken by one thread with sigwait(2) for the
/// whole life of the process.
///
/// Handlers lose signals here. libfuse's handler only sets a flag, which is
/// lost once the loop has returned; a dispatch source needs the signal set
/// to SIG_IGN, and any thread that has it unblocked then discards it. A
/// SIGTERM sent just after `fusermount3 -u` was lost half the time, and the
/// daemon reaped on for minutes instead of stopping. Blocked everywhere and
/// taken by sigwait, no signal is lost, and the action runs on an ordinary
/// thread where it may take locks.
public enum StopSignals {
    public static let numbers: [Int32] = [SIGINT, SIGTERM, SIGHUP]

    /// Blocks the stop signals in the calling thread, and so in every thread
    /// it starts from now on: call it before any thread exists. Also ignores
    /// SIGPIPE (a peer that went away must give EPIPE, not end the daemon),
    /// as `fuse_set_signal_handlers` did.
    public static func block() {
        var set = stopSet()
        pthread_sigmask(SIG_BLOCK, &set, nil)
        signal(SIGPIPE, SIG_IGN)
    }

    /// Starts the thread that runs `action` for each stop signal taken.
    /// Call it after any fork (`fuse_daemonize`): a child keeps neither the
    /// parent's other threads nor its pending signals. A signal that came
    /// before is pending and is taken at once.
    public static func watch(_ action: @escaping @Sendable (Int32) -> Void) {
        spawnThread("vanish-signals") {
            var set = stopSet()
            while true {
                var sig: Int32 = 0
                if sigwait(&set, &sig) == 0 { action(sig) }
            }
        }
    }

    private static func stopSet() -> sigset_t {
        var set = sigset_t()
        sigemptyset(&set)
        for s in numbers { sigaddset(&set, s) }
        return set
    }
}

/// Ends `Session.run` from another thread.
///
/// libfuse's loop looks at its exit flag only between blocking calls: the
/// multi-threaded loop's main thread sleeps in sem_wait, the single-threaded
/// one in read(2) on /dev/fuse. So after `fuse_session_exit` the loop's
/// thread gets a wake signal (SIGUSR2, a handler that does nothing) to break
/// that call, repeated until the loop has returned, since a signal that
/// lands between the flag's check and the call is not enough.
public final class LoopStopper: @unchecked Sendable {
    /// Sent with pthread_kill to the loop's thread only.
    public static let wakeSignal = SIGUSR2

    private let session: OpaquePointer
    private let lock = Condition()
    // Guarded by `lock`.
    private var loopThread: pthread_t?
    private var over = false

    init(session: OpaquePointer) {
        self.session = session
        vanish_install_wake_handler(LoopStopper.wakeSignal)
    }

    func loopStarts() {
        lock.lock(); loopThread = pthread_self(); lock.unlock()
    }

    /// The loop has returned, or the session is going away: from now on
    /// `stop` neither touches the session nor signals the thread (a late
    /// wake signal would break whatever that thread blocks in next).
    func end() {
        lock.lock(); loopThread = nil; over = true; lock.unlock()
    }

    /// Asks the loop to end and waits until it has; if it has not started,
    /// it will return as soon as it does.
    public func stop() {
        var asked = false
        while true {
            // Everything under the lock, so the loop's thread cannot pass
            // `end()` meanwhile: a wake signal sent here is pending before the
            // thread takes this lock, and is taken on the way.
            lock.lock()
            if over { lock.unlock(); return }
            if !asked { fuse_session_exit(session); asked = true }
            guard let t = loopThread else { lock.unlock(); return }
            pthread_kill(t, LoopStopper.wakeSignal)
            lock.unlock()
            usleep(20_000)
        }
    }
}
