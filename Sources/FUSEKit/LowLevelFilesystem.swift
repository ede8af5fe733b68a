import CFuse
import Glibc
import SystemPackage

/// A filesystem served through libfuse's low-level API.
///
/// Each request handler either replies through `req` as its last step or
/// throws, and the binding replies with the thrown errno. Handlers run on
/// libfuse's worker threads, several at once (also within one directory:
/// PARALLEL_DIROPS), so implementations must be thread-safe. Handlers left
/// unimplemented answer ENOSYS, which the kernel remembers and stops sending.
public protocol LowLevelFilesystem: AnyObject, Sendable {
    /// Negotiates capabilities (`init`), libfuse's in `conn` and the newer
    /// ones through the session's `transport`; runs once before any request.
    func initialize(_ conn: UnsafeMutablePointer<fuse_conn_info>, transport: Transport)
    /// The session is ending (`destroy`).
    func destroy()

    func lookup(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno)
    /// Drops `count` kernel references; never replies (the binding does).
    func forget(_ ino: fuse_ino_t, count: UInt64)
    func getattr(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno)
    func setattr(_ req: Request, _ ino: fuse_ino_t, _ attr: UnsafeMutablePointer<stat>, toSet: Int32,
                 _ fi: UnsafeMutablePointer<fuse_file_info>?) throws(Errno)
    func readlink(_ req: Request, _ ino: fuse_ino_t) throws(Errno)
    func mknod(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t, rdev: dev_t) throws(Errno)
    func mkdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t) throws(Errno)
    func unlink(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno)
    func rmdir(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno)
    func symlink(_ req: Request, target: UnsafePointer<CChar>, parent: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno)
    func rename(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, newParent: fuse_ino_t,
                newName: UnsafePointer<CChar>, flags: UInt32) throws(Errno)
    func link(_ req: Request, _ ino: fuse_ino_t, newParent: fuse_ino_t, newName: UnsafePointer<CChar>) throws(Errno)
    func open(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func read(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func write(_ req: Request, _ ino: fuse_ino_t, _ buf: UnsafeMutablePointer<fuse_bufvec>, offset: off_t,
               _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func flush(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func release(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func fsync(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func readdir(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                 _ fi: UnsafeMutablePointer<fuse_file_info>, plus: Bool) throws(Errno)
    func releasedir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func fsyncdir(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func statfs(_ req: Request, _ ino: fuse_ino_t) throws(Errno)
    func setxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, value: UnsafePointer<CChar>?,
                  size: Int, flags: Int32) throws(Errno)
    func getxattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>, size: Int) throws(Errno)
    func listxattr(_ req: Request, _ ino: fuse_ino_t, size: Int) throws(Errno)
    func removexattr(_ req: Request, _ ino: fuse_ino_t, name: UnsafePointer<CChar>) throws(Errno)
    func access(_ req: Request, _ ino: fuse_ino_t, mask: Int32) throws(Errno)
    func create(_ req: Request, parent: fuse_ino_t, name: UnsafePointer<CChar>, mode: mode_t,
                _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    /// `open(O_TMPFILE)` in `parent`: a file with no name, opened as by
    /// `create` and answered with `reply(created:)`. libfuse 3.14 does not
    /// know the request; the transport brings it (see transport.c).
    func tmpfile(_ req: Request, parent: fuse_ino_t, mode: mode_t,
                 _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    /// A restricted ioctl on an open file or directory (`FUSE_IOCTL_DIR` in
    /// `flags`): `input` holds what the kernel fetched from the caller, and
    /// the reply (`reply(ioctl:output:)`) at most `outputSize` bytes.
    func ioctl(_ req: Request, _ ino: fuse_ino_t, command: UInt32, _ fi: UnsafeMutablePointer<fuse_file_info>,
               flags: UInt32, input: UnsafeRawBufferPointer, outputSize: Int) throws(Errno)
    func fallocate(_ req: Request, _ ino: fuse_ino_t, mode: Int32, offset: off_t, length: off_t,
                   _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
    func copyFileRange(_ req: Request, input: fuse_ino_t, inputOffset: off_t, _ fiIn: UnsafeMutablePointer<fuse_file_info>,
                       output: fuse_ino_t, outputOffset: off_t, _ fiOut: UnsafeMutablePointer<fuse_file_info>,
                       length: Int, flags: Int32) throws(Errno)
    func lseek(_ req: Request, _ ino: fuse_ino_t, offset: off_t, whence: Int32,
               _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno)
}
