import CFuse
import CFuseTransport
import Glibc
import Synchronization
import SystemPackage

/// Holds the filesystem for the C callbacks: the session's transport, which
/// `fuse_req_userdata` points to, has it as its owner.
final class SessionBox: @unchecked Sendable {
    let fs: any LowLevelFilesystem
    let requests = RequestCounter()
    /// Set once by `Session`, before the session exists.
    var transport: Transport?
    init(_ fs: any LowLevelFilesystem) { self.fs = fs }
}

/// Counts the requests the session has begun to serve, so background work
/// (the reaper) can tell whether programs are using the mount right now and
/// step aside. One relaxed atomic add per request.
public final class RequestCounter: Sendable {
    fileprivate let value = Atomic<UInt64>(0)

    /// Requests begun so far; only changes matter.
    public var count: UInt64 { value.load(ordering: .relaxed) }
}

@inline(__always)
private func box(_ req: fuse_req_t?) -> SessionBox {
    box(userdata: fuse_req_userdata(req))
}

@inline(__always)
private func box(userdata: UnsafeMutableRawPointer?) -> SessionBox {
    Unmanaged<SessionBox>.fromOpaque(vanish_transport_owner(userdata)!).takeUnretainedValue()
}

/// Runs a handler and answers the request with its errno if it throws, so no
/// request is ever left unanswered and no handler error can end the daemon.
@inline(__always)
private func serve(_ req: fuse_req_t?, awaited: Bool = true,
                   _ body: (any LowLevelFilesystem, Request) throws(Errno) -> Void) {
    vanish_request_begin(req, awaited ? fuse_req_ctx(req)!.pointee.pid : 0, awaited ? 1 : 0)
    let r = Request(req!)
    let b = box(req)
    b.requests.value.wrappingAdd(1, ordering: .relaxed)
    do throws(Errno) {
        try body(b.fs, r)
    } catch {
        r.reply(error: error)
    }
}

