import CLinux
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
/// past `compactBytes`.
///
/// Writing one costs a `pwritev` into space allocated ahead, at an offset
/// reserved with one atomic add, so concurrent unlinks neither wait for each
/// other nor change the file's size (an O_APPEND write did both and made
/// `rm -rf` through the mount a fifth slower). Emptying the log bumps the
/// generation in its first 8 bytes; only records of the current generation
/// count, found by their magic and checksum at 8-byte steps, so a record
/// torn by a power cut, or a slot a killed writer never filled, skips
/// nothing after it.
public final class UnlinkIntents: Sendable {
    public static let fileName = "unlinks"
    /// The log is emptied when nothing is pending and it is this large.
    static let compactBytes = 64 << 10
    /// Space is allocated this much at a time.
    static let allocationStep = 1 << 20

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
        /// The undo window left it out (keep_exclude, keep_min_age): no trash record.
        public var unkept: Bool
        /// From the mount's root, without a leading slash.
        public var path: [UInt8]

        public init(ino: UInt64, ctimeSeconds: Int64, ctimeNanoseconds: Int64, deleted: UInt64,
                    uid: UInt32, gid: UInt32, inPlace: Bool, unkept: Bool = false, path: [UInt8]) {
            self.ino = ino
            self.ctimeSeconds = ctimeSeconds
            self.ctimeNanoseconds = ctimeNanoseconds
            self.deleted = deleted
            self.uid = uid
            self.gid = gid
            self.inPlace = inPlace
            self.unkept = unkept
            self.path = path
        }

