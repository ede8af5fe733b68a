import CLinux
import Glibc
import LinuxSyscalls
import Logging
import SystemPackage

/// The backing root and what is known of it before the first request:
/// where it is, what kind of filesystem it is on, and how its inode
/// numbers are shown. Opened before mounting, so an in-place mount still
/// reaches it.
struct SourceRoot: Sendable {
    let fd: Int32
    let path: String
    /// Served through a private copy of its mount carrying an atime option (see `AtimeMode`).
    let isPrivateMount: Bool
    /// A local disk filesystem (ext4, XFS, btrfs, tmpfs): requests are served
    /// in microseconds, so workers may spin for the next, and close(2) of its
    /// files never reports an error (see `FileHandlers.configure`).
    let isLocalDisk: Bool
    /// Whether the kernel may keep listings of its own directories between opens (see `opendir`).
    let cachesListings: Bool
    /// Whether it keeps POSIX ACLs. Without them (tmpfs built without,
    /// GlusterFS mounted without `acl`) it answers EOPNOTSUPP, which the
    /// kernel's own ACL check would hand the caller as the error of every
    /// access outside the owner's bits.
    let keepsACLs: Bool
    /// How inode numbers of filesystems mounted inside it are shown.
    let devices: DeviceMap
    /// What is mounted inside it or on the mount's paths (for `vanish rm`, see `hasMounts`).
    let mounts = MountTable()
    /// The daemon runs as root and serves other users: what it opens for them
    /// is opened with its rights (so O_NOATIME, ACL and setgid rules apply).
    static let actsForOthers = geteuid() == 0

    /// Opens `path` for `options`; `st` is its stat.
    static func open(_ path: String, _ options: FilesystemOptions, _ log: Logger) throws -> (SourceRoot, stat) {
        let (fd, privateMount) = try openRoot(path, options, log)
        let st: stat
        do { st = try Sys.fstat(fd) } catch { Sys.close(fd); throw error }
        let localDisk = FilesystemKind.isLocalDisk(fd)
        let caches = switch options.cache {
        case .always: true
        case .auto: localDisk
        case .never: false
        }
        return (SourceRoot(fd: fd, path: path, isPrivateMount: privateMount, isLocalDisk: localDisk,
                           cachesListings: caches, keepsACLs: keepsACLs(fd), devices: DeviceMap(rootDevice: st.st_dev)), st)
    }

    /// The backing root: the source itself, or for an atime option a private
    /// copy of its mount carrying it (see `AtimeMode`), if the daemon may
    /// make one; otherwise `noatime` falls back to O_NOATIME opens.
    private static func openRoot(_ source: String, _ options: FilesystemOptions,
                                 _ log: Logger) throws -> (Int32, Bool) {
        let attributes: (set: UInt64, clear: UInt64)? = switch options.atime {
        case .backing: nil
        case .relatime: (VANISH_MOUNT_ATTR_RELATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .noatime: (VANISH_MOUNT_ATTR_NOATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .strictatime: (VANISH_MOUNT_ATTR_STRICTATIME, VANISH_MOUNT_ATTR_ATIME_MASK)
        case .nodiratime: (VANISH_MOUNT_ATTR_NODIRATIME, 0)
        }
        if let attributes {
            if options.atimeCopyAllowed && geteuid() == 0 {
                let fd = vanish_open_tree_clone(source, attributes.set, attributes.clear)
                if fd >= 0 { return (fd, true) }
                log.warning("cannot give the source a mount of its own with the atime option: files opened O_NOATIME for noatime",
                            metadata: ["option": "\(options.atime.rawValue)", "error": "\(String(cString: strerror(errno)))"])
            } else {
                log.notice("the atime option applies to files the daemon opens itself (a filesystem is mounted in the source, or the daemon is not root)",
                           metadata: ["option": "\(options.atime.rawValue)"])
            }
        }
        return (try Sys.open(source, VANISH_O_PATH | O_DIRECTORY), false)
    }

    private static func keepsACLs(_ rootFD: Int32) -> Bool {
        do throws(Errno) {
            _ = try Sys.getxattr(pathFD: rootFD, "system.posix_acl_access", nil)
            return true
        } catch {
            return error != .notSupported
        }
    }
}
