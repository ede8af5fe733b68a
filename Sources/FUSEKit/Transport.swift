import CFuseTransport

/// A session's FUSE transport (CFuseTransport): what libfuse 3.14 does not
/// negotiate or know, and the channel requests come over. Made by `Session`,
/// which the filesystem is given it through (`LowLevelFilesystem.initialize`);
/// it lives as long as the session.
public final class Transport: @unchecked Sendable {
    let raw: OpaquePointer

    init(owner: UnsafeMutableRawPointer) {
        guard let t = vanish_transport_new(owner) else { fatalError("out of memory for the FUSE transport") }
        raw = t
    }

    deinit { vanish_transport_free(raw) }

    /// What the kernel offered in its INIT request (empty before it came).
    public var offered: KernelFeatures { KernelFeatures(rawValue: vanish_transport_offered(raw)) }

    /// What the INIT reply granted (empty before it was sent).
    public var granted: KernelFeatures { KernelFeatures(rawValue: vanish_transport_granted(raw)) }

    /// From `LowLevelFilesystem.initialize`: asks for `wanted` in the INIT
    /// reply about to be sent; returns what the kernel offered of it.
    /// `maxStackDepth` (1 or 2) is how deep the backing files' filesystem may
    /// be stacked: 1 lets overlayfs sit on the mount, 2 lets the backing
    /// files be on overlayfs.
    public func request(_ wanted: KernelFeatures, maxStackDepth: UInt32 = 1) -> KernelFeatures {
        KernelFeatures(rawValue: vanish_transport_request(raw, wanted.rawValue, maxStackDepth))
    }

    /// From `LowLevelFilesystem.initialize`: whether the INIT reply will ask
    /// for io_uring (replies then go into its buffers, not through pipes).
    public var ringComing: Bool { vanish_transport_ring_wanted(raw) != 0 }

    /// The session's device, for registering backing files (nil before it is mounted).
    public var backingFiles: BackingFiles? {
        let fd = vanish_transport_device_fd(raw)
        return fd >= 0 ? BackingFiles(device: fd) : nil
    }

    /// What serves requests now, and why.
    public var channel: RequestChannel.State { RequestChannel.state(of: raw) }

    /// How long the thread that just replied watches for the next request
    /// (µs; 0 while workers wait in the kernel as libfuse has them).
    public var spinMicroseconds: Int { Int(vanish_transport_spin_microseconds(raw)) }
}