        /// Whether `st` is the file this intent was written for.
        public func matches(_ st: stat) -> Bool {
            UInt64(st.st_ino) == ino && Int64(st.st_ctim.tv_sec) == ctimeSeconds
                && Int64(st.st_ctim.tv_nsec) == ctimeNanoseconds && st.st_mode & S_IFMT != S_IFDIR
        }
    }

    /// The fixed part of a record; the path's bytes follow it, then zeros
    /// up to a multiple of 8 bytes.
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
        var generation: UInt32 = 0
        var reserved: UInt32 = 0
        /// FNV-1a of the header (with this field 0) and the path.
        var checksum: UInt32 = 0
        static let expectedMagic: UInt32 = 0x5655_4E32  // "2NUV"
        static let inPlaceFlag: UInt32 = 1
        static let unkeptFlag: UInt32 = 2
    }
    /// The log's first 8 bytes: a magic and the current generation.
    private static let fileMagic: UInt32 = 0x474F_4C55  // "ULOG"
    private static let firstRecord = 8

    private let fd: Int32
    /// Where the next record goes.
    private let next = Atomic<Int>(UnlinkIntents.firstRecord)
    private let generation = Atomic<UInt32>(0)
    /// Bytes allocated to the file; growing it is serialized by `growth`.
    private let allocated = Atomic<Int>(0)
    private let growth = Mutex<Void>(())
    /// A growth failed (a full disk): no record is written until the log is emptied,
    /// so that none lies beyond a gap.
    private let broken = Atomic<Bool>(false)

    /// Opens (or makes) the log in the state directory `stateFD`. Its
    /// records stay for `intents()` until `clear()`.
    public init(stateFD: Int32, name: String = UnlinkIntents.fileName) throws(Errno) {
        let owned = try Sys.opened(stateFD, name, O_RDWR | O_CREAT | O_NOFOLLOW, 0o600)
        let st = try Sys.fstat(owned.raw)
        // Replaying a log someone else wrote would delete what they name.
        guard st.st_uid == geteuid(), st.st_mode & S_IFMT == S_IFREG, st.st_mode & 0o022 == 0 else {
            throw .notPermitted
        }
        fd = owned.take()
        allocated.store(Int(st.st_size), ordering: .relaxed)
        let (gen, _) = Self.readHeader(fd)
        generation.store(gen, ordering: .relaxed)
        // Nothing is written before `clear()`, which a mount calls once it
        // has read what is here: until then new records would mix with old.
        broken.store(true, ordering: .relaxed)
    }

    deinit { Sys.close(fd) }

    /// Writes one intent, before the unlink is answered. `path` is the
    /// file's path from the mount's root; `unkept`: the undo window leaves it out.
    public func record(_ st: stat, deleted: UInt64, uid: UInt32, gid: UInt32, inPlace: Bool, unkept: Bool = false,
                       path: UnsafeBufferPointer<UInt8>) throws(Errno) {
        if broken.load(ordering: .relaxed) { throw .noSpace }
        var h = Header()
        h.pathLength = UInt32(path.count)
        h.ino = UInt64(st.st_ino)
        h.ctimeSeconds = Int64(st.st_ctim.tv_sec)
        h.ctimeNanoseconds = Int64(st.st_ctim.tv_nsec)
        h.deleted = deleted
        h.uid = uid
        h.gid = gid
        h.flags = (inPlace ? Header.inPlaceFlag : 0) | (unkept ? Header.unkeptFlag : 0)
        h.generation = generation.load(ordering: .relaxed)
        h.checksum = Self.checksum(h, path)
        let length = MemoryLayout<Header>.size + path.count
        let total = (length + 7) & ~7
        let offset = next.wrappingAdd(total, ordering: .relaxed).oldValue
        if offset + total > allocated.load(ordering: .acquiring) { try grow(to: offset + total) }
        var padding: UInt64 = 0
        let n = withUnsafeMutableBytes(of: &h) { head -> Int in
            withUnsafeMutableBytes(of: &padding) { pad -> Int in
                var iov = (iovec(iov_base: head.baseAddress, iov_len: head.count),
                           iovec(iov_base: UnsafeMutableRawPointer(mutating: path.baseAddress), iov_len: path.count),
                           iovec(iov_base: pad.baseAddress, iov_len: total - length))
                return withUnsafePointer(to: &iov) {
                    $0.withMemoryRebound(to: iovec.self, capacity: 3) { pwritev(fd, $0, 3, off_t(offset)) }
                }
            }
        }
        if n != total { throw n < 0 ? Errno(rawValue: errno) : .noSpace }
    }

    /// Allocates space up to at least `size` bytes.
    private func grow(to size: Int) throws(Errno) {
        let failure: Errno? = growth.withLock { _ -> Errno? in
            let have = allocated.load(ordering: .relaxed)
            guard size > have else { return nil }
            let want = (size / Self.allocationStep + 1) * Self.allocationStep
            do throws(Errno) {
                try Sys.fallocate(fd, 0, off_t(have), off_t(want - have))
            } catch .notSupported {
                // A filesystem without fallocate: set the size; writes fill it as they come.
                do throws(Errno) { try Sys.ftruncate(fd, off_t(want)) } catch { return error }
            } catch {
                return error
            }
            allocated.store(want, ordering: .releasing)
            return nil
        }
        if let failure {
            broken.store(true, ordering: .relaxed)
            throw failure
        }
    }

    /// Empties the log if it has grown; call only while no unlink is pending
    /// and none can begin (the caller's lock), since its intent would go too.
    public func compactIfLarge() {
        guard next.load(ordering: .relaxed) >= Self.compactBytes || broken.load(ordering: .relaxed) else { return }
        clear()
    }

    /// Empties the log: a new generation, so every record written so far
    /// stops counting. Same condition as `compactIfLarge`.
    public func clear() {
        let gen = generation.load(ordering: .relaxed) &+ 1
        var head: (UInt32, UInt32) = (Self.fileMagic, gen)
        guard pwrite(fd, &head, 8, 0) == 8 else { return }
        generation.store(gen, ordering: .relaxed)
        next.store(Self.firstRecord, ordering: .relaxed)
        if allocated.load(ordering: .relaxed) < Self.firstRecord { allocated.store(Self.firstRecord, ordering: .relaxed) }
        broken.store(false, ordering: .relaxed)
    }

    /// The log's generation, and whether the file has a valid header.
    private static func readHeader(_ fd: Int32) -> (UInt32, Bool) {
        var head: (UInt32, UInt32) = (0, 0)
        guard pread(fd, &head, 8, 0) == 8, head.0 == fileMagic else { return (0, false) }
        return (head.1, true)
    }

    /// The intents of the current generation, in the order of their places in the log.
    public func intents() -> [Intent] {
        let (gen, valid) = Self.readHeader(fd)
        guard valid else { return [] }
        var data: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        var offset = off_t(Self.firstRecord)
        while true {
            let n = buffer.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, offset) }
            if n <= 0 { break }
            data += buffer[..<n]
            offset += off_t(n)
        }
        return Self.decode(data, generation: gen)
    }

    /// Finishes every logged unlink whose file is still at its path and
    /// unchanged (same inode, same ctime): it goes to `graveyard` as that
    /// unlink would have sent it, with a trash record when `keepingRecords`
    /// (and the window it was deleted under kept it) and its original deletion time; an empty file without a window is
    /// unlinked in place. Then empties the log, which also opens it for new
    /// records. `rootFD` is the mount's root; paths are walked one directory
    /// at a time, never following a symlink. Returns (finished, logged).
    public func finish(rootFD: Int32, graveyard: Graveyard, keepingRecords: Bool,
                       buried: (Int) -> Void, failed: (Errno) -> Void) -> (Int, Int) {
        let pending = intents()
        var finished = 0
        for intent in pending {
            switch Self.finish(intent, rootFD: rootFD, graveyard: graveyard, keepingRecords: keepingRecords) {
            case .success(let shard?): finished += 1; buried(shard)
            case .success(nil): finished += 1
            case .failure(.noSuchFileOrDirectory): break
            case .failure(let error): failed(error)
            }
        }
        clear()
        return (finished, pending.count)
    }

    /// Finishes one intent: the shard it went to (nil: unlinked in place),
    /// or ENOENT when its file is not there unchanged.
    private static func finish(_ intent: Intent, rootFD: Int32, graveyard: Graveyard,
                               keepingRecords: Bool) -> Result<Int?, Errno> {
        var components = intent.path.split(separator: 0x2F, omittingEmptySubsequences: false)
        guard let leaf = components.popLast(),
              !(components + [leaf]).contains(where: { $0.isEmpty || $0.elementsEqual([0x2E]) || $0.elementsEqual([0x2E, 0x2E]) })
        else { return .failure(.noSuchFileOrDirectory) }
        func withName<R>(_ bytes: ArraySlice<UInt8>, _ body: (UnsafePointer<CChar>) -> R) -> R {
            (Array(bytes) + [0]).withUnsafeBufferPointer { $0.withMemoryRebound(to: CChar.self) { body($0.baseAddress!) } }
        }
        guard let dup = try? Sys.dup(rootFD) else { return .failure(.noSuchFileOrDirectory) }
        var dir = OwnedDescriptor(dup)
        for component in components {
            let fd = dir.raw
            guard let next = withName(component, { try? Sys.openat(fd, $0, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) })
            else { return .failure(.noSuchFileOrDirectory) }
            dir = OwnedDescriptor(next)
        }
        let fd = dir.raw
        return withName(leaf) { name -> Result<Int?, Errno> in
            guard let st = try? Sys.lstatat(fd, name), intent.matches(st), st.st_dev == graveyard.device else {
                return .failure(.noSuchFileOrDirectory)
            }
            do throws(Errno) {
                if intent.inPlace {
                    try Sys.unlinkat(fd, name, 0)
                    return .success(nil)
                }
                let record = keepingRecords && !intent.unkept
                    ? TrashRecord(path: intent.path, uid: intent.uid, gid: intent.gid, bytes: Sys.diskBytes(st),
                                  kind: TrashRecord.Kind(mode: st.st_mode))
                    : nil
                // Left out of a window that holds everything else: due at once, as it would have been.
                let deletion: Graveyard.Deletion = keepingRecords && intent.unkept
                    ? .unheld(since: intent.deleted) : .at(intent.deleted)
                return .success(try graveyard.bury(fd, name, record: record, deletion: deletion,
                                                    file: st.st_mode & S_IFMT != S_IFDIR))
            } catch {
                return .failure(error)
            }
        }
    }

    /// The valid records of `generation` in `data`, looked for at every 8-byte step.
    static func decode(_ data: [UInt8], generation: UInt32) -> [Intent] {
        var out: [Intent] = []
        let headerSize = MemoryLayout<Header>.size
        var at = 0
        data.withUnsafeBytes { raw in
            while data.count - at >= headerSize {
                let h = raw.loadUnaligned(fromByteOffset: at, as: Header.self)
                let length = Int(h.pathLength)
                guard h.magic == Header.expectedMagic, h.generation == generation, length <= data.count - at - headerSize
                else { at += 8; continue }
                let path = UnsafeRawBufferPointer(rebasing: raw[(at + headerSize)..<(at + headerSize + length)])
                guard h.checksum == checksum(h, path.assumingMemoryBound(to: UInt8.self)) else { at += 8; continue }
                out.append(Intent(ino: h.ino, ctimeSeconds: h.ctimeSeconds, ctimeNanoseconds: h.ctimeNanoseconds,
                                  deleted: h.deleted, uid: h.uid, gid: h.gid,
                                  inPlace: h.flags & Header.inPlaceFlag != 0, unkept: h.flags & Header.unkeptFlag != 0,
                                  path: Array(path)))
                at += (headerSize + length + 7) & ~7
            }
        }
        return out
    }

    /// 32-bit FNV-1a (the 64-bit one is `FNV1a`): the width the log's format fixed.
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

