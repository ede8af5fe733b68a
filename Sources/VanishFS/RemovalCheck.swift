import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage

/// Whether a user could remove an entry, and for a directory everything
/// in it, as `rm -r` run by that user would: the one-step delete
/// (`vanish rm -r`, the `user.vanish.delete` trigger) moves the whole tree
/// with one rename, so it must refuse wherever `rm -r` would stop.
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
            if st.st_mode & S_IFMT != S_IFDIR && st.st_nlink <= 1 { bytes += UInt64(st.st_blocks) * 512 }
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
        let fd = try Sys.openat(parentFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        defer { Sys.close(fd) }
        try checkDirectory(fd, entry, depth: 1, into: &extent)
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
        guard let dp = fdopendir(listing) else {
            let e = Errno(rawValue: errno)
            Sys.close(listing)
            throw e
        }
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

    /// Whether the directory `fd` holds nothing, read with the daemon's own
    /// rights: the caller may not list it, yet may remove it empty.
    private func isEmptyAsDaemon(_ fd: Int32) throws(Errno) -> Bool {
        let own = Credentials(uid: geteuid(), gid: getegid(), groups: [])
        let read = { () throws(Errno) -> Bool in
            let listing = try Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            guard let dp = fdopendir(listing) else { Sys.close(listing); throw Errno(rawValue: errno) }
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
