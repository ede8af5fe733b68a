import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

// Open files: the handle (fi->fh) is the backing fd itself.
extension PassthroughFilesystem {
    public func open(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let node = inode(ino)
        let flags = backingOpenFlags(fi.pointee.flags)
        let fd = try fds.withFD(node) { pathFD throws(Errno) in
            try fds.retryingOnFDExhaustion { () throws(Errno) in
                try Sys.withProcPath(pathFD) { path throws(Errno) in try Sys.open(path, flags) }
            }
        }
        fi.pointee.fh = UInt64(fd)
        configure(fi)
        fds.opened(node)
        req.reply(open: fi)
    }

    public func read(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                     _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        req.replyData(fd: Int32(truncatingIfNeeded: fi.pointee.fh), offset: offset, size: size)
    }

    public func write(_ req: Request, _ ino: fuse_ino_t, _ buf: UnsafeMutablePointer<fuse_bufvec>, offset: off_t,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let fd = Int32(truncatingIfNeeded: fi.pointee.fh)
        let n = vanish_write_buf_to_fd(buf, fd, offset)
        if n < 0 { throw Errno(rawValue: Int32(-n)) }
        if observing { writing.wrote(fd, req.caller) }
        req.reply(written: n)
    }

    public func flush(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        // close() of a duplicate reports deferred write errors (NFS, quotas)
        // to the program's close(), as the backing filesystem would.
        let fd = Int32(truncatingIfNeeded: fi.pointee.fh)
        let dup = try Sys.dup(fd)
        if Glibc.close(dup) < 0 { throw Errno(rawValue: errno) }
        // flush comes with the program's close(); release may come later, after
        // the program has moved on (renamed the file, say): report it here.
        if observing { emitWritten(inode(ino), fd: fd) }
        req.replyOK()
    }

    public func release(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let fd = Int32(truncatingIfNeeded: fi.pointee.fh)
        if observing { emitWritten(inode(ino), fd: fd) }
        Sys.close(fd)
        fds.closed(inode(ino))
        req.replyOK()
    }

    public func fsync(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        try Sys.fsync(Int32(truncatingIfNeeded: fi.pointee.fh), dataOnly: dataOnly)
        req.replyOK()
    }

    public func fallocate(_ req: Request, _ ino: fuse_ino_t, mode: Int32, offset: off_t, length: off_t,
                          _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        try Sys.fallocate(Int32(truncatingIfNeeded: fi.pointee.fh), mode, offset, length)
        if observing { writing.wrote(Int32(truncatingIfNeeded: fi.pointee.fh), req.caller) }
        req.replyOK()
    }

    public func copyFileRange(_ req: Request, input: fuse_ino_t, inputOffset: off_t,
                              _ fiIn: UnsafeMutablePointer<fuse_file_info>, output: fuse_ino_t,
                              outputOffset: off_t, _ fiOut: UnsafeMutablePointer<fuse_file_info>,
                              length: Int, flags: Int32) throws(Errno) {
        let inFD = Int32(truncatingIfNeeded: fiIn.pointee.fh)
        let outFD = Int32(truncatingIfNeeded: fiOut.pointee.fh)
        let n = try Sys.copyFileRange(inFD, inputOffset, outFD, outputOffset, length, UInt32(bitPattern: flags))
        // The new file's data comes from another file in the mount: say which.
        if observing { writing.wrote(outFD, req.caller, source: (path(of: inode(input)), fileID(of: inode(input), fd: inFD))) }
        req.reply(written: n)
    }

    public func lseek(_ req: Request, _ ino: fuse_ino_t, offset: off_t, whence: Int32,
                      _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        req.reply(offset: try Sys.lseek(Int32(truncatingIfNeeded: fi.pointee.fh), offset, whence))
    }
}
