import CLinux

/// glibc's allocator settings a long-running daemon needs.
public enum Heap {
    /// mallopt(M_MMAP_THRESHOLD): blocks of `bytes` and more are mapped on
    /// their own and unmapped when freed; glibc stops moving the threshold.
    /// Call before any thread starts.
    public static func setMapThreshold(_ bytes: Int32) { _ = vanish_set_mmap_threshold(bytes) }

    /// malloc_trim(0): gives the free pages of every arena back to the kernel.
    public static func trim() { _ = vanish_malloc_trim() }
}
