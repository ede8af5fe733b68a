import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Who buried a graveyard entry, carried in its name: the reaper frees what
/// the entry holds with that user's uid, gid and groups, so the kernel
/// decides what goes, as it would for `rm -r` run by them. A descriptor
/// held inside a buried directory (on the source, or through the mount) can
/// move anything into it; nothing of that is freed that its deleter could
/// not have freed. An entry whose name says nobody (a file, which holds
/// nothing, or one the daemon's own user buried) is freed with the daemon's
/// rights.
///
/// The name holds the uid, the gid and a key to the supplementary groups,
/// which are written once per distinct set to `deleters/` in the client's
/// state directory (`DeleterRecords`).
public struct DeletedBy: Sendable, Hashable {
    public let uid: uid_t
    public let gid: gid_t
    let groupsKey: UInt64

    /// "-" and 32 hex digits after the entry's unique name.
    static let suffixLength = 33
    /// `<time>-<instance>-<counter>`, what every entry name starts with.
    static let baseLength = 36

    /// The suffix of an entry name, if it has one.
    public init?(entryName name: UnsafePointer<CChar>) {
        guard strlen(name) == Self.baseLength + Self.suffixLength, name[Self.baseLength] == 0x2D,
              let uid = Self.parseHex(name + Self.baseLength + 1, 8),
              let gid = Self.parseHex(name + Self.baseLength + 9, 8),
              let key = Self.parseHex(name + Self.baseLength + 17, 16) else { return nil }
        self.uid = uid_t(truncatingIfNeeded: uid)
        self.gid = gid_t(truncatingIfNeeded: gid)
        groupsKey = key
    }

    init(uid: uid_t, gid: gid_t, groupsKey: UInt64) {
        self.uid = uid
        self.gid = gid
        self.groupsKey = groupsKey
    }

    /// Writes the suffix at `p[i...]`.
    func write(into p: UnsafeMutablePointer<CChar>, at i: inout Int) {
        p[i] = 0x2D; i += 1
        Graveyard.writeHex(UInt64(uid), digits: 8, into: p, at: &i)
        Graveyard.writeHex(UInt64(gid), digits: 8, into: p, at: &i)
        Graveyard.writeHex(groupsKey, digits: 16, into: p, at: &i)
    }

    /// The name of its groups' record in `deleters/`.
    var recordName: String {
        Graveyard.hex(UInt64(uid), digits: 8) + Graveyard.hex(UInt64(gid), digits: 8) + Graveyard.hex(groupsKey, digits: 16)
    }

    private static func parseHex(_ p: UnsafePointer<CChar>, _ digits: Int) -> UInt64? {
        var v: UInt64 = 0
        for i in 0..<digits {
            let c = UInt8(bitPattern: p[i])
            switch c {
            case 0x30...0x39: v = v << 4 | UInt64(c - 0x30)
            case 0x61...0x66: v = v << 4 | UInt64(c - 0x61 + 10)
            default: return nil
            }
        }
        return v
    }
}

/// The supplementary groups of each deleter, one small file per distinct
/// identity in the client's private `deleters/`, written before the first
/// entry that names it is buried. Not synced: the uid and gid are in the
/// entry's name, so a record a crash lost costs only the groups, fewer
/// rights and never more (and an fsync here cost a user's first one-step
/// delete of each mount some 15 ms).
final class DeleterRecords: Sendable {
    private let dirFD: Int32
    private let known = Mutex<[DeletedBy: Credentials]>([:])
    private let identities = Mutex<[IdentityKey: DeletedBy]>([:])

    private struct IdentityKey: Hashable {
        let uid: uid_t
        let gid: gid_t
        let groups: [gid_t]
    }

    init(stateFD: Int32) throws(GraveyardError) {
        dirFD = try Graveyard.makePrivateDirectory(stateFD, ["deleters"])
    }

    deinit { Sys.close(dirFD) }

    /// The name suffix for `c`, its record written first if it is new.
    func identify(_ c: Credentials) throws(Errno) -> DeletedBy {
        let groups = Array(Set(c.groups)).sorted()
        let key = IdentityKey(uid: c.uid, gid: c.gid, groups: groups)
        if let id = identities.withLock({ $0[key] }) { return id }
        let text = "\(c.uid) \(c.gid)" + groups.map { " \($0)" }.joined() + "\n"
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in text.utf8 { hash = (hash ^ UInt64(b)) &* 0x100_0000_01b3 }
        // A key taken by another set (a collision) moves on to the next.
        for probe in UInt64(0)..<16 {
            let id = DeletedBy(uid: c.uid, gid: c.gid, groupsKey: hash &+ probe)
            if try store(id, text) {
                identities.withLock { $0[key] = id }
                known.withLock { $0[id] = Credentials(uid: c.uid, gid: c.gid, groups: groups) }
                return id
            }
        }
        throw .fileExists
    }

    /// Writes `text` as `id`'s record unless one is there; true if the record now says `text`.
    private func store(_ id: DeletedBy, _ text: String) throws(Errno) -> Bool {
        let name = id.recordName
        if let existing = read(name) { return existing == text }
        let temp = name + ".new"
        _ = try? Sys.unlinkat(dirFD, temp, 0)
        let fd = FileDescriptor(rawValue: try Sys.openat(dirFD, temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600))
        do {
            _ = try fd.closeAfter { _ = try fd.writeAll(text.utf8) }
        } catch {
            _ = try? Sys.unlinkat(dirFD, temp, 0)
            throw (error as? Errno) ?? .ioError
        }
        do throws(Errno) {
            try Sys.renameNoReplace(dirFD, temp, dirFD, name)
        } catch .fileExists {
            _ = try? Sys.unlinkat(dirFD, temp, 0)
            return read(name) == text
        }
        return true
    }

    private func read(_ name: String) -> String? {
        guard let fd = try? Sys.opened(dirFD, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC) else { return nil }
        var buffer = [UInt8](repeating: 0, count: 65536)
        let n = Glibc.read(fd.raw, &buffer, buffer.count)
        guard n > 0 else { return nil }
        return String(decoding: buffer[..<n], as: UTF8.self)
    }

    /// Whom `id` stands for. A record that is missing or does not match the
    /// name (another client's entry, adopted) gives the uid and gid alone:
    /// fewer rights, never more.
    func credentials(_ id: DeletedBy) -> Credentials {
        if let c = known.withLock({ $0[id] }) { return c }
        var c = Credentials(uid: id.uid, gid: id.gid, groups: [])
        if let text = read(id.recordName) {
            let numbers = text.split(whereSeparator: { $0 == " " || $0 == "\n" }).compactMap { UInt32($0) }
            if numbers.count >= 2, numbers[0] == id.uid, numbers[1] == id.gid {
                c.groups = Array(numbers.dropFirst(2))
            }
        }
        known.withLock { $0[id] = c }
        return c
    }
}
