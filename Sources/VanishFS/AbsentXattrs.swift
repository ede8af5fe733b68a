import Glibc
import LinuxSyscalls
import SystemPackage

/// Answers "no such xattr" without asking the backing file, for files known
/// to have none. `ls -l`, `cp -a`, `rsync -X` and `tar --xattrs` ask each
/// file for `security.selinux` and the ACL names, which most files lack, and
/// the kernel caches no xattr answers for FUSE but POSIX ACLs.
///
/// The answer is exactly as fresh as the attributes the kernel holds: a file
/// counts as xattr-less while the ctime last sent to the kernel is the one
/// it had no xattrs at, the kernel still trusts those attributes (within
/// their timeout, and not dropped because the source watch saw a change
/// behind the mount, which every xattr change is), and no xattr was set
/// through the mount since. Only on the source's own local disk filesystem,
/// where any xattr change moves the ctime to a value not seen before
/// (nanosecond, multigrain times).
struct AbsentXattrs: Sendable {
    /// Off with `cache=never` (attributes are not kept) and on network or FUSE sources.
    let enabled: Bool
    let device: dev_t
    /// How long (ms) the kernel keeps the source's attributes.
    let window: UInt32

    init(enabled: Bool, device: dev_t, timeout: Double) {
        self.enabled = enabled && timeout > 0
        self.device = device
        window = UInt32(min(timeout * 1000, Double(UInt32.max / 2)))
    }

    /// Whether `node` has no xattrs now, by the rule above.
    @inline(__always)
    func knownNone(_ node: Inode) -> Bool {
        guard enabled else { return false }
        let known = node.xattrsAt.load(ordering: .acquiring)
        guard known & 1 == 0, known != 0, known >> 1 == node.ctimeSent.load(ordering: .relaxed) else { return false }
        return trusted(node)
    }

    /// Records whether `node` has xattrs (`list`: the bytes of its names,
    /// from listxattr) at the ctime the kernel holds; nothing if that ctime
    /// may be stale or is recorded already.
    func learn(_ node: Inode, list: () throws(Errno) -> Int) {
        guard enabled, node.key.dev == device else { return }
        // The ctime before the listing: a change after it gives a newer ctime,
        // so what is recorded here can only be true or never used.
        let ctime = node.ctimeSent.load(ordering: .acquiring)
        guard ctime != 0, trusted(node), node.xattrsAt.load(ordering: .relaxed) >> 1 != ctime else { return }
        let names: Int
        do throws(Errno) { names = try list() } catch { return }
        node.xattrsAt.store(ctime << 1 | (names > 0 ? 1 : 0), ordering: .releasing)
    }

    /// An xattr was set or removed through the mount.
    @inline(__always)
    func changed(_ node: Inode) {
        node.xattrsAt.store(0, ordering: .releasing)
    }

    @inline(__always)
    private func trusted(_ node: Inode) -> Bool {
        guard node.key.dev == device, !node.attributesDropped.load(ordering: .acquiring) else { return false }
        let sent = node.attributesSent.load(ordering: .relaxed)
        return sent != 0 && InodeTable.coarseMilliseconds() &- sent < window
    }
}
