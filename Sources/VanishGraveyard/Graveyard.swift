import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Where deleted entries wait for the reaper: `SOURCE/.vanish/graveyard/<shard>/<unique name>`,
/// on the same filesystem as what is deleted, so hiding an entry is one rename.
///
/// Nothing here is reachable through the mount: the filesystem hides the
/// state directory from readdir and lookup and refuses to create it.
public final class Graveyard: @unchecked Sendable {
    /// The state directory's name in the source root.
    public static let stateDirectoryName = ".vanish"
    static let markerName = "VANISH-STATE-DIRECTORY"
    /// Entries are spread over this many directories so none grows huge.
    /// At most 64: the reaper keeps one bit per shard in a word.
    public static let shardCount = 64

    /// O_PATH fds of the shard directories, open for the graveyard's life.
    public let shardFDs: [Int32]
    public let stateFD: Int32
    public let device: dev_t
    private let counter = Atomic<UInt64>(0)
    private let instance: UInt32
    let trash = TrashIndex()

    /// Opens (or, with `create`, makes) the state directory in the root `rootFD`.
    /// Refuses a `.vanish` that is not Vanish's: nothing of the user's is touched.
    /// Without `create`, a missing one is `.absent`.
    public init(rootFD: Int32, create: Bool = true) throws(GraveyardError) {
        let name = Graveyard.stateDirectoryName
        if create { try Graveyard.makeStateDirectory(in: rootFD) }
        let state: Int32
        do throws(Errno) {
            state = try Sys.openat(rootFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        } catch .noSuchFileOrDirectory where !create {
            throw .absent
        } catch {
            throw .notOurs
        }
        guard (try? Sys.lstatat(state, Graveyard.markerName)) != nil else {
            Sys.close(state)
            throw .notOurs
        }
        stateFD = state
        var shards: [Int32] = []
        do throws(Errno) {
            do throws(Errno) { try Sys.mkdirat(state, "graveyard", 0o700) } catch .fileExists {}
            let grave = try Sys.openat(state, "graveyard", VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            defer { Sys.close(grave) }
            for i in 0..<Graveyard.shardCount {
                let shard = Graveyard.hex(UInt64(i), digits: 2)
                do throws(Errno) { try Sys.mkdirat(grave, shard, 0o700) } catch .fileExists {}
                shards.append(try Sys.openat(grave, shard, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW))
            }
            device = try Sys.fstat(grave).st_dev
        } catch {
            shards.forEach(Sys.close)
            Sys.close(state)
            throw .cannotCreate(error)
        }
        shardFDs = shards
        instance = UInt32(truncatingIfNeeded: getpid())
        loadTrash()
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
            let fd = try Sys.openat(rootFD, stateDirectoryName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            defer { Sys.close(fd) }
            let marker = try Sys.openat(fd, markerName, O_WRONLY | O_CREAT | O_EXCL, 0o600)
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
        Sys.close(stateFD)
    }

    /// Moves `name` out of `parentFD` into the graveyard with one rename and
    /// returns the shard it went to. Throws EXDEV when the entry lives on
    /// another filesystem.
    ///
    /// With a `record` the entry stays restorable during the undo window
    /// (its sidecar is written first). `expired` marks pieces of an entry
    /// already being reaped: they carry time 0, so no undo window keeps them.
    /// `unheld` marks an entry buried without its record while there is a
    /// window (the disk was full): it carries time 1, so the window does not
    /// keep it either, yet it is reported when freed, unlike a piece.
    /// `time` is when it was deleted (an unlink answered before its burial
    /// landed), now if not given. `named`, if given, gets the entry's name
    /// once it is in place. `linking` makes the entry a hard link and leaves
    /// the name where it is, for the caller to unlink (a file still open).
    @inline(__always) @discardableResult
    public func bury(_ parentFD: Int32, _ name: UnsafePointer<CChar>, record: TrashRecord? = nil,
                     expired: Bool = false, unheld: Bool = false, time: UInt64? = nil, linking: Bool = false,
                     named: ((UnsafePointer<CChar>) -> Void)? = nil) throws(Errno) -> Int {
        let n = counter.wrappingAdd(1, ordering: .relaxed).newValue
        // Runs of 64 deletions share a shard, so a reaper woken for a program
        // that unlinks file after file scans one directory for many of them;
        // pieces of a tree being reaped are spread one by one, for parallel workers.
        let shard = Int((expired ? n : n >> 6) % UInt64(Graveyard.shardCount))
        let sfd = shardFDs[shard]
        try withUniqueName(n, time: expired ? 0 : unheld ? 1 : time ?? Sys.wallClockNow()) { grave throws(Errno) in
            guard let record else {
                try Sys.renameNoReplace(parentFD, name, sfd, grave)
                named?(grave)
                return
            }
            try writeSidecar(sfd, grave, record)
            do throws(Errno) {
                if linking {
                    if linkat(parentFD, name, sfd, grave, 0) != 0 { throw Errno(rawValue: errno) }
                } else {
                    try Sys.renameNoReplace(parentFD, name, sfd, grave)
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

    /// `<ns since epoch>-<pid>-<counter>` in hex, built on the stack: unique
    /// across restarts, and sorting by name sorts by deletion time.
    @inline(__always)
    private func withUniqueName<R>(_ n: UInt64, time ns: UInt64,
                                   _ body: (UnsafePointer<CChar>) throws(Errno) -> R) throws(Errno) -> R {
        var storage: (UInt64, UInt64, UInt64, UInt64, UInt64) = (0, 0, 0, 0, 0)
        return try withUnsafeMutableBytes(of: &storage) { raw throws(Errno) -> R in
            let p = raw.baseAddress!.assumingMemoryBound(to: CChar.self)
            var i = 0
            Graveyard.writeHex(ns, digits: 16, into: p, at: &i)
            p[i] = 0x2D; i += 1
            Graveyard.writeHex(UInt64(instance), digits: 8, into: p, at: &i)
            p[i] = 0x2D; i += 1
            Graveyard.writeHex(n, digits: 10, into: p, at: &i)
            p[i] = 0
            return try body(UnsafePointer(p))
        }
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
            return "cannot create the graveyard \(Graveyard.stateDirectoryName)/graveyard in the source: \(errno)"
        }
    }
}
