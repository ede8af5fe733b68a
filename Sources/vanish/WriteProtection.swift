import CLinux
import Glibc

/// Whether a tree holds an entry rm, run from a terminal, would ask about
/// before removing it: one the caller may not write (symlinks aside), the
/// tree's top included. `vanish rm -r` leaves such a tree to rm, so the
/// question is asked as rm asks it.
enum WriteProtection {
    /// True if `path` (a directory) or anything below it is write-protected
    /// for the caller, or if the walk cannot tell (then rm decides).
    static func found(in path: String) -> Bool {
        RawArguments.withCString(path) { p in
            guard faccessat(AT_FDCWD, p, W_OK, AT_EACCESS) == 0 else { return true }
            let fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            // rm cannot list it either: it fails there without asking.
            guard fd >= 0 else { return errno != EACCES }
            return found(below: fd, depth: 0)
        }
    }

    /// Walks the directory `fd` (closed here).
    private static func found(below fd: Int32, depth: Int) -> Bool {
        guard depth < 4096, let dir = fdopendir(fd) else { close(fd); return true }
        defer { closedir(dir) }
        let dfd = dirfd(dir)
        while let entry = readdir(dir) {
            let name = vanish_dirent_name(entry)!
            if name[0] == 0x2E && (name[1] == 0 || (name[1] == 0x2E && name[2] == 0)) { continue }
            var type = Int(entry.pointee.d_type)
            if type == DT_UNKNOWN {
                var st = stat()
                guard fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else { continue }
                type = st.st_mode & S_IFMT == S_IFDIR ? DT_DIR : (st.st_mode & S_IFMT == S_IFLNK ? DT_LNK : DT_REG)
            }
            if type == DT_LNK { continue }
            if faccessat(dfd, name, W_OK, AT_EACCESS) != 0 {
                if errno == ENOENT { continue }
                return true
            }
            if type == DT_DIR {
                let sub = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                if sub < 0 {
                    if errno == EACCES || errno == ENOENT { continue }
                    return true
                }
                if found(below: sub, depth: depth + 1) { return true }
            }
        }
        return false
    }
}
