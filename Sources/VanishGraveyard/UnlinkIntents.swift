import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Unlinks the mount has answered but whose rename into the graveyard has
/// not landed yet, written down before the answer (`.vanish/unlinks`).
///
/// A daemon killed in that window would otherwise leave the files where
/// they were: the caller was told they are gone, and subscribers got a
/// `deleted` event. The next mount reads this log before it serves and
/// finishes each unlink whose file is still there, unchanged.
///
/// Each intent names the file by path (from the mount's root) and identity:
/// inode number and ctime, which any rename or change of the file moves.
/// An intent whose file has landed (or was restored, or re-created under
/// the same name) therefore matches nothing, so the log need not record
/// landings: it is emptied whenever no unlink is pending and it has grown
/// past `compactBytes`. Records carry a checksum, so a record torn by a
/// power cut ends the replay instead of being misread.
public final class UnlinkIntents: Sendable {
    public static let fileName = "unlinks"
    /// The log is emptied when nothing is pending and it is this large.
    static let compactBytes = 64 << 10

    public struct Intent: Sendable, Equatable {
        public var ino: UInt64
        public var ctimeSeconds: Int64
        public var ctimeNanoseconds: Int64
        /// When the unlink was answered (wall clock, ns).
        public var deleted: UInt64
        public var uid: UInt32
        public var gid: UInt32
        /// The file is empty and there is no undo window: unlink it where it is.
        public var inPlace: Bool
        /// From the mount's root, without a leading slash.
        public var path: [UInt8]

        public init(ino: UInt64, ctimeSeconds: Int64, ctimeNanoseconds: Int64, deleted: UInt64,
                    uid: UInt32, gid: UInt32, inPlace: Bool, path: [UInt8]) {
            self.ino = ino
            self.ctimeSeconds = ctimeSeconds
            self.ctimeNanoseconds = ctimeNanoseconds
            self.deleted = deleted
            self.uid = uid
            self.gid = gid
            self.inPlace = inPlace
            self.path = path
        }

        /// Whether `st` is the file this intent was written for.
        public func matches(_ st: stat) -> Bool {
            UInt64(st.st_ino) == ino && Int64(st.st_ctim.tv_sec) == ctimeSeconds
                && Int64(st.st_ctim.tv_nsec) == ctimeNanoseconds && st.st_mode & S_IFMT != S_IFDIR
        }
    }

    /// The fixed part of a record; the path's bytes follow it.
    private struct Header {
        var magic: UInt32 = Header.expectedMagic
        var pathLength: UInt32 = 0
        var ino: UInt64 = 0
        var ctimeSeconds: Int64 = 0
        var ctimeNanoseconds: Int64 = 0
        var deleted: UInt64 = 0
        var uid: UInt32 = 0
        var gid: UInt32 = 0
        var flags: UInt32 = 0
        /// FNV-1a of the header (with this field 0) and the path.
        var checksum: UInt32 = 0
        static let expectedMagic: UInt32 = 0x5655_4E31  // "VUN1"
        static let inPlaceFlag: UInt32 = 1
    }

    private let fd: Int32
    /// Bytes appended since the log was last emptied.
    private let written = Atomic<Int>(0)

    /// Opens (or makes) the log in the state directory `stateFD`.
    public init(stateFD: Int32) throws(Errno) {
        fd = try Sys.openat(stateFD, UnlinkIntents.fileName, O_RDWR | O_CREAT | O_APPEND | O_NOFOLLOW, 0o600)
        if let st = try? Sys.fstat(fd) { written.store(Int(st.st_size), ordering: .relaxed) }
    }

    deinit { Sys.close(fd) }

    /// Appends one intent with a single write, before the unlink is answered.
    /// `path` is the file's path from the mount's root.
    public func record(_ st: stat, deleted: UInt64, uid: UInt32, gid: UInt32, inPlace: Bool,
                       path: UnsafeBufferPointer<UInt8>) throws(Errno) {
        var h = Header()
        h.pathLength = UInt32(path.count)
        h.ino = UInt64(st.st_ino)
        h.ctimeSeconds = Int64(st.st_ctim.tv_sec)
        h.ctimeNanoseconds = Int64(st.st_ctim.tv_nsec)
        h.deleted = deleted
        h.uid = uid
        h.gid = gid
        h.flags = inPlace ? Header.inPlaceFlag : 0
        h.checksum = Self.checksum(h, path)
        let total = MemoryLayout<Header>.size + path.count
        let n = withUnsafeMutableBytes(of: &h) { head -> Int in
            var iov = (iovec(iov_base: head.baseAddress, iov_len: head.count),
                       iovec(iov_base: UnsafeMutableRawPointer(mutating: path.baseAddress), iov_len: path.count))
            return withUnsafePointer(to: &iov) {
                $0.withMemoryRebound(to: iovec.self, capacity: 2) { writev(fd, $0, 2) }
            }
        }
        if n != total {
            let why = n < 0 ? Errno(rawValue: errno) : Errno.noSpace
            // A short write leaves a torn tail that would end a replay early: cut it off.
            if n > 0, let st = try? Sys.fstat(fd) { _ = try? Sys.ftruncate(fd, st.st_size - off_t(n)) }
            throw why
        }
        written.wrappingAdd(total, ordering: .relaxed)
    }

    /// Empties the log if it has grown; call only while no unlink is pending
    /// and none can begin (the caller's lock), since its intent would go too.
    public func compactIfLarge() {
        guard written.load(ordering: .relaxed) >= Self.compactBytes else { return }
        clear()
    }

    /// Empties the log.
    public func clear() {
        if (try? Sys.ftruncate(fd, 0)) != nil { written.store(0, ordering: .relaxed) }
    }

    /// The intents in the log, in the order they were written, up to the
    /// first record that is torn or not one.
    public func intents() -> [Intent] {
        var data: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        var offset: off_t = 0
        while true {
            let n = buffer.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, offset) }
            if n <= 0 { break }
            data += buffer[..<n]
            offset += off_t(n)
        }
        return Self.decode(data)
    }

    static func decode(_ data: [UInt8]) -> [Intent] {
        var out: [Intent] = []
        let headerSize = MemoryLayout<Header>.size
        var at = 0
        data.withUnsafeBytes { raw in
            while data.count - at >= headerSize {
                let h = raw.loadUnaligned(fromByteOffset: at, as: Header.self)
                let length = Int(h.pathLength)
                guard h.magic == Header.expectedMagic, length <= data.count - at - headerSize else { return }
                let path = UnsafeRawBufferPointer(rebasing: raw[(at + headerSize)..<(at + headerSize + length)])
                guard h.checksum == checksum(h, path.assumingMemoryBound(to: UInt8.self)) else { return }
                out.append(Intent(ino: h.ino, ctimeSeconds: h.ctimeSeconds, ctimeNanoseconds: h.ctimeNanoseconds,
                                  deleted: h.deleted, uid: h.uid, gid: h.gid,
                                  inPlace: h.flags & Header.inPlaceFlag != 0, path: Array(path)))
                at += headerSize + length
            }
        }
        return out
    }

    private static func checksum(_ header: Header, _ path: UnsafeBufferPointer<UInt8>) -> UInt32 {
        var h = header
        h.checksum = 0
        var sum: UInt32 = 0x811C_9DC5
        func mix(_ bytes: UnsafeRawBufferPointer) {
            for b in bytes { sum = (sum ^ UInt32(b)) &* 0x0100_0193 }
        }
        withUnsafeBytes(of: &h) { mix($0) }
        mix(UnsafeRawBufferPointer(path))
        return sum
    }
}
