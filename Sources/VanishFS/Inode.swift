import Glibc
import LinuxSyscalls
import Synchronization

/// Identity of a backing file: the pair the kernel guarantees unique.
struct InodeKey: Hashable, Sendable {
    var dev: dev_t
    var ino: ino_t
}

/// One backing file known to the kernel.
///
/// Its FUSE node id names the backing file where it can (`NodeID`); the
/// table holds it while the kernel holds lookups on it. It does *not*
/// own an fd: the kernel can cache far more inodes than the fd limit allows,
/// so `FDCache` opens an O_PATH fd on demand (through `parent` and `name`)
/// and closes the least recently used ones.
final class Inode: @unchecked Sendable {
    let key: InodeKey
    /// The S_IFMT bits; an inode never changes type.
    let type: mode_t
    /// Its FUSE node id (see `NodeID`) and the generation paired with it in the kernel's handles.
    let id: UInt64
    let generation: UInt64
    /// The backing inode's birth time (ns; 0 if unknown): with `key`, its identity.
    let birth: UInt64

    /// Where it is, as the table knows it. Guarded by InodeTable's lock.
    struct Place {
        /// Kernel lookup count; the node id is valid while it is above zero.
        var lookups: UInt64 = 0
        /// Where this inode was last seen by name, for reopening its fd. Kept
        /// strong so a chain of ancestors stays walkable even after the kernel
        /// forgot one of them.
        var parent: Inode?
        var name: ContiguousArray<CChar>
        /// Its file id for events, once one was needed: the handle never
        /// changes for an inode, and asking the backing filesystem each time
        /// cost every chmod and rename a name_to_handle_at.
        var fileID: String?
        /// A directory `vanish rm` sent to the graveyard while the kernel still
        /// knew it (a process may be inside it); cleared by a restore.
        var buried = false
        /// For a directory: when (CLOCK_MONOTONIC_COARSE seconds, 0: never) a
        /// file in it, or in one of its subdirectories, was looked up; listings
        /// near it then carry attributes (`ReaddirPlusMode.walk`).
        var filesLookedUp: UInt32 = 0
    }
    var place: Place

    /// For a directory, statahead's view: read and written by `Statahead`
    /// alone, under its lock.
    struct Ahead {
        /// Lookups of its files in the current run, when the last one came
        /// (coarse ms), and whether reading ahead has begun in this run.
        var lookups: UInt32 = 0
        var last: UInt32 = 0
        var state: State = .watching
        /// Its subdirectories' names in listing order, each NUL-terminated,
        /// one after another; the byte offset of the one a walk opened last
        /// (`walkAt`) and of the first not yet warmed (`warmedTo`). See
        /// `Statahead.opened`.
        var subdirectoryNames = ContiguousArray<CChar>()
        var walkAt = 0
        var warmedTo = 0
        /// While reading ahead: the names stat'ed so far (`StatedNames`), and
        /// how many lookups since found theirs among them or did not.
        var stated: StatedNames?
        var hits: UInt32 = 0
        var misses: UInt32 = 0

        enum State { case watching, reading, finished }
    }
    var ahead = Ahead()

    /// When (CLOCK_MONOTONIC_COARSE ms, 0: never) its attributes were last
    /// sent to the kernel, which keeps them for the attribute timeout.
    let attributesSent = Atomic<UInt32>(0)
    /// For a directory: when (CLOCK_MONOTONIC_COARSE ms, 0: never) a listing
    /// of it last began to carry attributes (see `opendir`).
    let listedWithAttributes = Atomic<UInt32>(0)
    /// For a directory: its mode as last sent to the kernel (0 before), for
    /// telling whether other users could see a change in it when it happened.
    let modeSeen = Atomic<UInt32>(0)
    /// For a file: its mtime (ns) as last sent to the kernel, to tell a
    /// change the kernel never saw (a passthrough mmap write).
    let mtimeSent = Atomic<UInt64>(0)
    /// Its ctime (ns) as last sent to the kernel.
    let ctimeSent = Atomic<UInt64>(0)
    /// Whether it had xattrs, at a ctime: `ctime << 1 | had`, 0 when not
    /// known (see `AbsentXattrs`).
    let xattrsAt = Atomic<UInt64>(0)
    /// The watch told the kernel to drop its attributes and it has not
    /// asked for them since: a further change need not tell it again.
    let attributesDropped = Atomic<Bool>(false)
    /// The process (FUSE's caller pid) that made it through the mount; 0 if
    /// unknown. With `birth`, what the undo window does not keep: a file its
    /// own maker removes moments later (`Reaper.Policy.keepMinAge`).
    let madeBy = Atomic<Int32>(0)
    /// The process (FUSE's caller pid) that last opened it for writing in
    /// passthrough; negative once that handle was released, until the kernel
    /// next asks for its attributes; 0: none. The kernel marks size and times
    /// stale itself after each passthrough write, so the watch need not tell
    /// it of that writer's modify events, which it often reads after the close.
    let passthroughWriter = Atomic<Int32>(0)

