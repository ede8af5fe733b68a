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

/// The handlers of open directories: opendir, readdir and readdirplus,
/// releasedir and fsyncdir. Listings come from the backing directory, less
/// the names the mount keeps (`ReservedNames`), with attributes where a
/// walk wants them (`readdirplus=`), warming `Statahead` as they go.
struct DirectoryHandlers: Sendable {
    let namespace: BackingNamespace
    /// Each user's share of the daemon's descriptors.
    let shares: HandleShares
    let replies: EntryReplies
    let reserved: ReservedNames
    let changes: any ChangeObserver
    let statahead: Statahead
    let readdirPlus: ReaddirPlusMode
    let cache: CacheMode
    /// Whether the kernel may keep listings (`SourceRoot.cachesListings`).
    let cachesListings: Bool
    /// O_NOATIME for listings under `noatime` and `nodiratime` where no
    /// private mount carries the option (root's daemon only: others may not).
    let listingAtimeFlag: Int32

    init(namespace: BackingNamespace, shares: HandleShares, replies: EntryReplies, reserved: ReservedNames,
         changes: any ChangeObserver, statahead: Statahead, options: FilesystemOptions, source: SourceRoot) {
        self.namespace = namespace
        self.shares = shares
        self.replies = replies
        self.reserved = reserved
        self.changes = changes
        self.statahead = statahead
        readdirPlus = options.readdirPlus
        cache = options.cache
        cachesListings = source.cachesListings
        listingAtimeFlag = (options.atime == .noatime || options.atime == .nodiratime) && !source.isPrivateMount
            && SourceRoot.actsForOthers ? VANISH_O_NOATIME : 0
    }

    private var table: InodeTable { namespace.table }

    func opendir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let node = table.inode(ino)
        // Read before the reply, which ends the request.
        let caller = req.caller
        try shares.take(caller.uid)
        let stream: OpaquePointer
        do throws(Errno) {
            let fd = try namespace.withFD(node) { pathFD throws(Errno) in
                try namespace.retryingOnFDExhaustion { () throws(Errno) in
                    try Sys.openat(pathFD, ".", O_RDONLY | O_DIRECTORY | listingAtimeFlag)
                }
            }
            stream = try Sys.directoryStream(adopting: fd)
        } catch {
            shares.giveBack(caller.uid)
            throw error
        }
        let handle = DirectoryHandle(stream: stream, inode: node, owner: caller.uid)
        fi.pointee.fh = UInt64(UInt(bitPattern: Unmanaged.passRetained(handle).toOpaque()))
        if cachesListings && (cache == .always || node.key.dev == table.root.key.dev) {
            configureListingCache(node, fi)
        }
        let statWalk = readdirPlus == .always || table.listingWantsAttributes(node)
        req.reply(open: fi)
        statahead.opened(node, statWalk: statWalk, caller: caller)
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
        if cache == .always || replies.watched { fi.pointee.keep_cache = 1; return }
        let namesOnly = switch readdirPlus {
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

    /// How long after a listing sent attributes (which the kernel keeps for
    /// the 1 s of cache=auto) a cached copy of it is still reused.
    static let listingReuseMilliseconds: UInt32 = 500

    func releasedir(_ req: Request, _ ino: fuse_ino_t, _ fi: UnsafeMutablePointer<fuse_file_info>) throws(Errno) {
        let handle = Unmanaged<DirectoryHandle>.fromOpaque(UnsafeRawPointer(bitPattern: UInt(fi.pointee.fh))!)
        shares.giveBack(handle.takeUnretainedValue().owner)
        handle.release()
        req.replyOK()
    }

    func fsyncdir(_ req: Request, _ ino: fuse_ino_t, dataOnly: Bool,
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
    func readdir(_ req: Request, _ ino: fuse_ino_t, size: Int, offset: off_t,
                        _ fi: UnsafeMutablePointer<fuse_file_info>, plus: Bool) throws(Errno) {
        let h = DirectoryHandle.from(fi)
        let attributes = plus && (readdirPlus != .walk || table.listingWantsAttributes(h.inode))
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
                if reserved.isHidden(h.inode, name) { h.offset = next; continue }
                let room = size - used
                var added: Int
                if plus {
                    let needed = fuse_add_direntry_plus(req.raw, nil, 0, name, nil, 0)
                    if needed > room { seekdir(stream, h.offset); break }
                    var e = fuse_entry_param()
                    if isDotOrDotDot(name) || !attributes
                        || table.attributesFresh(dev: dev, ino: d.pointee.d_ino, type: mode_t(d.pointee.d_type) << 12,
                                                 now: now, window: replies.freshAttributesWindow(dev)) {
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
                                                  generation: replies.generationForID(dfd, name, st, birth: birth))
                        // The kernel may answer stats from these attributes:
                        // a later change behind the mount is measured from them.
                        changes.sawDirectory(node, st)
                        e = replies.entry(node, st)
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
        statahead.listed(h.inode, subdirectories: subdirectories, restart: offset == 0)
    }
}

