import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

// Attributes, links, extended attributes, permission checks, statfs.
extension VanishFilesystem {
    public func getattr(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        let node = inode(ino)
        // A directory's mtime and size must already show its unlinks.
        // Prefer the open handle: it still works after the name was unlinked.
        // statx, for the birth time a program may have asked for (FUSE_STATX).
        var (st, birth) = if let fi, !node.isDirectory {
            try Sys.fstatWithBirth(Int32(truncatingIfNeeded: fi.pointee.fh))
        } else if let found = namespace.statByName(node) {
            found
        } else {
            try namespace.withFD(node) { fd throws(Errno) in try Sys.fstatWithBirth(fd) }
        }
        changes.sawDirectory(node, st)
        node.sawAttributes(st)
        st = source.devices.present(st)
        req.reply(attr: &st, timeout: cacheTimeout(node), birth: birth)
    }

    public func setattr(_ req: Request, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>, toSet: Int32,
                        _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        let node = inode(ino)
        // Setting a directory's mtime is a change of ours (see `EventRecorder.sawDirectory`).
        if toSet & (FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_MTIME_NOW) != 0 { node.willChangeEntries() }
        let openFD: Int32? = (fi != nil && !node.isDirectory) ? Int32(truncatingIfNeeded: fi!.pointee.fh) : nil
        let isSymlink = node.isSymlink
        // A truncate by anyone but root clears setuid/setgid, as a write does.
        let clears = actsForOthers && toSet & FUSE_SET_ATTR_SIZE != 0 && toSet & FUSE_SET_ATTR_MODE == 0
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
                    self.files.clearPrivileges(file, kills, nil)
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
        st = source.devices.present(st)
        req.reply(attr: &st, timeout: cacheTimeout(node))
    }

    /// The setattr bits that name a field to change (the rest say how).
    private static let attributeFields = FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID | FUSE_SET_ATTR_SIZE
        | FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW

