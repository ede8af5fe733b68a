import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// Files open for reading, by the process that opened them: where a copy's
/// data may come from.
///
/// A `written` event says `copied_from` only when it is exact:
/// - the file was written with `copy_file_range` from a file in the mount
///   (the kernel names the source), or
/// - one process wrote the file while it had another file of the mount open
///   for reading (the newest such when it opened the file for writing), and
///   when the writing ends the two hold the same bytes, compared in full.
///   That covers `cp --reflink=never`, `rsync`, `install`, editors' "save as"
///   and any read-then-write copy, with or without passthrough (the daemon
///   sees neither reads nor writes then, only the opens).
/// Not recognized: a copy whose data went through another process (a pipe,
/// `cat a | cat > b`; a local `rsync`, whose sender and receiver are two
/// processes), a source outside the mount,
/// a copy changed before it was closed, and files over `compareLimit` bytes
/// or empty ones, which are not compared.
///
/// Lock order: `state` is a leaf lock.
final class ReadingHandles: Sendable {
    /// Files over this size are not compared (reading both back would cost the
    /// copy's own time again).
    static let compareLimit: off_t = 256 << 20

    private struct State {
        /// Read-only handles by process, newest last.
        var byProcess: [pid_t: [(fd: Int32, node: Inode)]] = [:]
        var processOf: [Int32: pid_t] = [:]
    }
    private let state = Lock(State())

    /// A read-only handle of a regular file was opened by `pid`.
    func opened(_ fd: Int32, _ node: Inode, by pid: pid_t) {
        state.withLock { s in
            s.byProcess[pid, default: []].append((fd, node))
            s.processOf[fd] = pid
        }
    }

    func released(_ fd: Int32) {
        state.withLock { s in
            guard let pid = s.processOf.removeValue(forKey: fd), var list = s.byProcess[pid] else { return }
            list.removeAll { $0.fd == fd }
            s.byProcess[pid] = list.isEmpty ? nil : list
        }
    }

    /// The file `pid` opened for reading most recently and still has open.
    func newest(of pid: pid_t) -> Inode? {
        state.withLock { $0.byProcess[pid]?.last?.node }
    }
}

/// How many bytes each user may have the daemon read back to compare
/// copies: a token bucket per uid, so one user closing large "copies" in a
/// loop spends their own share of the daemon's time, not everyone's. A
/// compare that would overdraw it is not made (no `copied_from`, which is
/// only ever said when certain).
final class CompareBudget: Sendable {
    static let bytesPerSecond = Double(128 << 20)
    static let burst = Double(512 << 20)
    /// Users whose buckets are kept; past that, full ones are forgotten.
    static let remembered = 1024

    private let buckets = Lock<[uid_t: (tokens: Double, at: UInt64)]>([:])

    /// Takes `bytes` from `uid`'s bucket; false (taking nothing) if it has not that many.
    func take(_ bytes: Int, for uid: uid_t) -> Bool {
        let now = Condition.now()
        return buckets.withLock { b in
            var bucket = b[uid] ?? (CompareBudget.burst, now)
            let elapsed = Duration.between(bucket.at, now).inSeconds
            bucket.tokens = min(CompareBudget.burst, bucket.tokens + elapsed * CompareBudget.bytesPerSecond)
            bucket.at = now
            let granted = bucket.tokens >= Double(bytes)
            if granted { bucket.tokens -= Double(bytes) }
            if b.count >= CompareBudget.remembered {
                let refilled = Duration.seconds(CompareBudget.burst / CompareBudget.bytesPerSecond).nanoseconds
                b = b.filter { now &- $0.value.at < refilled }
            }
            b[uid] = bucket
            return granted
        }
    }
}

extension EventRecorder {
    /// Whether `node` (`size` bytes now) holds the same bytes as `candidate`,
    /// compared in full; false for an empty file, one over the limit, or
    /// when `uid`'s compare budget runs out. Only data is read: a hole in
    /// `node` is checked against `candidate` by its extent map (reading
    /// `candidate` there only where it has data), so sparse files cost
    /// next to nothing.
    func sameContent(_ node: Inode, size: off_t, as candidate: Inode, uid: uid_t) -> Bool {
        guard size > 0, size <= ReadingHandles.compareLimit, node !== candidate,
              let ownedA = openForComparing(node) else { return false }
        guard let ownedB = openForComparing(candidate) else { return false }
        let a = ownedA.raw, b = ownedB.raw
        guard (try? Sys.fstat(b))?.st_size == size else { return false }
        let chunk = 1 << 20
        let buffer = UnsafeMutableRawPointer.allocate(byteCount: 2 * chunk, alignment: 4096)
        defer { buffer.deallocate() }
        /// Compares [from, to): both read where `a` has data; `b` alone, against zeros, in `a`'s holes.
        func compare(_ from: off_t, _ to: off_t, holeInA: Bool) -> Bool {
            var offset = from
            while offset < to {
                let want = min(chunk, Int(to - offset))
                guard compareBudget.take(holeInA ? want : 2 * want, for: uid) else { return false }
                if holeInA {
                    guard readFully(b, buffer + chunk, want, at: offset) else { return false }
                    memset(buffer, 0, want)
                } else {
                    guard readFully(a, buffer, want, at: offset), readFully(b, buffer + chunk, want, at: offset) else { return false }
                }
                guard memcmp(buffer, buffer + chunk, want) == 0 else { return false }
                offset += off_t(want)
            }
            return true
        }
        var offset: off_t = 0
        while offset < size {
            // Where a's next data begins: all after is a hole if there is none.
            let data = min(size, (try? Sys.lseek(a, offset, VANISH_SEEK_DATA)) ?? size)
            // In a's hole, b must read as zeros: only b's data there is read.
            var at = offset
            while at < data {
                let bData = min(data, (try? Sys.lseek(b, at, VANISH_SEEK_DATA)) ?? data)
                guard bData < data else { break }
                let bHole = min(data, (try? Sys.lseek(b, bData, VANISH_SEEK_HOLE)) ?? data)
                guard compare(bData, bHole, holeInA: true) else { return false }
                at = bHole
            }
            guard data < size else { break }
            let hole = min(size, (try? Sys.lseek(a, data, VANISH_SEEK_HOLE)) ?? size)
            guard compare(data, hole, holeInA: false) else { return false }
            offset = hole
        }
        return true
    }
    private func openForComparing(_ node: Inode) -> OwnedDescriptor? {
        guard let fd = try? namespace.withFD(node, { pathFD throws(Errno) in
            // The daemon's own reading touches no access time where it may say so.
            try Sys.withProcPath(pathFD) { path throws(Errno) in
                try Sys.open(path, O_RDONLY | (readsWithoutAtime ? VANISH_O_NOATIME : 0))
            }
        }) else { return nil }
        return OwnedDescriptor(fd)
    }

    private func readFully(_ fd: Int32, _ into: UnsafeMutableRawPointer, _ count: Int, at offset: off_t) -> Bool {
        var done = 0
        while done < count {
            let n = pread(fd, into + done, count - done, offset + off_t(done))
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { return false }
            done += n
        }
        return true
    }
}
