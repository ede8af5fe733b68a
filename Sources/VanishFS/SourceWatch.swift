import CFuse
import CLinux
import Glibc
import LinuxSyscalls

/// Changes other programs make on the source's filesystem, seen as they
/// happen (fanotify, by file handle and name), so the kernel may keep the
/// mount's names, attributes and listings for an hour instead of the
/// second that otherwise bounds how stale they get behind the mount: each
/// change drops exactly what it touched (see docs/design.md, "Watching the
/// source").
///
/// Only for a root daemon (a filesystem-wide mark needs CAP_SYS_ADMIN) whose
/// source's handles map to node ids (`HandleCodec`), on a local disk. The
/// daemon's own changes are skipped by pid: the kernel learns of those
/// from the requests themselves.
final class SourceWatch: @unchecked Sendable {
    /// How long the kernel may keep what the watch vouches for (seconds).
    static let timeout: Double = 3600
    /// Events in one read that make it a flood.
    static let floodBatch = 256

    /// The user a process runs as (the owner of its /proc directory), whom a
    /// change it made behind the mount is charged to; unknown once it is gone.
    static func user(of pid: Int32) -> UInt32 {
        var st = stat()
        return pid > 0 && stat("/proc/\(pid)", &st) == 0 ? st.st_uid : EntryInvalidations.unknownUser
    }

    private let fd: Int32

    init?(codec: HandleCodec) {
        fd = vanish_fanotify_watch(codec.mountFD)
        guard fd >= 0 else { return nil }
    }

    deinit { Sys.close(fd) }

    /// Reads events on a thread of its own for the rest of the process, and
    /// hands each to `body`.
    func start(_ body: @escaping @Sendable (UnsafePointer<vanish_fan_event>) -> Void) {
        let fd = fd
        spawnThread("vanish-fswatch") {
            let buffer = UnsafeMutableRawBufferPointer.allocate(byteCount: 256 * 1024, alignment: 8)
            let event = UnsafeMutablePointer<vanish_fan_event>.allocate(capacity: 1)
            while true {
                let n = read(fd, buffer.baseAddress, buffer.count)
                if n < 0 && errno == EINTR { continue }
                guard n > 0 else { return }
                var offset: Int32 = 0
                var count = 0
                while vanish_fanotify_event(buffer.baseAddress!.assumingMemoryBound(to: UInt8.self), Int32(n),
                                            &offset, event) == 1 {
                    body(event)
                    count += 1
                }
                // Most events are the daemon's own changes, one per request:
                // waking for each would cost every create a wake-up of this
                // thread. Let the kernel batch the next ones for a moment
                // (2 ms in a flood of another program's changes).
                usleep(count >= Self.floodBatch ? 2000 : 1000)
            }
        }
    }
}

extension VanishFilesystem {
    /// Starts following changes behind the mount, once the kernel can be told
    /// of them (at INIT: before it the kernel holds nothing to drop).
    func startWatching() {
        guard let watch = caches.watch, let codec = table.codec else { return }
        let me = getpid()
        watch.start { [unowned self] e in
            let mask = e.pointee.mask
            if mask & VANISH_FAN_Q_OVERFLOW != 0 { changedEverywhere(); return }
            if e.pointee.pid == me { return }
            if mask & VANISH_FAN_ENTRY_CHANGED != 0, let name = e.pointee.name,
               let dir = held(codec, e, at: Self.dirHandle, length: e.pointee.dir_length) {
                caches.invalidations.changedBehind(parent: fuse_ino_t(dir.id), name: Inode.copyName(name),
                                                   by: SourceWatch.user(of: e.pointee.pid))
            }
            if mask & VANISH_FAN_OBJECT_CHANGED != 0,
               let node = held(codec, e, at: Self.objectHandle, length: e.pointee.object_length),
               // A passthrough write through the mount: the kernel updated its own attributes.
               !(mask & VANISH_FAN_OBJECT_CHANGED == VANISH_FAN_DATA_CHANGED && node.wroteThroughMount(pid: e.pointee.pid)),
               !changes.follows(node),
               // Dropped already and not asked for since (a writer's stream of modify events).
               !node.attributesDropped.exchange(true, ordering: .acquiringAndReleasing) {
                caches.invalidations.attributes(of: fuse_ino_t(node.id), wait: false)
            }
        }
    }

    /// Where the event's directory and object handles sit in it.
    private static let dirHandle = MemoryLayout<vanish_fan_event>.offset(of: \vanish_fan_event.dir_handle)!
    private static let objectHandle = MemoryLayout<vanish_fan_event>.offset(of: \vanish_fan_event.object_handle)!

    /// The inode the kernel holds for the file handle at `offset` in the event.
    private func held(_ codec: HandleCodec, _ e: UnsafePointer<vanish_fan_event>, at offset: Int, length: Int32) -> Inode? {
        guard length > 0 else { return nil }
        let bytes = UnsafeRawBufferPointer(start: UnsafeRawPointer(e) + offset, count: Int(length))
        guard let (ino, generation) = codec.numberAndGeneration(of: bytes) else { return nil }
        return table.held(ino: ino, generation: generation)
    }

    /// The queue of changes overflowed: whatever the kernel holds may be stale.
    private func changedEverywhere() {
        log.warning("missed changes behind the mount (the watch's queue overflowed): every cached name and attribute dropped")
        for (id, parent, name) in table.everyNode() {
            caches.invalidations.attributes(of: fuse_ino_t(id), wait: false)
            if let parent, name.first != 0 { caches.invalidations.changedBehind(parent: fuse_ino_t(parent), name: name) }
        }
    }
}
