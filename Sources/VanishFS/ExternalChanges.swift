import Glibc
import LinuxSyscalls
import Synchronization
import VanishClient

/// Changes made behind the mount: by another client of a shared source, or
/// by a program working on the backing directory itself. Vanish cannot say
/// what they were, only that a directory's entries changed without it: its
/// mtime moved and no change of Vanish's own began since it was last read.
/// That becomes one `rescan` event for the directory, never a made-up
/// create or delete. A change of its own running at the same time as a
/// foreign one hides the foreign one (a missed hint, never a wrong one).
extension Inode {
    /// Called before a change of ours to this directory's entries, so the
    /// mtime it moves is not taken for someone else's.
    @inline(__always)
    func willChangeEntries() {
        if isDirectory { changedHere.store(true, ordering: .sequentiallyConsistent) }
    }
}

extension PassthroughFilesystem {
    /// A directory's attributes as a getattr or lookup just read them.
    @inline(__always)
    func notice(_ node: Inode, _ st: stat) {
        guard observing, node.isDirectory else { return }
        let mtime = Sys.nanoseconds(st.st_mtim)
        let seen = node.mtimeSeen.exchange(mtime, ordering: .sequentiallyConsistent)
        guard seen != mtime, seen != 0 else { return }
        if node.changedHere.exchange(false, ordering: .sequentiallyConsistent) { return }
        emit(.rescan, nil) { e in
            e.path("path", of: node, in: table)
            e.string("kind", "directory")
            e.string("reason", "its entries changed behind this mount (another client, or the backing directory)")
        }
    }
}
