import CLinux
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage

/// A bounded set of O_PATH fds for the inodes in use, least recently used
/// closed first.
///
/// libfuse's passthrough examples keep an fd per inode and die with EMFILE
/// once the kernel caches ~20,000 inodes. Here an inode without an fd is
/// reopened from its parent's fd and its name, and the result is checked
/// against the inode's (st_dev, st_ino) so a name that now means another file
/// gives ESTALE instead of touching the wrong one. A name that is gone gives
/// ESTALE too: the file may live on under another name the kernel still has
/// cached (a hard link whose last-seen name was removed), and on ESTALE the
/// kernel looks that name up again and retries, which teaches the table
/// where the file is now.
///
/// Only `BackingNamespace` holds one. Lock order: a leaf, never held across
/// a system call (evicted fds are closed once it is released); it guards
/// the `Inode` fields marked so, hence unchecked.
final class FDCache: @unchecked Sendable {
    private struct State {
        var newest: Inode?
        var oldest: Inode?
        var count = 0
    }

    private let lock = Lock(State())
    let limit: Int
    private let table: InodeTable

    init(limit: Int, table: InodeTable) {
        self.limit = max(8, limit)
        self.table = table
    }

    /// Runs `body` with an O_PATH fd of `inode`, opening one if needed; the
    /// fd stays valid (pinned) until `body` returns.
    @inline(__always)
    /// `withFD` for what may fail quietly (event details): nil if the inode cannot be reached.
    func withFDIfPossible<R>(_ inode: Inode, _ body: (Int32) -> R) -> R? {
        try? withFD(inode) { fd throws(Errno) in body(fd) }
    }

    func withFD<R>(_ inode: Inode, _ body: (Int32) throws(Errno) -> R) throws(Errno) -> R {
        if inode === table.root { return try body(inode.cache.fd) }
        let fd = try acquire(inode)
        defer { release(inode) }
        return try body(fd)
    }

    private func acquire(_ inode: Inode) throws(Errno) -> Int32 {
        let hit: Int32 = lock.withLock { state in
            guard inode.cache.fd >= 0 else { return -1 }
            inode.cache.pins += 1
            if inode.cache.listed { moveToFront(inode, &state) }
            return inode.cache.fd
        }
        if hit >= 0 { return hit }

        let opened = try reopen(inode)
        var toClose: [Int32] = []
        let fd: Int32 = lock.withLock { state in
            if inode.cache.fd >= 0 {
                // Another thread opened it meanwhile; use theirs.
                toClose.append(opened)
            } else {
                inode.cache.fd = opened
                inode.cache.closeWhenUnpinned = false
                insertAtFront(inode, &state)
                toClose = evictOverflow(&state)
            }
            inode.cache.pins += 1
            return inode.cache.fd
        }
        for f in toClose { Sys.close(f) }
        return fd
    }

    private func release(_ inode: Inode) {
        let closing: Int32 = lock.withLock { state in
            inode.cache.pins -= 1
            guard inode.cache.pins == 0, inode.cache.closeWhenUnpinned else { return -1 }
            return detach(inode, &state)
        }
        if closing >= 0 { Sys.close(closing) }
    }

    /// Gives the cache an fd the caller just opened for `inode` (after
    /// mkdir/symlink/mknod), so the next request doesn't reopen it.
    func adopt(_ inode: Inode, fd: Int32) {
        var toClose: [Int32] = []
        lock.withLock { state in
            if inode.cache.fd >= 0 {
                toClose.append(fd)
            } else {
                inode.cache.fd = fd
                insertAtFront(inode, &state)
                toClose = evictOverflow(&state)
            }
        }
        for f in toClose { Sys.close(f) }
    }

    /// The kernel forgot `inode`: close its fd now (or when its last user is done).
    func drop(_ inode: Inode) {
        let closing: Int32 = lock.withLock { state in
            guard inode.cache.fd >= 0 else { return -1 }
            if inode.cache.pins > 0 { inode.cache.closeWhenUnpinned = true; return -1 }
            return detach(inode, &state)
        }
        if closing >= 0 { Sys.close(closing) }
    }

    /// Files open through the mount: when none are, deletes skip looking for them.
    private let openFiles = Atomic<Int>(0)
    var anyOpen: Bool { openFiles.load(ordering: .relaxed) > 0 }

    /// A program opened `inode` through the mount.
    func opened(_ inode: Inode) {
        openFiles.wrappingAdd(1, ordering: .relaxed)
        lock.withLock { _ in inode.cache.openHandles += 1 }
    }

    /// A program closed a handle of `inode`; the last close lets go of an
    /// fd held because its name was removed. Returns whether it was the last.
    @discardableResult
    func closed(_ inode: Inode) -> Bool {
        openFiles.wrappingSubtract(1, ordering: .relaxed)
        let (last, unpin): (Bool, Bool) = lock.withLock { _ in
            inode.cache.openHandles -= 1
            guard inode.cache.openHandles <= 0 else { return (false, false) }
            guard inode.cache.heldForOpenHandles else { return (true, false) }
            inode.cache.heldForOpenHandles = false
            return (true, true)
        }
        if unpin { release(inode) }
        return last
    }

