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
