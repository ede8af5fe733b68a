import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

/// The handlers of open files: the handle (fi->fh) holds the backing fd
/// (see `FileHandle`). With passthrough the kernel reads and writes the
/// backing file itself, and only open, flush, fsync, fallocate,
/// copy_file_range, lseek and release come here. It holds only what these
/// handlers use; the router calls it, and create hands it the handles it
/// makes (`opened`).
struct FileHandlers: Sendable {
    let namespace: BackingNamespace
    /// Descriptor shares and passthrough ids of open files.
    let openFiles: OpenFiles
    let changes: any ChangeObserver
    /// Where the kernel is told to drop a file's attributes.
    let invalidations: EntryInvalidations
    /// For writes that meet a full disk while the undo window holds space (`makingRoom`).
    let deleter: Deleter
    let cache: CacheMode
    /// How a caller's open flags become the backing file's.
    let openFlags: OpenFlagPolicy
    /// Whether requests are served in microseconds (see `SourceRoot.isLocalDisk`).
    let sourceIsLocalDisk: Bool

    private var table: InodeTable { namespace.table }

    @inline(__always)
    private func inode(_ id: fuse_ino_t) -> Inode { table.inode(id) }

    func open(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let node = inode(ino)
        let flags = openFlags.backing(fi.pointee.flags)
        let caller = req.caller
        try openFiles.shares.take(caller.uid)
        var known: stat? = nil
        let fd: Int32
        do throws(Errno) {
            if let (byName, st) = namespace.openByName(node, flags: flags) {
                fd = byName
                known = st
            } else {
                fd = try namespace.withFD(node) { pathFD throws(Errno) in
                    try namespace.retryingOnFDExhaustion { () throws(Errno) in
                        try Sys.withProcPath(pathFD) { path throws(Errno) in try Sys.open(path, flags) }
                    }
                }
            }
        } catch {
            openFiles.shares.giveBack(caller.uid)
            throw error
        }
        let backing = opened(node, fd: fd, flags: flags, caller: caller, stat: known, fi, req)
        if req.reply(open: fi, backing: backing) == -ENOENT { abandonHandle(node, fi) }
    }

    /// Decides how a new handle of `node` is served, fills in `fi` and
    /// returns the backing id its reply carries (0: none). For open and
    /// create (which has the new file's `stat` already), once the caller's
    /// handle share was taken.
    func opened(_ node: Inode, fd: Int32, flags: Int32, caller: Caller, stat known: stat?,
                _ fi: UnsafeMutablePointer<fuse_file_info>, _ req: Request) -> Int32 {
        openFiles.shares.opened(fd, by: caller.uid)
        let kills = node.type == S_IFREG ? privilegesToClear(node, fd: fd, flags: flags, stat: known, req) : nil
        // A writer while the trash holds space it may need writes through
        // the daemon, which frees kept entries for it rather than fail (ENOSPC).
        let tight = flags & O_ACCMODE != O_RDONLY && deleter.reaper?.spaceIsTight(pending: deleter.burials.keptBytes) == true
        let (kind, backing) = node.type == S_IFREG && openFiles.passthrough.active
            ? openFiles.passthrough.open(node, fd: fd, throughDaemon: kills != nil || tight
                                  || reopenRefused(known, flags: flags, caller: caller, req))
            : (OpenKind.daemon, Int32(0))
        fi.pointee.fh = FileHandle.make(fd: fd, kind: kind, kills: kills)
        configure(fi, kind, node)
        namespace.opened(node)
        if node.type == S_IFREG {
            let writing = writesData(node, fi)
            if writing && kind == .passthrough { node.passthroughWriter.store(caller.pid, ordering: .relaxed) }
            changes.opened(fd, node, writing: writing, passthrough: kind == .passthrough, stat: known, req)
        }
        return backing
    }

