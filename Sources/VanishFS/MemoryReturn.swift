import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls

// A burst of files through the mount (a build, an unpacked archive) leaves
// the daemon holding the memory of every inode the kernel knew, long after
// the kernel forgot them: glibc keeps freed chunks in its per-thread arenas,
// and a dictionary never shrinks; this gives it back once the mount is
// quiet (figures in docs/decisions.md).
extension VanishFilesystem {
    /// Starts the thread that gives that memory back once the mount is
    /// quiet after the kernel has let go of at least 10,000 inodes (and the
    /// buffers kept for large reads whenever it is quiet).
    /// `requests` is any number that moves with each request.
    public func startMemoryReturn(requests: @escaping @Sendable () -> UInt64) {
        let table = self.table
        spawnThread("vanish-trim") {
            _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), id_t(vanish_gettid()), 19)
            var last = requests()
            while true {
                Sys.sleep(.seconds(2))
                let now = requests()
                defer { last = now }
                // malloc_trim takes each arena's lock in turn, and rebuilding
                // the map holds the table's: only when few requests come (a
                // mount that is never quiet keeps its memory for its next burst).
                guard now &- last < 200 else { continue }
                LargeReads.releaseIdle()
                guard table.shrinkage >= 10_000 else { continue }
                table.compact()
                Heap.trim()
            }
        }
    }
}
