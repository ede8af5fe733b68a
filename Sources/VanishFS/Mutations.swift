import FUSEKit
import CFuse
import Glibc
import LinuxSyscalls
import SystemPackage

// The one place where entries leave or move in the backing directory, and
// where new entries get their owner. The graveyard (instant delete) and the
// event journal hook in here.
extension PassthroughFilesystem {
    /// Removes `name` from the directory `parentFD` (unlink or rmdir).
    func removeEntry(parentFD: Int32, name: UnsafePointer<CChar>, directory: Bool) throws(Errno) {
        if !directory { holdIfOpen(parentFD, name) }
        try Sys.unlinkat(parentFD, name, directory ? AT_REMOVEDIR : 0)
    }

    /// Keeps a file that is about to lose its name reachable while programs have it open.
    func holdIfOpen(_ parentFD: Int32, _ name: UnsafePointer<CChar>) {
        guard let st = try? Sys.lstatat(parentFD, name), st.st_mode & S_IFMT == S_IFREG,
              let node = table.known(st) else { return }
        fds.holdIfOpen(node)
    }

    /// Renames with renameat2 semantics (NOREPLACE, EXCHANGE passed through).
    func renameEntry(_ pfd: Int32, _ name: UnsafePointer<CChar>, _ npfd: Int32, _ newName: UnsafePointer<CChar>,
                     flags: UInt32) throws(Errno) {
        if flags & VANISH_RENAME_EXCHANGE == 0 { holdIfOpen(npfd, newName) }
        try Sys.renameat2(pfd, name, npfd, newName, flags)
    }

    /// Names the mount must not let programs create, open or replace.
    @inline(__always)
    func checkNotReserved(_ parent: Inode, _ name: UnsafePointer<CChar>) throws(Errno) {}

    /// Gives a new entry to the process that asked for it.
    ///
    /// A root daemon creates everything as root; the kernel has already
    /// checked (default_permissions) that the caller may create it, so the
    /// entry is handed over: uid to the caller, gid to the caller's unless
    /// the directory is setgid (then it keeps the directory's group, as the
    /// backing filesystem set it). chown clears set-id bits, so they are
    /// put back. A daemon running as an ordinary user cannot chown, and
    /// serves only that user unless allow_other is set (then, like bindfs,
    /// new entries belong to the daemon's user). Returns true if it changed anything.
    func adoptOwnership(fd: Int32, parentFD: Int32, caller: Caller, mode: mode_t, st: inout stat,
                        pathFD: Bool) throws(Errno) -> Bool {
        guard actsForOthers else { return false }
        var gid = caller.gid
        if st.st_gid != gid {
            let parent = try Sys.fstat(parentFD)
            if parent.st_mode & S_ISGID != 0 { gid = st.st_gid }
        }
        guard st.st_uid != caller.uid || st.st_gid != gid else { return false }
        try Sys.fchown(fd, caller.uid, gid)
        let type = st.st_mode & S_IFMT
        let setID = mode & (S_ISUID | S_ISGID)
        if setID != 0 && type != S_IFDIR && type != S_IFLNK {
            let perms = (st.st_mode & 0o7777) | setID
            if pathFD { try Sys.chmod(pathFD: fd, perms) } else { try Sys.fchmod(fd, perms) }
        }
        return true
    }

    /// The flags to open a backing file with, and whether the kernel should
    /// bypass its page cache for this handle.
    func backingOpenFlags(_ requested: Int32) -> (Int32, direct: Bool) {
        var flags = requested & ~(O_NOCTTY | O_NOFOLLOW | VANISH_O_DIRECT)
        let direct = requested & VANISH_O_DIRECT != 0
        if options.writeback {
            // With write-back caching the kernel may read back pages of a
            // write-only file and does O_APPEND itself.
            if flags & O_ACCMODE == O_WRONLY { flags = (flags & ~O_ACCMODE) | O_RDWR }
            flags &= ~O_APPEND
        }
        return (flags, direct)
    }
}
