import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// The handlers of attributes: getattr and setattr, readlink, statfs,
/// access, and the inode-flag ioctls. Extended attributes are `XattrHandlers`.
struct AttributeHandlers: Sendable {
    let namespace: BackingNamespace
    let replies: EntryReplies
    let changes: any ChangeObserver
    /// Where the kernel is told to drop a file's attributes.
    let invalidations: EntryInvalidations

    @inline(__always)
    private func inode(_ id: fuse_ino_t) -> Inode { namespace.table.inode(id) }

    func getattr(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        let node = inode(ino)
        // A directory's mtime must already show its unlinks.
        // Prefer the open handle: it still works after the name was unlinked.
        // statx, for the birth time a program may have asked for (FUSE_STATX).
        var (st, birth, shown) = if node.isDirectory {
            try namespace.directoryAttributes(node)
        } else if let fi {
            try Self.same(Sys.fstatWithBirth(Int32(truncatingIfNeeded: fi.pointee.fh)))
        } else if let found = namespace.statByName(node) {
            Self.same(found)
        } else {
            try Self.same(namespace.withFD(node) { fd throws(Errno) in try Sys.fstatWithBirth(fd) })
        }
        changes.sawDirectory(node, st)
        node.sawAttributes(st)
        st = replies.devices.present(shown)
        req.reply(attr: &st, timeout: replies.cacheTimeout(node), birth: birth)
    }

    @inline(__always)
    private static func same(_ found: (stat, UInt64)) -> (stat, UInt64, stat) { (found.0, found.1, found.0) }

