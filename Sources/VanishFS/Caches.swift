import LinuxSyscalls

/// What the daemon and the kernel keep of the source between requests, and
/// what keeps it fresh: each spares syscalls or round trips, and each is
/// dropped or told when the source changes.
struct Caches: Sendable {
    /// Changes behind the mount as they happen: with it, the kernel keeps
    /// names and attributes of the source's filesystem for an hour (`cacheTimeout`).
    let watch: SourceWatch?
    /// Cache invalidations for the kernel, sent from their own thread.
    let invalidations: EntryInvalidations
    /// Files known to have no xattrs, answered without a syscall.
    let absentXattrs: AbsentXattrs
    /// Reads directories ahead of programs that stat what they list.
    let statahead: Statahead
}