    /// Applies the cache policy to a freshly opened file served as `kind`.
    @inline(__always)
    private func configure(_ fi: UnsafeMutablePointer<fuse_file_info>, _ kind: OpenKind, _ node: Inode) {
        switch kind {
        // The kernel's page cache is the backing file's: nothing to keep or bypass.
        case .passthrough: break
        case .passthroughDirect: fi.pointee.direct_io = 1
        case .daemon, .cached:
            switch cache {
            case .always: fi.pointee.keep_cache = 1
            case .never: fi.pointee.direct_io = 1
            case .auto: break
            }
        }
        // A read-only handle has nothing for close() to report: no write
        // error can be pending on it, it never ends a writing session (the
        // `written` event), and locks are the kernel's. FOPEN_NOFLUSH spares
        // every close of it a round trip (cat, compilers, tar, git reading).
        if fi.pointee.flags & O_ACCMODE == O_RDONLY { fi.pointee.noflush = 1 }
        // A writer in passthrough writes the backing file itself, so no data
        // waits in the kernel at close, and where that file's own close can
        // report nothing (`SourceRoot.isLocalDisk`), a FLUSH would only dup and close
        // an fd: every created file (tar, git checkout, compilers) was one
        // round trip more. Its writing session still ends at the release.
        // O_RDWR handles keep it: a shared mapping, which needs O_RDWR, writes
        // behind the kernel's copy of the mtime, and only FLUSH comes before
        // close() returns (`dropAttributesIfMappedWrites`).
        else if sourceIsLocalDisk && node.key.dev == table.root.key.dev
                    && (kind == .passthrough || kind == .passthroughDirect)
                    && fi.pointee.flags & O_ACCMODE != O_RDWR {
            fi.pointee.noflush = 1
        }
    }

    /// For passthrough the kernel opens the backing file again, as the
    /// caller. A source that is not a local disk (GlusterFS, any FUSE or
    /// network file system) checks that opener itself, and refuses a file
    /// whose mode does not grant the caller the access asked for, as a file
    /// just made by `open(O_CREAT | O_RDWR, 0)` does not, which natively
    /// works: such a handle is served by the daemon.
    private func reopenRefused(_ st: stat?, flags: Int32, caller: Caller, _ req: Request) -> Bool {
        guard !sourceIsLocalDisk, let st else { return false }
        let wanted: mode_t = switch flags & O_ACCMODE {
        case O_RDONLY: 4
        case O_WRONLY: 2
        default: 6
        }
        // The supplementary groups matter only to the group's bits.
        let groups = st.st_uid == caller.uid || st.st_gid == caller.gid ? [] : req.groups()
        return !Credentials(uid: caller.uid, gid: caller.gid, groups: groups).modeBitsGrant(st, wanted)
    }

    func read(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                     _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        req.replyData(fd: FileHandle.fd(fi.pointee.fh), offset: offset, size: size)
    }

    func write(_ req: Request, _ ino: fuse_ino_t, _ buf: UnsafeMutablePointer<fuse_bufvec>, offset: off_t,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let fd = FileHandle.fd(fi.pointee.fh)
        let n = try deleter.makingRoom { () throws(Errno) in
            let n = vanish_write_buf_to_fd(buf, fd, offset)
            if n < 0 { throw Errno(rawValue: Int32(-n)) }
            return n
        }
        if let kills = FileHandle.kills(fi.pointee.fh) { clearPrivileges(.open(fd), kills, ino) }
        changes.wrote(fd, inode(ino), req)
        req.reply(written: n)
    }

    func flush(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        // close() of a duplicate reports deferred write errors (NFS, quotas)
        // to the program's close(), as the backing filesystem would.
        let fd = FileHandle.fd(fi.pointee.fh)
        let dup = try Sys.dup(fd)
        if Glibc.close(dup) < 0 { throw Errno(rawValue: errno) }
        // close() waits for this reply, not for the RELEASE: a stat right
        // after must not find the attributes from before mmap writes.
        // (FLUSH carries no open flags: the backing fd has the caller's access mode.)
        if FileHandle.kind(fi.pointee.fh) == .passthrough && fcntl(fd, F_GETFL) & O_ACCMODE == O_RDWR {
            dropAttributesIfMappedWrites(inode(ino), fd, wait: true)
        }
        req.replyOK()
    }

    func release(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        letGo(inode(ino), fi, report: true, during: req)
        req.replyOK()
    }

    /// Whether a handle of `node` opened with `fi`'s flags can write its data
    /// (and so belongs to the inode's writing session).
    @inline(__always)
    func writesData(_ node: Inode, _ fi: UnsafeMutablePointer<fuse_file_info>) -> Bool {
        node.type == S_IFREG && fi.pointee.flags & O_ACCMODE != O_RDONLY
    }

