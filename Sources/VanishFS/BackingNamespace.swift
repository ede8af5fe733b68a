import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

/// The backing directory as the request handlers reach it: the inode table,
/// the fds of its inodes, and the unlinks answered before their rename into
/// the graveyard has landed (`DeferredBurials`).
///
/// Its invariant: nobody sees a name whose burial is pending. It holds by
/// construction, because the fd cache and the pending burials are private
/// here and every way to a directory's fd settles what that use could see:
/// - `atName`, `making`, `renaming`: a request about one name (lookup,
///   making, linking or renaming it, reading its xattrs through its parent)
///   lands that name's burial first;
/// - `withFD` and `reading`: a directory's own fd (listing it, its attributes,
///   fsyncdir, opening it) lands every burial queued in it first;
/// - `removing`: unlink and rmdir of a name the kernel has just looked up
///   (which settled it) wait for nothing, so `rm -rf` leaves a directory's
///   burials queued until the directory itself goes, with them, in one rename;
/// - `settle`: everything lands (trash listings, restores, snapshots, the end).
/// The burials are begun, queued and landed by the `Deleter`, which shares
/// `DeferredBurials` with this type but no fd: it reaches a directory through
/// these ways too, or `landing` (no wait) for the burial others wait for.
///
/// Lock order: InodeTable's lock, FDCache's lock and DeferredBurials' condition
/// are leaves: none is held while another is taken. DeferredBurials releases
/// its condition while a burial lands, so landing may use the other two.
final class BackingNamespace: Sendable {
    let table: InodeTable
    private let fds: FDCache
    private let burials: DeferredBurials

    init(table: InodeTable, fdLimit: Int, burials: DeferredBurials) {
        self.table = table
        fds = FDCache(limit: fdLimit, table: table)
        self.burials = burials
    }

    // MARK: Reaching the backing directory

    /// `body` with the fd of `dir`, once `name` in it has no burial pending.
    @inline(__always)
    func atName<R>(_ dir: Inode, _ name: UnsafePointer<CChar>, _ body: (Int32) throws(Errno) -> R) throws(Errno) -> R {
        burials.waitForName(dir, name)
        return try fds.withFD(dir, body)
    }

    /// For a request that makes `name` in `dir` (mkdir, mknod, symlink,
    /// link, create): `body` makes it with the fd of `dir`, once `name` has
    /// no burial pending; `answer` replies with what it returned. Then the
    /// directory, being in use rather than emptied by `rm -rf`, lands what
    /// is queued in it, after the reply and off the caller's path, so it
    /// does not keep removed names every lookup in it must search past.
    @inline(__always)
    func making<R>(_ dir: Inode, _ name: UnsafePointer<CChar>, _ body: (Int32) throws(Errno) -> R,
                   answer: (R) -> Void) throws(Errno) {
        dir.willChangeEntries()
        answer(try atName(dir, name, body))
        burials.landQueue(of: dir)
    }

    /// For a rename of `name` in `dir` to `newName` in `newDir`: both names
    /// settle, and a directory about to move (the source, or the other side
    /// of an exchange) first lets every pending burial land, since the log of
    /// answered unlinks names their files by path (`UnlinkIntents`). After
    /// `answer`, `newDir` lands its queue, as for `making`.
    func renaming(_ dir: Inode, _ name: UnsafePointer<CChar>, _ newDir: Inode, _ newName: UnsafePointer<CChar>,
                  exchange: Bool, _ body: (Int32, Int32) throws(Errno) -> Void, answer: () -> Void) throws(Errno) {
        dir.willChangeEntries()
        newDir.willChangeEntries()
        burials.waitForName(dir, name)
        burials.waitForName(newDir, newName)
        try fds.withFD(dir) { pfd throws(Errno) in
            try fds.withFD(newDir) { npfd throws(Errno) in
                if !burials.isEmpty {
                    func directory(_ fd: Int32, _ n: UnsafePointer<CChar>) -> InodeKey? {
                        guard let st = try? Sys.lstatat(fd, n), st.st_mode & S_IFMT == S_IFDIR else { return nil }
                        return InodeKey(dev: st.st_dev, ino: st.st_ino)
                    }
                    let target = directory(npfd, newName)
                    if directory(pfd, name) != nil || (exchange && target != nil) {
                        burials.drain()
                    } else if let target {
                        // A directory renamed over must be empty, which it is
                        // not while burials from it are pending.
                        burials.waitForDirectory(target)
                    }
                }
                try body(pfd, npfd)
            }
        }
        answer()
        burials.landQueue(of: newDir)
    }

