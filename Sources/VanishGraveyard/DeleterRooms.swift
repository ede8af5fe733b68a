import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

extension Graveyard {
    /// A graveyard name taken before its entry arrives: a one-step delete
    /// moves the tree into its deleter's room under this name, and `bury`
    /// with `reserved` later moves it on into a shard under the same name,
    /// so the `deleted` event can name the entry at once.
    public struct Reservation: Sendable, Equatable {
        let number: UInt64
        /// When its entry was deleted (ns since the epoch).
        public let time: UInt64
        public let deleter: DeletedBy?
    }

    /// A name for an entry `deleter` buries (nil: the daemon's own user),
    /// deleted now or at `time` (a part of a tree deleted then).
    public func reserve(by deleter: DeletedBy?, at time: UInt64? = nil) -> Reservation {
        Reservation(number: counter.wrappingAdd(1, ordering: .relaxed).newValue, time: time ?? clock.now(),
                    deleter: deleter)
    }

    /// A name for a piece split off an entry `deleter` buried at `since` (see `TreeRemover`).
    func reservePiece(by deleter: DeletedBy, of since: UInt64?) -> Reservation {
        Reservation(number: counter.wrappingAdd(1, ordering: .relaxed).newValue, time: Deletion.piece(of: since).nameTime,
                    deleter: deleter)
    }

    /// `body` with the name `reservation` stands for.
    public func withName<R>(_ reservation: Reservation,
                            _ body: (UnsafePointer<CChar>) throws(Errno) -> R) throws(Errno) -> R {
        try withUniqueName(reservation.number, time: reservation.time, by: reservation.deleter, body)
    }

    /// What to write into the names of entries `c` buries: nil where the
    /// reaper frees them with the daemon's own rights anyway (`c` is nil or
    /// the daemon's user, or the daemon cannot take on another identity).
    /// Throws if the deleter's record cannot be written: such an entry must
    /// not be buried in a way that would free it with the daemon's rights.
    public func identify(_ c: Credentials?) throws(Errno) -> DeletedBy? {
        guard let c, c.uid != geteuid(), Credentials.canSwitch else { return nil }
        return try deleters.identify(c)
    }

    /// Whom the contents of the entry `name` are freed as; nil for the daemon itself.
    public func credentials(ofEntry name: UnsafePointer<CChar>) -> Credentials? {
        guard Credentials.canSwitch, let id = DeletedBy(entryName: name) else { return nil }
        return deleters.credentials(id)
    }
}

/// Where a one-step delete lands first: `users/<uid>` in this client's state
/// directory, a directory of the deleter's own (mode 0700) inside the
/// daemon's private one. The deleter's move into it is made with their
/// credentials, so the kernel decides whether they may move the tree at all
/// (as `mv` would), and no path reaches it: only descriptors opened inside
/// the tree before the delete.
public final class DeleterRooms: Sendable {
    /// One user's room (O_PATH), open while anyone holds it: an fd that a
    /// one-step delete still waiting for its check uses stays that room's
    /// however many other rooms are opened meanwhile.
    public final class Room: Sendable {
        public let fd: Int32
        fileprivate init(adopting fd: Int32) { self.fd = fd }
        deinit { Sys.close(fd) }
    }

    /// `users/` (O_PATH), private to the daemon's user.
    private let usersFD: Int32
    /// `onestep/` (O_PATH), private to the daemon's user: where each tree
    /// moved into a room but not yet checked came from (`notePending`),
    /// for the next start should the daemon stop before the check.
    private let pendingFD: Int32
    /// The rooms used last, each with when (a count of uses). Bounded: a
    /// user with a range of subordinate uids acts as thousands of users,
    /// and one fd kept for each of them took all of the daemon's.
    private struct Recent {
        var rooms: [uid_t: (room: Room, used: UInt64)] = [:]
        var uses: UInt64 = 0
    }
    private let recent = Mutex(Recent())
    static let kept = 32

    init(stateFD: Int32) throws(Errno) {
        usersFD = try Graveyard.makeDirectory(stateFD, ["users"])
        do throws(Errno) {
            pendingFD = try Graveyard.makeDirectory(stateFD, ["onestep"])
        } catch {
            Sys.close(usersFD)
            throw error
        }
    }

    deinit {
        Sys.close(usersFD)
        Sys.close(pendingFD)
    }

    private static func pendingName(_ uid: uid_t, _ entry: UnsafePointer<CChar>) -> String {
        String(uid) + "-" + String(cString: entry)
    }

    /// Writes where the tree `entry` of `uid`'s room comes from, before it
    /// moves in: `record` has its path from the mount's root, and its undo
    /// window (0: not kept).
    public func notePending(_ uid: uid_t, _ entry: UnsafePointer<CChar>, _ record: TrashRecord) throws(Errno) {
        try record.write(to: pendingFD, Self.pendingName(uid, entry), O_TRUNC)
    }

    /// Where `entry` in `uid`'s room came from, if it was noted and still waits.
    public func pending(_ uid: uid_t, _ entry: UnsafePointer<CChar>) -> TrashRecord? {
        guard let fd = try? Sys.opened(pendingFD, Self.pendingName(uid, entry), O_RDONLY | O_NOFOLLOW) else { return nil }
        return TrashRecord(decoding: Sys.readAll(fd.raw))
    }

    /// The tree `entry` of `uid`'s room was checked: buried, put back or held.
    public func settled(_ uid: uid_t, _ entry: UnsafePointer<CChar>) {
        _ = try? Sys.unlinkat(pendingFD, Self.pendingName(uid, entry), 0)
    }

