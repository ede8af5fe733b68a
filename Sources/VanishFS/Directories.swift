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
    /// Whose handle share it takes.
    let owner: uid_t
    /// The telldir cookie of the next entry this handle will return.
    var offset: off_t = 0

    init(stream: OpaquePointer, inode: Inode, owner: uid_t) {
        self.stream = stream
        self.inode = inode
        self.owner = owner
    }

    deinit { closedir(stream) }

    static func from(_ fi: UnsafeMutablePointer<fuse_file_info>) -> DirectoryHandle {
        Unmanaged<DirectoryHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!).takeUnretainedValue()
    }
}

extension VanishFilesystem {
    public func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let node = inode(ino)
        // Read before the reply, which ends the request.
        let caller = req.caller
        try openFiles.shares.take(caller.uid)
        let stream: OpaquePointer
        do throws(Errno) {
            let fd = try namespace.withFD(node) { pathFD throws(Errno) in
                try namespace.retryingOnFDExhaustion { () throws(Errno) in
                    try Sys.openat(pathFD, ".", O_RDONLY | O_DIRECTORY | listingAtimeFlag)
                }
            }
            stream = try Sys.directoryStream(adopting: fd)
        } catch {
            openFiles.shares.giveBack(caller.uid)
            throw error
        }
        let handle = DirectoryHandle(stream: stream, inode: node, owner: caller.uid)
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(handle).toOpaque()))
        if source.cachesListings && (options.cache == .always || node.key.dev == table.root.key.dev) {
            configureListingCache(node, fi)
        }
        let statWalk = options.readdirPlus == .always || table.listingWantsAttributes(node)
        req.reply(open: fi)
        caches.statahead.opened(node, statWalk: statWalk, caller: caller)
    }

    /// The kernel keeps a listing (FOPEN_CACHE_DIR) until the directory
    /// changes: through the mount it sees that itself, Vanish's own changes
    /// (`vanish rm`, a restore) it is told of, and with cache=auto a change
    /// behind the mount shows as a new mtime once the directory's attributes
    /// expire. That needs an mtime that moves with every change, which only
    /// the source's own filesystem is vouched for (`cachesListings`).
    ///
    /// A cached listing is read with no round trip, but it refreshes no
    /// entry: with cache=auto an open keeps it (FOPEN_KEEP_CACHE) only
    /// where that costs nothing, that is a names-only listing, or one whose
    /// attributes were sent too lately to have expired. Otherwise the kernel
    /// drops it and lists again, with attributes (one round trip per chunk
    /// rather than a LOOKUP per entry), caching that listing in turn.
    private func configureListingCache(_ node: Inode, _ fi: UnsafeMutablePointer<fuse_file_info>) {
        fi.pointee.cache_readdir = 1
        // Watched, the listing and its entries' attributes last until a change drops them.
        if options.cache == .always || caches.watch != nil { fi.pointee.keep_cache = 1; return }
        let namesOnly = switch options.readdirPlus {
        case .never: true
        case .walk: !table.listingWantsAttributes(node)
        case .always, .auto: false
        }
        if namesOnly { fi.pointee.keep_cache = 1; return }
        let listed = node.listedWithAttributes.load(ordering: .relaxed)
        if listed != 0 && InodeTable.coarseMilliseconds() &- listed < Self.listingReuseMilliseconds {
            fi.pointee.keep_cache = 1
        }
    }

    /// How long (ms) after attributes of a file on `dev` were sent the
    /// kernel surely still has them: half the timeout it was given.
    func freshAttributesWindow(_ dev: dev_t) -> UInt32 {
        UInt32((caches.watch != nil && dev == table.root.key.dev ? SourceWatch.timeout : options.attrTimeout) * 500)
    }

    /// How long after a listing sent attributes (which the kernel keeps for
    /// the 1 s of cache=auto) a cached copy of it is still reused.
    static let listingReuseMilliseconds: UInt32 = 500

    /// O_NOATIME for listings under `noatime` and `nodiratime` where no
    /// private mount carries the option (root's daemon only: others may not).
    var listingAtimeFlag: Int32 {
        (options.atime == .noatime || options.atime == .nodiratime) && !source.isPrivateMount && actsForOthers
            ? VANISH_O_NOATIME : 0
    }

    public func releasedir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let handle = Unmanaged<DirectoryHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!)
        openFiles.shares.giveBack(handle.takeUnretainedValue().owner)
        handle.release()
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
        if attributes && offset == 0 { h.inode.listedWithAttributes.store(InodeTable.coarseMilliseconds(), ordering: .relaxed) }
        let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: size, alignment: 8)
        defer { buffer.deallocate() }
        // What a walk enters next (see `Statahead.listed`).
        var subdirectories = ContiguousArray<CChar>()
        let used = try namespace.reading(h) { stream throws(Errno) -> Int in
            if offset != h.offset {
                seekdir(stream, offset)
                h.offset = offset
            }
            let base = buffer.baseAddress!.assumingMemoryBound(to: CChar.self)
            let dfd = dirfd(stream)
            let dev = h.inode.key.dev
            let now = InodeTable.coarseMilliseconds()
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
                    if isDotOrDotDot(name) || !attributes
                        || table.attributesFresh(dev: dev, ino: d.pointee.d_ino, type: mode_t(d.pointee.d_type) << 12,
                                                 now: now, window: freshAttributesWindow(dev)) {
                        // No lookup for . and .., for names only, nor for
                        // files the kernel got attributes of just now (git
                        // status lists directories right after lstat'ing
                        // their files): node id 0 tells the kernel to take
                        // only the name and type.
                        e.attr.st_ino = d.pointee.d_ino
                        e.attr.st_mode = mode_t(d.pointee.d_type) << 12
                    } else {
                        guard let (st, birth) = try? Sys.lstatatWithBirth(dfd, name) else { h.offset = next; continue }
                        let node = table.remember(st, birth: birth, parent: h.inode, name: name,
                                                  generation: generationForID(dfd, name, st, birth: birth))
                        // The kernel may answer stats from these attributes:
                        // a later change behind the mount is measured from them.
                        changes.sawDirectory(node, st)
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
                if d.pointee.d_type == DT_DIR && !isDotOrDotDot(name) {
                    subdirectories.append(contentsOf: UnsafeBufferPointer(start: name, count: strlen(name) + 1))
                }
                used += added
                h.offset = next
            }
            return used
        }
        req.reply(bytes: UnsafeRawBufferPointer(start: buffer.baseAddress, count: used))
        caches.statahead.listed(h.inode, subdirectories: subdirectories, restart: offset == 0)
    }

    /// Entries readdir leaves out: the state directory with the graveyard.
    @inline(__always)
    func isHidden(_ dir: Inode, _ name: UnsafePointer<CChar>) -> Bool {
        if dir === table.root, name[0] == 0x2E, name[1] == 0x54, trashFolderUID(fuse_ino_t(FUSE_ROOT_ID), name) != nil {
            return true  // an entry the desktop trash folder of that name hides
        }
        return deleter.isStateDirectory(dir, name)
    }
}

