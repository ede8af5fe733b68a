import CFuse
import Foundation
import Synchronization
import Testing
@testable import VanishFS
import VanishTestSupport

/// The thread that tells the kernel of entries changed behind its back, and
/// the daemon's last wait for it before the session goes (in-process: no mount).
@Suite("entry invalidations")
struct EntryInvalidationsTests {
    /// Runs `body` on a thread of its own: whether it returned within `seconds`.
    func returns(within seconds: Double, _ body: @escaping @Sendable () -> Void) -> Bool {
        let done = DispatchSemaphore(value: 0)
        Thread.detachNewThread {
            body()
            done.signal()
        }
        return done.wait(timeout: .now() + seconds) == .success
    }

    @Test("a session that ends before the kernel's INIT, with notices queued and no sender started, lets go at once")
    func endsBeforeINIT() {
        // The invalidator is set at mount; the source watch may queue
        // notices from then on; the sender starts with INIT. A daemon whose
        // session ended first waited for ever at unmount.
        let notices = EntryInvalidations()
        notices.setInvalidator { _, _, _ in }
        notices.changedBehind(parent: fuse_ino_t(1), name: Inode.copyName("made-behind"))
        notices.attributes(of: fuse_ino_t(1), wait: false)
        #expect(returns(within: 10) { notices.setInvalidator(nil) })
    }

    @Test("once started, every notice queued is sent, in order, before the session may go")
    func sendsAllBeforeGoing() {
        let notices = EntryInvalidations()
        let sent = Mutex<[String]>([])
        notices.setInvalidator { parent, name, _ in
            let text = name.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
            sent.withLock { $0.append("\(parent)/\(text)") }
        }
        notices.start()
        for i in 1...200 {
            notices.changedBehind(parent: fuse_ino_t(i), name: Inode.copyName("n\(i)"))
        }
        #expect(returns(within: 10) { notices.setInvalidator(nil) })
        #expect(sent.withLock { $0 } == (1...200).map { "\($0)/n\($0)" })
        // Nothing is queued once the invalidator is gone.
        notices.changedBehind(parent: fuse_ino_t(1), name: Inode.copyName("late"))
        #expect(sent.withLock { $0.count } == 200)
    }

    @Test("a notice held in the kernel (its parent's lock taken by another process) holds back only that parent's notices")
    func heldParent() {
        let notices = EntryInvalidations()
        let sent = Mutex<[String]>([])
        let release = DispatchSemaphore(value: 0)
        notices.setInvalidator { parent, name, _ in
            let text = name.isEmpty ? "" : name.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
            // As fuse_reverse_inval_entry waits for a directory lock someone holds.
            if parent == 7 && text == "held" { release.wait() }
            sent.withLock { $0.append("\(parent)/\(text)") }
        }
        notices.start()
        notices.changedBehind(parent: fuse_ino_t(7), name: Inode.copyName("held"))
        notices.changedBehind(parent: fuse_ino_t(7), name: Inode.copyName("after"))
        // Other parents' notices, waited for as a restore and a delete trigger wait.
        #expect(notices.send(parent: fuse_ino_t(8), name: Inode.copyName("restored"), by: 0, timeout: .seconds(30)))
        #expect(notices.expire(parent: fuse_ino_t(9), name: Inode.copyName("removed"), by: 0, timeout: .seconds(30)))
        for i in 10...50 { notices.changedBehind(parent: fuse_ino_t(i), name: Inode.copyName("n")) }
        notices.attributes(of: fuse_ino_t(51))
        let early = sent.withLock { $0 }
        #expect(early.contains("51/") && !early.contains("7/after"), "\(early)")
        release.signal()
        #expect(returns(within: 30) { notices.setInvalidator(nil) })
        let order = sent.withLock { $0 }
        #expect(order.count == 46)
        #expect(order.firstIndex(of: "7/held")! < order.firstIndex(of: "7/after")!, "\(order)")
    }

    @Test("one user's notices held in the kernel for many parents take at most four senders: another user's still go")
    func heldByOneUser() {
        let notices = EntryInvalidations()
        let gate = DispatchSemaphore(value: 0)
        let held = Mutex((now: 0, most: 0))
        let sent = Mutex<[fuse_ino_t]>([])
        notices.setInvalidator { parent, _, _ in
            if parent >= 100 {
                held.withLock { h in h.now += 1; h.most = max(h.most, h.now) }
                gate.wait()
                held.withLock { $0.now -= 1 }
            }
            sent.withLock { $0.append(parent) }
        }
        notices.start()
        // nobody's one-step deletes in 70 directories they hold.
        for i in 0..<70 {
            notices.deleted(parent: fuse_ino_t(100 + i), name: Inode.copyName("t"), child: 1, by: 65534)
        }
        // Root's restore elsewhere, and a change behind the mount by a process that is gone.
        #expect(notices.send(parent: fuse_ino_t(7), name: Inode.copyName("restored"), by: 0, timeout: .seconds(30)))
        #expect(notices.send(parent: fuse_ino_t(8), name: Inode.copyName("made"), by: EntryInvalidations.unknownUser,
                             timeout: .seconds(30)))
        #expect(notices.send(parent: fuse_ino_t(9), name: Inode.copyName("after"), by: 0, timeout: .seconds(30)))
        #expect(held.withLock { $0.most } <= EntryInvalidations.mostPerUser)
        for _ in 0..<70 { gate.signal() }
        #expect(returns(within: 30) { notices.setInvalidator(nil) })
        #expect(sent.withLock { $0.count } == 73)
    }

    /// A FUSE filesystem with one file, f, whose reads wait while HOLD exists.
    static let hangingFS = #"""
