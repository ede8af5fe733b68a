import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

/// An open directory: the backing stream and where the kernel expects to be in it.
final class DirectoryHandle {
    let stream: OpaquePointer
    let inode: Inode
    /// The telldir cookie of the next entry this handle will return.
    var offset: off_t = 0

    init(stream: OpaquePointer, inode: Inode) {
        self.stream = stream
        self.inode = inode
    }

    deinit { closedir(stream) }

    static func from(_ fi: UnsafeMutablePointer<fuse_file_info>) -> DirectoryHandle {
        Unmanaged<DirectoryHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeUnretainedValue()
    }
}

extension PassthroughFilesystem {
    public func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let node = inode(ino)
        let fd = try namespace.withFD(node) { pathFD throws(Errno) in
            try namespace.retryingOnFDExhaustion { () throws(Errno) in
                try Sys.openat(pathFD, ".", O_RDONLY | O_DIRECTORY)
            }
        }
        guard let stream = fdopendir(fd) else {
            let e = Errno(rawValue: errno)
            Sys.close(fd)
            throw e
        }
        let handle = DirectoryHandle(stream: stream, inode: node)
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(handle).toOpaque()))
        if options.cache == .always { fi.pointee.cache_readdir = 1; fi.pointee.keep_cache = 1 }
        req.reply(open: fi)
    }

    public func releasedir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        Unmanaged<DirectoryHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).release()
        req.replyOK()
    }

    public func fsyncdir(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool,
                         _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        try namespace.reading(DirectoryHandle.from(fi)) { stream throws(Errno) in
            try Sys.fsync(dirfd(stream), dataOnly: dataOnly)
        }
        req.replyOK()
    }

    /// readdir and readdirplus. For readdirplus each entry is looked up (one
    /// fstatat, no fd opened) so `ls -l` and `find` need no further round
    /// trips; with `readdirplus=walk` only where the walk wants attributes,
    /// and other entries go as names (node id 0: the kernel takes the name
    /// and type only).
    public func readdir(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                        _ fi: UnsafeMutablePointer<fuse_file_info>, plus: Bool) throws(Errno) {
        let h = DirectoryHandle.from(fi)
        let attributes = plus && (options.readdirPlus != .walk || table.listingWantsAttributes(h.inode))
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: size, alignment: 8)
        defer { buffer.deallocate() }
        let used = try namespace.reading(h) { stream throws(Errno) -> Int in
            if offset != h.offset {
                seekdir(stream, offset)
                h.offset = offset
            }
            let base = buffer.baseAddress!.assumingMemoryBound(to: CChar.self)
            let dfd = dirfd(stream)
            var used = 0
            while true {
                errno = 0
                guard let d = Glibc.readdir(stream) else {
                    if errno != 0 && used == 0 { throw Errno(rawValue: errno) }
                    break
                }
                let name = vanish_dirent_name(d)!
                let next = d.pointee.d_off
                if isHidden(h.inode, name) { h.offset = next; continue }
                let room = size - used
                var added: Int
                if plus {
                    let needed = fuse_add_direntry_plus(req.raw, nil, 0, name, nil, 0)
                    if needed > room { seekdir(stream, h.offset); break }
                    var e = fuse_entry_param()
                    if isDotOrDotDot(name) || !attributes {
                        // No lookup for . and .., nor for names only: node id
                        // 0 tells the kernel to take only the name and type.
                        e.attr.st_ino = d.pointee.d_ino
                        e.attr.st_mode = mode_t(d.pointee.d_type) << 12
                    } else {
                        guard let (st, birth) = try? Sys.lstatatWithBirth(dfd, name) else { h.offset = next; continue }
                        let node = table.remember(st, birth: birth, parent: h.inode, name: name)
                        e = entry(node, st)
                    }
                    added = fuse_add_direntry_plus(req.raw, base + used, room, name, &e, next)
                } else {
                    var st = stat()
                    st.st_ino = d.pointee.d_ino
                    st.st_mode = mode_t(d.pointee.d_type) << 12
                    added = fuse_add_direntry(req.raw, base + used, room, name, &st, next)
                    if added > room { seekdir(stream, h.offset); break }
                }
                used += added
                h.offset = next
            }
            return used
        }
        req.reply(bytes: UnsafeRawBufferPointer(start: buffer.baseAddress, count: used))
    }

    /// Entries readdir leaves out: the state directory with the graveyard.
    @inline(__always)
    func isHidden(_ dir: Inode, _ name: UnsafePointer<CChar>) -> Bool { isReserved(dir, name) }
}

