import CFuse
import Glibc
import LinuxSyscalls
import SystemPackage

/// Deletes one graveyard entry, file or tree, with fd-relative calls only
/// (openat, readdir, unlinkat), holding one directory fd at a time and a
/// stack of names: trees deeper than PATH_MAX and deeper than the fd limit
/// are fine. Nothing else can reach inside a graveyard entry, so walking
/// back up through ".." is safe.
struct TreeRemover {
    var files: UInt64 = 0
    var bytes: UInt64 = 0
    let shouldStop: () -> Bool

    /// Removes `name` in the directory `parentFD`; returns false if told to stop midway.
    mutating func remove(_ parentFD: Int32, _ name: UnsafePointer<CChar>) -> Bool {
        guard let st = try? Sys.lstatat(parentFD, name) else { return true }
        if st.st_mode & S_IFMT != S_IFDIR {
            if (try? Sys.unlinkat(parentFD, name, 0)) != nil { count(st) }
            return true
        }
        return removeTree(parentFD, name)
    }

    private mutating func count(_ st: stat) {
        files += 1
        // Space is freed only with the last link.
        if st.st_nlink <= 1 { bytes += UInt64(st.st_blocks) * 512 }
    }

    private mutating func removeTree(_ parentFD: Int32, _ top: UnsafePointer<CChar>) -> Bool {
        guard var cur = try? Sys.openat(parentFD, top, O_RDONLY | O_DIRECTORY | O_NOFOLLOW) else { return true }
        var path: [ContiguousArray<CChar>] = []
        while true {
            guard let dp = fdopendir(cur) else { Sys.close(cur); return true }
            let dfd = dirfd(dp)
            var child: Int32 = -1
            var childName = ContiguousArray<CChar>()
            while let d = readdir(dp) {
                let name = vanish_dirent_name(d)!
                if name[0] == 0x2E && (name[1] == 0 || (name[1] == 0x2E && name[2] == 0)) { continue }
                let type = d.pointee.d_type
                if type == UInt8(DT_DIR) || type == UInt8(DT_UNKNOWN) {
                    if let fd = try? Sys.openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW) {
                        child = fd
                        childName = ContiguousArray(UnsafeBufferPointer(start: name, count: strlen(name) + 1))
                        break
                    }
                }
                if let st = try? Sys.lstatat(dfd, name), (try? Sys.unlinkat(dfd, name, 0)) != nil { count(st) }
                if shouldStop() { closedir(dp); return false }
            }
            if child >= 0 {
                // Go down; the directory is rescanned when we come back up.
                closedir(dp)
                path.append(childName)
                cur = child
                continue
            }
            // This directory is empty now: go up and remove it.
            if path.isEmpty {
                closedir(dp)
                try? Sys.unlinkat(parentFD, top, AT_REMOVEDIR)
                return true
            }
            let up = try? Sys.openat(dfd, "..", O_RDONLY | O_DIRECTORY)
            closedir(dp)
            guard let up else { return true }
            let name = path.removeLast()
            _ = name.withUnsafeBufferPointer { try? Sys.unlinkat(up, $0.baseAddress!, AT_REMOVEDIR) }
            cur = up
        }
    }
}
