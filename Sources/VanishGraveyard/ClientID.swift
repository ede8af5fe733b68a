import Glibc
import LinuxSyscalls
import SystemPackage

/// The name of one client's state in a shared source: `.vanish/clients/<id>/`.
/// Every machine that mounts a shared volume (and every client mount of it on
/// one machine) keeps its graveyard, trash records, event journal and lease
/// there, so no client ever acts on another's entries.
public struct ClientID: Sendable, Hashable, CustomStringConvertible {
    public let name: String

    /// Letters, digits, `.`, `_` and `-`, at most 64, not starting with a dot:
    /// a name that is safe as one path component on any backend.
    public init(_ name: String) throws(ClientIDError) {
        let bytes = Array(name.utf8)
        guard (1...64).contains(bytes.count), bytes[0] != 0x2E,
              bytes.allSatisfy({ ClientID.allowed($0) }) else { throw ClientIDError(name: name) }
        self.name = name
    }

    private init(unchecked name: String) { self.name = name }

    public var description: String { name }

    static func allowed(_ b: UInt8) -> Bool {
        switch b {
        case 0x30...0x39, 0x41...0x5A, 0x61...0x7A, 0x2E, 0x5F, 0x2D: true
        default: false
        }
    }

    /// This machine's id for `source` (its resolved path): the host name and
    /// a hash of the machine id and the path. Stable across remounts and
    /// reboots; two client mounts of one volume on one machine differ by path.
    public static func local(source: String) -> ClientID {
        var host = [CChar](repeating: 0, count: 256)
        gethostname(&host, host.count - 1)
        let hostBytes = host.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }
        var label = Array(hostBytes.map { allowed($0) ? $0 : 0x5F }.prefix(40))
        while label.first == 0x2E { label.removeFirst() }
        if label.isEmpty { label = Array("host".utf8) }
        var hash = FNV1a()
        hash.add(machineID())
        hash.add([0])
        hash.add(Array(source.utf8))
        let name = String(decoding: label, as: UTF8.self) + "-" + Graveyard.hex(hash.value >> 16, digits: 12)
        return ClientID(unchecked: name)
    }

    /// /etc/machine-id (systemd, or dbus's copy); the host name where neither exists.
    private static func machineID() -> [UInt8] {
        for path in ["/etc/machine-id", "/var/lib/dbus/machine-id"] {
            guard let fd = try? Sys.opened(path, O_RDONLY) else { continue }
            var buffer = [UInt8](repeating: 0, count: 64)
            let n = read(fd.raw, &buffer, buffer.count)
            if n > 0 { return Array(buffer[..<n]) }
        }
        return []
    }
}

public struct ClientIDError: Error, CustomStringConvertible {
    public let name: String
    public var description: String {
        "client id \"\(name)\" must be 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
    }
}

/// 64-bit FNV-1a: a stable hash (Swift's Hasher is seeded per process).
/// The unlink log's record checksum is the 32-bit one, which its on-disk
/// format fixed (`UnlinkIntents.checksum`).
public struct FNV1a {
    @usableFromInline var state: UInt64 = 0xcbf2_9ce4_8422_2325
    public var value: UInt64 { state }

    @inlinable public init() {}

    @inlinable
    public mutating func add(_ byte: UInt8) { state = (state ^ UInt64(byte)) &* 0x0000_0100_0000_01b3 }

    @inlinable
    public mutating func add(_ bytes: [UInt8]) { for b in bytes { add(b) } }

    /// The eight bytes of `v`, lowest first.
    @inlinable
    public mutating func add(_ v: UInt64) {
        var v = v
        for _ in 0..<8 {
            add(UInt8(truncatingIfNeeded: v))
            v >>= 8
        }
    }

    /// The bytes of a C string, without its NUL.
    @inlinable
    public mutating func add(cString p: UnsafePointer<CChar>) {
        var p = p
        while p.pointee != 0 {
            add(UInt8(bitPattern: p.pointee))
            p += 1
        }
    }
}
