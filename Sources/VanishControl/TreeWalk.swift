import CLinux
import Glibc
import LinuxSyscalls
import VanishFS
import VanishGraveyard

/// Every entry under a mount's backing root, for a subscriber's snapshot.
enum TreeWalk {
    /// Visits every entry under the root of `mount` (never a state directory),
    /// parents before children, with fd-relative calls that never follow a
    /// symlink and go into nested filesystems too. With `peer`, only what
    /// that user could list (read and search on every directory on the way,
    /// decided once per directory). `visit` returns false to stop.
    ///
    /// One fd is open at a time, whatever the depth: each directory's names
    /// are read whole before going down, and the walk comes back up by `..`,
    /// checked to be the directory it left (a tree moved meanwhile ends the
    /// walk). Memory is the names of the directories on the current path and
    /// that path once (a copy per level cost the square of a deep chain's depth).
    static func walk(_ mount: MountControl, as peer: Credentials? = nil,
                     _ visit: (_ path: [UInt8], _ st: stat, _ id: String) -> Bool) {
        // An unlink already in the journal must not show up as existing:
        // its name is skipped while its burial is pending (landing every
        // user's for a walk by anyone would undo their `rm -rf`'s grouping).
        mount.awaitOneStepSorted(for: peer?.uid ?? 0)
        let graveyards = mount.hasGraveyard
        guard let rootStat = try? Sys.fstat(mount.backingRoot), peer?.permits(mount.backingRoot, 5) ?? true,
              var current = try? Sys.opened(mount.backingRoot, ".", VANISH_O_PATH | O_DIRECTORY),
              let rootNames = names(in: current.raw, skippingState: graveyards) else { return }
        var stack = [Frame(dev: rootStat.st_dev, ino: rootStat.st_ino, prefixLength: 0, names: rootNames)]
        var path: [UInt8] = []
        while let frame = stack.last {
            guard frame.next < frame.names.count else {
                stack.removeLast()
                guard let up = stack.last else { return }
                guard let parent = try? Sys.opened(current.raw, "..", VANISH_O_PATH | O_DIRECTORY) else { return }
                current = parent
                guard let st = try? Sys.fstat(current.raw), st.st_dev == up.dev, st.st_ino == up.ino else { return }
                continue
            }
            stack[stack.count - 1].next += 1
            let done = frame.names[frame.next].withUnsafeBufferPointer { n -> Bool in
                let name = n.baseAddress!
                if mount.isPendingBurial(dev: frame.dev, ino: frame.ino, name) { return false }
                guard let st = try? Sys.lstatat(current.raw, name) else { return false }
                path.removeSubrange(frame.prefixLength...)
                if !path.isEmpty { path.append(0x2F) }
                path.append(contentsOf: UnsafeRawBufferPointer(start: name, count: n.count - 1))
                if !visit(path, st, FileID.read(current.raw, name)) { return true }
                guard st.st_mode & S_IFMT == S_IFDIR,
                      let sub = try? Sys.opened(current.raw, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW),
                      peer?.permits(sub.raw, 5) ?? true
                else { return false }
                let top = graveyards && st.st_dev != frame.dev && Graveyard.isStateDirectory(in: sub.raw)
                guard let opened = try? Sys.fstat(sub.raw), opened.st_dev == st.st_dev, opened.st_ino == st.st_ino,
                      let subNames = names(in: sub.raw, skippingState: top) else { return false }
                stack.append(Frame(dev: st.st_dev, ino: st.st_ino, prefixLength: path.count, names: subNames))
                current = sub
                return false
            }
            if done { return }
        }
    }

    /// A directory on the walk's path: what is left of its names.
    private struct Frame {
        var dev: dev_t
        var ino: ino_t
        /// How much of the walk's path names this directory.
        var prefixLength: Int
        var names: [[CChar]]
        var next = 0
    }

    /// The names in the directory `fd` but `.`, `..` and (`skippingState`)
    /// the state directory, each NUL-terminated; nil if it cannot be read.
    private static func names(in fd: Int32, skippingState: Bool) -> [[CChar]]? {
        guard let listing = try? Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) else { return nil }
        guard let dp = try? Sys.directoryStream(adopting: listing) else { return nil }
        defer { closedir(dp) }
        var out: [[CChar]] = []
        while let d = Glibc.readdir(dp) {
            let name = vanish_dirent_name(d)!
            if isDotOrDotDot(name) { continue }
            if skippingState && strcmp(name, Graveyard.stateDirectoryName) == 0 { continue }
            out.append(Array(UnsafeBufferPointer(start: name, count: strlen(name) + 1)))
        }
        return out
    }
}