    /// Called before `inode`'s name is removed or replaced: if programs hold
    /// it open, keep an fd so fstat and friends still reach it (the kernel
    /// sends those by inode, not by handle).
    /// Returns whether programs have it open.
    func holdIfOpen(_ inode: Inode) -> Bool {
        let (open, wanted): (Bool, Bool) = lock.withLock { _ in
            (inode.cache.openHandles > 0, inode.cache.openHandles > 0 && !inode.cache.heldForOpenHandles)
        }
        guard wanted, (try? acquire(inode)) != nil else { return open }
        let extra: Bool = lock.withLock { _ in
            if inode.cache.heldForOpenHandles || inode.cache.openHandles <= 0 { return true }
            inode.cache.heldForOpenHandles = true
            return false
        }
        if extra { release(inode) }
        return true
    }

    /// Closes about half the cached fds; called when an open hit EMFILE/ENFILE.
    func shrink() {
        var toClose: [Int32] = []
        lock.withLock { state in
            var target = state.count / 2
            var node = state.oldest
            while let n = node, target > 0 {
                node = n.cache.newer
                if n.cache.pins == 0 { toClose.append(detach(n, &state)); target -= 1 }
            }
        }
        for f in toClose { Sys.close(f) }
    }

    var openCount: Int { lock.withLock { $0.count } }

    /// Whether `inode` has an fd now (a hint: it may be evicted right after).
    func isCached(_ inode: Inode) -> Bool { inode === table.root || lock.withLock { _ in inode.cache.fd >= 0 } }

    /// Opens `inode` again from where it was last seen and checks it is still the same file.
    private func reopen(_ inode: Inode) throws(Errno) -> Int32 {
        guard let (parent, name) = table.location(of: inode) else { return try reopenByHandle(inode) }
        let fd: Int32
        do throws(Errno) {
            fd = try withFD(parent) { pfd throws(Errno) in
                try name.withUnsafeBufferPointer { n throws(Errno) in
                    try retryingOnFDExhaustion { () throws(Errno) in
                        try Sys.openat(pfd, n.baseAddress!, VANISH_O_PATH | O_NOFOLLOW)
                    }
                }
            }
        } catch .noSuchFileOrDirectory {
            throw Errno(rawValue: ESTALE)
        }
        let owned = OwnedDescriptor(fd)
        let st = try Sys.fstat(fd)
        guard st.st_dev == inode.key.dev, st.st_ino == inode.key.ino else { throw Errno(rawValue: ESTALE) }
        return owned.take()
    }

    /// Opens `inode`, which has no known name (the kernel asked for it by
    /// handle, see `ExportedHandles`), by the backing handle its id carries.
    private func reopenByHandle(_ inode: Inode) throws(Errno) -> Int32 {
        guard let codec = table.codec, let (ino, generation) = NodeID.decoded(inode.id) else {
            throw Errno(rawValue: ESTALE)
        }
        let fd = try retryingOnFDExhaustion { () throws(Errno) in
            let fd = codec.open(ino: ino, generation: generation, flags: VANISH_O_PATH)
            guard fd >= 0 else { throw errno == EMFILE || errno == ENFILE ? Errno(rawValue: errno) : Errno(rawValue: ESTALE) }
            return fd
        }
        let owned = OwnedDescriptor(fd)
        guard let st = try? Sys.fstat(fd), st.st_dev == inode.key.dev, st.st_ino == inode.key.ino else {
            throw Errno(rawValue: ESTALE)
        }
        return owned.take()
    }

    /// Runs an open; on EMFILE/ENFILE frees half the cache and tries once more.
    func retryingOnFDExhaustion(_ open: () throws(Errno) -> Int32) throws(Errno) -> Int32 {
        do throws(Errno) {
            return try open()
        } catch where error == .tooManyOpenFiles || error == .tooManyOpenFilesInSystem {
            shrink()
            return try open()
        }
    }

    // MARK: LRU list (lock held)

    private func insertAtFront(_ inode: Inode, _ state: inout State) {
        inode.cache.listed = true
        inode.cache.older = state.newest
        inode.cache.newer = nil
        state.newest?.cache.newer = inode
        state.newest = inode
        if state.oldest == nil { state.oldest = inode }
        state.count += 1
    }

    private func unlink(_ inode: Inode, _ state: inout State) {
        if let n = inode.cache.newer { n.cache.older = inode.cache.older } else { state.newest = inode.cache.older }
        if let o = inode.cache.older { o.cache.newer = inode.cache.newer } else { state.oldest = inode.cache.newer }
        inode.cache.newer = nil
        inode.cache.older = nil
    }

    private func moveToFront(_ inode: Inode, _ state: inout State) {
        guard state.newest !== inode else { return }
        unlink(inode, &state)
        state.count -= 1
        insertAtFront(inode, &state)
    }

    /// Takes `inode` out of the cache and returns its fd for closing.
    private func detach(_ inode: Inode, _ state: inout State) -> Int32 {
        let fd = inode.cache.fd
        if inode.cache.listed {
            unlink(inode, &state)
            state.count -= 1
            inode.cache.listed = false
        }
        inode.cache.fd = -1
        inode.cache.closeWhenUnpinned = false
        return fd
    }

    /// Evicts unpinned fds from the old end until the cache fits; looks at a
    /// bounded number so a run of pinned fds can't stall a request.
    private func evictOverflow(_ state: inout State) -> [Int32] {
        guard state.count > limit else { return [] }
        var out: [Int32] = []
        var node = state.oldest
        var budget = 64
        while state.count > limit, let n = node, budget > 0 {
            node = n.cache.newer
            budget -= 1
            if n.cache.pins == 0 { out.append(detach(n, &state)) }
        }
        return out
    }
}
