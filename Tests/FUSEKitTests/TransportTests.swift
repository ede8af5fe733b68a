import CFuse
import CFuseTransport
import Glibc
import Testing

/// The transport's rewrites, driven through its receive and reply hooks with
/// recorded requests and replies over a pipe, without a mount: what libfuse
/// 3.14 would read and what the kernel would get. Each test has transports
/// of its own (a session's state is its transport's).
@Suite("transport rewrites")
struct TransportTests {
    /// A transport with an unmounted session of operations `ops`, which
    /// takes O_TMPFILE opens (`tmpfile`), installed on a pipe its replies
    /// can be read from (`replies`).
    final class Fixture {
        let t: OpaquePointer
        let session: OpaquePointer
        let replies: (read: Int32, write: Int32)

        init(_ ops: fuse_lowlevel_ops = fuse_lowlevel_ops(),
             tmpfile: vanish_tmpfile_op = { req, _, _, _ in _ = fuse_reply_err(req, ENOSYS) }) throws {
            let t = try #require(vanish_transport_new(nil))
            self.t = t
            var argv: [UnsafeMutablePointer<CChar>?] = [strdup("test"), nil]
            defer { free(argv[0]) }
            var ops = ops
            let made = argv.withUnsafeMutableBufferPointer { p -> OpaquePointer? in
                var args = fuse_args(argc: 1, argv: p.baseAddress, allocated: 0)
                defer { fuse_opt_free_args(&args) }
                return vanish_transport_session_new(t, &args, &ops, tmpfile)
            }
            session = try #require(made)
            var fds: [Int32] = [0, 0]
            try #require(pipe(&fds) == 0)
            _ = fcntl(fds[0], F_SETFL, O_NONBLOCK)
            replies = (fds[0], fds[1])
            try #require(vanish_transport_install(t, replies.write) == 0)
        }

        /// What the kernel would get next from the session ([] if nothing).
        func reply() -> [UInt8] {
            var buffer = [UInt8](repeating: 0, count: 4096)
            let n = read(replies.read, &buffer, buffer.count)
            return n > 0 ? Array(buffer[..<n]) : []
        }

        deinit {
            fuse_session_destroy(session)  // closes the fd it served: `replies.write`
            vanish_transport_free(t)
            close(replies.read)
        }
    }

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

