import CFuse
import CFuseTransport
import Glibc
import SystemPackage

/// Kernel FUSE features newer than libfuse 3.14, negotiated by the session's
/// `Transport` in the INIT reply libfuse writes.
public struct KernelFeatures: OptionSet, Sendable, CustomStringConvertible {
    public let rawValue: UInt64
    public init(rawValue: UInt64) { self.rawValue = rawValue }

    /// Reads, writes, splice and mmap of a file opened with a backing id go
    /// from the kernel straight to the backing file (Linux 6.9).
    public static let passthrough = KernelFeatures(rawValue: VANISH_FUSE_PASSTHROUGH)
    /// Lookups and readdirs in one directory may run at the same time.
    public static let parallelDirops = KernelFeatures(rawValue: VANISH_FUSE_PARALLEL_DIROPS)
    /// The filesystem clears setuid/setgid on writes, truncates and chowns;
    /// the kernel stops asking for security.capability before every write.
    public static let killprivV2 = KernelFeatures(rawValue: VANISH_FUSE_HANDLE_KILLPRIV_V2)

    /// A file opened with direct_io (FOPEN_DIRECT_IO) may still be mapped
    /// shared; without it such an mmap fails with ENODEV (Linux 6.6).
    public static let directIOAllowMmap = KernelFeatures(rawValue: VANISH_FUSE_DIRECT_IO_ALLOW_MMAP)

    public var description: String {
        let names: [(KernelFeatures, String)] = [(.passthrough, "passthrough"), (.parallelDirops, "parallel_dirops"),
                                                 (.killprivV2, "killpriv_v2"), (.directIOAllowMmap, "direct_io_mmap")]
        let on = names.filter { contains($0.0) }.map(\.1)
        return on.isEmpty ? "none" : on.joined(separator: ",")
    }
}

/// Backing files registered with the kernel for passthrough opens
/// (FUSE_DEV_IOC_BACKING_OPEN/CLOSE on the session's /dev/fuse fd). The
/// kernel keeps its own reference to the file until the id is closed and
/// the last passthrough open of the inode is released.
public struct BackingFiles: Sendable {
    let device: Int32

    public init(device: Int32) { self.device = device }

    /// Registers `fd` (the daemon may close its own fd after); returns the id.
    /// EPERM without CAP_SYS_ADMIN, ELOOP for a backing stacked too deep,
    /// EOPNOTSUPP for a file without read_iter/write_iter.
    public func register(_ fd: Int32) throws(Errno) -> Int32 {
        let r = vanish_backing_open(device, fd)
        if r < 0 { throw Errno(rawValue: -r) }
        return r
    }

    /// Whether this process may register backing files (CAP_SYS_ADMIN).
    public static var permitted: Bool { vanish_has_cap_sys_admin() != 0 }

    /// Lets go of an id; opens already made with it keep working.
    public func unregister(_ id: Int32) {
        _ = vanish_backing_close(device, id)
    }
}