extension UnlinkIntents {
    /// Opens the log of `graveyard`'s client for the source at `source`: in
    /// the client's state directory, or, when that is on a network (or
    /// FUSE) volume, on this machine. Each answered unlink appends to it
    /// before the answer, and on a volume that append is a round trip to the
    /// server: rm -rf of 2,000 files through Vanish over GlusterFS took
    /// 0.84 s with the log on the volume, 0.42-0.59 s with it local. Only this
    /// client's next mount (or `vanish reap` here) reads it. `leftover` is a
    /// log found on the volume (written before the log moved), to finish
    /// first and then remove (`removeLeftover`).
    public static func open(for graveyard: Graveyard, source: String) throws(Errno)
        -> (log: UnlinkIntents, leftover: UnlinkIntents?, localPath: String?) {
        guard FilesystemKind.isRemote(graveyard.stateFD) else {
            return (try UnlinkIntents(stateFD: graveyard.stateFD), nil, nil)
        }
        let (dir, path) = try makeLocalDirectory()
        defer { Sys.close(dir) }
        var hash = FNV1a()
        hash.add(Array(source.utf8))
        let name = "unlinks-\(graveyard.client.name)-\(Graveyard.hex(hash.value, digits: 16))"
        let log = try UnlinkIntents(stateFD: dir, name: name)
        let leftover = (try? Sys.lstatat(graveyard.stateFD, fileName)) != nil ? try? UnlinkIntents(stateFD: graveyard.stateFD) : nil
        return (log, leftover, path + "/" + name)
    }

