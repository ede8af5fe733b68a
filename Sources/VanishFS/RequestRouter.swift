import CFuse
import CLinux
import FUSEKit
import Glibc
import SystemPackage

/// The handler types, one per group of operations, each holding only what
/// it uses; `MountParts` builds them, the router sends each request to one.
struct RequestHandlers: Sendable {
    /// What replies naming a file carry, and the names the mount keeps.
    let replies: EntryReplies
    let reserved: ReservedNames
    let files: FileHandlers
    let directories: DirectoryHandlers
    let attributes: AttributeHandlers
    let xattrs: XattrHandlers
    let entries: EntryHandlers
    let trash: TrashRequests
    let exported: ExportedHandles
    let deleteTrigger: DeleteTrigger
}

/// The filesystem the session serves: each operation goes to its handler
/// type (`RequestHandlers`), after one bit test of its node id sends
/// requests on the desktop trash folders (`TrashFolders`: their node ids,
/// and `.Trash-$uid` in the root) to theirs; "." and ".." to
/// `ExportedHandles`, the delete trigger to `DeleteTrigger`, the status
/// query to the mount (`VanishFilesystem`), which also starts and ends the
/// session.
public final class RequestRouter: LowLevelFilesystem {
    let fs: VanishFilesystem
    private let h: RequestHandlers

    public init(_ fs: VanishFilesystem) {
        self.fs = fs
        h = fs.handlers
    }

    @inline(__always) private func ours(_ ino: fuse_ino_t) -> Bool { TrashFolders.owns(ino) }

    public func initialize(_ conn: UnsafeMutablePointer<fuse_conn_info>, transport: Transport) {
        fs.initialize(conn, transport: transport)
    }
    public func destroy() { fs.destroy() }

