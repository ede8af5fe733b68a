import CLinux
import Glibc
import Synchronization
import SystemPackage

/// Typed wrappers over the Linux calls Vanish makes on the request path.
///
/// Each returns the call's result or throws the `Errno` it set, so a handler
/// can pass the backing filesystem's error to the kernel unchanged. They are
/// `@inlinable` and allocate nothing: they sit under every FUSE request.
public enum Sys {}

/// Set once fchmodat2 turned out to be missing (kernels before 6.6).
private let noFchmodat2 = Atomic<Bool>(false)

extension Sys {
    @inlinable @inline(__always)
    static func check(_ result: Int32) throws(Errno) -> Int32 {
        if result < 0 { throw Errno(rawValue: errno) }
        return result
    }

    @inlinable @inline(__always)
    static func check(_ result: Int) throws(Errno) -> Int {
        if result < 0 { throw Errno(rawValue: errno) }
        return result
    }

    /// `openat(2)`.
    @inlinable
    public static func openat(_ dirfd: Int32, _ name: UnsafePointer<CChar>, _ flags: Int32,
                              _ mode: mode_t = 0) throws(Errno) -> Int32 {
        try check(Glibc.openat(dirfd, name, flags | O_CLOEXEC, mode))
    }

    /// `open(2)` of an absolute path (used for `/proc/self/fd/N`).
    @inlinable
    public static func open(_ path: UnsafePointer<CChar>, _ flags: Int32) throws(Errno) -> Int32 {
        try check(Glibc.open(path, flags | O_CLOEXEC))
    }

    /// Everything left to read from `fd` (a small file: a sidecar, a /proc file).
    public static func readAll(_ fd: Int32) -> [UInt8] {
        var out: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        while true {
            let n = chunk.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { return out }
            out += chunk[..<n]
        }
    }

    /// The bytes of the small file at `path` (never following a final symlink); nil if it cannot be opened.
    public static func fileBytes(_ path: String) -> [UInt8]? {
        guard let fd = try? open(path, O_RDONLY | O_NOFOLLOW) else { return nil }
        defer { close(fd) }
        return readAll(fd)
    }

