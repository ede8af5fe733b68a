import FUSEKit
import Glibc
import LinuxSyscalls
import Logging
import Synchronization
import SystemPackage

/// How one open of a regular file is served.
enum OpenKind: UInt64 {
    /// Through the daemon, with passthrough off for the session.
    case daemon = 0
    /// Straight from the kernel to the backing file (the inode's backing id).
    case passthrough = 1
    /// With the inode's backing id, as the kernel requires of every open of
    /// an inode that has one, but `direct_io`: reads and writes come to the
    /// daemon (only mmap goes to the backing). For an open whose writes must
    /// clear setuid/setgid.
    case passthroughDirect = 2
    /// Through the daemon, data cached per the cache option, while the
    /// inode has no backing (counted: the kernel refuses a passthrough open
    /// beside one, ETXTBSY).
    case cached = 3
}

/// A file handle (`fi->fh`): the open fd in the low 32 bits, which every
/// handler reads with `Int32(truncatingIfNeeded:)`, and above it how the
/// open is served and whether its writes must clear setuid/setgid.
enum FileHandle {
    private static let killPrivBit: UInt64 = 1 << 40
    private static let outsideGroupBit: UInt64 = 1 << 41

    static func make(fd: Int32, kind: OpenKind, kills: PrivilegeKill?) -> UInt64 {
        var fh = UInt64(UInt32(bitPattern: fd)) | kind.rawValue << 32
        if let kills { fh |= killPrivBit | (kills.outsideGroup ? outsideGroupBit : 0) }
        return fh
    }

    /// What writes through the handle must clear, if anything.
    @inline(__always)
    static func kills(_ fh: UInt64) -> PrivilegeKill? {
        fh & killPrivBit == 0 ? nil : PrivilegeKill(outsideGroup: fh & outsideGroupBit != 0)
    }

    @inline(__always)
    static func fd(_ fh: UInt64) -> Int32 { Int32(truncatingIfNeeded: fh) }

    static func kind(_ fh: UInt64) -> OpenKind { OpenKind(rawValue: (fh >> 32) & 0xFF) ?? .daemon }
}

/// A write by a user without CAP_FSETID clears setuid, and setgid where the
/// group could execute the file or the writer is not in its group (the
/// kernel's setattr_should_drop_sgid).
struct PrivilegeKill {
    /// The writer is not in the file's group.
    var outsideGroup: Bool

    /// The mode once the writer's change cleared what it must.
    func cleared(_ mode: mode_t) -> mode_t {
        var m = mode & ~S_ISUID
        if m & S_IXGRP != 0 || outsideGroup { m &= ~S_ISGID }
        return m
    }
}

/// Passthrough opens, as libfuse's passthrough_hp (3.17) keeps them: one
/// backing id per inode, registered from its first open and closed on the
/// last release. The kernel requires every
/// passthrough open of an inode to use the same backing (EBUSY otherwise)
/// and refuses one while page-cache opens of it exist (ETXTBSY), so the
/// per-inode counts decide each open's kind under one lock.
///
/// Lock order: `lock` is a leaf (held across the BACKING_OPEN/CLOSE ioctl,
/// a few microseconds, never while taking another lock).
final class PassthroughFiles: @unchecked Sendable {
    private let lock = Lock<Void>(())
    /// Set once before the loop starts serving; nil: passthrough is off.
    private var backings: BackingFiles?
    /// The kernel refused backing files altogether (no CAP_SYS_ADMIN).
    private let refusedAll = Atomic<Bool>(false)
    // Guarded by `lock`.
    /// Devices whose files the kernel refused as backing (ELOOP, EOPNOTSUPP).
    private var refusedDevices: Set<dev_t> = []
    private let log: Logger

    init(log: Logger) { self.log = log }

    /// Turns passthrough on for this session (after the INIT reply granted it).
    func start(_ backings: BackingFiles) { self.backings = backings }

    var active: Bool { backings != nil && !refusedAll.load(ordering: .relaxed) }

    /// Chooses how an open of the regular file `node` is served, given the
    /// daemon's fd for it and whether its reads and writes must come to the
    /// daemon (writes that clear setuid/setgid). Returns the kind and the
    /// backing id the reply carries (0: none).
    ///
    /// The kernel opens a backing file of its own for each passthrough open,
    /// from the registered file's path, with that open's flags and the
    /// daemon's credentials: any open's fd can be the inode's backing.
    func open(_ node: Inode, fd: Int32, throughDaemon: Bool) -> (OpenKind, Int32) {
        guard let backings, !refusedAll.load(ordering: .relaxed) else { return (.daemon, 0) }
        return lock.withLock { _ -> (OpenKind, Int32) in
            if node.backing.id > 0 {
                node.backing.passthroughOpens += 1
                return (throughDaemon ? .passthroughDirect : .passthrough, node.backing.id)
            }
            if throughDaemon || node.backing.cachedOpens > 0 || refusedDevices.contains(node.key.dev)
                || refusedAll.load(ordering: .relaxed) {
                node.backing.cachedOpens += 1
                return (.cached, 0)
            }
            do throws(Errno) {
                let id = try backings.register(fd)
                node.backing.id = id
                node.backing.passthroughOpens = 1
                return (.passthrough, id)
            } catch {
                refuse(node, error)
                node.backing.cachedOpens += 1
                return (.cached, 0)
            }
        }
    }

    /// A handle of `node` opened as `kind` was released.
    func release(_ node: Inode, kind: OpenKind) {
        guard kind != .daemon else { return }
        lock.withLock { _ in
            if kind == .cached {
                node.backing.cachedOpens -= 1
                return
            }
            node.backing.passthroughOpens -= 1
            if node.backing.passthroughOpens == 0 && node.backing.id > 0 {
                backings?.unregister(node.backing.id)
                node.backing.id = 0
            }
        }
    }

    /// Called under `lock` when the kernel would not take a backing file.
    private func refuse(_ node: Inode, _ error: Errno) {
        if error == .notPermitted {
            // Needs CAP_SYS_ADMIN in the initial namespace: off for the session.
            refusedAll.store(true, ordering: .relaxed)
            log.warning("passthrough is off: the kernel refused a backing file (it needs CAP_SYS_ADMIN); file data goes through the daemon")
            return
        }
        guard refusedDevices.insert(node.key.dev).inserted else { return }
        log.warning("files on this backing device go through the daemon: the kernel refused one as a passthrough backing",
                    metadata: ["dev": "\(node.key.dev)", "error": "\(error)"])
    }
}