    public func lookup(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ours(parent) { return try h.trash.lookup(req, parent: parent, name: name) }
        if let uid = h.reserved.trashFolderUID(parent, name) { return try h.trash.lookupFolder(req, uid) }
        // "." and "..": only for file handles (path walks resolve them in the kernel).
        if name[0] == 0x2E && (name[1] == 0 || (name[1] == 0x2E && name[2] == 0)) {
            return try h.exported.lookup(req, parent, dotDot: name[1] != 0)
        }
        try h.entries.lookup(req, parent: parent, name: name)
    }
    public func forget(_ ino: fuse_ino_t, count: UInt64) {
        if ours(ino) { h.trash.trashFolders?.forget(ino, count: count) } else { h.entries.forget(ino, count: count) }
    }
    public func getattr(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        if ours(ino) { return try h.trash.getattr(req, ino) }
        try h.attributes.getattr(req, ino, fi)
    }
    public func setattr(_ req: Request, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>, toSet: Int32,
                        _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno) {
        if ours(ino) { return try h.trash.setattr(req, ino, attr, toSet: toSet) }
        try h.attributes.setattr(req, ino, attr, toSet: toSet, fi)
    }
    public func readlink(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        if ours(ino) { throw .invalidArgument }
        try h.attributes.readlink(req, ino)
    }
    public func mknod(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t, rdev: dev_t) throws(Errno) {
        if ours(parent), h.trash.isAnnouncing(req, parent, name) { return try h.trash.answer(req, parent: parent, name: name) }
        if ours(parent) || h.reserved.trashFolderUID(parent, name) != nil { throw .notPermitted }
        try h.entries.mknod(req, parent: parent, name: name, mode: mode, rdev: rdev)
    }
    public func mkdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t) throws(Errno) {
        if ours(parent), h.trash.isAnnouncing(req, parent, name) { return try h.trash.answer(req, parent: parent, name: name) }
        if ours(parent) || h.reserved.trashFolderUID(parent, name) != nil { return try h.trash.mkdir(req, parent: parent, name: name) }
        try h.entries.mkdir(req, parent: parent, name: name, mode: mode)
    }
    public func unlink(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ours(parent) { return try h.trash.unlink(req, parent: parent, name: name) }
        if h.reserved.trashFolderUID(parent, name) != nil { throw .isDirectory }
        try h.entries.unlink(req, parent: parent, name: name)
    }
    public func rmdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ours(parent) || h.reserved.trashFolderUID(parent, name) != nil { return try h.trash.rmdir(req, parent: parent, name: name) }
        if try h.deleteTrigger.removeArmed(req, parent: parent, name: name) { return }
        try h.entries.rmdir(req, parent: parent, name: name)
    }
    public func symlink(_ req: Request, target: UnsafePointer<CChar>, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ours(parent), h.trash.isAnnouncing(req, parent, name) { return try h.trash.answer(req, parent: parent, name: name) }
        if ours(parent) || h.reserved.trashFolderUID(parent, name) != nil { throw .notPermitted }
        try h.entries.symlink(req, target: target, parent: parent, name: name)
    }
    public func rename(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, newParent: fuse_ino_t,
                       newName: UnsafePointer<CChar>, flags: UInt32) throws(Errno) {
        if ours(parent) || ours(newParent) {
            return try h.trash.rename(req, parent: parent, name: name, newParent: newParent, newName: newName, flags: flags)
        }
        if h.reserved.trashFolderUID(parent, name) != nil || h.reserved.trashFolderUID(newParent, newName) != nil { throw .notPermitted }
        try h.entries.rename(req, parent: parent, name: name, newParent: newParent, newName: newName, flags: flags)
    }
    public func link(_ req: Request, _ ino: fuse_ino_t, newParent: fuse_ino_t, newName: UnsafePointer<CChar>) throws(Errno) {
        if ours(ino) || ours(newParent) || h.reserved.trashFolderUID(newParent, newName) != nil { throw .notPermitted }
        try h.entries.link(req, ino, newParent: newParent, newName: newName)
    }
    public func open(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return try h.trash.open(req, ino, fi) }
        try h.files.open(req, ino, fi)
    }
    public func read(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                     _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return try h.trash.read(req, ino, size: size, offset: offset) }
        try h.files.read(req, ino, size: size, offset: offset, fi)
    }
    public func write(_ req: Request, _ ino: fuse_ino_t, _ buf: UnsafeMutablePointer<fuse_bufvec>, offset: off_t,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return try h.trash.write(req, ino, buf, offset: offset) }
        try h.files.write(req, ino, buf, offset: offset, fi)
    }
    public func flush(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return req.replyOK() }
        try h.files.flush(req, ino, fi)
    }
    public func release(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return req.replyOK() }
        try h.files.release(req, ino, fi)
    }
    public func fsync(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return req.replyOK() }
        try h.files.fsync(req, ino, dataOnly: dataOnly, fi)
    }
    public func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return try h.trash.opendir(req, ino, fi) }
        try h.directories.opendir(req, ino, fi)
    }
    public func readdir(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                        _ fi: UnsafeMutablePointer<fuse_file_info>, plus: Bool) throws(Errno) {
        if ours(ino) { return try h.trash.readdir(req, size: size, offset: offset, fi, plus: plus) }
        try h.directories.readdir(req, ino, size: size, offset: offset, fi, plus: plus)
    }
    public func releasedir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return h.trash.releasedir(req, fi) }
        h.deleteTrigger.armed.released(handle: fi.pointee.fh)
        try h.directories.releasedir(req, ino, fi)
    }
    public func fsyncdir(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { return req.replyOK() }
        try h.directories.fsyncdir(req, ino, dataOnly: dataOnly, fi)
    }
    public func statfs(_ req: Request, _ ino: fuse_ino_t) throws(Errno) {
        try h.attributes.statfs(req, ours(ino) ? fuse_ino_t(FUSE_ROOT_ID) : ino)
    }
    public func setxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, value: UnsafePointer<CChar>?,
                         size: Int, flags: Int32) throws(Errno) {
        if ours(ino) { throw .notSupported }
        if ControlNames.isDeleteTrigger(name, flags: flags) {
            let deleted = try h.deleteTrigger.delete(req, ino)
            req.replyOK()
            return h.deleteTrigger.answered(deleted)
        }
        try h.xattrs.setxattr(req, ino, name: name, value: value, size: size, flags: flags)
    }
    public func getxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, size: Int) throws(Errno) {
        if ours(ino) { throw .noData }
        if ControlNames.isStatusQuery(ino, name) { return try fs.replyStatus(req, size: size) }
        try h.xattrs.getxattr(req, ino, name: name, size: size)
    }
    public func listxattr(_ req: Request, _ ino: fuse_ino_t, size: Int) throws(Errno) {
        if ours(ino) { return req.reply(xattrSize: 0) }
        try h.xattrs.listxattr(req, ino, size: size)
    }
    public func removexattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno) {
        if ours(ino) { throw .noData }
        try h.xattrs.removexattr(req, ino, name: name)
    }
    public func access(_ req: Request, _ ino: fuse_ino_t, mask: Int32) throws(Errno) {
        if ours(ino) { return try h.trash.access(req, ino, mask: mask) }
        try h.attributes.access(req, ino, mask: mask)
    }
    public func create(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t,
                       _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(parent) { return try h.trash.create(req, parent: parent, name: name, fi) }
        if h.reserved.trashFolderUID(parent, name) != nil { throw .isDirectory }
        try h.entries.create(req, parent: parent, name: name, mode: mode, fi)
    }
    public func tmpfile(_ req: Request, parent: fuse_ino_t, mode: mode_t,
                        _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(parent) { throw .notSupported }
        try h.entries.tmpfile(req, parent: parent, mode: mode, fi)
    }
    public func ioctl(_ req: Request, _ ino: fuse_ino_t, command: UInt32, _ fi: UnsafeMutablePointer<fuse_file_info>,
                      flags: UInt32, input: UnsafeRawBufferPointer, outputSize: Int) throws(Errno) {
        if ours(ino) { throw .inappropriateIOCTLForDevice }
        if command == VANISH_IOC_REMOVE_ON_RMDIR {
            guard flags & UInt32(FUSE_IOCTL_DIR) != 0 else { throw .notDirectory }
            try h.deleteTrigger.armed.arm(pid: req.caller.pid, uid: req.caller.uid, ino: ino, handle: fi.pointee.fh)
            return req.reply(ioctl: 0, output: UnsafeRawBufferPointer(start: nil, count: 0))
        }
        try h.attributes.ioctl(req, ino, command: command, fi, flags: flags, input: input, outputSize: outputSize)
    }
    public func fallocate(_ req: Request, _ ino: fuse_ino_t, mode: Int32, offset: off_t, length: off_t,
                          _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { throw .notSupported }
        try h.files.fallocate(req, ino, mode: mode, offset: offset, length: length, fi)
    }
    public func copyFileRange(_ req: Request, input: fuse_ino_t, inputOffset: off_t, _ fiIn: UnsafeMutablePointer<fuse_file_info>,
                              output: fuse_ino_t, outputOffset: off_t, _ fiOut: UnsafeMutablePointer<fuse_file_info>,
                              length: Int, flags: Int32) throws(Errno) {
        // The kernel copies through read and write instead.
        if ours(input) || ours(output) { throw .notSupported }
        try h.files.copyFileRange(req, input: input, inputOffset: inputOffset, fiIn, output: output, outputOffset: outputOffset,
                             fiOut, length: length, flags: flags)
    }
    public func lseek(_ req: Request, _ ino: fuse_ino_t, offset: off_t, whence: Int32,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        if ours(ino) { throw .invalidArgument }
        try h.files.lseek(req, ino, offset: offset, whence: whence, fi)
    }
}
