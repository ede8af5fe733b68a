import CFuse
import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

// Exportable file handles: the kernel's handles of the mount (node id and
// generation) keep working after the kernel forgot the inode and after a
// remount, as on the backing filesystem, so the mount can be NFS-exported and
// name_to_handle_at/open_by_handle_at work. See docs/design.md.
extension VanishFilesystem {
    /// The handle layout of the source's filesystem if the daemon can open
    /// files by handle there (it needs CAP_DAC_READ_SEARCH): tried on the root.
    /// It keeps a reading fd of the root, for open_by_handle_at.
    static func handleCodec(rootFD: Int32, root st: stat) -> HandleCodec? {
        FileID.withHandle(rootFD, nil) { handle in
            guard let handle, var codec = HandleCodec(root: handle, ino: UInt64(st.st_ino)),
                  let mountFD = try? Sys.openat(rootFD, ".", O_RDONLY | O_DIRECTORY) else { return nil }
            codec.mountFD = mountFD
            let fd = vanish_open_by_handle(mountFD, handle.baseAddress!.assumingMemoryBound(to: UInt8.self),
                                           Int32(handle.count), VANISH_O_PATH)
            let same = fd >= 0 && (try? Sys.fstat(fd)).map { $0.st_dev == st.st_dev && $0.st_ino == st.st_ino } == true
            if fd >= 0 { Sys.close(fd) }
            guard same else { Sys.close(mountFD); return nil }
            return codec
        }
    }
}

/// LOOKUPs of "." and "..", which the kernel sends only with export
/// support, answered from the file handles node ids carry (see `NodeID`).
struct ExportedHandles: Sendable {
    let namespace: BackingNamespace
    let replies: EntryReplies
    /// What such a handle may not reach.
    let limits: HandleLimits

    private var table: InodeTable { namespace.table }

    private static func generation(_ codec: HandleCodec, _ dirFD: Int32, _ name: UnsafePointer<CChar>?,
                                   ino: UInt64) -> UInt32? {
        FileID.withHandle(dirFD, name) { handle in handle.flatMap { codec.generation(of: $0, ino: ino) } }
    }

    /// A LOOKUP of "." (`dotDot` false) or "..": the kernel sends these only
    /// with export support, for a handle of a file it no longer holds
    /// (node id `id`) or for the parent of the directory `id` (reconnecting
    /// a directory found by handle to the tree).
    func lookup(_ req: Request, _ id: fuse_ino_t, dotDot: Bool) throws(Errno) {
        guard table.codec != nil else { throw .noSuchFileOrDirectory }
        let (node, st) = try dotDot ? parent(of: table.inode(id)) : found(UInt64(id))
        var e = replies.entry(node, st)
        req.reply(entry: &e)
    }

    /// The file node id `id` names: the node the kernel holds, or the backing
    /// file its handle opens, if that may be reached through the mount.
    private func found(_ id: UInt64) throws(Errno) -> (Inode, stat) {
        if let held = table.held(id) {
            let st = try namespace.withFD(held) { fd throws(Errno) in try Sys.fstat(fd) }
            table.lookedUpAgain(held)
            return (held, st)
        }
        guard let codec = table.codec, let (ino, generation) = NodeID.decoded(id) else { throw .staleNFSFileHandle }
        // An unlinked file keeps its name until its queued burial lands:
        // land them, so the graveyard tells whether the file was deleted.
        namespace.settle()
        let fd = codec.open(ino: ino, generation: generation, flags: VANISH_O_PATH)
        guard fd >= 0 else { throw .staleNFSFileHandle }
        return try adopting(OwnedDescriptor(fd), generation: generation) { st in st.st_ino == ino }
    }

    /// The parent directory of the directory `dir`.
    private func parent(of dir: Inode) throws(Errno) -> (Inode, stat) {
        guard dir.isDirectory else { throw .notDirectory }
        let fd = try namespace.withFD(dir) { dfd throws(Errno) in try Sys.openat(dfd, "..", VANISH_O_PATH | O_DIRECTORY) }
        let generation = table.codec.flatMap { codec in
            (try? Sys.fstat(fd)).flatMap { Self.generation(codec, fd, nil, ino: UInt64($0.st_ino)) }
        }
        return try adopting(OwnedDescriptor(fd), generation: generation) { _ in true }
    }

    /// Makes (or counts) the node for the backing file open as the O_PATH
    /// `fd`, which it takes, after checking it is the file wanted (`expected`)
    /// and may be reached through the mount.
    private func adopting(_ fd: consuming OwnedDescriptor, generation: UInt32?,
                          _ expected: (stat) -> Bool) throws(Errno) -> (Inode, stat) {
        let (st, birth) = try Sys.fstatWithBirth(fd.raw)
        guard st.st_dev == table.root.key.dev, expected(st), reachable(fd.raw, st) else { throw .staleNFSFileHandle }
        let node = table.foundByHandle(st, birth: birth, generation: generation)
        if node !== table.root { namespace.adopt(node, fd: fd.take()) }
        return (node, st)
    }

    /// Whether the backing file open as `fd` (`st`) may be reached through
    /// the mount, as its handle would reach it on the backing filesystem: a
    /// directory whose parents lead to the source root without passing the
    /// state directory; another file that has a link and is not one the
    /// graveyard holds (deleted through the mount). A file inside a tree
    /// `vanish rm` took cannot be told from a live one: like a file held
    /// open, it stays reachable by a handle made before, until it is freed.
    private func reachable(_ fd: Int32, _ st: stat) -> Bool {
        guard st.st_mode & S_IFMT == S_IFDIR else {
            return st.st_nlink > 0 && !(limits.buried?.contains(UInt64(st.st_ino)) ?? false)
        }
        var at = fd
        var owned: Int32 = -1
        defer { if owned >= 0 { Sys.close(owned) } }
        var here = st
        // Deep enough for any tree a path can name (PATH_MAX / 2 levels).
        for _ in 0..<2048 {
            let key = InodeKey(dev: here.st_dev, ino: here.st_ino)
            if key == table.root.key { return true }
            if key == limits.stateDirectory { return false }
            guard let up = try? Sys.openat(at, "..", VANISH_O_PATH | O_DIRECTORY) else { return false }
            if owned >= 0 { Sys.close(owned) }
            owned = up
            at = up
            guard let above = try? Sys.fstat(up) else { return false }
            // The top of the filesystem without passing the source root: outside the source.
            if above.st_dev == here.st_dev && above.st_ino == here.st_ino { return false }
            here = above
        }
        return false
    }
}

/// What a handle of a file the kernel no longer holds may not reach: the
/// graveyard's files (their inode numbers, refused) and the state
/// directory (never passed on the way up).
struct HandleLimits: Sendable {
    let buried: BuriedNumbers?
    let stateDirectory: InodeKey?
}