    /// What libfuse reads when the kernel sends `bytes` to `t`.
    func received(by t: OpaquePointer, _ bytes: [UInt8]) throws -> [UInt8] {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]); close(fds[1]) }
        try #require(write(fds[1], bytes, bytes.count) == bytes.count)
        var buffer = [UInt8](repeating: 0, count: 4096)
        let n = vanish_transport_receive_hook(t, fds[0], &buffer, buffer.count)
        try #require(n == bytes.count)
        return Array(buffer[..<n])
    }

    /// What the kernel gets when libfuse writes `header` and `body` as two iovecs through `t`.
    func sent(by t: OpaquePointer, _ bytes: [UInt8]) throws -> [UInt8] {
        var fds: [Int32] = [0, 0]
        try #require(pipe(&fds) == 0)
        defer { close(fds[0]); close(fds[1]) }
        var header = Array(bytes[..<16]), body = Array(bytes[16...])
        let n = header.withUnsafeMutableBytes { h in
            body.withUnsafeMutableBytes { b in
                var iov = [iovec(iov_base: h.baseAddress, iov_len: h.count), iovec(iov_base: b.baseAddress, iov_len: b.count)]
                return vanish_transport_reply_hook(t, fds[1], &iov, 2)
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
        let f = try Fixture()
        let t = f.t
        let initExt: UInt64 = 1 << 30, parallelDirops = VANISH_FUSE_PARALLEL_DIROPS, passthrough = VANISH_FUSE_PASSTHROUGH
        // INIT: the kernel offers passthrough (flags2) and parallel dirops.
        let offered = initExt | parallelDirops | passthrough | 1  // | ASYNC_READ
        var initIn = Bytes()
        initIn.u32(7); initIn.u32(45); initIn.u32(131072)
        initIn.u32(UInt32(truncatingIfNeeded: offered)); initIn.u32(UInt32(offered >> 32)); initIn.zeros(44)
        let initRequest = Self.request(opcode: 26, unique: 2, body: initIn.b)
        #expect(try received(by: t, initRequest) == initRequest, "INIT reaches libfuse as the kernel sent it")
        #expect(vanish_transport_offered(t) == offered)
        #expect(vanish_transport_request(t, parallelDirops | passthrough | VANISH_FUSE_HANDLE_KILLPRIV_V2, 1)
                == parallelDirops | passthrough, "what was offered of what is wanted")

        // libfuse's INIT reply (protocol 7.38, no flags2) gets them added, and the stacking depth.
        var initOut = Bytes()
        initOut.u32(7); initOut.u32(38); initOut.u32(131072); initOut.u32(1)
        initOut.u16(12); initOut.u16(9); initOut.u32(1 << 20); initOut.u32(1); initOut.u16(256); initOut.u16(0)
        initOut.u32(0); initOut.zeros(28)
        let patched = try sent(by: t, Self.reply(unique: 2, body: initOut.b))
        #expect(patched.count == 16 + 64)
        let flags = UInt64(Self.u32(patched, 16 + 12)) | UInt64(Self.u32(patched, 16 + 32)) << 32
        #expect(flags == 1 | initExt | parallelDirops | passthrough)
        #expect(Self.u32(patched, 16 + 36) == 1, "max_stack_depth")
        #expect(vanish_transport_granted(t) == parallelDirops | passthrough)

        // O_TMPFILE: FUSE_TMPFILE (51) with fuse_create_in and the name "/" becomes a CREATE (35).
        var create = Bytes()
        create.u32(UInt32(O_RDWR)); create.u32(0o100600); create.u32(0o022); create.u32(0)
        let tmpfile = Self.request(opcode: 51, unique: 4, body: create.b + [UInt8(ascii: "/"), 0])
        let asCreate = try received(by: t, tmpfile)
        #expect(Self.u32(asCreate, 4) == 35 && Array(asCreate[8...]) == Array(tmpfile[8...]))
        // A LOOKUP of the same size is left alone.
        let lookup = Self.request(opcode: 1, unique: 6, body: Array("abcdefghijklmnopq".utf8) + [0])
        #expect(try received(by: t, lookup) == lookup)

        // STATX (52) becomes the GETATTR (3) it begins with ...
        var statxIn = Bytes()
        statxIn.u32(0); statxIn.u32(0); statxIn.u64(0); statxIn.u32(0); statxIn.u32(0x7ff)
        let statx = Self.request(opcode: 52, unique: 8, body: statxIn.b)
        let asGetattr = try received(by: t, statx)
        #expect(Self.u32(asGetattr, 4) == 3 && Array(asGetattr[8...]) == Array(statx[8...]))
        // ... and libfuse's fuse_attr_out reply goes out as a fuse_statx_out.
        var attrOut = Bytes()
        attrOut.u64(1); attrOut.u32(500_000_000); attrOut.u32(0)
        attrOut.u64(77); attrOut.u64(4096); attrOut.u64(8)  // ino, size, blocks
        attrOut.u64(100); attrOut.u64(200); attrOut.u64(300)  // atime, mtime, ctime
        attrOut.u32(1); attrOut.u32(2); attrOut.u32(3)
        attrOut.u32(0o100644); attrOut.u32(1); attrOut.u32(1000); attrOut.u32(1000); attrOut.u32(0); attrOut.u32(4096); attrOut.u32(0)
        let statxOut = try sent(by: t, Self.reply(unique: 8, body: attrOut.b))
        #expect(statxOut.count == 16 + 288 && Self.u32(statxOut, 0) == 16 + 288)
        let s = 16 + 32  // fuse_statx after attr_valid, its nsec, flags and two spares
        #expect(Self.u64(statxOut, 16) == 1 && Self.u32(statxOut, 24) == 500_000_000)
        #expect(Self.u32(statxOut, s) == 0x7ff, "basic stats, no birth time (none was given)")
        #expect(Self.u32(statxOut, s + 28) & 0xffff == 0o100644 && Self.u64(statxOut, s + 32) == 77)
        #expect(Self.u64(statxOut, s + 40) == 4096 && Self.u64(statxOut, s + 112) == 200, "size, mtime")
        // Answered once: the same id again (and an error to another STATX) passes unchanged.
        let again = Self.reply(unique: 8, body: attrOut.b)
        #expect(try sent(by: t, again) == again)
        _ = try received(by: t, Self.request(opcode: 52, unique: 10, body: statxIn.b))
        let error = Self.reply(unique: 10, error: -ENOENT, body: [])
        #expect(try sent(by: t, error + []).count == 16)
    }

    /// Runs `bytes` through the transport's receive hook and libfuse, as a
    /// worker does, and returns what the session replied.
    func serve(_ f: Fixture, _ bytes: [UInt8]) throws -> [UInt8] {
        var request = try received(by: f.t, bytes)
        request.withUnsafeMutableBytes { p in
            var buf = fuse_buf(size: p.count, flags: fuse_buf_flags(rawValue: 0), mem: p.baseAddress, fd: -1, pos: 0)
            fuse_session_process_buf(f.session, &buf)
        }
        return f.reply()
    }

    /// The INIT request of a 6.18 kernel offering `flags`.
    static func initRequest(unique: UInt64, flags: UInt64) -> [UInt8] {
        var body = Bytes()
        body.u32(7); body.u32(45); body.u32(131072)
        body.u32(UInt32(truncatingIfNeeded: flags)); body.u32(UInt32(flags >> 32)); body.zeros(44)
        return request(opcode: 26, unique: unique, body: body.b)
    }

    static let birth: UInt64 = 1_700_000_000_123_456_789

    @Test("through libfuse: an O_TMPFILE open reaches the tmpfile operation and a create of any other name create; STATX gets the birth time its handler gave, GETATTR none; an open carries its backing id")
    func throughLibfuse() throws {
        var ops = fuse_lowlevel_ops()
        ops.create = { req, _, name, _, _ in
            // ENAMETOOLONG marks "create was called with this name".
            _ = fuse_reply_err(req, strcmp(name!, "f") == 0 ? ENAMETOOLONG : EIO)
        }
        ops.getattr = { req, _, _ in
            vanish_request_begin(req, 0, 0)
            var st = stat()
            st.st_ino = 77
            st.st_mode = S_IFREG | 0o644
            st.st_size = 5
            _ = vanish_reply_attr_birth(req, &st, 1.5, TransportTests.birth)
        }
        ops.open = { req, _, fi in
            fi!.pointee.fh = 42
            fi!.pointee.keep_cache = 1
            _ = vanish_reply_open_backing(req, fi, 7)
        }
        // EXDEV marks "tmpfile was called".
        let f = try Fixture(ops) { req, parent, _, _ in _ = fuse_reply_err(req, parent == 1 ? EXDEV : EIO) }
        let initExt: UInt64 = 1 << 30
        let initReply = try serve(f, Self.initRequest(unique: 2, flags: initExt | VANISH_FUSE_PARALLEL_DIROPS))
        #expect(initReply.count == 16 + 64 && Self.u32(initReply, 4) == 0, "INIT answered")

        var create = Bytes()
        create.u32(UInt32(O_RDWR)); create.u32(0o100600); create.u32(0o022); create.u32(0)
        let tmpfile = try serve(f, Self.request(opcode: 51, unique: 4, body: create.b + [UInt8(ascii: "/"), 0]))
        #expect(Self.u32(tmpfile, 4) == UInt32(bitPattern: -EXDEV) && Self.u64(tmpfile, 8) == 4)
        let named = try serve(f, Self.request(opcode: 35, unique: 6, body: create.b + [UInt8(ascii: "f"), 0]))
        #expect(Self.u32(named, 4) == UInt32(bitPattern: -ENAMETOOLONG) && Self.u64(named, 8) == 6)

        var getattrIn = Bytes()
        getattrIn.u32(0); getattrIn.u32(0); getattrIn.u64(0)
        let getattr = try serve(f, Self.request(opcode: 3, unique: 8, body: getattrIn.b))
        #expect(getattr.count == 16 + 104 && Self.u64(getattr, 16 + 16) == 77, "a fuse_attr_out")
        var statxIn = Bytes()
        statxIn.u32(0); statxIn.u32(0); statxIn.u64(0); statxIn.u32(0); statxIn.u32(0xfff)
        let statx = try serve(f, Self.request(opcode: 52, unique: 10, body: statxIn.b))
        #expect(statx.count == 16 + 288 && Self.u32(statx, 0) == 16 + 288, "a fuse_statx_out")
        let s = 16 + 32
        #expect(Self.u64(statx, 16) == 1 && Self.u32(statx, 24) == 500_000_000, "its timeout")
        #expect(Self.u32(statx, s) == 0x7ff | 0x800, "basic stats and the birth time")
        #expect(Self.u64(statx, s + 32) == 77 && Self.u64(statx, s + 40) == 5, "ino, size")
        #expect(Self.u64(statx, s + 80) == Self.birth / 1_000_000_000 && Self.u32(statx, s + 88) == 123_456_789, "btime")
        // An open answered passthrough: libfuse's fields, the passthrough flag (1 << 7) and the backing id.
        var openIn = Bytes()
        openIn.u32(UInt32(O_RDONLY)); openIn.u32(0)
        let open = try serve(f, Self.request(opcode: 14, unique: 12, body: openIn.b))
        #expect(open.count == 16 + 16 && Self.u64(open, 16) == 42)
        #expect(Self.u32(open, 16 + 8) == 1 << 1 | 1 << 7, "FOPEN_KEEP_CACHE | FOPEN_PASSTHROUGH")
        #expect(Self.u32(open, 16 + 12) == 7, "backing_id")
        #expect(f.reply() == [], "one reply each")
    }

    @Test("each session's transport keeps its own state: what one was offered, granted and handed over is not another's")
    func sessionsApart() throws {
        let a = try Fixture(), b = try Fixture()
        let initExt: UInt64 = 1 << 30
        _ = try received(by: a.t, Self.initRequest(unique: 2, flags: initExt | VANISH_FUSE_PASSTHROUGH))
        _ = try received(by: b.t, Self.initRequest(unique: 2, flags: initExt | VANISH_FUSE_PARALLEL_DIROPS))
        #expect(vanish_transport_offered(a.t) == initExt | VANISH_FUSE_PASSTHROUGH)
        #expect(vanish_transport_offered(b.t) == initExt | VANISH_FUSE_PARALLEL_DIROPS)
        #expect(vanish_transport_request(a.t, VANISH_FUSE_PASSTHROUGH | VANISH_FUSE_PARALLEL_DIROPS, 1) == VANISH_FUSE_PASSTHROUGH)
        #expect(vanish_transport_request(b.t, VANISH_FUSE_PASSTHROUGH | VANISH_FUSE_PARALLEL_DIROPS, 1) == VANISH_FUSE_PARALLEL_DIROPS)
        // A STATX handed over by `a` is rewritten on `a`'s way out only.
        var statxIn = Bytes()
        statxIn.u32(0); statxIn.u32(0); statxIn.u64(0); statxIn.u32(0); statxIn.u32(0x7ff)
        _ = try received(by: a.t, Self.request(opcode: 52, unique: 8, body: statxIn.b))
        var attrOut = Bytes()
        attrOut.u64(1); attrOut.u32(0); attrOut.u32(0); attrOut.zeros(88)
        let onB = Self.reply(unique: 8, body: attrOut.b)
        #expect(try sent(by: b.t, onB) == onB, "b never saw that STATX")
        #expect(try sent(by: a.t, onB).count == 16 + 288)
        // A transport without a tmpfile operation leaves FUSE_TMPFILE to libfuse (ENOSYS).
        let bare = try #require(vanish_transport_new(nil))
        defer { vanish_transport_free(bare) }
        var create = Bytes()
        create.u32(UInt32(O_RDWR)); create.u32(0o100600); create.u32(0o022); create.u32(0)
        let tmpfile = Self.request(opcode: 51, unique: 4, body: create.b + [UInt8(ascii: "/"), 0])
        #expect(try received(by: bare, tmpfile) == tmpfile)
    }
}
