import FUSEKit
import CFuse
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

// The one place where entries leave or move in the backing directory, and
// where new entries get their owner. The graveyard (instant delete) and the
// event journal hook in here.
extension PassthroughFilesystem {
    /// Removes `name` from the directory `parentFD`.
    ///
    /// unlink is one rename into the graveyard, so the caller never waits for
    /// data to be freed, except where unlinking frees no data anyway and a
    /// graveyard link would show: a file with other hard links (their
    /// st_nlink must drop now) or one programs hold open (fstat must say
    /// st_nlink 0; its space returns at the last close, as POSIX says).
    /// rmdir stays a real rmdir: only an empty directory may go (ENOTEMPTY),
    /// and removing one frees no data.
    func removeEntry(parentFD: Int32, name: UnsafePointer<CChar>, directory: Bool) throws(Errno) {
        if directory {
            try Sys.unlinkat(parentFD, name, AT_REMOVEDIR)
            return
        }
        let st = try Sys.lstatat(parentFD, name)
        if st.st_nlink > 1 || holdIfOpen(st) {
            try Sys.unlinkat(parentFD, name, 0)
        } else {
            try bury(parentFD, name)
        }
    }

    /// Moves an entry into the graveyard; on another filesystem (EXDEV)
    /// deletes it at once instead.
    func bury(_ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) {
        guard let graveyard, let reaper else {
            try deleteNow(parentFD, name)
            return
        }
        do {
            reaper.noteBuried(shard: try graveyard.bury(parentFD, name))
        } catch .improperLink {
            noteSynchronousDelete()
            try deleteNow(parentFD, name)
        }
    }

    /// Deletes an entry that cannot reach the graveyard (a nested filesystem).
    private func deleteNow(_ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) {
        do {
            try Sys.unlinkat(parentFD, name, 0)
        } catch .isDirectory {
            try Sys.unlinkat(parentFD, name, AT_REMOVEDIR)
        }
    }

    private func noteSynchronousDelete() {
        log.notice("an entry on a nested filesystem was deleted in the request (it cannot reach the graveyard)")
    }

    /// Keeps a file that is about to lose its name reachable while programs
    /// have it open; returns whether any do.
    @discardableResult
    func holdIfOpen(_ st: stat) -> Bool {
        guard fds.anyOpen, st.st_mode & S_IFMT == S_IFREG, let node = table.known(st) else { return false }
        return fds.holdIfOpen(node)
    }

    /// Renames with renameat2 semantics (NOREPLACE, EXCHANGE passed through).
    func renameEntry(_ pfd: Int32, _ name: UnsafePointer<CChar>, _ npfd: Int32, _ newName: UnsafePointer<CChar>,
                     flags: UInt32) throws(Errno) {
        let target = flags & VANISH_RENAME_EXCHANGE == 0 ? try? Sys.lstatat(npfd, newName) : nil
        if flags == 0, let target, target.st_mode & S_IFMT != S_IFDIR, target.st_nlink == 1, !holdIfOpen(target),
           let source = try? Sys.lstatat(pfd, name), source.st_mode & S_IFMT != S_IFDIR,
           source.st_ino != target.st_ino || source.st_dev != target.st_dev {
            // Replacing a file whose data the replacement would free: swap the
            // two atomically (the new name never goes missing), then bury the
            // old target from where the source was, so the reaper frees it.
            try Sys.renameat2(pfd, name, npfd, newName, VANISH_RENAME_EXCHANGE)
            try bury(pfd, name)
            return
        }
        try Sys.renameat2(pfd, name, npfd, newName, flags)
    }

    /// The state directory's name may not be made, opened or replaced through the mount.
    @inline(__always)
    func checkNotReserved(_ parent: Inode, _ name: UnsafePointer<CChar>) throws(Errno) {
        if isReserved(parent, name) { throw .notPermitted }
    }

    @inline(__always)
    func isReserved(_ parent: Inode, _ name: UnsafePointer<CChar>) -> Bool {
        // ".vanish" in the source root, compared without allocating.
        parent === table.root && name[0] == 0x2E && graveyard != nil && strcmp(name, Graveyard.stateDirectoryName) == 0
    }

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
