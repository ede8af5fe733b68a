import CXattr
import Glibc

/// A connection to a mount's control socket.
public final class ControlClient {
    public let socketPath: String
    private let fd: Int32
    private var buffer: [UInt8] = []
    /// Where the unread part of `buffer` starts: lines are consumed by
    /// moving this, not by shifting the rest of a 64 KiB chunk each time.
    private var start = 0
    /// Where the search for a newline goes on: before it, from `start`,
    /// there is none (a long answer is scanned once, not once per read).
    private var searched = 0
    /// recv(2) lands here, then only what arrived is copied into `buffer`.
    private var scratch = [UInt8](repeating: 0, count: 65536)

    public struct Failure: Error, CustomStringConvertible {
        public var description: String
        public var errno: Int32
        public init(_ description: String, errno: Int32 = EIO) {
            self.description = description
            self.errno = errno
        }

        /// Throws the daemon's `{"error": …, "errno": …}` answer, if that is what `answer` is.
        static func check(_ answer: JSON) throws(Failure) {
            if let message = answer["error"]?.string {
                throw Failure(message, errno: Int32(answer["errno"]?.int ?? Int(EIO)))
            }
        }
    }

    /// Connects to the socket the mount at `mountpoint` publishes.
    public convenience init(mountpoint: String) throws(Failure) {
        try self.init(socketPath: ControlClient.socketPath(of: mountpoint))
    }

    public init(socketPath: String) throws(Failure) {
        self.socketPath = socketPath
        fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw Failure("socket: \(String(cString: strerror(errno)))") }
        guard let rc = ControlClient.withAddress(socketPath, { connect(fd, $0, $1) }) else {
            close(fd)
            throw Failure("socket path too long: \(socketPath)")
        }
        guard rc == 0 else {
            let e = errno
            close(fd)
            throw Failure("cannot reach the daemon at \(socketPath): \(String(cString: strerror(e)))", errno: e)
        }
    }

    deinit { close(fd) }

    /// Calls `body` with the sockaddr_un for `path` (connect, bind); nil if
    /// the path does not fit in sun_path.
    public static func withAddress(_ path: String, _ body: (UnsafePointer<sockaddr>, socklen_t) -> Int32) -> Int32? {
        var addr = sockaddr_un()
        addr.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: addr.sun_path) else { return nil }
        withUnsafeMutableBytes(of: &addr.sun_path) { raw in
            raw.copyBytes(from: bytes)
            raw[bytes.count] = 0
        }
        return withUnsafePointer(to: &addr) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
    }

    /// The control socket of the Vanish mount at `mountpoint` (from its status attribute).
    public static func socketPath(of mountpoint: String) throws(Failure) -> String {
        var buffer = [UInt8](repeating: 0, count: 8192)
        let n = getxattr(mountpoint, ControlProtocol.statusAttribute, &buffer, buffer.count)
        guard n > 0 else {
            let e = errno
            if e == ENODATA || e == ENOTSUP { throw Failure("\(mountpoint) is not the root of a Vanish mount", errno: e) }
            throw Failure("cannot read the status of \(mountpoint): \(String(cString: strerror(e)))", errno: e)
        }
        guard let path = JSON.parse(buffer[..<n])?["socket"]?.string, !path.isEmpty else {
            throw Failure("the Vanish mount at \(mountpoint) has no control socket")
        }
        return path
    }

    /// Sends one request.
    public func send(_ request: JSON) throws(Failure) {
        let line = Array((request.serialized + "\n").utf8)
        var sent = 0
        while sent < line.count {
            let n = line[sent...].withUnsafeBytes { Glibc.send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
            if n < 0 {
                let e = errno
                if e == EINTR { continue }
                // A daemon that turns a peer away (too many connections, no
                // descriptor left) answers and closes at once: its reason
                // may be here already, and says more than EPIPE.
                if e == EPIPE || e == ECONNRESET, let answer = try? receiveObject()?.object {
                    try Failure.check(answer)
                }
                throw Failure("sending to the daemon: \(String(cString: strerror(e)))", errno: e)
            }
            sent += n
        }
    }

    /// The next JSON line from the daemon; nil when it closed the connection.
    public func receive() throws(Failure) -> JSON? {
        try receiveObject()?.object
    }

    /// The next line as the daemon sent it (without its newline) and parsed.
    func receiveObject() throws(Failure) -> (object: JSON, line: [UInt8])? {
        guard let line = try receiveLine() else { return nil }
        guard let obj = JSON.parse(line), obj.object != nil else {
            throw Failure("unreadable answer from the daemon")
        }
        return (obj, line)
    }

    func receiveLine() throws(Failure) -> [UInt8]? {
        while true {
            if let nl = buffer[max(start, searched)...].firstIndex(of: 0x0A) {
                let line = Array(buffer[start..<nl])
                start = nl + 1
                searched = start
                return line
            }
            searched = buffer.count
            guard try fill() else { return nil }
        }
    }

    /// Every complete line received so far (each with its newline), at
    /// least one; nil when the daemon closed the connection.
    func receiveLines() throws(Failure) -> [UInt8]? {
        while true {
            if let nl = buffer[max(start, searched)...].lastIndex(of: 0x0A) {
                let lines = Array(buffer[start...nl])
                start = nl + 1
                searched = start
                return lines
            }
            searched = buffer.count
            guard try fill() else { return nil }
        }
    }

    /// One recv into the buffer; false at the end of the stream.
    private func fill() throws(Failure) -> Bool {
        while true {
            buffer.removeSubrange(..<start)
            searched -= start
            start = 0
            let n = scratch.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
            if n > 0 { buffer.append(contentsOf: scratch[..<n]) }
            if n < 0 {
                if errno == EINTR { continue }
                throw Failure("reading from the daemon: \(String(cString: strerror(errno)))")
            }
            return n > 0
        }
    }

    /// Sends a request and returns its single answer, turning `{"error":…}` into a Failure.
    public func call(_ request: JSON) throws(Failure) -> JSON {
        try send(request)
        guard let answer = try receive() else { throw Failure("the daemon closed the connection") }
        try Failure.check(answer)
        return answer
    }
}
