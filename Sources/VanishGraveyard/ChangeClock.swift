import CLinux
import Glibc
import LinuxSyscalls
import Synchronization

/// When a directory was deleted, on the clock its filesystem stamps changes
/// with, so that the reaper can tell what changed in a buried tree after
/// (`TreeRemover.cameInLater`) from what changed just before.
///
/// Since Linux 6.13, ext4, XFS, btrfs and tmpfs stamp a change to an inode
/// whose times were read since its last change with the fine-grained
/// clock, and every later change on any of them is stamped no earlier
/// (multigrain timestamps: a global floor). So a change made here to a
/// private file whose times were just read gives a time that every later
/// change reaches and every earlier one stays below. Elsewhere (older
/// kernels, other or remote filesystems: `fine` is false) it is the wall
/// clock, and the reaper allows a tick of the coarse clock on top.
///
/// Lock order: `lock` is a leaf.
public final class ChangeClock: Sendable {
    private let fd: Int32
    private let lock = Mutex<Bool>(false)
    /// Whether `now` is the filesystem's own fine-grained stamp.
    public let fine: Bool

    /// Keeps its file (`clock`) in the private directory `stateFD`.
    init(stateFD: Int32) {
        let fd = (try? Sys.openat(stateFD, "clock", O_RDONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o600)) ?? -1
        self.fd = fd
        guard fd >= 0, !FilesystemKind.isRemote(fd) else {
            fine = false
            return
        }
        // Fine-grained if a change right after a read is stamped no earlier
        // than the wall clock just before it (a coarse stamp lags a tick).
        var toggle = false
        var fine = true
        for _ in 0..<2 {
            let before = Sys.wallClockNow()
            fine = fine && Self.stamp(fd, toggle: &toggle) >= before
        }
        self.fine = fine
    }

    deinit { if fd >= 0 { Sys.close(fd) } }

    /// Now, for a deletion (ns since the epoch).
    public func now() -> UInt64 {
        guard fine else { return Sys.wallClockNow() }
        return lock.withLock { toggle in Self.stamp(fd, toggle: &toggle) }
    }

    /// Reads the file's times and changes its mode, twice, and returns the
    /// second change's stamp. A change is stamped with the coarse clock (or
    /// the floor, the last fine stamp handed out: another change's, just
    /// before) unless that is not later than the inode's own last stamp;
    /// after the first change it is not, so the second gets the fine clock,
    /// later than every stamp before it.
    private static func stamp(_ fd: Int32, toggle: inout Bool) -> UInt64 {
        var stamp = Sys.wallClockNow()
        for _ in 0..<2 {
            _ = try? Sys.fstat(fd)
            toggle.toggle()
            guard fchmod(fd, toggle ? 0o400 : 0o600) == 0, let st = try? Sys.fstat(fd) else { return Sys.wallClockNow() }
            stamp = Sys.nanoseconds(st.st_ctim)
        }
        return stamp
    }
}
