import CFuse
import CFuseTransport
import Glibc
import SystemPackage

/// One request from the kernel, answered exactly once through one of the
/// `reply` methods (or by throwing from the handler, which replies with that errno).
public struct Request: @unchecked Sendable {
    public let raw: fuse_req_t

    @inlinable
    public init(_ raw: fuse_req_t) { self.raw = raw }

    /// The uid, gid, pid and umask of the process that made the call (`fuse_req_ctx`).
    @inlinable
    public var caller: Caller {
        let ctx = fuse_req_ctx(raw)!.pointee
        return Caller(uid: ctx.uid, gid: ctx.gid, pid: ctx.pid, umask: ctx.umask)
    }

    /// The caller's supplementary groups (libfuse reads them from the
    /// caller's /proc entry, which cannot be another process's while the
    /// caller waits in this request). Not for the hot path.
    public func groups() -> [gid_t] {
        var groups = [gid_t](repeating: 0, count: 64)
        var n = fuse_req_getgroups(raw, Int32(groups.count), &groups)
        if n > groups.count {
            groups = [gid_t](repeating: 0, count: Int(n))
            n = fuse_req_getgroups(raw, Int32(groups.count), &groups)
        }
        return Array(groups.prefix(Int(max(0, min(n, Int32(groups.count))))))
    }

    /// Before recording a change this request made: waits (up to `timeout`)
    /// for the handlers of change-recording requests the kernel sent
    /// earlier to finish, so the record follows the kernel's order (see the
    /// transport). False if it waited that long in vain. Only while this
    /// request is being handled, on its thread; once answered it waits for nothing.
    /// 250 ms: a `written` event's RELEASE handler (which may read the file
    /// to tell a copy) took more than 50 ms under CI's load, and its event
    /// then followed the program's next one.
    @discardableResult
    public func awaitEarlierChanges(timeout: Duration = .milliseconds(250)) -> Bool {
        vanish_order_wait_for_earlier(raw, timeout.nanoseconds) != 0
    }

    /// This request has recorded all its changes: later ones stop waiting for it.
    public func doneRecordingChanges() { vanish_order_done(raw) }

    /// Whether the caller is in `gid`, as its primary group or another.
    public func isInGroup(_ gid: gid_t) -> Bool { caller.gid == gid || groups().contains(gid) }

    /// `fuse_reply_err`.
    @inlinable
    public func reply(error: Errno) { _ = fuse_reply_err(raw, error.rawValue) }

    /// `fuse_reply_err(req, 0)`: success for operations that return nothing.
    @inlinable
    public func replyOK() { _ = fuse_reply_err(raw, 0) }

    /// `fuse_reply_entry`.
    @inlinable
    public func reply(entry: inout fuse_entry_param) { _ = fuse_reply_entry(raw, &entry) }

    /// `fuse_reply_create`.
    @inlinable
    public func reply(created entry: inout fuse_entry_param, _ fi: UnsafePointer<fuse_file_info>) {
        _ = fuse_reply_create(raw, &entry, fi)
    }

    /// `fuse_reply_attr`.
    @inlinable
    public func reply(attr: inout stat, timeout: Double) { _ = fuse_reply_attr(raw, &attr, timeout) }

    /// `fuse_reply_attr` with the file's birth time (ns; 0: unknown), which
    /// reaches a program that asked `statx` for it (FUSE_STATX, brought by
    /// the transport).
    @inlinable
    public func reply(attr: inout stat, timeout: Double, birth: UInt64) {
        _ = vanish_reply_attr_birth(raw, &attr, timeout, birth)
    }

    /// `fuse_reply_open`.
    @inlinable
    public func reply(open fi: UnsafePointer<fuse_file_info>) { _ = fuse_reply_open(raw, fi) }

    /// `fuse_reply_open`, passthrough to `backing` (a `BackingFiles` id) when
    /// above 0. Returns libfuse's result: -ENOENT when the open was
    /// interrupted and the kernel did not take the handle.
    @inlinable
    @discardableResult
    public func reply(open fi: UnsafePointer<fuse_file_info>, backing: Int32) -> Int32 {
        vanish_reply_open_backing(raw, fi, backing)
    }

    /// `fuse_reply_create`, passthrough to `backing` when above 0; returns as `reply(open:backing:)`.
    @inlinable
    @discardableResult
    public func reply(created entry: inout fuse_entry_param, _ fi: UnsafePointer<fuse_file_info>, backing: Int32) -> Int32 {
        vanish_reply_create_backing(raw, &entry, fi, backing)
    }

    /// `fuse_reply_readlink`.
    @inlinable
    public func reply(link: UnsafePointer<CChar>) { _ = fuse_reply_readlink(raw, link) }

    /// `fuse_reply_buf`.
    @inlinable
    public func reply(ioctl result: Int32, output: UnsafeRawBufferPointer) {
        _ = fuse_reply_ioctl(raw, result, output.baseAddress, output.count)
    }

    public func reply(bytes: UnsafeRawBufferPointer) {
        _ = fuse_reply_buf(raw, bytes.baseAddress?.assumingMemoryBound(to: CChar.self), bytes.count)
    }

    /// Replies with `size` bytes of `fd` from `offset`; libfuse splices them
    /// to the kernel when it can, so they never pass through user memory.
    /// A read too large for its pipe goes through a reused buffer instead
    /// (`LargeReads`).
    public func replyData(fd: Int32, offset: off_t, size: Int) {
        if size > LargeReads.spliceLimit, LargeReads.reply(raw, fd: fd, offset: offset, size: size) { return }
        _ = vanish_reply_fd_data(raw, fd, offset, size)
    }

    /// `fuse_reply_write`.
    @inlinable
    public func reply(written: Int) { _ = fuse_reply_write(raw, written) }

    /// `fuse_reply_statfs`.
    @inlinable
    public func reply(statfs: inout statvfs) { _ = fuse_reply_statfs(raw, &statfs) }

    /// `fuse_reply_xattr`: the size a getxattr/listxattr value would need.
    @inlinable
    public func reply(xattrSize: Int) { _ = fuse_reply_xattr(raw, xattrSize) }

    /// `fuse_reply_lseek`.
    @inlinable
    public func reply(offset: off_t) { _ = fuse_reply_lseek(raw, offset) }
}

/// Who made a request, from `fuse_req_ctx`.
public struct Caller: Sendable, Equatable {
    public var uid: uid_t
    public var gid: gid_t
    public var pid: pid_t
    public var umask: mode_t

    @inlinable
    public init(uid: uid_t, gid: gid_t, pid: pid_t, umask: mode_t) {
        self.uid = uid; self.gid = gid; self.pid = pid; self.umask = umask
    }
}
