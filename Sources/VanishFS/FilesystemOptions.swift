import VanishGraveyard

/// How the kernel may cache what Vanish tells it.
public enum CacheMode: String, Sendable, CaseIterable {
    /// Entries and attributes trusted for 1 s; file data kept while the
    /// file's mtime is unchanged. Safe when the backing directory is also
    /// changed from outside (within that second).
    case auto
    /// Everything trusted for a day and page cache kept across opens:
    /// fastest, for in-place mounts where every change goes through Vanish.
    case always
    /// Nothing cached, reads and writes go straight to the backing files:
    /// for backing directories that other programs change all the time.
    case never
}

/// When the kernel asks for attributes along with directory entries
/// (READDIRPLUS), which spares a LOOKUP per entry to programs that go on to
/// stat, open or unlink what they listed.
public enum ReaddirPlusMode: String, Sendable, CaseIterable {
    /// Fitted to the walk, per directory: names only, until programs look
    /// up the files of a directory they listed (`ls -l`, `find -ls`, `du`,
    /// `rm -rf`, `git status`); then listings of it and of the directories
    /// near it (under its parent or grandparent) carry attributes for a while
    /// (`InodeTable.walkHintSeconds`). `find -name` costs no lstat per entry,
    /// and a stat walk pays lookups only in its first directory.
    case walk
    /// Every listing carries attributes: `rm -rf`, `find -ls`, `du`, `tar`,
    /// `ls -l` and cp -r need no LOOKUP after reading a directory, at the
    /// price of an lstat per entry for programs that only want names.
    case always
    /// The kernel's guess: the first chunk of a listing, and later chunks
    /// of directories whose entries were looked up since.
    case auto
    /// Names only: cheapest for `find -name` over cold trees.
    case never
}

/// The filesystem's own settings (libfuse's mount options are separate).
/// When reading through the mount updates access times. The kernel leaves
/// atime to a FUSE filesystem, and the backing files' own follow their
/// filesystem's mount (relatime, usually), which passthrough reads go
/// through too. So a root daemon given an atime option serves the source
/// through a private, unattached copy of its mount carrying that option
/// (`open_tree` and `mount_setattr`); other daemons open files O_NOATIME
/// for `noatime` where they may.
public enum AtimeMode: String, Sendable {
    /// The backing filesystem's own rule (no option, or `atime`).
    case backing
    case relatime
    case noatime
    case strictatime
    case nodiratime
}

public struct FilesystemOptions: Sendable {
    public var cache: CacheMode = .auto
    public var atime: AtimeMode = .backing
    /// A private copy of the source's mount may carry the atime option:
    /// nothing is mounted inside the source (the copy holds the source's
    /// own mount only).
    public var atimeCopyAllowed = true
    public var readdirPlus: ReaddirPlusMode = .walk
    /// Kernel write-back caching of file data (FUSE_CAP_WRITEBACK_CACHE).
    /// The kernel allows no passthrough beside it.
    public var writeback = false
    /// Serve regular files' data through the kernel's FUSE passthrough
    /// where the kernel and the daemon's rights allow (`-o passthrough=auto`,
    /// the default); off: every byte goes through the daemon.
    public var passthrough = true
    /// The kernel checks permissions (default_permissions): have it check
    /// POSIX ACLs as well. Not otherwise: FUSE_POSIX_ACL turns the kernel's
    /// checks on, and those refresh a directory's attributes before every
    /// unlink in it (a GETATTR each; docs/performance.md).
    public var posixACLs = false
    /// With `cache=auto`, follow changes behind the mount on the source's
    /// filesystem (`SourceWatch`) and let the kernel keep what it was told
    /// for an hour; off (`-o nowatch`): a second.
    public var watchSource = true
    /// Most O_PATH fds kept open for inodes; nil picks half the fd limit.
    public var fdCacheLimit: Int?
    /// Where the mount is (absolute, symlinks resolved), for mounts made on
    /// top of paths inside it (`hasMounts`); nil when not known.
    public var mountpoint: String?
    /// Deleting: the graveyard, where its state lives and how it is shared
    /// and reaped.
    public var deleting = DeletingOptions()
    /// How far ahead (KiB) the kernel may read a file read in order: what
    /// the INIT reply offers. The kernel takes the lower of this and the
    /// mount's own limit, which starts at 128 KiB; `vanish mount` raises
    /// that (see Readahead).
    public var readaheadKB = 1024

    public init() {}

    var entryTimeout: Double {
        switch cache { case .auto: 1.0; case .always: 86400; case .never: 0 }
    }
    var attrTimeout: Double { entryTimeout }
    /// How long the kernel may remember that a name does not exist.
    var negativeTimeout: Double { entryTimeout }
}

/// How a mount deletes (part of `FilesystemOptions`).
public struct DeletingOptions: Sendable {
    /// Where the state directory may live outside the source (`StateLocation`):
    /// one found there is used; with `stateOutside` (an in-place mount) one is
    /// made there, and one in the source moved there.
    public var stateBases: [String] = []
    public var stateOutside = false
    /// This client's name in a shared source's state directory; nil: the
    /// host name and a hash of the machine id and the source path.
    public var client: ClientID?
    /// How long (ns) a client may go without renewing its lease before
    /// another adopts its graveyard.
    public var leaseLength: UInt64 = Duration.seconds(60).nanoseconds
    /// Reaper threads; nil picks the number of cores.
    public var reaperWorkers: Int?
    /// Delete through the graveyard. Off for read-only mounts, which must
    /// not write a state directory into the source.
    public var graveyard = true
    /// Answer an unlink once the file is checked and do its rename into the
    /// graveyard after the reply (see `DeferredBurials`). Off with
    /// `-o sync_unlink`, and with cache=never, whose users watch the backing
    /// directory itself.
    public var deferUnlink = true
    /// The undo window, its limits, and the reaper's rate.
    public var reaping = Reaper.Policy()

    public init() {}
}