    func setattr(_ req: Request, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>, toSet: Int32,
                        _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        let node = inode(ino)
        // Setting a directory's mtime is a change of ours (see `EventRecorder.sawDirectory`).
        if toSet & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW) != 0 { node.willChangeEntries() }
        let openFD: Int32? = (fi != nil && !node.isDirectory) ? Int32(truncatingIfNeeded: fi!.pointee.fh) : nil
        let isSymlink = node.isSymlink
        // A truncate by anyone but root clears setuid/setgid, as a write does.
        let clears = SourceRoot.actsForOthers && toSet & FUSE_SET_ATTR_SIZE != 0 && toSet & FUSE_SET_ATTR_MODE == 0
            && req.caller.uid != 0
        let outsideGroup = { (gid: gid_t) in !req.isInGroup(gid) }
        let apply = { (file: FileRef) throws(Errno) -> stat in
            if toSet & FUSE_SET_ATTR_MODE != 0 { try Sys.chmod(file, attr.pointee.st_mode) }
            // chown(path, -1, -1) arrives with no field to set, and moves
            // only the ctime: it does the same on the backing file.
            if toSet & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID) != 0 || toSet & Self.attributeFields == 0 {
                let uid = toSet & FUSE_SET_ATTR_UID != 0 ? attr.pointee.st_uid : uid_t.max
                let gid = toSet & FUSE_SET_ATTR_GID != 0 ? attr.pointee.st_gid : gid_t.max
                try Sys.fchown(file.fd, uid, gid)
            }
            if toSet & FUSE_SET_ATTR_SIZE != 0 {
                try Sys.truncate(file, attr.pointee.st_size)
                if clears, let st = try? Sys.fstat(file.fd) {
                    // The reply carries the new mode: nothing for the kernel to drop.
                    let kills = PrivilegeKill(outsideGroup: st.st_mode & S_ISGID != 0 && outsideGroup(st.st_gid))
                    kills.clear(file)
                }
            }
            if toSet & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME) != 0 {
                var times = (timespec(tv_sec: 0, tv_nsec: VANISH_UTIME_OMIT), timespec(tv_sec: 0, tv_nsec: VANISH_UTIME_OMIT))
                if toSet & FUSE_SET_ATTR_ATIME_NOW != 0 { times.0.tv_nsec = VANISH_UTIME_NOW }
                else if toSet & FUSE_SET_ATTR_ATIME != 0 { times.0 = attr.pointee.st_atim }
                if toSet & FUSE_SET_ATTR_MTIME_NOW != 0 { times.1.tv_nsec = VANISH_UTIME_NOW }
                else if toSet & FUSE_SET_ATTR_MTIME != 0 { times.1 = attr.pointee.st_mtim }
                try withUnsafePointer(to: &times) { p throws(Errno) in
                    let ts = UnsafeRawPointer(p).assumingMemoryBound(to: timespec.self)
                    try Sys.setTimes(file, isSymlink: isSymlink, ts)
                }
            }
            return try Sys.fstat(file.fd)
        }
        let before = changes.settingAttributes(node, toSet: toSet) {
            try? openFD.map(Sys.fstat) ?? namespace.withFD(node) { fd throws(Errno) in try Sys.fstat(fd) }
        }
        // An open handle reaches the file even after its name is gone.
        var st = if let openFD { try apply(.open(openFD)) } else {
            try namespace.withFD(node) { fd throws(Errno) in try apply(.path(fd)) }
        }
        node.sawAttributes(st)
        changes.attributesChanged(req, node, toSet: toSet, before: before, after: st)
        st = replies.devices.present(st)
        req.reply(attr: &st, timeout: replies.cacheTimeout(node))
    }

    /// The setattr bits that name a field to change (the rest say how).
    private static let attributeFields = FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID | FUSE_SET_ATTR_SIZE
        | FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW

    func readlink(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        let node = inode(ino)
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: Int(PATH_MAX) + 1, alignment: 1)
        defer { buffer.deallocate() }
        let n = try namespace.withFD(node) { fd throws(Errno) in
            try Sys.readlink(fd, into: UnsafeMutableRawBufferPointer(rebasing: buffer[..<Int(PATH_MAX)]))
        }
        buffer[n] = 0
        req.reply(link: buffer.baseAddress!.assumingMemoryBound(to: CChar.self))
    }

    func statfs(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        var st = try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.fstatvfs(fd) }
        req.reply(statfs: &st)
    }

    func access(_ req: Request, _ ino: fuse_ino_t, mask: Int32) throws(Errno) {
        try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.access(fd, mask) }
        req.replyOK()
    }

    /// The inode-flag ioctls (`lsattr`, `chattr`, `xfs_io -c stat`/`chproj`),
    /// the only ones served: the kernel sends them through its own checked
    /// path (the caller owns the file, or is capable; CAP_LINUX_IMMUTABLE
    /// for immutable and append-only), opening the file for them; any other
    /// command is ENOTTY, as for a file that knows none.
    func ioctl(_ req: Request, _ ino: fuse_ino_t, command: UInt32, _ fi: UnsafeMutablePointer<fuse_file_info>,
                      flags: UInt32, input: UnsafeRawBufferPointer, outputSize: Int) throws(Errno) {
        let sets = command == VANISH_FS_IOC_SETFLAGS || command == VANISH_FS_IOC_FSSETXATTR
        guard sets || command == VANISH_FS_IOC_GETFLAGS || command == VANISH_FS_IOC_FSGETXATTR,
              flags & UInt32(FUSE_IOCTL_UNRESTRICTED) == 0 else { throw .inappropriateIOCTLForDevice }
        let fd = flags & UInt32(FUSE_IOCTL_DIR) != 0
            ? dirfd(DirectoryHandle.from(fi).stream) : FileHandle.fd(fi.pointee.fh)
        // struct fsxattr, the larger of the two arguments.
        try withUnsafeTemporaryAllocation(byteCount: 32, alignment: 8) { output throws(Errno) in
            // Zeroed: what the ioctl does not fill must not carry the stack to the caller.
            output.initializeMemory(as: UInt8.self, repeating: 0)
            let count = min(outputSize, output.count)
            let r = vanish_fileattr_ioctl(fd, command, input.baseAddress, input.count, output.baseAddress, count)
            if r < 0 { throw Errno(rawValue: -r) }
            // The flags moved the file's ctime, which the kernel does not know.
            if sets { invalidations.attributes(of: ino) }
            if sets { changes.flagsChanged(req, inode(ino)) }
            req.reply(ioctl: 0, output: UnsafeRawBufferPointer(rebasing: output[..<count]))
        }
    }
}

/// Whether the kernel has getxattrat/listxattrat (6.13+); cleared on the first ENOSYS.
enum XattrAt {
    static let available = Atomic<Bool>(true)
    static var usable: Bool {
        get { available.load(ordering: .relaxed) }
        set { available.store(newValue, ordering: .relaxed) }
    }
}