/// The `fuse_lowlevel_ops` table: one non-capturing trampoline per operation.
/// Operations that wait for the disk or for data (fsync, I/O the daemon
/// serves) first let another worker receive (`Workers.mayBlock`).
///
/// getlk/setlk and flock are left out on purpose: without them libfuse does
/// not advertise POSIX_LOCKS/FLOCK_LOCKS and the kernel arbitrates both kinds
/// of lock itself, across every process using the mount, with the owner
/// semantics POSIX asks for (which a daemon holding all files in one
/// process could not give).
func makeOperationTable() -> fuse_lowlevel_ops {
    var ops = fuse_lowlevel_ops()
    ops.`init` = { userdata, conn in
        let b = box(userdata: userdata)
        b.fs.initialize(conn!, transport: b.transport!)
    }
    ops.destroy = { userdata in box(userdata: userdata).fs.destroy() }
    ops.lookup = { req, parent, name in serve(req) { fs, r throws(Errno) in try fs.lookup(r, parent: parent, name: name!) } }
    ops.forget = { req, ino, n in
        box(req).fs.forget(ino, count: n)
        fuse_reply_none(req)
    }
    ops.forget_multi = { req, count, forgets in
        let fs = box(req).fs
        for i in 0..<count { fs.forget(forgets![i].ino, count: forgets![i].nlookup) }
        fuse_reply_none(req)
    }
    ops.getattr = { req, ino, fi in serve(req) { fs, r throws(Errno) in try fs.getattr(r, ino, fi) } }
    ops.setattr = { req, ino, attr, toSet, fi in
        serve(req) { fs, r throws(Errno) in try fs.setattr(r, ino, attr!, toSet: toSet, fi) }
    }
    ops.readlink = { req, ino in serve(req) { fs, r throws(Errno) in try fs.readlink(r, ino) } }
    ops.mknod = { req, parent, name, mode, rdev in
        serve(req) { fs, r throws(Errno) in try fs.mknod(r, parent: parent, name: name!, mode: mode, rdev: rdev) }
    }
    ops.mkdir = { req, parent, name, mode in
        serve(req) { fs, r throws(Errno) in try fs.mkdir(r, parent: parent, name: name!, mode: mode) }
    }
    ops.unlink = { req, parent, name in serve(req) { fs, r throws(Errno) in try fs.unlink(r, parent: parent, name: name!) } }
    ops.rmdir = { req, parent, name in serve(req) { fs, r throws(Errno) in try fs.rmdir(r, parent: parent, name: name!) } }
    ops.symlink = { req, target, parent, name in
        serve(req) { fs, r throws(Errno) in try fs.symlink(r, target: target!, parent: parent, name: name!) }
    }
    ops.rename = { req, parent, name, newParent, newName, flags in
        serve(req) { fs, r throws(Errno) in
            try fs.rename(r, parent: parent, name: name!, newParent: newParent, newName: newName!, flags: flags)
        }
    }
    ops.link = { req, ino, newParent, newName in
        serve(req) { fs, r throws(Errno) in try fs.link(r, ino, newParent: newParent, newName: newName!) }
    }
    ops.open = { req, ino, fi in serve(req) { fs, r throws(Errno) in try fs.open(r, ino, fi!) } }
    ops.read = { req, ino, size, off, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.read(r, ino, size: size, offset: off, fi!) }
    }
    ops.write_buf = { req, ino, bufv, off, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.write(r, ino, bufv!, offset: off, fi!) }
    }
    ops.flush = { req, ino, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.flush(r, ino, fi!) }
    }
    ops.release = { req, ino, fi in
        serve(req, awaited: false) { fs, r throws(Errno) in try fs.release(r, ino, fi!) }
    }
    ops.fsync = { req, ino, datasync, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.fsync(r, ino, dataOnly: datasync != 0, fi!) }
    }
    ops.opendir = { req, ino, fi in serve(req) { fs, r throws(Errno) in try fs.opendir(r, ino, fi!) } }
    ops.readdir = { req, ino, size, off, fi in
        serve(req) { fs, r throws(Errno) in try fs.readdir(r, ino, size: size, offset: off, fi!, plus: false) }
    }
    ops.readdirplus = { req, ino, size, off, fi in
        serve(req) { fs, r throws(Errno) in try fs.readdir(r, ino, size: size, offset: off, fi!, plus: true) }
    }
    ops.releasedir = { req, ino, fi in
        serve(req, awaited: false) { fs, r throws(Errno) in try fs.releasedir(r, ino, fi!) }
    }
    ops.fsyncdir = { req, ino, datasync, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.fsyncdir(r, ino, dataOnly: datasync != 0, fi!) }
    }
    ops.statfs = { req, ino in serve(req) { fs, r throws(Errno) in try fs.statfs(r, ino) } }
    ops.setxattr = { req, ino, name, value, size, flags in
        serve(req) { fs, r throws(Errno) in try fs.setxattr(r, ino, name: name!, value: value, size: size, flags: flags) }
    }
    ops.getxattr = { req, ino, name, size in
        serve(req) { fs, r throws(Errno) in try fs.getxattr(r, ino, name: name!, size: size) }
    }
    ops.listxattr = { req, ino, size in serve(req) { fs, r throws(Errno) in try fs.listxattr(r, ino, size: size) } }
    ops.removexattr = { req, ino, name in
        serve(req) { fs, r throws(Errno) in try fs.removexattr(r, ino, name: name!) }
    }
    ops.access = { req, ino, mask in serve(req) { fs, r throws(Errno) in try fs.access(r, ino, mask: mask) } }
    ops.create = { req, parent, name, mode, fi in
        serve(req) { fs, r throws(Errno) in try fs.create(r, parent: parent, name: name!, mode: mode, fi!) }
    }
    ops.fallocate = { req, ino, mode, off, len, fi in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in try fs.fallocate(r, ino, mode: mode, offset: off, length: len, fi!) }
    }
    ops.copy_file_range = { req, inoIn, offIn, fiIn, inoOut, offOut, fiOut, len, flags in
        vanish_workers_may_block()
        serve(req) { fs, r throws(Errno) in
            try fs.copyFileRange(r, input: inoIn, inputOffset: offIn, fiIn!, output: inoOut,
                                 outputOffset: offOut, fiOut!, length: len, flags: flags)
        }
    }
    ops.ioctl = { req, ino, cmd, _, fi, flags, inBuf, inSize, outSize in
        serve(req) { fs, r throws(Errno) in
            try fs.ioctl(r, ino, command: cmd, fi!, flags: flags, input: UnsafeRawBufferPointer(start: inBuf, count: inSize),
                         outputSize: outSize)
        }
    }
    ops.lseek = { req, ino, off, whence, fi in
        serve(req) { fs, r throws(Errno) in try fs.lseek(r, ino, offset: off, whence: whence, fi!) }
    }
    return ops
}

/// O_TMPFILE opens (FUSE_TMPFILE), which libfuse 3.14 does not know: the
/// transport gives them here (see `vanish_transport_session_new`).
let tmpfileOperation: vanish_tmpfile_op = { req, parent, mode, fi in
    serve(req) { fs, r throws(Errno) in try fs.tmpfile(r, parent: parent, mode: mode, fi!) }
}
