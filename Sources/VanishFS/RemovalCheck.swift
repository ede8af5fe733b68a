import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

/// Whether a user could remove an entry, and for a directory everything
/// in it, as `rm -r` run by that user would: the one-step delete
/// (`vanish rm -r`, the `user.vanish.delete` trigger) moves the whole tree
/// with one rename, so what `rm -r` would leave must come back (`sift`).
///
/// The kernel does the checking: the walk runs with the caller's fsuid,
/// fsgid and groups on the worker's thread (`Credentials`), so
/// modes, ACLs and capabilities count as they would for the caller. What
/// `rm -r` needs, and this checks:
/// - write and search permission on the entry's directory, and the sticky
///   rule there (the caller owns the entry or the directory);
/// - in every non-empty directory of the tree: read (to list it), write
///   and search permission, and the sticky rule for each entry in it (an
///   empty directory needs nothing of its own: rmdir asks only its parent);
/// - no immutable or append-only entry, and no such directory holding one;
/// - no filesystem mounted in the tree (EBUSY).
struct RemovalCheck: Sendable {
    /// The caller's identity, or nil for root, whom no mode or sticky bit stops.
    let credentials: Credentials?
    /// Directories deeper than this are refused (each level holds an fd).
    static let maxDepth = 4096

    /// From a request's caller. Fails with EPERM for another user's call to
    /// a daemon that cannot take on their identity (one not run by root):
    /// it could check only with its own user's rights.
    init(_ req: Request, _ caller: Caller) throws(Errno) {
        if caller.uid == 0 { credentials = nil; return }
        guard Credentials.canSwitch || caller.uid == geteuid() else { throw .notPermitted }
        credentials = Credentials(uid: caller.uid, gid: caller.gid, groups: req.groups())
    }

    init(credentials: Credentials?) { self.credentials = credentials }

    /// Checks that `name` in the directory `parentFD` (an O_PATH fd) may go,
    /// with all it holds if `recursive`; throws the errno `rm` would meet.
    /// Returns what goes: how many files and directories, itself included
    /// (what the reaper will have to delete), and the disk space deleting
    /// its files gives back (files with other links give none).
    @discardableResult
    func check(_ parentFD: Int32, _ name: UnsafePointer<CChar>, recursive: Bool) throws(Errno) -> Extent {
        guard let credentials, Credentials.canSwitch else { return try checkAsSelf(parentFD, name, recursive) }
        return try credentials.acting { () throws(Errno) -> Extent in try checkAsSelf(parentFD, name, recursive) }
    }

    /// Runs `body` with these credentials where the daemon can take them on
    /// (as `check` does), else with its own.
    func acting<R>(_ body: () throws(Errno) -> R) throws(Errno) -> R {
        guard let credentials, Credentials.canSwitch else { return try body() }
        return try credentials.acting(body)
    }

    /// What a tree holds, as the reaper will meet it.
    struct Extent {
        var entries = 0
        var bytes: UInt64 = 0

        /// Files' blocks only: the reaper counts what it frees the same way.
        mutating func add(_ st: stat) {
            entries += 1
            if st.st_mode & S_IFMT != S_IFDIR && st.st_nlink <= 1 { bytes += Sys.diskBytes(st) }
        }
    }

