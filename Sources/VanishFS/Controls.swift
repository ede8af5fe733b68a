import CFuse
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishClient
import VanishGraveyard

/// The mount's own xattr names, compared without allocating: the delete
/// trigger (`DeleteTrigger`) and the status (`getxattr(MOUNT_ROOT,
/// "user.vanish.status")`, JSON about the graveyard and the reaper, what
/// `vanish status` reads).
enum ControlNames {
    static let deleteAttribute = ControlProtocol.deleteAttribute
    static let statusAttribute = ControlProtocol.statusAttribute

    /// True if a setxattr of `name` with `flags` is the delete trigger: the
    /// name with both XATTR_CREATE and XATTR_REPLACE, which no copy of data
    /// passes (see `ControlProtocol.deleteFlags`); else it is stored as any
    /// other attribute.
    @inline(__always)
    static func isDeleteTrigger(_ name: UnsafePointer<CChar>, flags: Int32) -> Bool {
        flags == ControlProtocol.deleteFlags && name[0] == 0x75 && strcmp(name, deleteAttribute) == 0
    }

    /// True for the status name (`user.vanish.status`): reserved, never
    /// stored in the source.
    @inline(__always)
    static func isReserved(_ name: UnsafePointer<CChar>) -> Bool {
        name[0] == 0x75 && strcmp(name, statusAttribute) == 0
    }

    @inline(__always)
    static func isStatusQuery(_ ino: fuse_ino_t, _ name: UnsafePointer<CChar>) -> Bool {
        ino == fuse_ino_t(FUSE_ROOT_ID) && name[0] == 0x75 && strcmp(name, statusAttribute) == 0
    }
}

extension VanishFilesystem {
    /// "on", or "off: " and why (an option, the kernel, the daemon's rights).
    var passthroughState: String {
        if openFiles.passthrough.active { return "on" }
        let why = kernel.passthroughReason.withLock { $0 }
        return why == "on" ? "off: the kernel refused backing files" : why
    }

    /// getxattr of the status name on the root: the status, as JSON, for the caller.
    func replyStatus(_ req: Request, size: Int) throws(Errno) {
        guard var json = statusJSON(for: req.caller.uid) else { throw .noData }
        let count = json.utf8.count
        if size == 0 { req.reply(xattrSize: count); return }
        guard size >= count else { throw .outOfRange }
        json.withUTF8 { req.reply(bytes: UnsafeRawBufferPointer($0)) }
    }

    /// The status attribute's value for `uid` (`StatusReport`): nil before INIT.
    func statusJSON(for uid: uid_t) -> String? {
        guard let transport = kernel.transport.withLock({ $0 }) else { return nil }
        return StatusReport.json(statusFacts(for: uid, transport: transport), for: uid)
    }

    /// What `vanish status` shows `uid`: counts for the whole mount, and
    /// the undo window's entries of `uid` (none listed for root, who gets
    /// the totals), from the per-user index; how requests are served from
    /// the session's `transport`.
    package func statusFacts(for uid: uid_t, transport: Transport) -> StatusFacts {
        let d = deleter
        return StatusFacts(
            place: .init(source: source.path, stateDirectory: d.stateDirectory, graveyard: d.graveyard != nil,
                         socket: control.status.socket, log: control.status.log, client: d.graveyard?.client.name,
                         leaseSeconds: Duration.nanoseconds(d.leases?.length ?? 0).inSeconds, otherClients: d.leases?.peers ?? []),
            reaping: d.reapingFacts(oneStep: oneStep, heldPutBack: control.heldEntriesPutBack),
            undoWindow: d.undoWindowFacts(for: uid),
            serving: .init(knownInodes: table.count, stataheadEntries: caches.statahead.prefetched.load(ordering: .relaxed),
                           cachedFDs: namespace.cachedFDs, fdCacheLimit: namespace.fdLimit,
                           kernelFeatures: "\(transport.granted)", passthrough: passthroughState,
                           spinMicroseconds: transport.spinMicroseconds,
                           cacheSeconds: caches.watch != nil ? SourceWatch.timeout : options.attrTimeout,
                           fileHandles: table.codec != nil ? "exportable" : "while cached", requests: transport.channel))
    }
}
