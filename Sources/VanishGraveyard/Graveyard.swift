import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Where deleted entries wait for the reaper:
/// `SOURCE/.vanish/clients/<client>/graveyard/<shard>/<unique name>`, on the
/// same filesystem as what is deleted, so hiding an entry is one rename.
/// Each client of a shared source (see `ClientID`) has a directory of its
/// own under `clients/`, holding its graveyard, its event journal, its log
/// of answered unlinks and its lease; another client only ever takes a
/// graveyard whole, with one rename (`Adoption`).
///
/// Nothing here is reachable through the mount: the filesystem hides the
/// state directory from readdir and lookup and refuses to create it.
public final class Graveyard: @unchecked Sendable {
    /// The state directory's name in the source root.
    public static let stateDirectoryName = ".vanish"
    static let markerName = "VANISH-STATE-DIRECTORY"
    /// Where the clients' directories are, in the state directory.
    public static let clientsDirectoryName = "clients"
    /// A client's graveyard, in its directory.
    static let graveyardName = "graveyard"
    /// Graveyards this one adopted, in it, until their entries are moved in.
    static let incomingName = "incoming"
    /// Entries are spread over this many directories so none grows huge.
    /// At most 64: the reaper keeps one bit per shard in a word.
    public static let shardCount = 64

    /// O_PATH fds of the shard directories, open for the graveyard's life.
    public let shardFDs: [Int32]
    /// This client's directory, `.vanish/clients/<client>`: its journal,
    /// unlink log and lease live here too.
    public let stateFD: Int32
    /// `.vanish` itself, shared by every client of the source.
    public let sharedFD: Int32
    /// The graveyard directory, parent of the shards (O_PATH).
    let graveyardFD: Int32
    public let client: ClientID
    public let device: dev_t
    let counter = Atomic<UInt64>(0)
    /// The undo window (ns) written into each kept entry's record as it is
    /// buried, so that it outlives this mount's options (set by the reaper).
    let window = Atomic<UInt64>(0)
    private let instance: UInt32
    let trash = TrashIndex()
    /// The deleters' groups, named by the entries they buried (`DeletedBy`).
    let deleters: DeleterRecords
    /// Where one-step deletes land, and where the reaper, acting as a
    /// deleter, moves the subdirectories it splits off; nil if they could
    /// not be made.
    public let rooms: DeleterRooms?
    /// When directories are deleted, as their filesystem stamps changes.
    public let clock: ChangeClock