    // Atomic (see `ExternalChanges.swift`).
    /// For a directory: its mtime (ns) when a getattr or lookup last read it; 0 before.
    let mtimeSeen = Atomic<UInt64>(0)
    /// For a directory: a change of ours to its entries began since then.
    let changedHere = Atomic<Bool>(false)

    /// Its place in the fd cache. Guarded by FDCache's lock.
    struct Cached {
        var fd: Int32 = -1
        /// Handlers currently using `fd`; a pinned fd is never evicted.
        var pins: Int32 = 0
        var newer: Inode?
        var older: Inode?
        var listed = false
        /// The kernel forgot this inode while its fd was pinned: close on unpin.
        var closeWhenUnpinned = false
        /// Files programs have open on this inode through the mount.
        var openHandles: Int32 = 0
        /// Its last known name was removed while open: the fd holds one pin
        /// until the last handle closes, as the only way left to reach it.
        var heldForOpenHandles = false
    }
    var cache = Cached()

    /// Its passthrough backing. Guarded by PassthroughFiles' lock.
    struct Backing {
        /// The kernel's id for this file's backing while passthrough opens of it exist, else 0.
        var id: Int32 = 0
        /// Open handles using `id`; the last release closes the id.
        var passthroughOpens: Int32 = 0
        /// Open handles served through the daemon with the kernel's page cache:
        /// while any exist the kernel refuses a passthrough open (ETXTBSY).
        var cachedOpens: Int32 = 0
    }
    var backing = Backing()

    init(key: InodeKey, type: mode_t, id: UInt64, generation: UInt64, birth: UInt64 = 0, parent: Inode?,
         name: UnsafePointer<CChar>) {
        self.key = key
        self.type = type
        self.id = id
        self.generation = generation
        self.birth = birth
        place = Place(parent: parent, name: Inode.copyName(name))
    }

    var isDirectory: Bool { type == S_IFDIR }

    /// Its attributes are on their way to the kernel, which keeps them for
    /// the attribute timeout.
    @inline(__always)
    func sawAttributes(_ st: stat) {
        ctimeSent.store(Sys.nanoseconds(st.st_ctim), ordering: .relaxed)
        attributesSent.store(InodeTable.coarseMilliseconds(), ordering: .relaxed)
        attributesDropped.store(false, ordering: .releasing)
        if type == S_IFREG, case let writer = passthroughWriter.load(ordering: .relaxed), writer < 0 {
            _ = passthroughWriter.compareExchange(expected: writer, desired: 0, ordering: .relaxed)
        }
        if type == S_IFDIR { modeSeen.store(UInt32(st.st_mode), ordering: .relaxed) }
        else if type == S_IFREG { mtimeSent.store(Sys.nanoseconds(st.st_mtim), ordering: .relaxed) }
    }
    var isSymlink: Bool { type == S_IFLNK }

    /// Whether process `pid` writes it, or wrote it, in passthrough and the
    /// kernel has not asked for its attributes since the close.
    func wroteThroughMount(pid: Int32) -> Bool {
        let writer = passthroughWriter.load(ordering: .relaxed)
        return writer != 0 && (writer == pid || writer == -pid)
    }

    /// Whether `st`'s mtime is not the one last sent to the kernel.
    func mtimeDiffers(from st: stat) -> Bool { Sys.nanoseconds(st.st_mtim) != mtimeSent.load(ordering: .relaxed) }

    static func copyName(_ name: UnsafePointer<CChar>) -> ContiguousArray<CChar> {
        let n = strlen(name)
        return ContiguousArray(UnsafeBufferPointer(start: name, count: n + 1))
    }

    /// True when `name` equals the stored name (no allocation).
    func nameEquals(_ other: UnsafePointer<CChar>) -> Bool {
        place.name.withUnsafeBufferPointer { strcmp($0.baseAddress!, other) == 0 }
    }
}