    /// Forgets the origins of trees no room holds any more (the daemon
    /// stopped between noting one and its move, or after its check).
    public func forgetSettled() {
        for name in (try? Sys.names(in: pendingFD, ".")) ?? [] {
            let parts = name.split(separator: "-", maxSplits: 1)
            var held = false
            if parts.count == 2, uid_t(parts[0]) != nil,
               let room = try? Sys.opened(usersFD, String(parts[0]), VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) {
                held = (try? Sys.lstatat(room.raw, String(parts[1]))) != nil
            }
            if !held { _ = try? Sys.unlinkat(pendingFD, name, 0) }
        }
    }

    /// What rooms hold: trees a daemon that stopped before checking them
    /// left there, by the uid whose room it is and its group. Empty rooms
    /// are removed (a room is made again on its user's next one-step delete).
    public func leftovers() -> [(uid: uid_t, gid: gid_t, room: Room, names: [String])] {
        var found: [(uid: uid_t, gid: gid_t, room: Room, names: [String])] = []
        for user in (try? Sys.names(in: usersFD, ".")) ?? [] {
            guard let uid = uid_t(user),
                  let fd = try? Sys.openat(usersFD, user, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
            else { continue }
            let room = Room(adopting: fd)
            guard let st = try? Sys.fstat(fd) else { continue }
            let names = ((try? Sys.names(in: fd, ".")) ?? []).filter { !Self.isStaged($0) }
            if names.isEmpty {
                // Not one in use (made again or opened since the start): rmdir
                // fails harmlessly if a restore staged something there meanwhile.
                recent.withLock { r in
                    if r.rooms[uid] == nil { _ = try? Sys.unlinkat(usersFD, user, AT_REMOVEDIR) }
                }
                continue
            }
            found.append((uid, st.st_gid, room, names))
        }
        return found
    }

    /// A restore moves its entry through its user's room under this name,
    /// which says where it goes back if the daemon stops meanwhile.
    static func stagedName(shard: Int, id: String) -> String {
        "restoring-" + Graveyard.hex(UInt64(shard), digits: 2) + "-" + id
    }

    /// Whether `name` in a room is a restore under way, not a one-step delete.
    public static func isStaged(_ name: String) -> Bool { name.hasPrefix("restoring-") }

    /// Moves entries that restores left staged in rooms (the daemon stopped
    /// between its two renames) back to their shards, before the trash is read.
    ///
    /// A room is its user's: they may reach it (through `..` of a directory
    /// staged there, from a descriptor held inside it) and put anything in
    /// it under any name. So a staged name goes back only as a kept entry of
    /// that user (`isKept`: its record is in the shard, where no user
    /// writes), and a directory only under a name that frees it as them
    /// (`mayReturn`); anything else stays in the room, renamed as a
    /// leftover of theirs, checked and freed as them (`leftovers`).
    func returnStaged(to shardFDs: [Int32], isKept: (_ shard: Int, _ id: String, _ uid: uid_t) -> Bool) {
        for user in (try? Sys.names(in: usersFD, ".")) ?? [] {
            guard let uid = uid_t(user),
                  let roomFD = try? Sys.opened(usersFD, user, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
            let room = roomFD.raw
            for name in (try? Sys.names(in: room, ".")) ?? [] where Self.isStaged(name) {
                let parts = name.split(separator: "-", maxSplits: 2)
                if parts.count == 3, let shard = Int(parts[1], radix: 16), shardFDs.indices.contains(shard),
                   case let id = String(parts[2]), !id.hasPrefix("."), isKept(shard, id, uid),
                   Self.mayReturn(room, name, as: id, uid: uid),
                   (try? Sys.renameNoReplace(room, name, shardFDs[shard], id)) != nil {
                    continue
                }
                _ = try? Sys.renameNoReplace(room, name, room, "returned-" + name.dropFirst("restoring-".count))
            }
        }
    }

    /// Whether `name` in the room of `uid` may become the graveyard entry
    /// `id`: a directory's contents are freed as the user its entry name
    /// says (the daemon, when it names none), so a directory goes back only
    /// under a name that says `uid`. Anything else is freed with one unlink.
    static func mayReturn(_ room: Int32, _ name: String, as id: String, uid: uid_t) -> Bool {
        guard let st = try? Sys.lstatat(room, name) else { return false }
        if st.st_mode & S_IFMT != S_IFDIR { return true }
        return id.withCString { DeletedBy(entryName: $0) }?.uid == uid
    }

    /// `uid`'s room, made on first use: a directory only the daemon's user
    /// could have made (`users/` is private), given to `uid` and `gid`.
    /// Hold the room while its fd is used.
    public func room(for uid: uid_t, gid: gid_t) throws(Errno) -> Room {
        try recent.withLock { (r: inout Recent) throws(Errno) -> Room in
            r.uses &+= 1
            if let hit = r.rooms[uid] {
                r.rooms[uid] = (hit.room, r.uses)
                return hit.room
            }
            let name = String(uid)
            do throws(Errno) { try Sys.mkdirat(usersFD, name, 0o700) } catch .fileExists {}
            let room = Room(adopting: try Sys.openat(usersFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW))
            let st = try Sys.fstat(room.fd)
            if st.st_uid != uid { try Sys.fchown(room.fd, uid, gid) }
            if st.st_mode & 0o077 != 0 { try Sys.chmod(.path(room.fd), 0o700) }
            if r.rooms.count >= Self.kept, let oldest = r.rooms.min(by: { $0.value.used < $1.value.used })?.key {
                r.rooms[oldest] = nil
            }
            r.rooms[uid] = (room, r.uses)
            return room
        }
    }
}