    private func checkAsSelf(_ parentFD: Int32, _ name: UnsafePointer<CChar>, _ recursive: Bool) throws(Errno) -> Extent {
        let (parent, parentProtected) = try Sys.lstatatProtected(parentFD, "")
        if parentProtected { throw .notPermitted }
        if credentials != nil { try Sys.access(parentFD, W_OK | X_OK) }
        let (entry, isProtected) = try Sys.lstatatProtected(parentFD, name)
        try checkEntry(entry, isProtected, in: parent)
        var extent = Extent()
        extent.add(entry)
        guard recursive, entry.st_mode & S_IFMT == S_IFDIR else { return extent }
        let fd = try Sys.opened(parentFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        try checkDirectory(fd.raw, entry, depth: 1, into: &extent)
        return extent
    }

    /// The rules for one entry of a directory `dir` the caller may write.
    @inline(__always)
    private func checkEntry(_ entry: stat, _ isProtected: Bool, in dir: stat) throws(Errno) {
        if isProtected { throw .notPermitted }
        if let credentials, dir.st_mode & S_ISVTX != 0,
           entry.st_uid != credentials.uid, dir.st_uid != credentials.uid {
            throw .notPermitted
        }
    }

    /// Everything in the directory `fd` (O_PATH; `st` its stat) may go;
    /// what it holds, at any depth, is added to `extent`.
    private func checkDirectory(_ fd: Int32, _ st: stat, depth: Int, into extent: inout Extent) throws(Errno) {
        guard depth <= RemovalCheck.maxDepth else { throw .fileNameTooLong }
        var subdirectories: [(name: [CChar], st: stat)] = []
        let listing: Int32
        do throws(Errno) {
            listing = try Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        } catch .permissionDenied {
            // rm -r cannot list it, but removes it if it is empty.
            if try isEmptyAsDaemon(fd) { return }
            throw .permissionDenied
        }
        let dp = try Sys.directoryStream(adopting: listing)
        defer { closedir(dp) }
        var writable = false
        while let d = readdir(dp) {
            let name = vanish_dirent_name(d)!
            if isDotOrDotDot(name) { continue }
            if !writable {
                if credentials != nil { try Sys.access(fd, W_OK | X_OK) }
                writable = true
            }
            let (entry, isProtected) = try Sys.lstatatProtected(fd, name)
            try checkEntry(entry, isProtected, in: st)
            extent.add(entry)
            if entry.st_mode & S_IFMT == S_IFDIR {
                // Another filesystem mounted here: rmdir would say EBUSY.
                if entry.st_dev != st.st_dev { throw .resourceBusy }
                subdirectories.append((Array(UnsafeBufferPointer(start: name, count: strlen(name) + 1)), entry))
            }
        }
        for sub in subdirectories {
            let child = try sub.name.withUnsafeBufferPointer { n throws(Errno) in
                try Sys.openat(fd, n.baseAddress!, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            }
            defer { Sys.close(child) }
            try checkDirectory(child, sub.st, depth: depth + 1, into: &extent)
        }
    }

    /// What `rm -r` by the caller leaves of a tree it may remove from its
    /// directory: nothing (`whole`), or else the paths, from the tree's top,
    /// of the largest parts that go (each removable whole from a directory
    /// that stays), and the first errno `rm` would have met.
    struct Sifted {
        var whole = true
        var goes: [[[CChar]]] = []
        var extent = Extent()
        var why: Errno?
    }

    /// Sorts the tree `name` in the directory `parentFD` (O_PATH), which
    /// the caller has already moved there with their own rename, into what
    /// goes and what stays, by `rm -r`'s rules (see the type's comment) and
    /// the kernel's answers to the caller. Unlike `check`, it walks all of it.
    func sift(_ parentFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> Sifted {
        try acting { () throws(Errno) -> Sifted in
            var sifted = Sifted()
            let entry = try Sys.lstatat(parentFD, name)
            guard entry.st_mode & S_IFMT == S_IFDIR else {
                sifted.extent.add(entry)
                return sifted
            }
            let fd = try Sys.opened(parentFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            var extent = Extent()
            sifted.whole = siftDirectory(fd.raw, entry, goes: true, path: [], depth: 1, into: &sifted, extent: &extent)
            if sifted.whole { sifted.extent = extent; sifted.extent.add(entry) }
            return sifted
        }
    }

    /// Whether everything in the directory `fd` (O_PATH; `st` its stat) goes,
    /// and it too if `goes` (its own directory lets it). Where not, the
    /// parts of it that go whole are added to `sifted`; `extent` gets what
    /// goes of it.
    private func siftDirectory(_ fd: Int32, _ st: stat, goes: Bool, path: [[CChar]], depth: Int,
                               into sifted: inout Sifted, extent: inout Extent) -> Bool {
        func fail(_ e: Errno) { if sifted.why == nil { sifted.why = e } }
        guard depth <= RemovalCheck.maxDepth else { fail(.fileNameTooLong); return false }
        let listing: Int32
        do throws(Errno) {
            listing = try Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        } catch {
            // rm -r cannot list it, but removes it if it is empty.
            if error == .permissionDenied, (try? isEmptyAsDaemon(fd)) == true { return goes }
            fail(error)
            return false
        }
        let dp: OpaquePointer
        do throws(Errno) { dp = try Sys.directoryStream(adopting: listing) } catch { fail(error); return false }
        let protected = (try? Sys.lstatatProtected(fd, ""))?.protected ?? true
        var writable: Errno? = protected ? .notPermitted : nil
        if writable == nil, credentials != nil {
            do throws(Errno) { try Sys.access(fd, W_OK | X_OK) } catch { writable = error }
        }
        var all = true
        var going: [[CChar]] = []
        var goingExtent = Extent()
        var subdirectories: [(name: [CChar], st: stat, goes: Bool)] = []
        while let d = readdir(dp) {
            let name = vanish_dirent_name(d)!
            if isDotOrDotDot(name) { continue }
            guard let (entry, isProtected) = try? Sys.lstatatProtected(fd, name) else { all = false; continue }
            var fromHere = writable == nil
            if let writable { fail(writable) } else {
                do throws(Errno) { try checkEntry(entry, isProtected, in: st) } catch { fail(error); fromHere = false }
            }
            let owned = Array(UnsafeBufferPointer(start: name, count: strlen(name) + 1))
            if entry.st_mode & S_IFMT == S_IFDIR {
                // Another filesystem mounted here: rmdir would say EBUSY, and nothing of it goes.
                if entry.st_dev != st.st_dev { fail(.resourceBusy); all = false; continue }
                subdirectories.append((owned, entry, fromHere))
            } else if fromHere {
                going.append(owned)
                goingExtent.add(entry)
            } else {
                all = false
            }
        }
        closedir(dp)
        for sub in subdirectories {
            guard let child = try? sub.name.withUnsafeBufferPointer({ n throws(Errno) in
                try Sys.openat(fd, n.baseAddress!, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            }) else { all = false; continue }
            var inner = Extent()
            let whole = siftDirectory(child, sub.st, goes: sub.goes, path: path + [sub.name], depth: depth + 1,
                                      into: &sifted, extent: &inner)
            Sys.close(child)
            if whole {
                going.append(sub.name)
                goingExtent.entries += inner.entries + 1
                goingExtent.bytes += inner.bytes
            } else {
                all = false
                extent.entries += inner.entries
                extent.bytes += inner.bytes
            }
        }
        if all && goes {
            extent.entries += goingExtent.entries
            extent.bytes += goingExtent.bytes
            return true
        }
        for name in going { sifted.goes.append(path + [name]) }
        extent.entries += goingExtent.entries
        extent.bytes += goingExtent.bytes
        return false
    }

    /// Whether the directory `fd` holds nothing, read with the daemon's own
    /// rights: the caller may not list it, yet may remove it empty.
    private func isEmptyAsDaemon(_ fd: Int32) throws(Errno) -> Bool {
        let own = Credentials(uid: geteuid(), gid: getegid(), groups: [])
        let read = { () throws(Errno) -> Bool in
            let listing = try Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            let dp = try Sys.directoryStream(adopting: listing)
            defer { closedir(dp) }
            while let d = readdir(dp) {
                if !isDotOrDotDot(vanish_dirent_name(d)!) { return false }
            }
            return true
        }
        guard credentials != nil, Credentials.canSwitch else { return try read() }
        return try own.acting(read)
    }
}
