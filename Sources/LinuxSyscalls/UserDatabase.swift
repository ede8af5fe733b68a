import Glibc

/// Users and groups as /etc/passwd and /etc/group list them, read directly.
/// glibc's own lookups (getpwuid, getgrouplist) load the NSS modules of
/// /etc/nsswitch.conf, and in the fully static release binary a module such
/// as libnss_systemd crashes the thread that loads it. A user only another
/// source knows (LDAP, systemd-homed) is not found: callers fall back to
/// fewer rights, never more.
public enum UserDatabase {
    /// The name and primary group of `uid`.
    public static func user(_ uid: uid_t, passwd: String = "/etc/passwd") -> (name: String, gid: gid_t)? {
        for fields in records(passwd) where fields.count >= 4 && UInt32(fields[2]) == uid {
            guard let gid = UInt32(fields[3]) else { return nil }
            return (fields[0], gid)
        }
        return nil
    }

    /// `name`'s groups: `primary` and every group that lists them as a member.
    public static func groups(of name: String, primary: gid_t, group: String = "/etc/group") -> [gid_t] {
        var groups = [primary]
        for fields in records(group) where fields.count >= 4 {
            guard let gid = UInt32(fields[2]), gid != primary else { continue }
            if fields[3].split(separator: ",").contains(where: { $0 == name }) { groups.append(gid) }
        }
        return groups
    }

    /// The colon-separated fields of each line of the file at `path` (none if unreadable).
    static func records(_ path: String) -> [[String]] {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return [] }
        defer { close(fd) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let n = read(fd, &chunk, chunk.count)
            if n < 0 && errno == EINTR { continue }
            guard n > 0 else { break }
            bytes += chunk[..<n]
            // The user database is small; a file this big is not one.
            if bytes.count > 64 << 20 { return [] }
        }
        return bytes.split(separator: 0x0A).compactMap { line in
            guard line.first != 0x23 else { return nil }
            return line.split(separator: 0x3A, omittingEmptySubsequences: false).map { String(decoding: $0, as: UTF8.self) }
        }
    }
}