    /// Opens (or, with `create`, makes) the state directory in the root
    /// `rootFD`, and `client`'s directory in it. Refuses a `.vanish` that is
    /// not Vanish's: nothing of the user's is touched. Without `create`, a
    /// missing state directory is `.absent` (a missing client directory in
    /// one that exists is made). The state of a Vanish from before per-client
    /// directories moves into `client`'s, with one rename each.
    public init(rootFD: Int32, client: ClientID, create: Bool = true) throws(GraveyardError) {
        let name = Graveyard.stateDirectoryName
        if create { try Graveyard.makeStateDirectory(in: rootFD) }
        let owned: OwnedDescriptor
        do throws(Errno) {
            owned = try Sys.opened(rootFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        } catch .noSuchFileOrDirectory where !create {
            throw .absent
        } catch {
            throw .notOurs
        }
        let shared = owned.raw
        guard (try? Sys.lstatat(shared, Graveyard.markerName)) != nil else { throw .notOurs }
        try Graveyard.checkPrivate(shared, Graveyard.stateDirectoryName)
        self.client = client
        var shards: [Int32] = []
        var state: Int32 = -1, grave: Int32 = -1
        var deleters: DeleterRecords?
        do throws(GraveyardError) {
            state = try Graveyard.makePrivateDirectory(shared, [Graveyard.clientsDirectoryName, client.name])
            deleters = try DeleterRecords(stateFD: state)
            Graveyard.moveLegacyState(from: shared, to: state)
            grave = try Graveyard.makePrivateDirectory(state, [Graveyard.graveyardName])
            for i in 0..<Graveyard.shardCount {
                shards.append(try Graveyard.makePrivateDirectory(grave, [Graveyard.hex(UInt64(i), digits: 2)]))
            }
            do throws(Errno) { device = try Sys.fstat(grave).st_dev } catch { throw .cannotCreate(error) }
        } catch {
            shards.forEach(Sys.close)
            if grave >= 0 { Sys.close(grave) }
            if state >= 0 { Sys.close(state) }
            throw error
        }
        sharedFD = owned.take()
        stateFD = state
        graveyardFD = grave
        shardFDs = shards
        self.deleters = deleters!
        rooms = try? DeleterRooms(stateFD: state)
        clock = ChangeClock(stateFD: state)
        rooms?.returnStaged(to: shards) { shard, id, uid in
            // Read directly: `self` is not whole yet.
            Graveyard.readSidecar(shards[shard], id)?.uid == uid
        }
        instance = UInt32(truncatingIfNeeded: getpid())
        loadTrash()
    }

    /// mkdir (mode 0700) and open (O_PATH) each name of `path` in turn,
    /// starting at `dirFD`; ones already there are opened, never followed,
    /// and refused with EPERM unless private (see `makePrivateDirectory`).
    static func makeDirectory(_ dirFD: Int32, _ path: [String]) throws(Errno) -> Int32 {
        do throws(GraveyardError) { return try makePrivateDirectory(dirFD, path) } catch { throw error.errno }
    }

    /// `makeDirectory`, saying which directory another user could have written.
    static func makePrivateDirectory(_ dirFD: Int32, _ path: [String]) throws(GraveyardError) -> Int32 {
        var at = dirFD
        for (i, name) in path.enumerated() {
            let next: Int32
            do throws(Errno) {
                do throws(Errno) { try Sys.mkdirat(at, name, 0o700) } catch .fileExists {}
                next = try Sys.openat(at, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            } catch {
                if i > 0 { Sys.close(at) }
                throw .cannotCreate(error)
            }
            if i > 0 { Sys.close(at) }
            at = next
            do throws(GraveyardError) { try checkPrivate(at, name) } catch {
                Sys.close(at)
                throw error
            }
        }
        return at
    }

    /// Refuses a directory of the state that anyone but the daemon's own
    /// user could have written or read: one another user made (before the
    /// first mount, in a source they may write) could hold an unlink log to
    /// replay, or a graveyard that catches the daemon's deletions.
    public static func checkPrivate(_ fd: Int32, _ name: String) throws(GraveyardError) {
        let st: stat
        do throws(Errno) { st = try Sys.fstat(fd) } catch { throw .cannotCreate(error) }
        let me = geteuid()
        if st.st_uid != me {
            throw .untrusted(name, "it belongs to uid \(st.st_uid), not to the daemon's user, uid \(me)")
        }
        if st.st_mode & 0o077 != 0 {
            throw .untrusted(name, "its mode is \(String(st.st_mode & 0o7777, radix: 8)), not 700")
        }
    }

    /// A state directory from before per-client directories kept its
    /// graveyard, journal and unlink log in `.vanish` itself: the first
    /// client to open it takes them over, a rename each. A graveyard the
    /// client already has leaves the old one to be absorbed as adopted.
    private static func moveLegacyState(from shared: Int32, to state: Int32) {
        for name in ["events", UnlinkIntents.fileName] where (try? Sys.lstatat(shared, name)) != nil {
            try? Sys.renameNoReplace(shared, name, state, name)
        }
        guard (try? Sys.lstatat(shared, graveyardName)) != nil else { return }
        if (try? Sys.renameNoReplace(shared, graveyardName, state, graveyardName)) != nil { return }
        guard let grave = try? makeDirectory(state, [graveyardName, incomingName]) else { return }
        defer { Sys.close(grave) }
        _ = try? Sys.renameNoReplace(shared, graveyardName, grave, "legacy-" + hex(Sys.wallClockNow(), digits: 16))
    }

    /// Whether the directory `rootFD` holds a `.vanish` that is Vanish's (it carries the marker).
    public static func isStateDirectory(in rootFD: Int32) -> Bool {
        guard let state = try? Sys.openat(rootFD, stateDirectoryName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else {
            return false
        }
        defer { Sys.close(state) }
        return (try? Sys.lstatat(state, markerName)) != nil
    }

    /// mkdir `.vanish` with its marker; one that is already there is left
    /// as it is (the caller then checks it carries the marker).
    private static func makeStateDirectory(in rootFD: Int32) throws(GraveyardError) {
        do throws(Errno) {
            try Sys.mkdirat(rootFD, stateDirectoryName, 0o700)
            let fd = try Sys.opened(rootFD, stateDirectoryName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            let marker = try Sys.openat(fd.raw, markerName, O_WRONLY | O_CREAT | O_EXCL, 0o600)
            let text = "This directory holds Vanish's graveyard: deleted entries waiting to be freed.\n"
            _ = text.withCString { write(marker, $0, strlen($0)) }
            Sys.close(marker)
        } catch .fileExists {
            // Already there: ours only if it carries the marker.
        } catch {
            throw .cannotCreate(error)
        }
    }

    deinit {
        shardFDs.forEach(Sys.close)
        Sys.close(graveyardFD)
        Sys.close(stateFD)
        Sys.close(sharedFD)
    }

    /// Moves `name` out of `parentFD` into the graveyard with one rename and
    /// returns the shard it went to. Throws EXDEV when the entry lives on
    /// another filesystem.
    ///
    /// With a `record` the entry stays restorable during the undo window
    /// (its sidecar is written first). `expired` marks pieces of an entry
    /// already being reaped: no undo window keeps them. `unheld` marks an
    /// entry buried without its record while there is a window (the disk was
    /// full): the window does not keep it either, yet it is reported when
    /// freed, unlike a piece. Both carry when their tree was deleted.
    /// `time` is when it was deleted (an unlink answered before its burial
    /// landed), now if not given. `named`, if given, gets the entry's name
    /// once it is in place. `linking` makes the entry a hard link and leaves
    /// the name where it is, for the caller to unlink (a file still open).
    @inline(__always) @discardableResult
    /// `checked`: the directory the caller checked under `name` (its inode):
    /// another exchanged onto the name before the rename goes back at once
    /// and the burial fails with ENOTEMPTY, as the rmdir of the name would.
    public func bury(_ parentFD: Int32, _ name: UnsafePointer<CChar>, record: TrashRecord? = nil,
                     deletion: Deletion = .now, linking: Bool = false, reserved: Reservation? = nil,
                     by deleter: DeletedBy? = nil, file: Bool = false, checked directory: ino_t? = nil,
                     shard chosen: Int? = nil,
                     named: ((UnsafePointer<CChar>) -> Void)? = nil) throws(Errno) -> Int {
        let n = reserved?.number ?? counter.wrappingAdd(1, ordering: .relaxed).newValue
        // Runs of 64 deletions share a shard, so a reaper woken for a program
        // that unlinks file after file scans one directory for many of them;
        // pieces of a tree being reaped are spread one by one, for parallel
        // workers (but where the reaper chooses, see `TreeRemover`).
        let shard = chosen ?? Int((deletion.isPiece ? n : n >> 6) % UInt64(Graveyard.shardCount))
        let sfd = shardFDs[shard]
        let namesFile = file && reserved == nil
        // A directory's deletion time is what the reaper judges later changes in it by.
        try withUniqueName(n, time: reserved?.time ?? deletion.nameTime(clock: file ? nil : clock), by: reserved?.deleter ?? deleter,
                           file: namesFile) { grave throws(Errno) in
            guard var record else {
                try Sys.renameNoReplace(parentFD, name, sfd, grave)
                try Self.returnSwapped(sfd, grave, to: parentFD, name, file: namesFile, directory: directory)
                named?(grave)
                return
            }
            if record.window == nil { record.window = window.load(ordering: .relaxed) }
            try writeSidecar(sfd, grave, record)
            do throws(Errno) {
                if linking {
                    if linkat(parentFD, name, sfd, grave, 0) != 0 { throw Errno(rawValue: errno) }
                } else {
                    try Sys.renameNoReplace(parentFD, name, sfd, grave)
                    try Self.returnSwapped(sfd, grave, to: parentFD, name, file: namesFile, directory: directory)
                }
            } catch {
                removeSidecar(sfd, grave)
                throw error
            }
            let id = String(cString: grave)
            trash.insert(TrashEntry(id: id, shard: shard, deleted: Graveyard.deletionTime(grave) ?? 0, record: record))
            named?(grave)
        }
        return shard
    }

    /// After the rename of what was checked to be a `file`, or the
    /// `directory` of that inode: if something else came instead (another
    /// user's directory, exchanged onto the name on the source between the
    /// caller's check and this rename), it goes back to the name at once
    /// and the burial fails (EISDIR for a file, ENOTEMPTY for a directory),
    /// as the unlink or rmdir of the name would have. If a file's name was
    /// taken meanwhile the directory stays under it, never walked
    /// (`namesFile`). A directory in place of a checked one goes back beside
    /// the name (`NAME~N`: a rename within its directory, which whoever could
    /// exchange there could make) when the name was filled again, and the
    /// burial fails either way: it is never recorded as the caller's. One
    /// lstat of the new entry.
    @inline(__always)
    static func returnSwapped(_ shardFD: Int32, _ grave: UnsafePointer<CChar>, to parentFD: Int32,
                              _ name: UnsafePointer<CChar>, file: Bool, directory: ino_t?) throws(Errno) {
        guard file || directory != nil, let st = try? Sys.lstatat(shardFD, grave) else { return }
        if file {
            guard st.st_mode & S_IFMT == S_IFDIR else { return }
        } else {
            guard st.st_ino != directory else { return }
        }
        if (try? Sys.renameNoReplace(shardFD, grave, parentFD, name)) != nil { throw file ? .isDirectory : .directoryNotEmpty }
        if file { return }
        let base = Array(UnsafeBufferPointer(start: name, count: min(strlen(name), 240)))
        for n in 1...16 {
            let beside = base + Array("~\(n)".utf8CString)
            let back = beside.withUnsafeBufferPointer { (try? Sys.renameNoReplace(shardFD, grave, parentFD, $0.baseAddress!)) != nil }
            if back { break }
        }
        throw .directoryNotEmpty
    }

    /// `<ns since epoch>-<pid>-<counter>` in hex, built on the stack: unique
    /// across restarts, and sorting by name sorts by deletion time; then
    /// whom the entry's contents are freed as, if not the daemon (`DeletedBy`).
    @inline(__always)
    /// `file`: the entry is not a directory, which its name says with `_`
    /// before the counter (`namesFile`).
    func withUniqueName<R>(_ n: UInt64, time ns: UInt64, by deleter: DeletedBy? = nil, file: Bool = false,
                                   _ body: (UnsafePointer<CChar>) throws(Errno) -> R) throws(Errno) -> R {
        return try withUnsafeTemporaryAllocation(byteCount: 72, alignment: 8) { raw throws(Errno) -> R in
            let p = raw.bindMemory(to: CChar.self).baseAddress!
            var i = 0
            Graveyard.writeHex(ns, digits: 16, into: p, at: &i)
            p[i] = 0x2D; i += 1
            Graveyard.writeHex(UInt64(instance), digits: 8, into: p, at: &i)
            p[i] = file ? 0x5F : 0x2D; i += 1
            Graveyard.writeHex(n, digits: 10, into: p, at: &i)
            deleter?.write(into: p, at: &i)
            p[i] = 0
            return try body(UnsafePointer(p))
        }
    }

    /// Whether the entry name `name` was given to a file (or a symlink,
    /// anything but a directory): the reaper frees such an entry with one
    /// unlink, and never walks a directory found under such a name with
    /// the daemon's rights. A user who swaps a directory of theirs in
    /// between a check and a rename by name (on the source behind an
    /// unlink, or in their room during a restore) gets it stuck, not freed
    /// as root. Names from before this rule carry `-` (see docs/security.md).
    public static func namesFile(_ name: UnsafePointer<CChar>) -> Bool {
        name[25] == 0x5F && strlen(name) == DeletedBy.baseLength
    }

    static func writeHex(_ v: UInt64, digits: Int, into p: UnsafeMutablePointer<CChar>, at i: inout Int) {
        for d in stride(from: digits - 1, through: 0, by: -1) {
            let nibble = Int((v >> (UInt64(d) * 4)) & 0xF)
            p[i] = CChar(nibble < 10 ? 48 + nibble : 87 + nibble)
            i += 1
        }
    }

    static func hex(_ v: UInt64, digits: Int) -> String {
        var s = String(v, radix: 16)
        while s.count < digits { s = "0" + s }
        return s
    }
}

public enum GraveyardError: Error, CustomStringConvertible, Equatable {
    case notOurs
    case cannotCreate(Errno)
    /// There is no state directory, and none was to be made.
    case absent
    /// A directory of the state (named) that another user could have written, and why.
    case untrusted(String, String)

    /// The errno for callers that speak only errno.
    var errno: Errno {
        switch self {
        case .cannotCreate(let e): e
        case .absent: .noSuchFileOrDirectory
        case .notOurs, .untrusted: .notPermitted
        }
    }

    public var description: String {
        switch self {
        case .notOurs:
            return """
                the source already has a \(Graveyard.stateDirectoryName) that is not Vanish's state \
                directory (no \(Graveyard.markerName) marker in it); Vanish will not use or hide it. \
                Rename it and mount again.
                """
        case .absent:
            return "there is no \(Graveyard.stateDirectoryName) state directory"
        case .cannotCreate(let errno):
            return "cannot create the graveyard in the source's \(Graveyard.stateDirectoryName): \(errno)"
        case .untrusted(let name, let why):
            return """
                refusing the source's \(Graveyard.stateDirectoryName) state directory: \(name) is not private \
                to this daemon's user (\(why)), so another user could have planted or changed what it holds. \
                Nothing in it was used or moved. Move it aside (or, if it is a mount's of that user, mount as \
                them), then mount again: a fresh one is made.
                """
        }
    }
}