    /// Finishes the unlinks a killed daemon had answered but not done, from
    /// `log` and from a `leftover` log (one a network volume kept from before
    /// logs moved to the machine, removed once finished), as `finish` does
    /// each. Used by a mount before it serves and by `vanish reap`. Returns
    /// how many were finished and how many were logged.
    public static func finishInterrupted(_ log: UnlinkIntents, leftover: UnlinkIntents?, graveyard: Graveyard,
                                         rootFD: Int32, keepingRecords: Bool, buried: (Int) -> Void,
                                         failed: (Errno) -> Void) -> (finished: Int, logged: Int) {
        var total = (finished: 0, logged: 0)
        for l in [leftover, log].compactMap({ $0 }) {
            let (finished, logged) = l.finish(rootFD: rootFD, graveyard: graveyard, keepingRecords: keepingRecords,
                                              buried: buried, failed: failed)
            total.finished += finished
            total.logged += logged
        }
        if leftover != nil { _ = try? Sys.unlinkat(graveyard.stateFD, fileName, 0) }
        return total
    }

    /// `/var/lib/vanish` for root, else `$XDG_STATE_HOME/vanish` or
    /// `~/.local/state/vanish`: made (0700) as needed, opened O_PATH, and its path.
    private static func makeLocalDirectory() throws(Errno) -> (Int32, String) {
        guard let base = StateLocation.localBase else { throw .noSuchFileOrDirectory }
        // The directories above are the system's or the user's own: made if
        // missing, as mkdir -p would; only the last one must be private.
        var parent = try Sys.opened("/", VANISH_O_PATH | O_DIRECTORY)
        let names = base.split(separator: "/").map(String.init)
        for name in names.dropLast() {
            do throws(Errno) { try Sys.mkdirat(parent.raw, name, 0o755) } catch .fileExists {}
            parent = try Sys.opened(parent.raw, name, VANISH_O_PATH | O_DIRECTORY)
        }
        return (try Graveyard.makeDirectory(parent.raw, [names.last!]), base)
    }
}