    /// `body` with the fd of `dir`, to unlink or rmdir `name` in it: the kernel
    /// looked the name up first, which settled it, and the directory's other
    /// burials may stay queued.
    @inline(__always)
    func removing<R>(_ dir: Inode, _ name: UnsafePointer<CChar>, _ body: (Int32) throws(Errno) -> R) throws(Errno) -> R {
        dir.willChangeEntries()
        return try fds.withFD(dir, body)
    }

    /// `body` with an O_PATH fd of `node`; a directory's queued burials land first.
    @inline(__always)
    func withFD<R>(_ node: Inode, _ body: (Int32) throws(Errno) -> R) throws(Errno) -> R {
        if node.isDirectory { burials.waitForDirectory(node.key) }
        return try fds.withFD(node, body)
    }

    /// The attributes (and birth time) of the directory `node`, and what to
    /// show of them: its answered unlinks are in its mtime and ctime, whose
    /// burials may stay queued. (With `default_permissions`, as with
    /// `allow_other`, the kernel asks for the directory's attributes after
    /// every unlink in it: landing its queue there made `rm -rf` rename each
    /// file on its own, 0.6 s for 10k files against 0.3 s, and kept no
    /// directory whole in an undo window.) The backing filesystem sets
    /// both again, later, when the burials land.
    func directoryAttributes(_ node: Inode) throws(Errno) -> (backing: stat, birth: UInt64, shown: stat) {
        guard let latest = burials.latestUnlink(in: node.key) else {
            let (st, birth) = try withFD(node) { fd throws(Errno) in try Sys.fstatWithBirth(fd) }
            return (st, birth, st)
        }
        let (st, birth) = try fds.withFD(node) { fd throws(Errno) in try Sys.fstatWithBirth(fd) }
        var shown = st
        let at = timespec(tv_sec: Int(latest / 1_000_000_000), tv_nsec: Int(latest % 1_000_000_000))
        func raise(_ t: inout timespec) {
            if t.tv_sec < at.tv_sec || (t.tv_sec == at.tv_sec && t.tv_nsec < at.tv_nsec) { t = at }
        }
        raise(&shown.st_mtim)
        raise(&shown.st_ctim)
        return (st, birth, shown)
    }

    /// The attributes (and birth time) of the non-directory `node` read by
    /// its last known name in its parent: one statx and no fd, where `withFD`
    /// would open an O_PATH fd and check it (the kernel asks again after
    /// every read of a file, for its access time). nil where it cannot serve
    /// (an fd is cached already, no known name, the name now holds another
    /// file, any error): the caller then goes through `withFD`.
    func statByName(_ node: Inode) -> (stat, UInt64)? {
        guard !node.isDirectory, !fds.isCached(node), let (parent, name) = table.location(of: node),
              name.first != 0 else { return nil }
        let found = try? fds.withFD(parent) { pfd throws(Errno) in
            try name.withUnsafeBufferPointer { n throws(Errno) in try Sys.lstatatWithBirth(pfd, n.baseAddress!) }
        }
        guard let (st, birth) = found, st.st_dev == node.key.dev, st.st_ino == node.key.ino else { return nil }
        return (st, birth)
    }