// A FUSE filesystem with one file, f, whose reads wait while HOLD exists:
// a page of it mapped into another call's buffer holds that call in the kernel.
#define FUSE_USE_VERSION 31
#include <fuse.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

static const char *hold, *reading;

static int hang_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof *st);
    if (strcmp(path, "/") == 0) { st->st_mode = S_IFDIR | 0755; st->st_nlink = 2; return 0; }
    if (strcmp(path, "/f") == 0) { st->st_mode = S_IFREG | 0644; st->st_nlink = 1; st->st_size = 4096; return 0; }
    return -ENOENT;
}

static int hang_open(const char *path, struct fuse_file_info *fi) {
    (void)fi;
    return strcmp(path, "/f") == 0 ? 0 : -ENOENT;
}

static int hang_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)path; (void)fi;
    int fd = open(reading, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
    while (access(hold, F_OK) == 0) usleep(10000);
    if (off >= 4096) return 0;
    size_t n = size < (size_t)(4096 - off) ? size : (size_t)(4096 - off);
    memset(buf, 0, n);
    return (int)n;
}

static const struct fuse_operations ops = { .getattr = hang_getattr, .open = hang_open, .read = hang_read };

int main(int argc, char *argv[]) {
    // hang MOUNTPOINT HOLD READING
    if (argc != 4) return 64;
    hold = argv[2];
    reading = argv[3];
    char *args[] = { argv[0], "-f", "-s", argv[1], NULL };
    return fuse_main(4, args, &ops, NULL);
}
"""#

    /// Reads DIR's entries into a private map of FILE's one page: the page
    /// fault waits for the read while getdents holds DIR's lock.
    static let holder = #"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
f = os.open(sys.argv[2], os.O_RDONLY)
m = mmap.mmap(f, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
buf = ctypes.addressof(ctypes.c_char.from_buffer(m))
print("ready", flush=True)
n = libc.syscall(217, d, ctypes.c_void_p(buf), 4096)
print("done", n, flush=True)
"""#

    static let asNobody = ["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]

    /// Runs `body` with nobody's hanging FUSE filesystem mounted in `work`:
    /// `page` is its file, whose reads wait while `hold` exists (removed, so
    /// every holder lets go, before the filesystem is unmounted); a read
    /// beginning makes `work/reading`.
    static func withHangingFS(_ body: (_ work: String, _ page: String, _ hold: String) throws -> Void) throws {
        try #require(which("cc") != nil && which("pkg-config") != nil, "cc and pkg-config (mount-scripts/install --deps-only)")
        let build = try makeTempDirectory()
        defer { removeTree(build) }
        try hangingFS.write(toFile: build + "/hang.c", atomically: true, encoding: .utf8)
        let cc = try run(["/bin/sh", "-c", "cc -O2 -o hang hang.c $(pkg-config --cflags --libs fuse3)"], cwd: build)
        try #require(cc.ok, "\(cc)")
        chmod(build, 0o755)
        let work = build + "/w", theirs = build + "/w/mnt", hold = build + "/w/hold"
        mkdir(work, 0o777)
        chmod(work, 0o777)
        mkdir(theirs, 0o755)
        chown(theirs, 65534, 65534)
        close(creat(hold, 0o644))
        let fs = try spawn(asNobody + [build + "/hang", theirs, hold, work + "/reading"])
        defer {
            unlink(hold)
            _ = try? run(["fusermount3", "-u", theirs])
            kill(fs, SIGTERM)
            var st: Int32 = 0
            waitpid(fs, &st, 0)
        }
        try waitFor("nobody's FUSE mount") {
            (try? String(contentsOfFile: "/proc/self/mountinfo", encoding: .utf8))?.contains(" \(theirs) ") == true
        }
        try body(work, theirs + "/f", hold)
    }

    /// Runs nobody's `script` with `arguments` until `body` returns, then lets its holds go.
    static func holding(_ script: String, in work: String, _ arguments: [String], hold: String,
                        _ body: (pid_t) throws -> Void) throws {
        try script.write(toFile: work + "/hold.py", atomically: true, encoding: .utf8)
        let holder = try spawn(asNobody + ["/usr/bin/python3", work + "/hold.py"] + arguments)
        defer {
            unlink(hold)
            var st: Int32 = 0
            waitpid(holder, &st, 0)
        }
        try body(holder)
    }

    @Test("nobody holding a directory's lock (getdents into a page of their own FUSE mount that never comes) holds back no notice for another directory")
    func heldDirectoryOnAMount() throws {
        try Self.withHangingFS { work, page, hold in
            try withVanishMount(options: ["allow_other"], prepare: { src in
                let r = try sh("install -d -o nobody nd nd/t1 && mkdir rt", cwd: src)
                guard r.ok else { throw TestFailure(r.stderr) }
            }) { m in
                try Self.holding(Self.holder, in: work, [m.path("nd"), page], hold: hold) { _ in
                    try waitFor("nobody's getdents to hold nd") { access(work + "/reading", F_OK) == 0 }
                    // The kernel now remembers rt/ext as absent.
                    #expect(access(m.path("rt/ext"), F_OK) != 0)
                    // nobody's one-step delete in nd: its notice waits for nd's lock (the
                    // trigger answers after its own wait for it ends).
                    let trigger = try runAsNobody(deleteTriggerCommand + [m.path("nd/t1")])
                    #expect(trigger.ok, "\(trigger)")
                    // A file made on the source in root's directory shows through the mount.
                    try "e\n".write(toFile: m.backing("rt/ext"), atomically: false, encoding: .utf8)
                    try waitFor("rt/ext to show while nd is held", timeout: 30) { access(m.path("rt/ext"), F_OK) == 0 }
                    // And root's own one-step delete elsewhere is told to the kernel at once.
                    #expect(mkdir(m.path("rt/x"), 0o755) == 0)
                    let rootTrigger = try run(deleteTriggerCommand + [m.path("rt/x")])
                    #expect(rootTrigger.ok, "\(rootTrigger)")
                    #expect(access(m.path("rt/x"), F_OK) != 0)
                }
            }
        }
    }

    /// Holds every directory named: a private map of FILE's page per
    /// directory, made first, then a thread each reading its directory's
    /// entries into its page (they all wait for the one read of the page).
    static let manyHolder = #"""
    import ctypes, mmap, os, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)
    page, dirs = sys.argv[1], sys.argv[2:]
    held = []
    for d in dirs:
        f = os.open(page, os.O_RDONLY)
        m = mmap.mmap(f, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        held.append((os.open(d, os.O_RDONLY | os.O_DIRECTORY), m, ctypes.addressof(ctypes.c_char.from_buffer(m))))
    threads = [threading.Thread(target=libc.syscall, args=(217, fd, ctypes.c_void_p(a), 4096)) for fd, _, a in held]
    for t in threads: t.start()
    for t in threads: t.join()
    """#

    @Test("nobody holding 70 directories their own one-step deletes changed holds back no notice of root's")
    func manyHeldDirectoriesOnAMount() throws {
        let count = 70
        try Self.withHangingFS { work, page, hold in
            try withVanishMount(options: ["allow_other"], prepare: { src in
                let r = try sh("install -d -o nobody nd && for i in $(seq \(count)); do install -d -o nobody nd/h$i nd/h$i/t; done && mkdir rt",
                               cwd: src)
                guard r.ok else { throw TestFailure(r.stderr) }
            }) { m in
                let dirs = (1...count).map { m.path("nd/h\($0)") }
                try Self.holding(Self.manyHolder, in: work, [page] + dirs, hold: hold) { holder in
                    // Every thread waits in the kernel (state D), each holding its directory.
                    try waitFor("nobody's \(count) getdents to hold their directories", timeout: 30) {
                        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(holder)/task")) ?? []
                        let waiting = tasks.filter { tid in
                            let stat = (try? String(contentsOfFile: "/proc/\(holder)/task/\(tid)/stat", encoding: .utf8)) ?? ""
                            return stat.split(separator: ")").last?.split(separator: " ").first == "D"
                        }
                        return waiting.count >= count
                    }
                    #expect(access(m.path("rt/ext"), F_OK) != 0)
                    // nobody's one-step delete in each: their notices wait for the directories they hold.
                    let triggers = try runAsNobody(["/usr/bin/python3", "-c", """
                        import os, sys, threading
                        def trigger(p):
                            try: os.setxattr(p, "user.vanish.delete", b"", os.XATTR_CREATE | os.XATTR_REPLACE)
                            except OSError as e: print(p, e)
                        ts = [threading.Thread(target=trigger, args=(d + "/t",)) for d in sys.argv[1:]]
                        for t in ts: t.start()
                        for t in ts: t.join()
                        """] + dirs)
                    #expect(triggers.ok && triggers.stdout.isEmpty, "\(triggers)")
                    // Root's file made on the source shows through the mount.
                    try "e\n".write(toFile: m.backing("rt/ext"), atomically: false, encoding: .utf8)
                    try waitFor("rt/ext to show while nobody holds \(count) directories", timeout: 30) {
                        access(m.path("rt/ext"), F_OK) == 0
                    }
                }
            }
        }
    }
}

