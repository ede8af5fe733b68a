import CLinux
import Glibc
import LinuxSyscalls
import SystemPackage

/// Taking over another client's graveyard (it is gone: its lease expired, or
/// an administrator said so). The claim is one rename of the whole graveyard
/// directory into this one's `incoming/`, so of two clients adopting at once
/// exactly one gets it, and no entry is ever freed by two. Absorbing then
/// moves each entry (and its trash record) into this graveyard's shards,
/// where the reaper and the undo window treat it as one of this client's.
extension Graveyard {
    /// The clients with a directory in this source's state directory, this one included.
    public func clients() -> [ClientID] {
        Graveyard.names(in: sharedFD, Graveyard.clientsDirectoryName).compactMap { try? ClientID($0) }
    }

    /// Claims `other`'s graveyard whole; false if it has none (another
    /// client adopted it first, or it never deleted anything).
    @discardableResult
    public func claim(_ other: ClientID) throws(Errno) -> Bool {
        guard other != client else { return false }
        let from: OwnedDescriptor
        do throws(Errno) {
            from = try Graveyard.openDirectory(sharedFD, [Graveyard.clientsDirectoryName, other.name])
        } catch .noSuchFileOrDirectory {
            return false
        }
        let incoming = OwnedDescriptor(try Graveyard.makeDirectory(graveyardFD, [Graveyard.incomingName]))
        let name = other.name + "." + Graveyard.hex(Sys.wallClockNow(), digits: 16)
        do throws(Errno) {
            try Sys.renameNoReplace(from.raw, Graveyard.graveyardName, incoming.raw, name)
        } catch .noSuchFileOrDirectory {
            return false
        }
        return true
    }

    /// Whether adopted graveyards wait to be absorbed (one lstat).
    public var hasIncoming: Bool { (try? Sys.lstatat(graveyardFD, Graveyard.incomingName)) != nil }