    public func readlink(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        let node = inode(ino)
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: Int(PATH_MAX) + 1, alignment: 1)
        defer { buffer.deallocate() }
        let n = try namespace.withFD(node) { fd throws(Errno) in
            try Sys.readlink(fd, into: UnsafeMutableRawBufferPointer(rebasing: buffer[..<Int(PATH_MAX)]))
        }
        buffer[n] = 0
        req.reply(link: buffer.baseAddress!.assumingMemoryBound(to: CChar.self))
    }

    public func statfs(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        var st = try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.fstatvfs(fd) }
        req.reply(statfs: &st)
    }

    public func access(_ req: Request, _ ino: fuse_ino_t, mask: Int32) throws(Errno) {
        try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.access(fd, mask) }
        req.replyOK()
    }

    /// The inode-flag ioctls (`lsattr`, `chattr`, `xfs_io -c stat`/`chproj`),
    /// the only ones served: the kernel sends them through its own checked
    /// path (the caller owns the file, or is capable; CAP_LINUX_IMMUTABLE
    /// for immutable and append-only), opening the file for them; any other
    /// command is ENOTTY, as for a file that knows none.
    public func ioctl(_ req: Request, _ ino: fuse_ino_t, command: UInt32, _ fi: UnsafeMutablePointer<fuse_file_info>,
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
            if sets { caches.invalidations.attributes(of: ino) }
            if sets { changes.flagsChanged(req, inode(ino)) }
            req.reply(ioctl: 0, output: UnsafeRawBufferPointer(rebasing: output[..<count]))
        }
    }

    public func setxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, value: UnsafePointer<CChar>?,
                         size: Int, flags: Int32) throws(Errno) {
        if isDeleteTrigger(name) {
            try deleteByTrigger(req, ino)
            req.replyOK()
            return
        }
        // The status name answers reads only; stored, it would shadow nothing and mislead.
        if isControlName(name) { throw .notPermitted }
        try namespace.withFD(inode(ino)) { fd throws(Errno) in
            try Sys.setxattr(pathFD: fd, name, value, size, flags)
            // Setting an access ACL clears setgid when the caller is not in
            // the file's group (FUSE_SETXATTR_ACL_KILL_SGID, which libfuse
            // 3.14 does not pass on); the daemon's own rights would keep it.
            if actsForOthers, req.caller.uid != 0, strcmp(name, "system.posix_acl_access") == 0,
               let st = try? Sys.fstat(fd), st.st_mode & S_ISGID != 0, !req.isInGroup(st.st_gid) {
                try Sys.chmod(pathFD: fd, st.st_mode & 0o7777 & ~S_ISGID)
            }
        }
        caches.absentXattrs.changed(inode(ino))
        if changesMode(name) { caches.invalidations.attributes(of: ino) }
        changes.xattrChanged(req, inode(ino), name: name)
        req.replyOK()
    }

    /// Whether setting or removing xattr `name` changes the file's mode (an
    /// access ACL carries the group and other bits): the kernel, which keeps
    /// the mode it was last told, must drop it.
    @inline(__always)
    func changesMode(_ name: UnsafePointer<CChar>) -> Bool {
        name[0] == 0x73 && strcmp(name, "system.posix_acl_access") == 0
    }

    public func getxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, size: Int) throws(Errno) {
        if isStatusQuery(ino, name) {
            guard var json = statusJSON(for: req.caller.uid) else { throw .noData }
            let count = json.utf8.count
            if size == 0 { req.reply(xattrSize: count); return }
            guard size >= count else { throw .outOfRange }
            json.withUTF8 { req.reply(bytes: UnsafeRawBufferPointer($0)) }
            return
        }
        let node = inode(ino)
        if caches.absentXattrs.knownNone(node) { throw .noData }
        do throws(Errno) {
            if size == 0 {
                req.reply(xattrSize: try readXattr(node, name, nil))
                return
            }
            let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: size, alignment: 1)
            defer { buffer.deallocate() }
            let n = try readXattr(node, name, buffer)
            req.reply(bytes: UnsafeRawBufferPointer(rebasing: buffer[..<n]))
        } catch .noData {
            caches.absentXattrs.learn(node) { () throws(Errno) in try listXattrs(node, nil) }
            throw .noData
        } catch .notSupported where isACLName(name) && kernel.checksACLs.load(ordering: .relaxed) {
            // A file system inside the source that keeps no ACLs: for the
            // kernel's check, no ACL (the mode bits decide, as they do there).
            throw .noData
        }
    }

    @inline(__always)
    private func isACLName(_ name: UnsafePointer<CChar>) -> Bool {
        name[0] == 0x73 && (strcmp(name, "system.posix_acl_access") == 0 || strcmp(name, "system.posix_acl_default") == 0)
    }

    public func listxattr(_ req: Request, _ ino: fuse_ino_t, size: Int) throws(Errno) {
        let node = inode(ino)
        if caches.absentXattrs.knownNone(node) {
            if size == 0 { req.reply(xattrSize: 0) } else { req.reply(bytes: UnsafeRawBufferPointer(start: nil, count: 0)) }
            return
        }
        // The kernel lists trusted.* names only to CAP_SYS_ADMIN; the daemon,
        // which has it when it runs as root, lists them for root's calls only
        // (uid 0 stands for it).
        if req.caller.uid != 0 && actsForOthers {
            try listXattrsWithoutTrusted(req, node, size: size)
            return
        }
        let n: Int
        if size == 0 {
            n = try listXattrs(node, nil)
            req.reply(xattrSize: n)
        } else {
            let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: size, alignment: 1)
            defer { buffer.deallocate() }
            n = try listXattrs(node, buffer)
            req.reply(bytes: UnsafeRawBufferPointer(rebasing: buffer[..<n]))
        }
        caches.absentXattrs.learn(node) { () throws(Errno) in n }
    }

    /// listxattr without trusted.* names: the whole list is read (the size
    /// the kernel asks first must be that of what is then given).
    private func listXattrsWithoutTrusted(_ req: Request, _ node: Inode, size: Int) throws(Errno) {
        var capacity = max(size, 256)
        while true {
            let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: capacity, alignment: 1)
            defer { buffer.deallocate() }
            let n: Int
            do throws(Errno) { n = try listXattrs(node, buffer) } catch .outOfRange {
                capacity = try listXattrs(node, nil) + 256
                continue
            }
            var kept = 0
            var i = 0
            while i < n {
                let start = buffer.baseAddress! + i
                let length = strlen(start.assumingMemoryBound(to: CChar.self)) + 1
                if !(length > 8 && memcmp(start, "trusted.", 8) == 0) {
                    if kept != i { memmove(buffer.baseAddress! + kept, start, length) }
                    kept += length
                }
                i += length
            }
            if size == 0 { req.reply(xattrSize: kept); return }
            guard kept <= size else { throw .outOfRange }
            req.reply(bytes: UnsafeRawBufferPointer(rebasing: buffer[..<kept]))
            return
        }
    }

    /// getxattr of `node`. `ls -l` asks for an xattr of every entry right
    /// after readdirplus, which opened none of them: where the kernel has
    /// getxattrat, read it through the parent's fd and the name (one call)
    /// instead of opening, verifying and going through /proc (three).
    private func readXattr(_ node: Inode, _ name: UnsafePointer<CChar>,
                           _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        if XattrAt.usable, !namespace.isCached(node), let (parent, entry) = table.location(of: node) {
            do {
                return try entry.withUnsafeBufferPointer { e throws(Errno) in
                    try namespace.atName(parent, e.baseAddress!) { pfd throws(Errno) in try Sys.getxattrat(pfd, e.baseAddress!, name, buffer) }
                }
            } catch .noFunction {
                XattrAt.usable = false
            }
        }
        return try namespace.withFD(node) { fd throws(Errno) in try Sys.getxattr(pathFD: fd, name, buffer) }
    }

    /// listxattr of `node`, by the same route as `readXattr`.
    private func listXattrs(_ node: Inode, _ buffer: UnsafeMutableRawBufferPointer?) throws(Errno) -> Int {
        if XattrAt.usable, !namespace.isCached(node), let (parent, entry) = table.location(of: node) {
            do {
                return try entry.withUnsafeBufferPointer { e throws(Errno) in
                    try namespace.atName(parent, e.baseAddress!) { pfd throws(Errno) in try Sys.listxattrat(pfd, e.baseAddress!, buffer) }
                }
            } catch .noFunction {
                XattrAt.usable = false
            }
        }
        return try namespace.withFD(node) { fd throws(Errno) in try Sys.listxattr(pathFD: fd, buffer) }
    }

    public func removexattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if isControlName(name) { throw .notPermitted }
        try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.removexattr(pathFD: fd, name) }
        caches.absentXattrs.changed(inode(ino))
        if changesMode(name) { caches.invalidations.attributes(of: ino) }
        changes.xattrChanged(req, inode(ino), name: name)
        req.replyOK()
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