    /// A shared writable mmap (which needs O_RDWR) of a passthrough file
    /// changes it where neither the daemon nor the kernel's FUSE side sees
    /// (write(2) through passthrough the kernel notes itself): given the fd
    /// of such a handle, the kernel's copy of its attributes goes if the
    /// mtime moved.
    func dropAttributesIfMappedWrites(_ node: Inode, _ fd: Int32, wait: Bool) {
        guard let st = try? Sys.fstat(fd), node.mtimeDiffers(from: st) else { return }
        invalidations.attributes(of: table.nodeID(node), wait: wait)
    }

    /// Lets go of a handle whose open could not be answered (the caller was interrupted).
    func abandonHandle(_ node: Inode, _ fi: UnsafeMutablePointer<fuse_file_info>) {
        letGo(node, fi, report: false, during: nil)
    }

    /// Lets go of a handle: its share of the inode's backing id, its place in
    /// the writing or reading sessions (`report`: the `written` event its
    /// release may end), then its fd.
    ///
    /// The file stops counting as open before anything else: the kernel sent
    /// the RELEASE before the program's close() returned, and an unlink that
    /// follows it must not find the file open (that unlinks it in place, out
    /// of reach of the undo window). The last handle of a file inside a tree
    /// `vanish rm` buried also lets go of its cached fd: the kernel keeps such
    /// a file's dentry (under the invalidated tree) and so never forgets it,
    /// and that fd would hold the deleted file's space.
    private func letGo(_ node: Inode, _ fi: UnsafeMutablePointer<fuse_file_info>, report: Bool, during req: Request?) {
        let fh = fi.pointee.fh
        let fd = FileHandle.fd(fh)
        let last = namespace.closed(node)
        let kind = FileHandle.kind(fh)
        // A mapping may outlive the close (and its FLUSH) and write on.
        if kind == .passthrough && fi.pointee.flags & O_ACCMODE == O_RDWR {
            dropAttributesIfMappedWrites(node, fd, wait: false)
        }
        openFiles.passthrough.release(node, kind: kind)
        if kind == .passthrough && writesData(node, fi) {
            let pid = node.passthroughWriter.load(ordering: .relaxed)
            if pid > 0 { _ = node.passthroughWriter.compareExchange(expected: pid, desired: -pid, ordering: .relaxed) }
        }
        if node.type == S_IFREG { changes.released(fd, node, writing: writesData(node, fi), report: report, during: req) }
        openFiles.shares.released(fd)
        Sys.close(fd)
        if last && table.isBuried(node) { namespace.drop(node) }
    }

    func fsync(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        try Sys.fsync(FileHandle.fd(fi.pointee.fh), dataOnly: dataOnly)
        req.replyOK()
    }

    func fallocate(_ req: Request, _ ino: fuse_ino_t, mode: Int32, offset: off_t, length: off_t,
                          _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let fd = FileHandle.fd(fi.pointee.fh)
        try deleter.makingRoom { () throws(Errno) in try Sys.fallocate(fd, mode, offset, length) }
        if let kills = FileHandle.kills(fi.pointee.fh) { clearPrivileges(.open(fd), kills, ino) }
        changes.wrote(fd, inode(ino), req)
        req.replyOK()
    }

    func copyFileRange(_ req: Request, input: fuse_ino_t, inputOffset: off_t,
                              _ fiIn: UnsafeMutablePointer<fuse_file_info>, output: fuse_ino_t,
                              outputOffset: off_t, _ fiOut: UnsafeMutablePointer<fuse_file_info>,
                              length: Int, flags: Int32) throws(Errno) {
        let inFD = FileHandle.fd(fiIn.pointee.fh)
        let outFD = FileHandle.fd(fiOut.pointee.fh)
        let n = try deleter.makingRoom { () throws(Errno) in
            try Sys.copyFileRange(inFD, inputOffset, outFD, outputOffset, length, UInt32(bitPattern: flags))
        }
        if let kills = FileHandle.kills(fiOut.pointee.fh) { clearPrivileges(.open(outFD), kills, output) }
        changes.copied(from: inode(input), inFD, at: inputOffset, into: inode(output), outFD, at: outputOffset,
                       length: n, req)
        req.reply(written: n)
    }

