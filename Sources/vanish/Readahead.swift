import Glibc
import LinuxSyscalls
import Logging

/// The kernel's readahead for the mount: how far ahead it asks the daemon
/// for a file read in order.
///
/// A FUSE mount starts at 128 KiB, and its INIT reply can only lower that,
/// so between the mount and that reply the daemon sets
/// `/sys/class/bdi/MAJOR:MINOR/read_ahead_kb` (root only), as mergerfs's
/// `readahead=` does. With 1 MiB, requests are
/// answered from the large-read buffers and a cold 256 MiB `dd` took
/// 0.08–0.09 s instead of 0.11–0.12 s (ext4 on a RAM disk); 4 KiB random
/// reads did not change.
enum Readahead {
    /// Sets the readahead of the mount at `mountpoint` (just made: the last
    /// one stacked there). Only a raise asked for explicitly is worth a
    /// warning when it cannot be set: a lower value needs no write, the
    /// INIT reply lowers it.
    static func apply(kb: Int, at mountpoint: String, explicit: Bool, log: Logger) {
        guard let device = MountPaths.mounts().last(where: { $0.point == mountpoint })?.device else { return }
        let path = "/sys/class/bdi/\(device)/read_ahead_kb"
        let current = Sys.readNumber(atPath: path)
        if let current, kb <= current { return }
        let fd = open(path, O_WRONLY | O_CLOEXEC)
        var failure = fd < 0 ? errno : 0
        if fd >= 0 {
            let text = "\(kb)\n"
            if write(fd, text, text.utf8.count) < 0 { failure = errno }
            close(fd)
        }
        if failure != 0 {
            let message: Logger.Message = "readahead stays at \(current.map { "\($0)" } ?? "the kernel's") KiB: cannot write \(path)"
            let metadata: Logger.Metadata = ["error": "\(String(cString: strerror(failure)))"]
            if explicit { log.warning(message, metadata: metadata) } else { log.debug(message, metadata: metadata) }
        }
    }
}
