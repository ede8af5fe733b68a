import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

/// The handlers of extended attributes. The mount's own requests
/// (`ControlNames`: the delete trigger, the status) never reach the source:
/// the router answers them, and these refuse to store the status name.
struct XattrHandlers: Sendable {
    let namespace: BackingNamespace
    let changes: any ChangeObserver
    /// Where the kernel is told to drop a file's attributes (an ACL moves the mode).
    let invalidations: EntryInvalidations
    /// Files known to have no xattrs, answered without a syscall.
    let absentXattrs: AbsentXattrs
    /// What the kernel agreed to at INIT (whether it checks ACLs).
    let kernel: KernelTerms

    private var table: InodeTable { namespace.table }

    @inline(__always)
    private func inode(_ id: fuse_ino_t) -> Inode { table.inode(id) }

    func setxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, value: UnsafePointer<CChar>?,
                  size: Int, flags: Int32) throws(Errno) {
        // The status name answers reads only; stored, it would shadow nothing and mislead.
        if ControlNames.isReserved(name) { throw .notPermitted }
        try namespace.withFD(inode(ino)) { fd throws(Errno) in
            try Sys.setxattr(pathFD: fd, name, value, size, flags)
            // Setting an access ACL clears setgid when the caller is not in
            // the file's group (FUSE_SETXATTR_ACL_KILL_SGID, which libfuse
            // 3.14 does not pass on); the daemon's own rights would keep it.
            if SourceRoot.actsForOthers, req.caller.uid != 0, strcmp(name, "system.posix_acl_access") == 0,
               let st = try? Sys.fstat(fd), st.st_mode & S_ISGID != 0, !req.isInGroup(st.st_gid) {
                try Sys.chmod(pathFD: fd, st.st_mode & 0o7777 & ~S_ISGID)
            }
        }
        absentXattrs.changed(inode(ino))
        if changesMode(name) { invalidations.attributes(of: ino) }
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

    func getxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, size: Int) throws(Errno) {
        let node = inode(ino)
        if absentXattrs.knownNone(node) { throw .noData }
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
            absentXattrs.learn(node) { () throws(Errno) in try listXattrs(node, nil) }
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

    func listxattr(_ req: Request, _ ino: fuse_ino_t, size: Int) throws(Errno) {
        let node = inode(ino)
        if absentXattrs.knownNone(node) {
            if size == 0 { req.reply(xattrSize: 0) } else { req.reply(bytes: UnsafeRawBufferPointer(start: nil, count: 0)) }
            return
        }
        // The kernel lists trusted.* names only to CAP_SYS_ADMIN; the daemon,
        // which has it when it runs as root, lists them for root's calls only
        // (uid 0 stands for it).
        if req.caller.uid != 0 && SourceRoot.actsForOthers {
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
        absentXattrs.learn(node) { () throws(Errno) in n }
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

    func removexattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ControlNames.isReserved(name) { throw .notPermitted }
        try namespace.withFD(inode(ino)) { fd throws(Errno) in try Sys.removexattr(pathFD: fd, name) }
        absentXattrs.changed(inode(ino))
        if changesMode(name) { invalidations.attributes(of: ino) }
        changes.xattrChanged(req, inode(ino), name: name)
        req.replyOK()
    }
}
