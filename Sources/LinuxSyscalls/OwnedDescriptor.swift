import Glibc
import SystemPackage

/// A file descriptor this code owns: closed when the value goes away, on
/// every path, a thrown error's included, unless `take()` hands it on.
/// Non-copyable, so exactly one owner closes it exactly once; it replaces
/// `defer { close(fd) }` and `catch { close(fd); throw error }`.
@frozen
public struct OwnedDescriptor: ~Copyable {
    /// The descriptor, for calls that take an `Int32`; never close it.
    public let raw: Int32

    /// Owns `raw`, an open descriptor.
    @inlinable
    public init(_ raw: Int32) { self.raw = raw }

    deinit { _ = Glibc.close(raw) }

    /// Gives up ownership: the descriptor stays open, and is the caller's.
    @inlinable
    public consuming func take() -> Int32 {
        let raw = raw
        discard self
        return raw
    }
}

extension Sys {
    /// `openat(2)`, owned.
    @inlinable
    public static func opened(_ dirfd: Int32, _ name: UnsafePointer<CChar>, _ flags: Int32,
                              _ mode: mode_t = 0) throws(Errno) -> OwnedDescriptor {
        OwnedDescriptor(try openat(dirfd, name, flags, mode))
    }

    /// `open(2)` of an absolute path, owned.
    @inlinable
    public static func opened(_ path: UnsafePointer<CChar>, _ flags: Int32) throws(Errno) -> OwnedDescriptor {
        OwnedDescriptor(try open(path, flags))
    }
}
