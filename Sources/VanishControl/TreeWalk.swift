import CLinux
import Glibc
import LinuxSyscalls
import VanishFS
import VanishGraveyard

/// Every entry under a mount's backing root, for a subscriber's snapshot.
enum TreeWalk {
    /// Visits every entry under the root of `fs` (never a state directory),
    /// parents before children, with fd-relative calls that never follow a
    /// symlink and go into nested filesystems too. `visit` returns false to stop.
    static func walk(_ fs: PassthroughFilesystem, _ visit: (_ path: [UInt8], _ st: stat, _ id: String) -> Bool) {
        // An unlink already in the journal must not show up as existing.
        fs.settle()
        let graveyards = fs.hasGraveyard
        var stop = false
        // `top`: a root whose `.vanish` is a graveyard (the source's, or a nested filesystem's).
        func descend(_ dirFD: Int32, _ prefix: [UInt8], top: Bool) {
            guard let fd = try? Sys.openat(dirFD, ".", O_RDONLY | O_DIRECTORY), let dp = fdopendir(fd) else { return }
            defer { closedir(dp) }
            while !stop, let d = Glibc.readdir(dp) {
                let name = vanish_dirent_name(d)!
                if isDotOrDotDot(name) { continue }
                if top && strcmp(name, Graveyard.stateDirectoryName) == 0 { continue }
                guard let st = try? Sys.lstatat(dirfd(dp), name) else { continue }
                var path = prefix
                if !path.isEmpty { path.append(0x2F) }
                path.append(contentsOf: UnsafeRawBufferPointer(start: name, count: strlen(name)))
                if !visit(path, st, fs.fileID(dirfd(dp), name)) { stop = true; return }
                if st.st_mode & S_IFMT == S_IFDIR,
                   let sub = try? Sys.openat(dirfd(dp), name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) {
                    let nestedRoot = graveyards && st.st_dev != (try? Sys.fstat(dirfd(dp)))?.st_dev
                    descend(sub, path, top: nestedRoot && Graveyard.isStateDirectory(in: sub))
                    Sys.close(sub)
                }
            }
        }
        descend(fs.backingRoot, [], top: graveyards)
    }
}