    /// Moves every entry of the adopted graveyards into this one, calling
    /// `landed` with each entry's shard, and removes what held them.
    /// Returns how many entries moved. Resumable: a crash leaves entries
    /// either here or there, never lost (an orphan record is removed at start).
    /// An entry whose record is there but cannot be read yet waits, with
    /// what holds it, for a later call (see `absorb(shard:landed:)`).
    @discardableResult
    public func absorbAdopted(landed: (Int) -> Void) -> Int {
        guard let incoming = try? Sys.openat(graveyardFD, Graveyard.incomingName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        else { return 0 }
        defer { Sys.close(incoming) }
        var moved = 0
        // An adopted graveyard may hold ones its client had adopted: those are lifted up and taken in turn.
        var pending = Graveyard.names(in: incoming, ".")
        while let adopted = pending.popLast() {
            guard let g = try? Sys.openat(incoming, adopted, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
            if let inner = try? Graveyard.openDirectory(g, [Graveyard.incomingName]) {
                for nested in Graveyard.names(in: inner.raw, ".") {
                    let lifted = adopted + "+" + nested
                    if (try? Sys.renameNoReplace(inner.raw, nested, incoming, lifted)) != nil { pending.append(lifted) }
                }
            }
            _ = try? Sys.unlinkat(g, Graveyard.incomingName, AT_REMOVEDIR)
            for shard in Graveyard.names(in: g, ".") where shard != Graveyard.incomingName {
                guard let s = try? Sys.openat(g, shard, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
                moved += absorb(shard: s, landed: landed)
                Sys.close(s)
                _ = try? Sys.unlinkat(g, shard, AT_REMOVEDIR)
            }
            Sys.close(g)
            _ = try? Sys.unlinkat(incoming, adopted, AT_REMOVEDIR)
        }
        _ = try? Sys.unlinkat(graveyardFD, Graveyard.incomingName, AT_REMOVEDIR)
        return moved
    }

    /// Moves one adopted shard's entries in, each under a new name of this
    /// graveyard that keeps its deletion time (names from another machine
    /// could collide), its trash record first.
    private func absorb(shard from: Int32, landed: (Int) -> Void) -> Int {
        let all = Graveyard.names(in: from, ".")
        let records = Set(all.filter { $0.hasPrefix(".") }.map { String($0.dropFirst()) })
        var moved = 0
        var later: Set<String> = []
        for name in all where !name.hasPrefix(".") {
            let record = records.contains(name) ? readSidecar(from, name) : nil
            // A record that is there but cannot be read yet may still be on
            // its way from the client that wrote it (a network volume's
            // client keeps writes back a while): leave the entry for a
            // later look rather than take it without its record, unless
            // the record is old enough to be damaged instead.
            if records.contains(name) && record == nil && Self.isRecent(from, "." + name) {
                later.insert(name)
                continue
            }
            let time = name.withCString { Graveyard.nameTime($0) } ?? 0
            let n = counter.wrappingAdd(1, ordering: .relaxed).newValue
            let shard = Int(n % UInt64(Graveyard.shardCount))
            let sfd = shardFDs[shard]
            let deleter = name.withCString { DeletedBy(entryName: $0) }
            let ok = (try? withUniqueName(n, time: time, by: deleter) { grave throws(Errno) -> Bool in
                if record != nil {
                    var side: [CChar] = [0x2E]
                    side.append(contentsOf: UnsafeBufferPointer(start: grave, count: strlen(grave) + 1))
                    if (try? Sys.renameNoReplace(from, "." + name, sfd, side)) == nil { return false }
                }
                do throws(Errno) {
                    try Sys.renameNoReplace(from, name, sfd, grave)
                } catch {
                    if record != nil { removeSidecar(sfd, grave) }
                    return false
                }
                if let record {
                    let id = String(cString: grave)
                    trash.insert(TrashEntry(id: id, shard: shard, deleted: time, record: record))
                }
                return true
            }) ?? false
            if ok {
                moved += 1
                landed(shard)
            }
        }
        // Records whose entry is gone (freed by the client that died, or moved above).
        for id in records.subtracting(later) { _ = try? Sys.unlinkat(from, "." + id, 0) }
        return moved
    }

    /// How long a record that cannot be read is waited for (its mtime's age).
    static let recordGrace = Duration.seconds(120).nanoseconds

    /// Whether `name` in `dirFD` changed less than `recordGrace` ago.
    static func isRecent(_ dirFD: Int32, _ name: String) -> Bool {
        guard let st = try? Sys.lstatat(dirFD, name) else { return false }
        let mtime = st.st_mtim.tv_sec < 0 ? 0 : Sys.nanoseconds(st.st_mtim)
        return mtime &+ recordGrace > Sys.wallClockNow()
    }

    /// Entries waiting in client `other`'s graveyard (a scan: for status).
    public func pendingEntries(of other: ClientID) -> Int {
        guard let g = try? Graveyard.openDirectory(sharedFD, [Graveyard.clientsDirectoryName, other.name, Graveyard.graveyardName])
        else { return 0 }
        var n = 0
        for shard in Graveyard.names(in: g.raw, ".") {
            n += Graveyard.names(in: g.raw, shard).filter { !$0.hasPrefix(".") }.count
        }
        return n
    }

    /// Opens (O_PATH) each name of `path` in turn from `dirFD`, never following a symlink.
    static func openDirectory(_ dirFD: Int32, _ path: [String]) throws(Errno) -> OwnedDescriptor {
        precondition(!path.isEmpty, "a path of at least one name")
        var at = try Sys.opened(dirFD, path[0], VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        for name in path.dropFirst() {
            at = try Sys.opened(at.raw, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        }
        return at
    }

    /// The names in `dirFD`'s child `name` (`.` for itself) but `.` and
    /// `..`; none if it cannot be read. Never follows a symlink.
    static func names(in dirFD: Int32, _ name: String) -> [String] {
        guard let dp = try? Sys.openDirectory(dirFD, name) else { return [] }
        defer { closedir(dp) }
        var out: [String] = []
        while let d = readdir(dp) {
            let p = vanish_dirent_name(d)!
            if p[0] == 0x2E && (p[1] == 0 || (p[1] == 0x2E && p[2] == 0)) { continue }
            out.append(String(cString: p))
        }
        return out
    }
}
