import CFuse
import CLinux
import Glibc
import LinuxSyscalls
import Synchronization

/// Reads too large for libfuse to splice, answered from reused buffers.
///
/// libfuse splices a read's data from the file through a pipe into
/// /dev/fuse, but only when the pipe holds the whole reply. A pipe grows to
/// `/proc/sys/fs/pipe-max-size` (1 MiB by default) unless the daemon has
/// CAP_SYS_RESOURCE, so the kernel's largest reads (1 MiB, as `dd bs=1M
/// iflag=direct` sends them) never fit: libfuse then maps a fresh 1 MiB
/// buffer for each, faults in its 256 pages and unmaps it (the daemon's
/// fixed mmap threshold keeps glibc from recycling it). That made O_DIRECT
/// reads up to 2.5× passthrough_ll's. Here such a read is a pread into a
/// buffer kept from the last one and one reply.
public enum LargeReads {
    /// The largest read libfuse can splice in this process: its per-thread
    /// pipe must hold the data plus three pages and the 16-byte header.
    static let spliceLimit: Int = {
        var fds: [Int32] = [-1, -1]
        guard vanish_pipe_cloexec(&fds) == 0 else { return 0 }
        defer { close(fds[0]); close(fds[1]) }
        let overhead = 3 * Int(getpagesize()) + 16
        // 2 MiB covers any read the kernel sends (256 pages at most); else
        // libfuse grows its pipes to pipe-max-size.
        var capacity = Int(vanish_pipe_resize(fds[0], 2 << 20))
        if capacity < 0 {
            let most = Sys.readNumber(atPath: "/proc/sys/fs/pipe-max-size") ?? 1 << 20
            capacity = Int(vanish_pipe_resize(fds[0], Int32(clamping: most)))
        }
        return max(0, capacity - overhead)
    }()

    static let buffers = BufferPool(size: 1 << 20, keep: 4)

    /// Unmaps the buffers kept for the next large read (about 1 MiB each,
    /// four at most): for a mount that has gone quiet.
    public static func releaseIdle() { buffers.releaseIdle() }

    /// Reads up to `size` bytes of `fd` at `offset` into a pooled buffer and
    /// replies with them; false, with nothing sent, if `size` is over the
    /// pool's buffer size or no buffer could be mapped (the caller lets
    /// libfuse answer).
    static func reply(_ req: fuse_req_t, fd: Int32, offset: off_t, size: Int) -> Bool {
        guard size <= buffers.size, let buffer = buffers.take() else { return false }
        defer { buffers.give(buffer) }
        var done = 0
        while done < size {
            let n = pread(fd, buffer + done, size - done, offset + off_t(done))
            if n > 0 { done += n; continue }
            if n == 0 { break }
            if errno == EINTR { continue }
            // Bytes already read are what a short read returns; an error
            // before any is the read's answer.
            if done > 0 { break }
            _ = fuse_reply_err(req, errno)
            return true
        }
        _ = fuse_reply_buf(req, buffer.assumingMemoryBound(to: CChar.self), done)
        return true
    }
}

/// Page-aligned anonymous buffers of one size, kept between uses so their
/// pages stay faulted in. At most `keep` wait in the pool (more concurrent
/// readers get buffers of their own, unmapped after use); `releaseIdle`
/// gives them all back, for a mount that has gone quiet.
final class BufferPool: Sendable {
    let size: Int
    private let keep: Int
    // Addresses, not pointers: a Mutex's value must be Sendable.
    private let idle = Lock<[UInt]>([])

    init(size: Int, keep: Int) {
        self.size = size
        self.keep = keep
    }

    func take() -> UnsafeMutableRawPointer? {
        if let b = idle.withLock({ $0.popLast() }) { return UnsafeMutableRawPointer(bitPattern: b) }
        let p = mmap(nil, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        return p == MAP_FAILED ? nil : p
    }

    func give(_ buffer: UnsafeMutableRawPointer) {
        let kept = idle.withLock { list -> Bool in
            guard list.count < keep else { return false }
            list.append(UInt(bitPattern: buffer))
            return true
        }
        if !kept { munmap(buffer, size) }
    }

    func releaseIdle() {
        idle.withLock { list in
            for b in list { munmap(UnsafeMutableRawPointer(bitPattern: b), size) }
            list.removeAll()
        }
    }
}