    func lseek(_ req: Request, _ ino: fuse_ino_t, offset: off_t, whence: Int32,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        req.reply(offset: try Sys.lseek(FileHandle.fd(fi.pointee.fh), offset, whence))
    }
}

// Setuid, setgid and file capabilities. A write, truncate or fallocate by a
// process without CAP_FSETID clears them natively; the daemon's own writes
// as root never would, and with KILLPRIV_V2 (and passthrough, which the
// daemon never sees writes of) the kernel leaves it to the daemon.
extension FileHandlers {
    /// What writes through a new handle must clear, or nil: for a root
    /// daemon, a caller other than root, a writable open of a file that has
    /// anything to clear. Such handles stay off passthrough, so their
    /// writes come here. An O_TRUNC open clears at once.
    func privilegesToClear(_ node: Inode, fd: Int32, flags: Int32, stat known: stat?, _ req: Request) -> PrivilegeKill? {
        guard SourceRoot.actsForOthers, req.caller.uid != 0, flags & O_ACCMODE != O_RDONLY else { return nil }
        guard let st = known ?? (try? Sys.fstat(fd)) else { return nil }
        let kills = PrivilegeKill(outsideGroup: st.st_mode & S_ISGID != 0 && !req.isInGroup(st.st_gid))
        if kills.cleared(st.st_mode) != st.st_mode {
            if flags & O_TRUNC != 0 { clearPrivileges(.open(fd), kills, table.nodeID(node)) }
            return kills
        }
        return fgetxattr(fd, "security.capability", nil, 0) >= 0 ? kills : nil
    }

    /// Clears what `kills` says of `file`, and security.capability; the kernel is told to drop
    /// the mode it keeps for `ino`, which would otherwise still show the
    /// bits for the attribute timeout (for ever with cache=always).
    func clearPrivileges(_ file: FileRef, _ kills: PrivilegeKill, _ ino: fuse_ino_t?) {
        if kills.clear(file), let ino { invalidations.attributes(of: ino) }
    }
}

extension PrivilegeKill {
    /// Clears what this says of `file`, and security.capability; true if
    /// the mode changed.
    @discardableResult
    func clear(_ file: FileRef) -> Bool {
        var changed = false
        if let st = try? Sys.fstat(file.fd), case let mode = cleared(st.st_mode & 0o7777), mode != st.st_mode & 0o7777 {
            try? Sys.chmod(file, mode)
            changed = true
        }
        switch file {
        case .path(let fd):
            // The magic link names the inode itself; nothing is resolved by name.
            _ = try? Sys.withProcPath(fd) { path throws(Errno) in _ = CLinux.removexattr(path, "security.capability") }
        case .open(let fd):
            _ = fremovexattr(fd, "security.capability")
        }
        return changed
    }
}

/// The flags to open a backing file with.
///
/// O_DIRECT stays with the kernel, which bypasses its page cache for
/// the handle while the flag is set (fcntl may clear it) and still
/// allows a shared mmap, as a plain file does, through its page cache
/// (`direct_io` would send every read and write to the daemon). The
/// backing fd is buffered: writes arrive
/// spliced from a pipe, which an O_DIRECT fd refuses (EINVAL).
struct OpenFlagPolicy: Sendable {
    /// `atime=noatime` for a daemon acting for others on a shared source.
    let addsNoatime: Bool
    let writeback: Bool

    init(_ options: FilesystemOptions, _ source: SourceRoot) {
        addsNoatime = options.atime == .noatime && !source.isPrivateMount && SourceRoot.actsForOthers
        writeback = options.writeback
    }

    @inline(__always)
    func backing(_ requested: Int32) -> Int32 {
        var flags = requested & ~(O_NOCTTY | O_NOFOLLOW | VANISH_O_DIRECT)
        if addsNoatime { flags |= VANISH_O_NOATIME }
        if writeback {
            // With write-back caching the kernel may read back pages of a
            // write-only file and does O_APPEND itself.
            if flags & O_ACCMODE == O_WRONLY { flags = (flags & ~O_ACCMODE) | O_RDWR }
            flags &= ~O_APPEND
        }
        return flags
    }
}

