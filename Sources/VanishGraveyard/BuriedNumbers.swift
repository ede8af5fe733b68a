import CLinux
import Glibc
import LinuxSyscalls

/// The inode numbers at the top of the graveyard's shards: the files
/// unlinked or replaced through the mount (and trees' top directories) that
/// wait to be freed or restored. A file handle cannot tell where its file
/// is; asked to open one, the mount checks here that the file was not
/// deleted (see docs/design.md, "Exportable file handles").
///
/// A shard is read again only when it changed: its mtime moved, or was too
/// close to the last reading for a change in the same clock tick to show.
public final class BuriedNumbers: Sendable {
    private struct Shard {
        var mtime: Int64 = -1
        var readAt: Int64 = 0
        var numbers: Set<UInt64> = []
    }

    private let shardFDs: [Int32]
    private let shards: Lock<[Shard]>
    /// How long after a shard's last change its reading is trusted (ns):
    /// filesystems stamp times from a coarse clock.
    private static let settle = Int64(Duration.milliseconds(100).nanoseconds)

    public init(_ graveyard: Graveyard) {
        shardFDs = graveyard.shardFDs
        shards = Lock([Shard](repeating: Shard(), count: graveyard.shardFDs.count))
    }

    /// Whether an entry at the top of a shard is the inode numbered `ino`.
    /// O(entries) for the shards that changed since the last call.
    public func contains(_ ino: UInt64) -> Bool {
        for (i, fd) in shardFDs.enumerated() {
            guard let st = try? Sys.fstat(fd) else { return true }
            let mtime = Int64(bitPattern: Sys.nanoseconds(st.st_mtim))
            let cached: Set<UInt64>? = shards.withLock { s in
                s[i].mtime == mtime && s[i].readAt - mtime > Self.settle ? s[i].numbers : nil
            }
            if let cached {
                if cached.contains(ino) { return true }
                continue
            }
            let now = Int64(bitPattern: Sys.wallClockNow())
            // Unreadable: as if it held the file, so a handle is refused rather than trusted.
            guard let numbers = Self.read(fd) else { return true }
            shards.withLock { $0[i] = Shard(mtime: mtime, readAt: now, numbers: numbers) }
            if numbers.contains(ino) { return true }
        }
        return false
    }

    private static func read(_ shard: Int32) -> Set<UInt64>? {
        guard let dp = try? Sys.openDirectory(shard, ".") else { return nil }
        defer { closedir(dp) }
        var numbers = Set<UInt64>()
        while let d = readdir(dp) { numbers.insert(UInt64(d.pointee.d_ino)) }
        return numbers
    }
}
