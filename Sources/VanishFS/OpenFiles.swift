/// What the daemon holds for open files: each user's share of its
/// descriptors, and the backing ids of files opened in passthrough mode.
struct OpenFiles: Sendable {
    /// How many open handles each user may have the daemon hold.
    let shares = HandleShares(fdLimit: FileLimits.current())
    /// Backing ids of files opened in passthrough mode.
    let passthrough: PassthroughFiles
}
