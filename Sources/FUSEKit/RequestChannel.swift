import CFuseTransport
import Glibc

/// How requests reach the daemon: read from /dev/fuse by libfuse's workers,
/// or over io_uring (FUSE_OVER_IO_URING), one queue per CPU served on that
/// CPU by the thread that fetched the request (CFuseTransport/ring.c).
public enum RingMode: String, Sendable, CaseIterable {
    /// io_uring where the kernel offers it (the fuse module's
    /// `enable_uring` is on), else /dev/fuse.
    case auto
    /// io_uring; a root daemon turns `enable_uring` on first. The mount
    /// fails if the kernel still does not offer it.
    case on
    /// /dev/fuse only.
    case off
}

public enum RequestChannel {
    /// The fuse module's switch: while it is off the kernel offers io_uring
    /// to no daemon; on, it only offers it (a daemon that does not ask is
    /// unaffected).
    public static let kernelSwitch = "/sys/module/fuse/parameters/enable_uring"

    /// Whether the kernel offers io_uring to new mounts: nil if this kernel
    /// has no FUSE over io_uring at all.
    public static var kernelSwitchOn: Bool? {
        let fd = open(kernelSwitch, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var c: UInt8 = 0
        return read(fd, &c, 1) == 1 ? c == UInt8(ascii: "Y") : nil
    }

    /// Turns the kernel's switch on (root only); the errno if it cannot.
    public static func turnKernelSwitchOn() -> Int32 {
        let fd = open(kernelSwitch, O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { return errno }
        defer { close(fd) }
        return write(fd, "Y", 1) == 1 ? 0 : errno
    }

    /// What serves requests now, and why.
    public struct State: Sendable {
        public var ring: Bool
        public var queues: Int
        public var depth: Int
        public var threads: Int
        public var bufferBytes: UInt64
        /// How long a ring thread watches its queue after a reply (µs).
        public var spinMicroseconds: Int
        /// Why requests come over /dev/fuse (nil over io_uring).
        public var reason: String?
        /// Nodes forgotten in forgets read from /dev/fuse, and the reads that
        /// brought them (over io_uring, forgets come in batches).
        public var forgets: UInt64 = 0
        public var forgetReads: UInt64 = 0
        /// Replies after which a ring thread watched its entry for the next request.
        public var watches: UInt64 = 0

        public var name: String { ring ? "io_uring" : "/dev/fuse" }

        public init(ring: Bool, queues: Int = 0, depth: Int = 0, threads: Int = 0, bufferBytes: UInt64 = 0,
                    spinMicroseconds: Int = 0, reason: String? = nil) {
            (self.ring, self.queues, self.depth, self.threads) = (ring, queues, depth, threads)
            (self.bufferBytes, self.spinMicroseconds, self.reason) = (bufferBytes, spinMicroseconds, reason)
        }
    }

    /// What serves a session's requests, and why (`Transport.channel`).
    static func state(of transport: OpaquePointer) -> State {
        var info = vanish_ring_info()
        vanish_transport_ring_info(transport, &info)
        var s = State(ring: info.active != 0, queues: Int(info.queues), depth: Int(info.depth),
                      threads: Int(info.threads), bufferBytes: info.buffer_bytes,
                      spinMicroseconds: Int(info.spin_microseconds), reason: nil)
        (s.forgets, s.forgetReads, s.watches) = (info.forgets, info.forget_reads, info.watches)
        guard !s.ring else { return s }
        if info.mode == Int32(VANISH_RING_OFF) {
            s.reason = "off by -o io_uring=off"
        } else if info.error != 0 {
            s.reason = "the io_uring queues could not be made: \(String(cString: strerror(info.error)))"
        } else if info.offered == 0 {
            s.reason = switch kernelSwitchOn {
            case nil: "this kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)"
            case true?: "the kernel did not offer it to this mount (it was mounted before enable_uring was turned on)"
            case false?: "the kernel does not offer it: \(kernelSwitch) is N (root: vanish mount -o io_uring=on, or mount-scripts/install --io-uring)"
            }
        } else {
            s.reason = "the connection ended"
        }
        return s
    }
}
