import CLinux
import Glibc
import LinuxSyscalls
import SystemPackage

/// Who asks on the control socket, as the kernel vouches for it
/// (SO_PEERCRED, SO_PEERGROUPS): permission checks for listing, restoring
/// and watching use these, never the daemon's own rights.
extension Credentials {
    /// Whether these credentials are granted all of `mask` (R=4, W=2, X=1)
    /// on the file `fd` (O_PATH), as the kernel decides it for them: mode
    /// bits, ACLs, capabilities. A daemon that cannot take on another
    /// user's identity goes by the mode bits, and refuses another user a
    /// file with an access ACL (whose entries only the kernel should read).
    func permits(_ fd: Int32, _ mask: mode_t) -> Bool {
        if Credentials.canSwitch {
            return (try? acting { () throws(Errno) in try Sys.access(fd, Int32(mask)) }) != nil
        }
        if uid == geteuid() { return (try? Sys.access(fd, Int32(mask))) != nil }
        guard let st = try? Sys.fstat(fd) else { return false }
        if (try? Sys.getxattr(pathFD: fd, "system.posix_acl_access", nil)) != nil { return false }
        return modeBitsGrant(st, mask)
    }

    /// Opens the directory `components` below `root` as these credentials
    /// would reach it on the mount: one name at a time, never following a
    /// symlink, with search permission (`listing`: read and search) on every
    /// directory on the way and `needing` (R=4, W=2, X=1) on the last; a
    /// component that is not a plain name is EINVAL. Close the result unless it is `root`.
    func openDirectory(_ components: [[UInt8]], under root: Int32, needing: mode_t,
                       listing: Bool = false) throws(Errno) -> Int32 {
        var dirFD = root
        do throws(Errno) {
            for p in components {
                // A name only: a NUL would end the C string early ("..\0x" is "..").
                guard !p.isEmpty, !p.contains(0), p != [0x2E], p != [0x2E, 0x2E] else { throw Errno.invalidArgument }
                guard permits(dirFD, listing ? 5 : 1) else { throw Errno.permissionDenied }
                let next = try (p + [0]).withUnsafeBufferPointer { b throws(Errno) in
                    try Sys.openat(dirFD, UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self),
                                   VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                }
                if dirFD != root { Sys.close(dirFD) }
                dirFD = next
            }
            guard permits(dirFD, needing) else { throw Errno.permissionDenied }
            return dirFD
        } catch {
            if dirFD != root { Sys.close(dirFD) }
            throw error
        }
    }

    /// Whether these credentials could see the entry at `path` below `root`:
    /// read and search permission on every directory above it, so that
    /// every name on the path is one they could have listed.
    func mayObserve(_ path: [UInt8], under root: Int32) -> Bool {
        if uid == 0 { return true }
        let parts = path.split(separator: 0x2F).dropLast().map { Array($0) }
        guard let fd = try? openDirectory(parts, under: root, needing: 5, listing: true) else { return false }
        if fd != root { Sys.close(fd) }
        return true
    }
}