    /// `readlink(2)` of `path` as a string (a /proc link); nil if it is none.
    public static func readLink(_ path: String) -> String? {
        var buffer = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
        let n = Glibc.readlink(path, &buffer, buffer.count - 1)
        guard n > 0 else { return nil }
        return String(decoding: buffer[..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// `close(2)`. Errors are dropped: on Linux the fd is gone either way.
    @inlinable
    public static func close(_ fd: Int32) { _ = Glibc.close(fd) }

    /// `fstatat(2)` without following a final symlink.
    @inlinable
    public static func lstatat(_ dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> stat {
        var st = stat()
        _ = try check(Glibc.fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW))
        return st
    }

    /// lstat of `name` from the kernel's cached attributes, with the id of
    /// the mount it is on: one that is not its directory's is a filesystem
    /// mounted there, and a FUSE or NFS server stopped there cannot hold the
    /// caller, as a plain `lstatat` would (AT_STATX_DONT_SYNC).
    @inlinable
    public static func lstatatCached(_ dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (stat, mount: UInt64) {
        var st = stat()
        var mount: UInt64 = 0
        _ = try check(vanish_lstat_cached(dirfd, name, &st, &mount))
        return (st, mount)
    }

    /// The id of the mount `dirfd` is on (STATX_MNT_ID).
    public static func mountID(_ dirfd: Int32) throws(Errno) -> UInt64 {
        var mount: UInt64 = 0
        _ = try check(vanish_mount_id(dirfd, "", &mount))
        return mount
    }

    /// `statx(2)` of `name` without following a symlink: its stat and its
    /// birth time in nanoseconds (0 where the filesystem keeps none).
    @inlinable
    public static func lstatatWithBirth(_ dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (stat, UInt64) {
        var st = stat()
        var birth: UInt64 = 0
        _ = try check(vanish_stat_birth(dirfd, name, AT_SYMLINK_NOFOLLOW, &st, &birth))
        return (st, birth)
    }

    /// `statx(2)` of `name` without following a symlink (of `dirfd` itself
    /// if `name` is ""): its stat, and whether it is immutable or
    /// append-only (`chattr +i`, `+a`), which no unlink or rename of it,
    /// or in it for a directory, gets past, whoever asks. One syscall, as `lstatat`.
    @inlinable
    public static func lstatatProtected(_ dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (stat, protected: Bool) {
        var st = stat()
        var attributes: UInt64 = 0
        let flags = AT_SYMLINK_NOFOLLOW | (name.pointee == 0 ? VANISH_AT_EMPTY_PATH : 0)
        _ = try check(vanish_statx_stat(dirfd, name, flags, &st, nil, &attributes))
        return (st, vanish_attributes_protected(attributes) != 0)
    }

    /// `statx(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`, as `lstatatWithBirth`.
    @inlinable
    public static func fstatWithBirth(_ fd: Int32) throws(Errno) -> (stat, UInt64) {
        var st = stat()
        var birth: UInt64 = 0
        _ = try check(vanish_stat_birth(fd, "", VANISH_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, &st, &birth))
        return (st, birth)
    }

    /// `fstatat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: works on O_PATH fds.
    @inlinable
    public static func fstat(_ fd: Int32) throws(Errno) -> stat {
        var st = stat()
        _ = try check(Glibc.fstatat(fd, "", &st, VANISH_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
        return st
    }

    /// `mkdirat(2)`.
    @inlinable
    public static func mkdirat(_ dirfd: Int32, _ name: UnsafePointer<CChar>, _ mode: mode_t) throws(Errno) {
        _ = try check(Glibc.mkdirat(dirfd, name, mode))
    }

    /// `mknodat(2)`.
    @inlinable
    public static func mknodat(_ dirfd: Int32, _ name: UnsafePointer<CChar>, _ mode: mode_t,
                               _ dev: dev_t) throws(Errno) {
        _ = try check(Glibc.mknodat(dirfd, name, mode, dev))
    }

    /// `symlinkat(2)`.
    @inlinable
    public static func symlinkat(_ target: UnsafePointer<CChar>, _ dirfd: Int32,
                                 _ name: UnsafePointer<CChar>) throws(Errno) {
        _ = try check(Glibc.symlinkat(target, dirfd, name))
    }

    /// `readlinkat(fd, "", …)` on an O_PATH fd of the link itself.
    @inlinable
    public static func readlink(_ fd: Int32, into buffer: UnsafeMutableRawBufferPointer) throws(Errno) -> Int {
        try check(Glibc.readlinkat(fd, "", buffer.baseAddress!.assumingMemoryBound(to: CChar.self),
                                   buffer.count))
    }

    /// `unlinkat(2)`; `flags` is 0 or `AT_REMOVEDIR`.
    @inlinable
    public static func unlinkat(_ dirfd: Int32, _ name: UnsafePointer<CChar>, _ flags: Int32) throws(Errno) {
        _ = try check(Glibc.unlinkat(dirfd, name, flags))
    }

    /// `renameat2(2)`; plain `renameat` when `flags` is 0.
    @inlinable
    public static func renameat2(_ olddirfd: Int32, _ oldname: UnsafePointer<CChar>, _ newdirfd: Int32,
                                 _ newname: UnsafePointer<CChar>, _ flags: UInt32) throws(Errno) {
        if flags == 0 {
            _ = try check(Glibc.renameat(olddirfd, oldname, newdirfd, newname))
        } else {
            _ = try check(vanish_renameat2(olddirfd, oldname, newdirfd, newname, flags))
        }
    }

    /// `renameat2(RENAME_NOREPLACE)`: EEXIST instead of replacing what
    /// `newname` holds. Filesystems without the flag (NFS, CIFS, many FUSE
    /// filesystems) answer EINVAL; there it becomes an `lstat` of `newname`
    /// and a plain rename, which is not atomic: use it where nothing else
    /// makes names in `newdirfd`, or where losing that race is acceptable.
    @inlinable
    public static func renameNoReplace(_ olddirfd: Int32, _ oldname: UnsafePointer<CChar>, _ newdirfd: Int32,
                                       _ newname: UnsafePointer<CChar>) throws(Errno) {
        do throws(Errno) {
            try renameat2(olddirfd, oldname, newdirfd, newname, VANISH_RENAME_NOREPLACE)
        } catch .invalidArgument {
            if (try? lstatat(newdirfd, newname)) != nil { throw .fileExists }
            // An invalid rename (a directory into itself) fails here again.
            try renameat2(olddirfd, oldname, newdirfd, newname, 0)
        }
    }

    /// `linkat(AT_FDCWD, "/proc/self/fd/N", newdirfd, newname, AT_SYMLINK_FOLLOW)`:
    /// links the inode behind an O_PATH fd without needing CAP_DAC_READ_SEARCH.
    @inlinable
    public static func link(fd: Int32, _ newdirfd: Int32, _ newname: UnsafePointer<CChar>) throws(Errno) {
        try withProcPath(fd) { path throws(Errno) in
            _ = try check(Glibc.linkat(AT_FDCWD, path, newdirfd, newname, AT_SYMLINK_FOLLOW))
        }
    }

    /// `fchownat(fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`.
    @inlinable
    public static func fchown(_ fd: Int32, _ uid: uid_t, _ gid: gid_t) throws(Errno) {
        _ = try check(Glibc.fchownat(fd, "", uid, gid, VANISH_AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
    }

    /// `fchmod(2)` on an open fd.
    @inlinable
    public static func fchmod(_ fd: Int32, _ mode: mode_t) throws(Errno) {
        _ = try check(Glibc.fchmod(fd, mode))
    }

    /// chmod of the inode behind an O_PATH fd (which fchmod refuses):
    /// `fchmodat2(fd, "", mode, AT_EMPTY_PATH)`, or `chmod("/proc/self/fd/N")`
    /// on kernels before 6.6 (the path walk through /proc cost chmod a
    /// twentieth of the daemon's time in a metadata benchmark).
    public static func chmod(pathFD fd: Int32, _ mode: mode_t) throws(Errno) {
        if !noFchmodat2.load(ordering: .relaxed) {
            if vanish_fchmodat2(fd, "", mode, VANISH_AT_EMPTY_PATH) == 0 { return }
            let e = Errno(rawValue: errno)
            guard e == .noFunction || e == .invalidArgument || e == .notSupported else { throw e }
            noFchmodat2.store(true, ordering: .relaxed)
        }
        try withProcPath(fd) { path throws(Errno) in _ = try check(Glibc.chmod(path, mode)) }
    }

    /// `ftruncate(2)`.
    @inlinable
    public static func ftruncate(_ fd: Int32, _ size: off_t) throws(Errno) {
        _ = try check(Glibc.ftruncate(fd, size))
    }

    /// `truncate("/proc/self/fd/N")`.
    @inlinable
    public static func truncate(pathFD fd: Int32, _ size: off_t) throws(Errno) {
        try withProcPath(fd) { path throws(Errno) in _ = try check(Glibc.truncate(path, size)) }
    }

    /// `futimens(2)`.
    @inlinable
    public static func futimens(_ fd: Int32, _ times: UnsafePointer<timespec>) throws(Errno) {
        _ = try check(Glibc.futimens(fd, times))
    }

    /// `utimensat(fd, "", times, AT_EMPTY_PATH)`: the inode behind an O_PATH
    /// fd, whatever its type (no /proc/self/fd path walk).
    @inlinable
    public static func utimens(pathFD fd: Int32, isSymlink: Bool, _ times: UnsafePointer<timespec>) throws(Errno) {
        _ = try check(Glibc.utimensat(fd, "", times, VANISH_AT_EMPTY_PATH | (isSymlink ? AT_SYMLINK_NOFOLLOW : 0)))
    }

    /// chmod of the file `file` refers to, by the call its kind of fd takes.
    @inlinable
    public static func chmod(_ file: FileRef, _ mode: mode_t) throws(Errno) {
        switch file {
        case .path(let fd): try chmod(pathFD: fd, mode)
        case .open(let fd): try fchmod(fd, mode)
        }
    }

    /// truncate of the file `file` refers to.
    @inlinable
    public static func truncate(_ file: FileRef, _ size: off_t) throws(Errno) {
        switch file {
        case .path(let fd): try truncate(pathFD: fd, size)
        case .open(let fd): try ftruncate(fd, size)
        }
    }

    /// Sets the access and modification times of the file `file` refers to
    /// (`isSymlink`: an O_PATH fd on a symlink, whose own times are set).
    @inlinable
    public static func setTimes(_ file: FileRef, isSymlink: Bool, _ times: UnsafePointer<timespec>) throws(Errno) {
        switch file {
        case .path(let fd): try utimens(pathFD: fd, isSymlink: isSymlink, times)
        case .open(let fd): try futimens(fd, times)
        }
    }

    /// `dup(2)`.
    @inlinable
    public static func dup(_ fd: Int32) throws(Errno) -> Int32 { try check(Glibc.dup(fd)) }

    /// `fsync(2)` or `fdatasync(2)`.
    @inlinable
    public static func fsync(_ fd: Int32, dataOnly: Bool) throws(Errno) {
        _ = try check(dataOnly ? Glibc.fdatasync(fd) : Glibc.fsync(fd))
    }

    /// `fstatvfs(2)`.
    @inlinable
    public static func fstatvfs(_ fd: Int32) throws(Errno) -> statvfs {
        var st = statvfs()
        _ = try check(Glibc.fstatvfs(fd, &st))
        return st
    }

    /// `fallocate(2)`.
    @inlinable
    public static func fallocate(_ fd: Int32, _ mode: Int32, _ offset: off_t, _ length: off_t) throws(Errno) {
        _ = try check(vanish_fallocate(fd, mode, offset, length))
    }

    /// `copy_file_range(2)`.
    @inlinable
    public static func copyFileRange(_ fdIn: Int32, _ offIn: off_t, _ fdOut: Int32, _ offOut: off_t,
                                     _ length: Int, _ flags: UInt32) throws(Errno) -> Int {
        var inOff = offIn
        var outOff = offOut
        return try check(vanish_copy_file_range(fdIn, &inOff, fdOut, &outOff, length, flags))
    }

    /// `lseek(2)`.
    @inlinable
    public static func lseek(_ fd: Int32, _ offset: off_t, _ whence: Int32) throws(Errno) -> off_t {
        let r = Glibc.lseek(fd, offset, whence)
        if r < 0 { throw Errno(rawValue: errno) }
        return r
    }

    /// `faccessat2(fd, "", mode, AT_EMPTY_PATH | AT_EACCESS)`.
    @inlinable
    public static func access(_ fd: Int32, _ mode: Int32) throws(Errno) {
        _ = try check(vanish_faccessat2(fd, "", mode, VANISH_AT_EMPTY_PATH | AT_EACCESS))
    }
}

// MARK: - Extended attributes (through /proc/self/fd/N, since O_PATH fds refuse f*xattr)

extension Sys {
    /// `getxattr("/proc/self/fd/N", …)`; a nil buffer asks for the size.
    @inlinable
    public static func getxattr(pathFD fd: Int32, _ name: UnsafePointer<CChar>,
                                _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        try withProcPath(fd) { path throws(Errno) in
            try check(CLinux.getxattr(path, name, buffer?.baseAddress, buffer?.count ?? 0))
        }
    }

    /// `setxattr("/proc/self/fd/N", …)`.
    @inlinable
    public static func setxattr(pathFD fd: Int32, _ name: UnsafePointer<CChar>, _ value: UnsafeRawPointer?,
                                _ size: Int, _ flags: Int32) throws(Errno) {
        try withProcPath(fd) { path throws(Errno) in
            _ = try check(CLinux.setxattr(path, name, value, size, flags))
        }
    }

    /// `listxattr("/proc/self/fd/N", …)`; a nil buffer asks for the size.
    @inlinable
    public static func listxattr(pathFD fd: Int32, _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        try withProcPath(fd) { path throws(Errno) in
            try check(CLinux.listxattr(path, buffer?.baseAddress?.assumingMemoryBound(to: CChar.self),
                                      buffer?.count ?? 0))
        }
    }

    /// `getxattrat(dirfd, name, AT_SYMLINK_NOFOLLOW, attr, …)` (Linux 6.13+):
    /// no fd for the file itself; ENOSYS on older kernels.
    @inlinable
    public static func getxattrat(_ dirfd: Int32, _ path: UnsafePointer<CChar>, _ name: UnsafePointer<CChar>,
                                  _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        try check(vanish_getxattrat(dirfd, path, name, buffer?.baseAddress, buffer?.count ?? 0))
    }

    /// `listxattrat(dirfd, name, AT_SYMLINK_NOFOLLOW, …)` (Linux 6.13+).
    @inlinable
    public static func listxattrat(_ dirfd: Int32, _ path: UnsafePointer<CChar>,
                                   _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        try check(vanish_listxattrat(dirfd, path, buffer?.baseAddress?.assumingMemoryBound(to: CChar.self),
                                     buffer?.count ?? 0))
    }

    /// `removexattr("/proc/self/fd/N", …)`.
    @inlinable
    public static func removexattr(pathFD fd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) {
        try withProcPath(fd) { path throws(Errno) in _ = try check(CLinux.removexattr(path, name)) }
    }
}

// MARK: - /proc/self/fd paths without allocating

extension Sys {
    /// Calls `body` with `"/proc/self/fd/<fd>"` built on the stack.
    @inlinable
    public static func withProcPath<R>(_ fd: Int32,
                                       _ body: (UnsafePointer<CChar>) throws(Errno) -> R) throws(Errno) -> R {
        // "/proc/self/fd/" is 14 bytes; an Int32 needs at most 10 digits and a NUL.
        return try withUnsafeTemporaryAllocation(byteCount: 32, alignment: 8) { raw throws(Errno) -> R in
            let p = raw.bindMemory(to: CChar.self).baseAddress!
            let prefix: StaticString = "/proc/self/fd/"
            prefix.withUTF8Buffer { pre in
                for i in 0..<pre.count { p[i] = CChar(bitPattern: pre[i]) }
            }
            var digits = 0
            var n = UInt32(bitPattern: fd)
            repeat { digits += 1; n /= 10 } while n > 0
            n = UInt32(bitPattern: fd)
            var i = 14 + digits
            p[i] = 0
            repeat { i -= 1; p[i] = CChar(48 + Int(n % 10)); n /= 10 } while n > 0
            return try body(UnsafePointer(p))
        }
    }
}

extension Sys {
    /// CLOCK_REALTIME in nanoseconds since the epoch: what graveyard entry
    /// names and event times carry (pacing uses `Condition.now()`).
    @inline(__always)
    public static func wallClockNow() -> UInt64 {
        var ts = timespec()
        clock_gettime(CLOCK_REALTIME, &ts)
        return Sys.nanoseconds(ts)
    }
}

extension Sys {
    /// `t` in nanoseconds since its clock's epoch (one before the epoch
    /// wraps; clamp first where such a time can come).
    @inlinable
    public static func nanoseconds(_ t: timespec) -> UInt64 {
        UInt64(truncatingIfNeeded: t.tv_sec) &* 1_000_000_000 &+ UInt64(truncatingIfNeeded: t.tv_nsec)
    }
}

extension Sys {
    /// The number at the start of a small file such as a /proc/sys or /sys
    /// setting (`open`, `read`, `close`); nil if it cannot be read or does
    /// not start with a digit.
    public static func readNumber(atPath path: String) -> Int? {
        let fd = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { Glibc.close(fd) }
        var text = [UInt8](repeating: 0, count: 32)
        let n = Glibc.read(fd, &text, text.count)
        var value: Int?
        for c in text.prefix(max(0, n)) {
            guard c >= 48 && c <= 57 else { break }
            value = (value ?? 0) * 10 + Int(c - 48)
        }
        return value
    }
}

extension Sys {
    /// A directory stream of `name` in `dirfd` (`.` for `dirfd` itself),
    /// never following a symlink: close it with `closedir`. The descriptor
    /// is closed here if the stream cannot be made (`fdopendir` fails).
    public static func openDirectory(_ dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> OpaquePointer {
        try directoryStream(adopting: openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))
    }

    /// A stream over the directory open as `fd` (`fdopendir`), which then
    /// owns it (`closedir` closes both); `fd` is closed here if the stream
    /// cannot be made, so no caller leaks it.
    public static func directoryStream(adopting fd: Int32) throws(Errno) -> OpaquePointer {
        guard let dp = fdopendir(fd) else {
            let e = Errno(rawValue: errno)
            close(fd)
            throw e
        }
        return dp
    }

    /// The disk space `st` says its file takes: the one rule every count of
    /// freed or held bytes uses (st_blocks is in 512-byte units whatever the
    /// filesystem's block size).
    @inline(__always)
    public static func diskBytes(_ st: stat) -> UInt64 { UInt64(st.st_blocks) * 512 }

    /// The names in the directory `name` of `dirfd` (not followed if a
    /// symlink), "." and ".." left out. The stream is closed on every path.
    public static func names(in dirfd: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> [String] {
        let dp = try openDirectory(dirfd, name)
        defer { closedir(dp) }
        var names: [String] = []
        while let d = readdir(dp) {
            let n = vanish_dirent_name(d)!
            if !isDotOrDotDot(n) { names.append(String(cString: n)) }
        }
        return names
    }
}

/// Whether a directory entry's name is `.` or `..` (compared without allocating).
@inline(__always)
public func isDotOrDotDot(_ name: UnsafePointer<CChar>) -> Bool {
    name[0] == 0x2E && (name[1] == 0 || (name[1] == 0x2E && name[2] == 0))
}

/// What kind of filesystem an fd is on, as Vanish's policies need to know.
public enum FilesystemKind {
    /// A network filesystem or a FUSE one (GlusterFS's client, sshfs, another
    /// Vanish): a deletion there waits on a round trip, not on the CPU.
    public static func isRemote(_ fd: Int32) -> Bool {
        let remote = [VANISH_FUSE_SUPER_MAGIC, VANISH_NFS_SUPER_MAGIC, VANISH_CIFS_SUPER_MAGIC, VANISH_SMB2_SUPER_MAGIC,
                      VANISH_SMB_SUPER_MAGIC, VANISH_CEPH_SUPER_MAGIC, VANISH_AFS_FS_MAGIC, VANISH_V9FS_MAGIC]
        return remote.contains(vanish_filesystem_type(fd))
    }

    /// ext4, XFS, btrfs or tmpfs. Two things follow that Vanish relies on: a
    /// directory gets a new mtime with every change, however close together
    /// (nanosecond times, and since Linux 6.13 a distinct one after each
    /// query), so an unchanged mtime means an unchanged listing; and close(2)
    /// of a file there never reports an error (no flush operation), unlike on
    /// network and FUSE filesystems, which report deferred write errors there.
    public static func isLocalDisk(_ fd: Int32) -> Bool {
        let local = [VANISH_EXT4_SUPER_MAGIC, VANISH_XFS_SUPER_MAGIC, VANISH_BTRFS_SUPER_MAGIC, VANISH_TMPFS_MAGIC]
        return local.contains(vanish_filesystem_type(fd))
    }
}

/// An fd on a file, by kind: an O_PATH one allows no I/O and no f*() call
/// but fstat and fchownat, so its mode, size and times change through other
/// calls than an open fd's (see `Sys.chmod(_:_:)`).
public enum FileRef: Sendable {
    case path(Int32)
    case open(Int32)

    /// The fd itself, for calls both kinds take (fstat, fchownat).
    @inlinable
    public var fd: Int32 {
        switch self {
        case .path(let fd), .open(let fd): fd
        }
    }
}
