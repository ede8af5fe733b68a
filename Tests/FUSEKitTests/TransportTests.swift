import CFuseTransport
import Glibc
import Testing

/// The transport's rewrites, driven through its receive and reply hooks with
/// recorded requests and replies over a pipe, without a mount: what libfuse
/// 3.14 would read and what the kernel would get. The transport's state is
/// the process's (one session), so the steps run in one test, in the order a
/// session sees them.
@Suite("transport rewrites")
struct TransportTests {
    /// Little-endian bytes of a request or reply, as the kernel lays them out.
    struct Bytes {
        var b: [UInt8] = []
        mutating func u16(_ v: UInt16) { b += withUnsafeBytes(of: v.littleEndian, Array.init) }
        mutating func u32(_ v: UInt32) { b += withUnsafeBytes(of: v.littleEndian, Array.init) }
        mutating func u64(_ v: UInt64) { b += withUnsafeBytes(of: v.littleEndian, Array.init) }
        mutating func zeros(_ n: Int) { b += [UInt8](repeating: 0, count: n) }
    }

    static func u32(_ b: [UInt8], _ at: Int) -> UInt32 { b[at..<at + 4].reversed().reduce(0) { $0 << 8 | UInt32($1) } }
    static func u64(_ b: [UInt8], _ at: Int) -> UInt64 { b[at..<at + 8].reversed().reduce(0) { $0 << 8 | UInt64($1) } }

    /// fuse_in_header (40 bytes) before `body`.
    static func request(opcode: UInt32, unique: UInt64, body: [UInt8]) -> [UInt8] {
        var h = Bytes()
        h.u32(UInt32(40 + body.count)); h.u32(opcode); h.u64(unique); h.u64(1)
        h.u32(0); h.u32(0); h.u32(1234); h.u16(0); h.u16(0)
        return h.b + body
    }

    /// fuse_out_header (16 bytes) before `body`.
    static func reply(unique: UInt64, error: Int32 = 0, body: [UInt8]) -> [UInt8] {
        var h = Bytes()
        h.u32(UInt32(16 + body.count)); h.u32(UInt32(bitPattern: error)); h.u64(unique)
        return h.b + body
    }

