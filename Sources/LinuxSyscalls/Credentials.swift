import CLinux
import Glibc
import SystemPackage

/// A user's identity for file access: whom a request or a connection came
/// from, as the kernel vouches for it. `acting` takes it on for the calling
/// thread alone, so that the kernel itself checks what that user may do
/// (modes, ACLs, the sticky bit, capabilities dropped with a non-zero
/// fsuid) instead of a copy of its rules; only a daemon with CAP_SETUID and
/// CAP_SETGID (root) can.
public struct Credentials: Sendable {
    public var uid: uid_t
    public var gid: gid_t
    public var groups: [gid_t]

    public init(uid: uid_t, gid: gid_t, groups: [gid_t]) {
        self.uid = uid
        self.gid = gid
        self.groups = groups
    }

    /// Whether the mode bits of `st` grant all of `mask` (R=4, W=2, X=1) to
    /// these credentials, as the kernel's generic_permission decides by
    /// them alone: no ACL, and of capabilities only root's (which passes,
    /// except that execute needs some x bit). Where the kernel can decide,
    /// ask it instead (`acting` and `Sys.access`).
    public func modeBitsGrant(_ st: stat, _ mask: mode_t) -> Bool {
        if uid == 0 { return mask & 1 == 0 || st.st_mode & 0o111 != 0 || st.st_mode & S_IFMT == S_IFDIR }
        let bits: mode_t
        if st.st_uid == uid {
            bits = (st.st_mode >> 6) & 7
        } else if st.st_gid == gid || groups.contains(st.st_gid) {
            bits = (st.st_mode >> 3) & 7
        } else {
            bits = st.st_mode & 7
        }
        return bits & mask == mask
    }

    /// `uid` with its primary group and groups as /etc/passwd and /etc/group
    /// have them now (`UserDatabase`: never NSS); a uid they do not know
    /// gets `fallbackGID` alone.
    public static func ofUser(_ uid: uid_t, fallbackGID: gid_t) -> Credentials {
        guard let user = UserDatabase.user(uid) else {
            return Credentials(uid: uid, gid: fallbackGID, groups: [fallbackGID])
        }
        return Credentials(uid: uid, gid: user.gid, groups: UserDatabase.groups(of: user.name, primary: user.gid))
    }

    /// `body` with `credentials` taken on (`acting`), or with the thread's own when nil.
    @inline(__always)
    public static func acting<R>(_ credentials: Credentials?, _ body: () throws(Errno) -> R) throws(Errno) -> R {
        guard let credentials else { return try body() }
        return try credentials.acting(body)
    }

    /// Whether this process may take other users' identities.
    public static var canSwitch: Bool { geteuid() == 0 }

    /// Runs `body` with these credentials for file access on this thread,
    /// then puts the thread's own back, also when `body` throws.
    public func acting<R>(_ body: () throws(Errno) -> R) throws(Errno) -> R {
        let saved = Credentials.current()
        try Credentials.apply(self)
        defer {
            // Puts back what was there; failing that, the thread would go on
            // with a user's rights, so the daemon stops instead.
            do throws(Errno) { try Credentials.apply(saved) } catch {
                fatalError("cannot restore the thread's own credentials: \(error)")
            }
        }
        return try body()
    }

    /// Runs `body` (which makes a file) with the calling thread's umask set to
    /// `mask`, then sets it back, also when `body` throws. The filesystem that
    /// makes the file then applies the mask as it would for the caller: not at
    /// all where the directory has a default ACL, which decides instead.
    public static func withUmask<R>(_ mask: mode_t, _ body: () throws(Errno) -> R) throws(Errno) -> R {
        let old = vanish_thread_umask(mask)
        if old < 0 { throw Errno(rawValue: errno) }
        defer { _ = vanish_thread_umask(mode_t(old)) }
        return try body()
    }

    /// The calling thread's file-system identity.
    public static func current() -> Credentials {
        let n = Glibc.getgroups(0, nil)
        var groups = [gid_t](repeating: 0, count: Int(max(n, 0)))
        let got = groups.isEmpty ? 0 : Glibc.getgroups(n, &groups)
        // setfsuid(-1) changes nothing and returns the current fsuid.
        let uid = uid_t(bitPattern: vanish_thread_setfsuid(uid_t.max))
        let gid = gid_t(bitPattern: vanish_thread_setfsgid(gid_t.max))
        return Credentials(uid: uid, gid: gid, groups: Array(groups.prefix(Int(max(got, 0)))))
    }

    private static func apply(_ c: Credentials) throws(Errno) {
        let rc = c.groups.withUnsafeBufferPointer { vanish_thread_setgroups($0.count, $0.baseAddress) }
        if rc != 0 { throw Errno(rawValue: errno) }
        _ = vanish_thread_setfsgid(c.gid)
        _ = vanish_thread_setfsuid(c.uid)
        // Neither call reports failure except by leaving the id unchanged.
        guard uid_t(bitPattern: vanish_thread_setfsuid(uid_t.max)) == c.uid,
              gid_t(bitPattern: vanish_thread_setfsgid(gid_t.max)) == c.gid else { throw .notPermitted }
    }
}
