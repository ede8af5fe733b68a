import FUSEKit
import Synchronization

/// What the kernel and the daemon agreed at INIT, for the handlers and
/// the status: set once there, read from any thread after.
final class KernelTerms: Sendable {
    /// The kernel checks POSIX ACLs (FUSE_POSIX_ACL).
    let checksACLs = Atomic(false)
    /// The kernel sends the caller's umask with each mode instead of
    /// applying it (FUSE_DONT_MASK), so a directory's default ACL can
    /// decide in its place, as natively.
    let leavesUmask = Atomic(false)
    /// Why passthrough is on or off (for the log and `vanish status`).
    let passthroughReason = Mutex("off: not negotiated yet")
    /// The session's transport: how requests are served.
    let transport = Mutex<Transport?>(nil)
}
