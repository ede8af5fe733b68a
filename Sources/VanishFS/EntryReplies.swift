import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls

/// What a reply naming a file carries: its node id and generation, its
/// attributes as the mount shows them (`DeviceMap`), and how long the
/// kernel may keep them. Every handler that answers with an entry or
/// attributes uses it.
struct EntryReplies: Sendable {
    let table: InodeTable
    let devices: DeviceMap
    /// Whether changes behind the mount are watched (`SourceWatch`): names
    /// and attributes of the source's own filesystem then last an hour.
    let watched: Bool
    /// The cache mode's timeout, for everything else.
    let attrTimeout: Double

    /// The reply for a name that now refers to `node`.
    @inline(__always)
    func entry(_ node: Inode, _ st: stat) -> fuse_entry_param {
        node.sawAttributes(st)
        var e = fuse_entry_param()
        e.ino = table.nodeID(node)
        e.generation = node.generation
        e.attr = devices.present(st)
        e.attr_timeout = cacheTimeout(node)
        e.entry_timeout = e.attr_timeout
        return e
    }

    /// How long the kernel may keep `node`'s name and attributes: an hour
    /// on the source's own filesystem while it is watched, else the cache mode's.
    @inline(__always)
    func cacheTimeout(_ node: Inode) -> Double {
        watched && node.key.dev == table.root.key.dev ? SourceWatch.timeout : attrTimeout
    }

    /// How long (ms) after attributes of a file on `dev` were sent the
    /// kernel surely still has them: half the timeout it was given.
    func freshAttributesWindow(_ dev: dev_t) -> UInt32 {
        UInt32((watched && dev == table.root.key.dev ? SourceWatch.timeout : attrTimeout) * 500)
    }

    /// The backing generation of the file `st` describes (`name` in `dirFD`,
    /// or `dirFD` itself without a name) when a new node for it would carry
    /// its handle (`InodeTable.wantsGeneration`); nil otherwise. One
    /// name_to_handle_at, only for files the kernel does not hold yet.
    func generationForID(_ dirFD: Int32, _ name: UnsafePointer<CChar>?, _ st: stat, birth: UInt64) -> UInt32? {
        guard let codec = table.codec, table.wantsGeneration(st, birth: birth) else { return nil }
        return FileID.withHandle(dirFD, name) { handle in
            handle.flatMap { codec.generation(of: $0, ino: UInt64(st.st_ino)) }
        }
    }
}

/// The names the mount keeps for itself: the state directory (with the
/// graveyard), which no request may see or change, and the desktop trash
/// folders `.Trash-$uid` in the root, served by `TrashFolders` in place of
/// whatever the source has there.
struct ReservedNames: Sendable {
    let deleter: Deleter
    let trashFolders: TrashFolders?
    let table: InodeTable
    /// The backing root.
    let rootFD: Int32

    @inline(__always)
    func isStateDirectory(_ parent: Inode, _ name: UnsafePointer<CChar>) -> Bool {
        deleter.isStateDirectory(parent, name)
    }

    /// The uid of the folder `name` in the root names, when the mount serves
    /// it: there is an undo window, and no real trash of that user's there,
    /// a directory they own. Anything else of that name on the source
    /// (another user could have put it there, hoping for the user's
    /// `trash-put`) is hidden by the folder.
    @inline(__always)
    func trashFolderUID(_ parent: fuse_ino_t, _ name: UnsafePointer<CChar>) -> UInt32? {
        guard parent == fuse_ino_t(FUSE_ROOT_ID), name[0] == 0x2E, name[1] == 0x54, trashFolders != nil,
              let uid = TrashFolders.uid(ofFolder: name) else { return nil }
        if let st = try? Sys.lstatat(rootFD, name), st.st_mode & S_IFMT == S_IFDIR, st.st_uid == uid { return nil }
        return uid
    }

    /// Entries a listing leaves out: the state directory, and what a trash folder's name hides.
    @inline(__always)
    func isHidden(_ dir: Inode, _ name: UnsafePointer<CChar>) -> Bool {
        if dir === table.root, name[0] == 0x2E, name[1] == 0x54, trashFolderUID(fuse_ino_t(FUSE_ROOT_ID), name) != nil {
            return true
        }
        return deleter.isStateDirectory(dir, name)
    }
}