    /// Opens the regular file `node` with `flags` through its parent and
    /// last known name: one openat, and an fstat (returned) that checks it
    /// is still the same file. That spares an open without a cached fd the
    /// O_PATH open and the /proc reopen of `withFD`. nil where it cannot
    /// serve (an fd is cached already, O_TRUNC, the name now holds another
    /// file, any error): the caller then opens through `withFD`, which gives
    /// the authoritative error.
    func openByName(_ node: Inode, flags: Int32) -> (fd: Int32, stat: stat)? {
        guard node.type == S_IFREG, flags & O_TRUNC == 0, !fds.isCached(node),
              let (parent, name) = table.location(of: node) else { return nil }
        // O_NONBLOCK: should the name have become a FIFO, the open must not
        // wait for a writer. Cleared after, unless the caller asked for it.
        let opened = try? name.withUnsafeBufferPointer { n throws(Errno) in
            try atName(parent, n.baseAddress!) { pfd throws(Errno) in
                try Sys.openat(pfd, n.baseAddress!, flags | O_NOFOLLOW | O_NONBLOCK)
            }
        }
        guard let fd = opened else { return nil }
        guard let st = try? Sys.fstat(fd), st.st_dev == node.key.dev, st.st_ino == node.key.ino,
              flags & O_NONBLOCK != 0 || fcntl(fd, F_SETFL, flags) == 0 else {
            Sys.close(fd)
            return nil
        }
        return (fd, st)
    }

    /// As `withFD`, nil if the inode cannot be reopened.
    func withFDIfPossible<R>(_ node: Inode, _ body: (Int32) -> R) -> R? {
        if node.isDirectory { burials.waitForDirectory(node.key) }
        return fds.withFDIfPossible(node, body)
    }

    /// `body` with the fd of the directory `dir` as it is, its queued
    /// burials left queued: for reading ahead, which only warms the backing
    /// filesystem's caches and shows no name. (Landing them there made
    /// `rm -rf` of a directory looked up cold rename its first files one by
    /// one, and kept it whole in no undo window.)
    func warming<R>(_ dir: Inode, _ body: (Int32) -> R) -> R? {
        fds.withFDIfPossible(dir, body)
    }

    /// `body` with an open directory's stream, once no burial in it is pending.
    @inline(__always)
    func reading<R>(_ handle: DirectoryHandle, _ body: (OpaquePointer) throws(Errno) -> R) throws(Errno) -> R {
        burials.waitForDirectory(handle.inode.key)
        return try body(handle.stream)
    }

    /// Lets every pending burial land: a trash listing, a restore or a
    /// snapshot must see each answered unlink in place.
    func settle() { burials.drain() }

    /// Lands the burials queued now that go to `uid`'s trash, waiting for
    /// none in flight (`answered`: but for `uid`'s own): what a desktop
    /// trash folder's owner looks at, which others can neither hold up nor
    /// make land.
    func landQueued(keptFor uid: uid_t, answered: Bool = false) { burials.landQueued(keptFor: uid, answered: answered) }

    /// Whether `name` in the backing directory `dir` is an answered unlink
    /// whose burial has not landed: a walk of the backing tree skips it.
    func isPendingBurial(_ dir: InodeKey, _ name: UnsafePointer<CChar>) -> Bool { burials.isPending(dir, name) }

    /// `body` with the fd of `dir` without waiting for its burials: for
    /// landing one of them, which is what the others wait for.
    func landing<R>(in dir: Inode, _ body: (Int32) throws(Errno) -> R) throws(Errno) -> R {
        try fds.withFD(dir, body)
    }

    // MARK: The fd cache's bookkeeping

    var fdLimit: Int { fds.limit }
    var cachedFDs: Int { fds.openCount }
    var anyOpen: Bool { fds.anyOpen }
    func isCached(_ node: Inode) -> Bool { fds.isCached(node) }
    func adopt(_ node: Inode, fd: Int32) { fds.adopt(node, fd: fd) }
    func drop(_ node: Inode) { fds.drop(node) }
    func opened(_ node: Inode) { fds.opened(node) }
    func closed(_ node: Inode) -> Bool { fds.closed(node) }
    func holdIfOpen(_ node: Inode) -> Bool { fds.holdIfOpen(node) }
    func shrink() { fds.shrink() }
    func retryingOnFDExhaustion(_ open: () throws(Errno) -> Int32) throws(Errno) -> Int32 {
        try fds.retryingOnFDExhaustion(open)
    }
}