    /// What libfuse reads when the kernel sends `bytes`.
    func received(_ bytes: [UInt8]) throws -> [UInt8] {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]); close(fds[1]) }
        try #require(write(fds[1], bytes, bytes.count) == bytes.count)
        var buffer = [UInt8](repeating: 0, count: 4096)
        let n = vanish_transport_receive_hook(fds[0], &buffer, buffer.count)
        try #require(n == bytes.count)
        return Array(buffer[..<n])
    }

    /// What the kernel gets when libfuse writes `header` and `body` as two iovecs.
    func sent(_ bytes: [UInt8]) throws -> [UInt8] {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]); close(fds[1]) }
        var header = Array(bytes[..<16]), body = Array(bytes[16...])
        let n = header.withUnsafeMutableBytes { h in
            body.withUnsafeMutableBytes { b in
                var iov = [iovec(iov_base: h.baseAddress, iov_len: h.count), iovec(iov_base: b.baseAddress, iov_len: b.count)]
                return vanish_transport_reply_hook(fds[1], &iov, 2)
            }
        }
        try #require(n > 0)
        var buffer = [UInt8](repeating: 0, count: 4096)
        let m = read(fds[0], &buffer, buffer.count)
        try #require(m == n)
        return Array(buffer[..<m])
    }

    @Test("INIT asks for what 3.14 does not know; TMPFILE and STATX reach libfuse as CREATE and GETATTR, STATX answered with its own reply")
    func rewrites() throws {
        let initExt: UInt64 = 1 << 30, parallelDirops = VANISH_FUSE_PARALLEL_DIROPS, passthrough = VANISH_FUSE_PASSTHROUGH
        // INIT: the kernel offers passthrough (flags2) and parallel dirops.
        let offered = initExt | parallelDirops | passthrough | 1  // | ASYNC_READ
        var initIn = Bytes()
        initIn.u32(7); initIn.u32(45); initIn.u32(131072)
        initIn.u32(UInt32(truncatingIfNeeded: offered)); initIn.u32(UInt32(offered >> 32)); initIn.zeros(44)
        let initRequest = Self.request(opcode: 26, unique: 2, body: initIn.b)
        #expect(try received(initRequest) == initRequest, "INIT reaches libfuse as the kernel sent it")
        #expect(vanish_transport_offered() == offered)
        #expect(vanish_transport_request(parallelDirops | passthrough | VANISH_FUSE_HANDLE_KILLPRIV_V2, 1)
                == parallelDirops | passthrough, "what was offered of what is wanted")

        // libfuse's INIT reply (protocol 7.38, no flags2) gets them added, and the stacking depth.
        var initOut = Bytes()
        initOut.u32(7); initOut.u32(38); initOut.u32(131072); initOut.u32(1)
        initOut.u16(12); initOut.u16(9); initOut.u32(1 << 20); initOut.u32(1); initOut.u16(256); initOut.u16(0)
        initOut.u32(0); initOut.zeros(28)
        let patched = try sent(Self.reply(unique: 2, body: initOut.b))
        #expect(patched.count == 16 + 64)
        let flags = UInt64(Self.u32(patched, 16 + 12)) | UInt64(Self.u32(patched, 16 + 32)) << 32
        #expect(flags == 1 | initExt | parallelDirops | passthrough)
        #expect(Self.u32(patched, 16 + 36) == 1, "max_stack_depth")
        #expect(vanish_transport_granted() == parallelDirops | passthrough)

        // O_TMPFILE: FUSE_TMPFILE (51) with fuse_create_in and the name "/" becomes a CREATE (35).
        var create = Bytes()
        create.u32(UInt32(O_RDWR)); create.u32(0o100600); create.u32(0o022); create.u32(0)
        let tmpfile = Self.request(opcode: 51, unique: 4, body: create.b + [UInt8(ascii: "/"), 0])
        let asCreate = try received(tmpfile)
        #expect(Self.u32(asCreate, 4) == 35 && Array(asCreate[8...]) == Array(tmpfile[8...]))
        // A LOOKUP of the same size is left alone.
        let lookup = Self.request(opcode: 1, unique: 6, body: Array("abcdefghijklmnopq".utf8) + [0])
        #expect(try received(lookup) == lookup)

        // STATX (52) becomes the GETATTR (3) it begins with ...
        var statxIn = Bytes()
        statxIn.u32(0); statxIn.u32(0); statxIn.u64(0); statxIn.u32(0); statxIn.u32(0x7ff)
        let statx = Self.request(opcode: 52, unique: 8, body: statxIn.b)
        let asGetattr = try received(statx)
        #expect(Self.u32(asGetattr, 4) == 3 && Array(asGetattr[8...]) == Array(statx[8...]))
        // ... and libfuse's fuse_attr_out reply goes out as a fuse_statx_out.
        var attrOut = Bytes()
        attrOut.u64(1); attrOut.u32(500_000_000); attrOut.u32(0)
        attrOut.u64(77); attrOut.u64(4096); attrOut.u64(8)  // ino, size, blocks
        attrOut.u64(100); attrOut.u64(200); attrOut.u64(300)  // atime, mtime, ctime
        attrOut.u32(1); attrOut.u32(2); attrOut.u32(3)
        attrOut.u32(0o100644); attrOut.u32(1); attrOut.u32(1000); attrOut.u32(1000); attrOut.u32(0); attrOut.u32(4096); attrOut.u32(0)
        let statxOut = try sent(Self.reply(unique: 8, body: attrOut.b))
        #expect(statxOut.count == 16 + 288 && Self.u32(statxOut, 0) == 16 + 288)
        let s = 16 + 32  // fuse_statx after attr_valid, its nsec, flags and two spares
        #expect(Self.u64(statxOut, 16) == 1 && Self.u32(statxOut, 24) == 500_000_000)
        #expect(Self.u32(statxOut, s) == 0x7ff, "basic stats, no birth time (none was given)")
        #expect(Self.u32(statxOut, s + 28) & 0xffff == 0o100644 && Self.u64(statxOut, s + 32) == 77)
        #expect(Self.u64(statxOut, s + 40) == 4096 && Self.u64(statxOut, s + 112) == 200, "size, mtime")
        // Answered once: the same id again (and an error to another STATX) passes unchanged.
        let again = Self.reply(unique: 8, body: attrOut.b)
        #expect(try sent(again) == again)
        _ = try received(Self.request(opcode: 52, unique: 10, body: statxIn.b))
        let error = Self.reply(unique: 10, error: -ENOENT, body: [])
        #expect(try sent(error + []).count == 16)
    }
}
