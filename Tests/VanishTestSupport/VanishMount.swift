import CLinux
import Foundation
import Glibc
import Synchronization

/// Whether FUSE tests can run here. Under CI=true they always run, so a
/// missing /dev/fuse or fusermount3 fails the run instead of skipping it.
public enum FUSEAvailability {
    public static var isCI: Bool { ProcessInfo.processInfo.environment["CI"] == "true" }
    public static var hasDevice: Bool { access("/dev/fuse", R_OK | W_OK) == 0 }
    public static var hasFusermount: Bool { which("fusermount3") != nil }
    /// The reason FUSE tests cannot run, or nil.
    public static var missing: String? {
        if !hasDevice { return "/dev/fuse is missing or not usable" }
        if !hasFusermount { return "fusermount3 is not installed (apt-get install fuse3)" }
        return nil
    }
    /// For `.enabled(if:)`: run when usable, and always under CI.
    public static var shouldRun: Bool { missing == nil || isCI }
    public static var isRoot: Bool { geteuid() == 0 }
    /// For tests that switch users or mount other filesystems; CI runs as root.
    public static var shouldRunAsRoot: Bool { (missing == nil && isRoot) || isCI }
}

public struct TestFailure: Error, CustomStringConvertible {
    public var description: String
    public init(_ d: String) { description = d }
}

/// Finds a program on PATH.
public func which(_ name: String) -> String? {
    for dir in (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin:/bin").split(separator: ":") {
        let p = "\(dir)/\(name)"
        if access(p, X_OK) == 0 { return p }
    }
    return nil
}

/// The vanish binary built next to the test bundle (or $VANISH_BINARY).
public var vanishBinary: String {
    if let b = ProcessInfo.processInfo.environment["VANISH_BINARY"] { return b }
    let exe = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? ""
    var dir = URL(fileURLWithPath: exe).deletingLastPathComponent()
    // swift test on Linux runs .build/<config>/<Package>PackageTests.xctest
    if dir.lastPathComponent.hasSuffix(".xctest") { dir = dir.deletingLastPathComponent() }
    return dir.appendingPathComponent("vanish").path
}

/// The delete trigger as any program sets it (`vanish rm` aside): the
/// attribute with XATTR_CREATE and XATTR_REPLACE together, for PATH as the
/// last argument. (`setfattr` cannot pass flags: set by it, the name is data.)
public let deleteTriggerCommand = ["/usr/bin/python3", "-c", """
    import os, sys
    try: os.setxattr(sys.argv[1], "user.vanish.delete", b"", os.XATTR_CREATE | os.XATTR_REPLACE)
    except OSError as e: sys.exit(f"{sys.argv[1]}: {e.strerror}")
    """]

/// `deleteTriggerCommand` as a shell function `trigger PATH`, to put before a script.
public var deleteTriggerFunction: String {
    "trigger() { " + deleteTriggerCommand.map(shellQuote).joined(separator: " ") + " \"$1\"; }\n"
}

/// A fresh temporary directory, removed by `removeTree`.
public func makeTempDirectory(_ prefix: String = "vanish-test") throws -> String {
    var template = Array("/tmp/\(prefix).XXXXXX".utf8CString)
    guard mkdtemp(&template) != nil else { throw TestFailure("mkdtemp failed: \(errno)") }
    return String(decoding: template.dropLast().map { UInt8(bitPattern: $0) }, as: UTF8.self)
}

/// Removes a test directory; refuses to descend into anything still mounted.
public func removeTree(_ path: String) {
    if let t = mountType(at: path) { print("not removing \(path): a \(t) mount is still there"); return }
    removeOutsideState(of: path)
    try? FileManager.default.removeItem(atPath: path)
    // FileManager goes by path and gives up below PATH_MAX (the deep-tree
    // tests make 3,000 levels), and no one may remove an immutable or
    // append-only file a test left: clear those flags, then rm, fd-relative.
    if access(path, F_OK) == 0 {
        _ = try? run(["chattr", "-R", "-f", "-i", "-a", path])
        _ = try? run(["rm", "-rf", "--one-file-system", path])
    }
}

/// A temporary directory holding empty `src` and `mnt` directories: (base, src, mnt).
public func makeSourceAndMountpoint() throws -> (String, String, String) {
    let base = try makeTempDirectory()
    guard mkdir(base + "/src", 0o755) == 0 && mkdir(base + "/mnt", 0o755) == 0 else {
        removeTree(base)
        throw TestFailure("cannot make src and mnt in \(base)")
    }
    return (base, base + "/src", base + "/mnt")
}

/// The state directories in-place mounts of sources at or below `path` made
/// outside them (StateLocation: each names its source in a SOURCE file),
/// which would outlive the test's temporary directory.
public func removeOutsideState(of path: String) {
    let bases = ["/var/lib/vanish/in-place", "/.vanish-in-place", "/tmp/.vanish-in-place",
                 NSHomeDirectory() + "/.local/state/vanish/in-place"]
    for base in bases {
        for key in (try? FileManager.default.contentsOfDirectory(atPath: base)) ?? [] {
            let dir = base + "/" + key
            guard let source = try? String(contentsOfFile: dir + "/SOURCE", encoding: .utf8),
                  case let s = source.trimmingCharacters(in: .newlines), s == path || s.hasPrefix(path + "/") else { continue }
            try? FileManager.default.removeItem(atPath: dir)
        }
    }
}

/// Waits for `condition` to hold, checking every few milliseconds, up to `timeout` seconds.
public func waitFor(_ what: String, timeout: Double = 15, _ condition: () throws -> Bool) throws {
    let deadline = Date().addingTimeInterval(timeout)
    while Date() < deadline {
        if try condition() { return }
        usleep(5_000)
    }
    throw TestFailure("timed out after \(timeout)s waiting for \(what)")
}

/// Runs `body` while libfuse splices requests in instead of reading them:
/// it does so only while a pipe may hold its whole 1 MiB buffer, past the
/// default pipe-max-size, so that limit is raised meanwhile (root only). The
/// setting is the machine's: tests running at once share one raise, and the
/// last to finish puts the old value back.
public func withSplicedRequests<R>(_ body: () throws -> R) throws -> R {
    let knob = "/proc/sys/fs/pipe-max-size"
    try splicedRequests.withLock { state in
        if state.users == 0 {
            state.saved = try String(contentsOfFile: knob, encoding: .utf8)
            try "4194304\n".write(toFile: knob, atomically: false, encoding: .utf8)
        }
        state.users += 1
    }
    defer {
        splicedRequests.withLock { state in
            state.users -= 1
            if state.users == 0, let saved = state.saved {
                try? saved.write(toFile: knob, atomically: false, encoding: .utf8)
            }
        }
    }
    return try body()
}

private let splicedRequests = Mutex<(users: Int, saved: String?)>((0, nil))

/// Stops `pid` with SIGSTOP and waits until every one of its threads has
/// stopped: the stop reaches each thread only when it next runs, and a
/// thread that had not yet stopped may still answer a request meanwhile.
public func stopProcess(_ pid: pid_t) throws {
    kill(pid, SIGSTOP)
    try waitFor("every thread of \(pid) to stop") {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? []
        return !tasks.isEmpty && tasks.allSatisfy { task in
            // The state is the field after the parenthesised command name.
            guard let stat = try? String(contentsOfFile: "/proc/\(pid)/task/\(task)/stat", encoding: .utf8),
                  let close = stat.lastIndex(of: ")") else { return true }  // the thread has exited
            return stat[stat.index(close, offsetBy: 2)...].first == "T"
        }
    }
}

/// The mount type at `path` in /proc/self/mountinfo, or nil.
public func mountType(at path: String) -> String? {
    mounts().last { $0.point == path }?.type
}

/// Mount points strictly below `path`, deepest first (what a test mounted
/// inside its source: a tmpfs, a nested Vanish).
public func mountPoints(below path: String) -> [String] {
    mounts().map(\.point).filter { $0.hasPrefix(path + "/") }.sorted { $0.count > $1.count }
}

/// (mount point, type) for each line of /proc/self/mountinfo, in mount order.
private func mounts() -> [(point: String, type: String)] {
    guard let text = try? String(contentsOfFile: "/proc/self/mountinfo", encoding: .utf8) else { return [] }
    return text.split(separator: "\n").compactMap { line in
        let f = line.split(separator: " ")
        guard f.count > 7, let dash = f.firstIndex(of: "-"), dash + 1 < f.count else { return nil }
        return (unescapeMountField(f[4]), String(f[dash + 1]))
    }
}

/// mountinfo writes space, tab, newline and backslash as octal escapes (`\040`).
private func unescapeMountField(_ field: Substring) -> String {
    var out: [UInt8] = []
    let b = Array(field.utf8)
    var i = 0
    while i < b.count {
        if b[i] == 0x5C, i + 3 < b.count, let v = UInt8(String(decoding: b[(i + 1)...(i + 3)], as: UTF8.self), radix: 8) {
            out.append(v)
            i += 4
        } else {
            out.append(b[i])
            i += 1
        }
    }
    return String(decoding: out, as: UTF8.self)
}

/// The pids of `vanish` daemons serving `mountpoint` (found by their
/// command line: a daemon another user started is not our child).
public func vanishDaemons(serving mountpoint: String) -> [pid_t] {
    guard let entries = try? FileManager.default.contentsOfDirectory(atPath: "/proc") else { return [] }
    return entries.compactMap { name -> pid_t? in
        guard let pid = pid_t(name),
              let raw = FileManager.default.contents(atPath: "/proc/\(name)/cmdline") else { return nil }
        let args = raw.split(separator: 0).map { String(decoding: $0, as: UTF8.self) }
        guard args.contains("mount"), args.last == mountpoint,
              args.first.map({ $0.hasSuffix("/vanish") || $0 == "vanish" }) == true else { return nil }
        return pid
    }
}

/// Cleanup for a test that mounted with the daemonizing `vanish mount`
/// (the daemon is not our child): unmounts if still mounted, waits for the
/// daemon to finish (it empties the graveyard after an unmount, writing in
/// the source), killing it if it hangs, then removes `base`.
public func unmountAndRemove(_ mountpoint: String, base: String, timeout: Double = 20) {
    let pids = vanishDaemons(serving: mountpoint)
    // Mounts may stack (a test of what must refuse to): take off every one.
    for _ in 0..<8 where mountType(at: mountpoint) != nil { _ = try? run(["fusermount3", "-uz", mountpoint]) }
    let gone = { pids.allSatisfy { kill($0, 0) != 0 && errno == ESRCH } }
    if (try? waitFor("vanish daemons \(pids) to exit", timeout: timeout, gone)) == nil {
        for pid in pids { kill(pid, SIGKILL) }
        _ = try? waitFor("killed vanish daemons to go", timeout: 5, gone)
    }
    removeTree(base)
}

/// Result of a finished process.
public struct ProcessResult: Sendable {
    public var status: Int32
    public var stdout: String
    public var stderr: String
    public var ok: Bool { status == 0 }
}

/// Runs a program and waits for it. Output goes through temporary files
/// (no pipe can fill up), and the child starts with an empty signal mask
/// and default handlers: Foundation's Process passes on the test runner's
/// blocked SIGCHLD, which makes a shell's `wait` hang forever.
@discardableResult
public func run(_ args: [String], cwd: String? = nil, environment: [String: String]? = nil,
                input: String? = nil) throws -> ProcessResult {
    let dir = try makeTempDirectory("vanish-run")
    defer { removeTree(dir) }
    let inPath = dir + "/in", outPath = dir + "/out", errPath = dir + "/err"
    try (input ?? "").write(toFile: inPath, atomically: false, encoding: .utf8)
    var script = "exec <" + shellQuote(inPath) + " >" + shellQuote(outPath) + " 2>" + shellQuote(errPath) + "; "
    if let cwd { script += "cd " + shellQuote(cwd) + " || exit 127; " }
    script += "exec " + args.map(shellQuote).joined(separator: " ")
    var env = ProcessInfo.processInfo.environment
    if let environment { env.merge(environment) { $1 } }
    let pid = try spawn(["/bin/sh", "-c", script], environment: env)
    var status: Int32 = 0
    while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
    let code = (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
    return ProcessResult(status: code,
                         stdout: (try? String(contentsOfFile: outPath, encoding: .utf8)) ?? "",
                         stderr: (try? String(contentsOfFile: errPath, encoding: .utf8)) ?? "")
}

/// Runs a shell script with `sh -c`.
@discardableResult
public func sh(_ script: String, cwd: String? = nil, environment: [String: String]? = nil) throws -> ProcessResult {
    try run(["/bin/sh", "-c", script], cwd: cwd, environment: environment)
}

/// A real Vanish mount in a temporary directory, served by the built
/// `vanish` binary in the foreground. `close()` (also called from deinit)
/// unmounts and reaps the daemon whatever happened in the test.
public final class VanishMount {
    public let base: String
    public let source: String
    public let mountpoint: String
    public let logPath: String
    public private(set) var pid: pid_t = 0
    private var closed = false

    /// - Parameters:
    ///   - options: `-o` items.
    ///   - arguments: further `vanish mount` arguments.
    ///   - inPlace: mount the source over itself.
    ///   - fileLimit: run the daemon under `ulimit -n` of this value.
    ///   - prepare: fills the source before mounting.
    ///   - existingSource: mount this directory instead of a fresh one (it is not removed).
    public init(options: [String] = [], arguments: [String] = [], inPlace: Bool = false, fileLimit: Int? = nil,
                existingSource: String? = nil, prepare: ((String) throws -> Void)? = nil) throws {
        if let why = FUSEAvailability.missing { throw TestFailure("FUSE tests cannot run: \(why)") }
        base = try makeTempDirectory()
        source = existingSource ?? base + "/source"
        mountpoint = inPlace ? source : base + "/mnt"
        logPath = base + "/vanish.log"
        if existingSource == nil { mkdir(source, 0o755) }
        if !inPlace { mkdir(mountpoint, 0o755) }
        chmod(base, 0o755)
        do {
            try prepare?(source)
            var cmd = [vanishBinary, "mount", "-f"]
            if !options.isEmpty { cmd += ["-o", options.joined(separator: ",")] }
            cmd += arguments
            cmd += inPlace ? [source] : [source, mountpoint]
            var script = "exec " + cmd.map(shellQuote).joined(separator: " ") + " </dev/null >" + shellQuote(logPath) + " 2>&1"
            if let fileLimit { script = "ulimit -n \(fileLimit) && " + script }
            pid = try spawn(["/bin/sh", "-c", script])
            try waitFor("the mount at \(mountpoint)") {
                if mountType(at: mountpoint) == "fuse.vanish" { return true }
                var status: Int32 = 0
                if waitpid(pid, &status, WNOHANG) == pid {
                    pid = 0
                    throw TestFailure("vanish exited before mounting: \(log)")
                }
                return false
            }
        } catch {
            close()
            throw error
        }
    }

    deinit { close() }

    /// What the daemon wrote to stderr.
    public var log: String { (try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "" }

    /// Waits until the daemon's log says `text` (the session's own lines
    /// come with the kernel's INIT, which may follow the mount).
    public func waitForLog(_ text: String, timeout: Double = 15) throws {
        try waitFor("the log to say \(text)", timeout: timeout) { log.contains(text) }
    }

    public func path(_ relative: String) -> String { mountpoint + "/" + relative }
    public func backing(_ relative: String) -> String { source + "/" + relative }

    /// Unmounts with fusermount3 and returns the daemon's exit status. `lazy`
    /// detaches a mount that a path lookup in flight still holds, which a plain
    /// unmount refuses with EBUSY.
    @discardableResult
    public func unmount(lazy: Bool = false, timeout: Double = 20) throws -> Int32 {
        let r = try run(["fusermount3", lazy ? "-uz" : "-u", mountpoint])
        guard r.ok else { throw TestFailure("fusermount3 \(lazy ? "-uz" : "-u") failed: \(r.stderr)") }
        return try waitForExit(timeout: timeout)
    }

    /// Waits for the daemon to exit and returns its exit status (128+signal if killed).
    public func waitForExit(timeout: Double = 20) throws -> Int32 {
        guard pid > 0 else { throw TestFailure("daemon already reaped") }
        var status: Int32 = 0
        try waitFor("vanish (pid \(pid)) to exit", timeout: timeout) { waitpid(pid, &status, WNOHANG) == pid }
        pid = 0
        return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
    }

    /// Tears everything down; safe to call more than once.
    public func close() {
        guard !closed else { return }
        closed = true
        if mountType(at: mountpoint) != nil { _ = try? run(["fusermount3", "-u", mountpoint]) }
        if pid > 0 {
            var status: Int32 = 0
            if (try? waitFor("daemon exit", timeout: 10, { waitpid(pid, &status, WNOHANG) == pid })) == nil {
                kill(pid, SIGKILL)
                waitpid(pid, &status, 0)
            }
            pid = 0
        }
        for _ in 0..<8 where mountType(at: mountpoint) != nil { _ = try? run(["fusermount3", "-uz", mountpoint]) }
        // What the test mounted in the source (a tmpfs) would keep its
        // directory, and so `base`, from being removed.
        for p in mountPoints(below: base) { _ = try? run(["umount", "-l", p]) }
        removeTree(base)
    }
}

/// `withVanishMount` over a fresh tmpfs of `size` as the source (root
/// only): for tests of space, which statfs must see apart from the rest of
/// the machine. The tmpfs goes with the mount, also when the test fails.
public func withVanishMountOnTmpfs<R>(size: String, options: [String] = [], arguments: [String] = [],
                                      prepare: ((String) throws -> Void)? = nil,
                                      _ body: (VanishMount) throws -> R) throws -> R {
    var tmpfs = ""
    defer { if !tmpfs.isEmpty { _ = try? run(["umount", "-l", tmpfs]) } }
    return try withVanishMount(options: options, arguments: arguments, prepare: { src in
        tmpfs = src
        let r = try run(["mount", "-t", "tmpfs", "-o", "size=\(size)", "tmpfs", src])
        guard r.ok else { throw TestFailure("mounting a tmpfs source: \(r.stderr)") }
        try prepare?(src)
    }, body)
}

/// Entries waiting in the source's graveyard (on the backing filesystem).
public func graveyardCount(_ source: String) throws -> Int {
    let r = try sh("find .vanish/clients/*/graveyard -mindepth 2 -maxdepth 2 | wc -l", cwd: source)
    return Int(r.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? -1
}

/// `vanish status --json` of the mount, parsed (a failure if it is not a JSON object).
public func statusJSON(_ m: VanishMount) throws -> [String: Any] { try statusJSON(path: m.mountpoint) }

/// `vanish status --json` of the mount at `path`, parsed.
public func statusJSON(path: String) throws -> [String: Any] {
    let r = try run([vanishBinary, "status", "--json", path])
    guard r.ok, let json = try JSONSerialization.jsonObject(with: Data(r.stdout.utf8)) as? [String: Any] else {
        throw TestFailure("vanish status --json: \(r.stdout)\(r.stderr)")
    }
    return json
}

/// `vanish status --wait`: returns once the reaper has emptied the graveyard
/// (a failure, not a hung suite, if it never does).
public func waitForReaper(_ m: VanishMount, timeout: Int = 180) throws {
    let r = try run(["timeout", "\(timeout)", vanishBinary, "status", "--wait", m.mountpoint])
    if r.status == 124 { throw TestFailure("status --wait still waiting after \(timeout) s") }
    guard r.ok else { throw TestFailure("status --wait failed: \(r.stderr)") }
}

/// Bytes an ordinary user may still write on the filesystem holding `path`.
public func freeBytes(_ path: String) -> UInt64 {
    var st = statvfs()
    statvfs(path, &st)
    return UInt64(st.f_bavail) * UInt64(st.f_frsize)
}

/// Mounts, runs `body`, and always cleans up.
public func withVanishMount<R>(options: [String] = [], arguments: [String] = [], inPlace: Bool = false,
                               fileLimit: Int? = nil, prepareExisting existingSource: String? = nil,
                               prepare: ((String) throws -> Void)? = nil,
                               _ body: (VanishMount) throws -> R) throws -> R {
    let m = try VanishMount(options: options, arguments: arguments, inPlace: inPlace, fileLimit: fileLimit,
                            existingSource: existingSource, prepare: prepare)
    defer { m.close() }
    return try body(m)
}

public func shellQuote(_ s: String) -> String { "'" + s.replacingOccurrences(of: "'", with: "'\\''") + "'" }

/// posix_spawn without waiting, with an empty signal mask and default
/// signal handlers; the caller reaps.
public func spawn(_ args: [String], environment: [String: String]? = nil) throws -> pid_t {
    var pid: pid_t = 0
    let argv = args.map { strdup($0) } + [nil]
    defer { argv.forEach { free($0) } }
    let envStrings = (environment ?? ProcessInfo.processInfo.environment).map { strdup("\($0.key)=\($0.value)") } + [nil]
    defer { envStrings.forEach { free($0) } }
    var attr = posix_spawnattr_t()
    posix_spawnattr_init(&attr)
    defer { posix_spawnattr_destroy(&attr) }
    var none = sigset_t(), all = sigset_t()
    sigemptyset(&none)
    sigfillset(&all)
    posix_spawnattr_setsigmask(&attr, &none)
    posix_spawnattr_setsigdefault(&attr, &all)
    posix_spawnattr_setflags(&attr, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
    // Tests run in parallel in one process: without this, a descriptor
    // another test holds open inside its mount leaks into this child, and
    // that mount's unmount fails with EBUSY for as long as the child lives.
    var actions = posix_spawn_file_actions_t()
    posix_spawn_file_actions_init(&actions)
    defer { posix_spawn_file_actions_destroy(&actions) }
    vanish_spawn_closefrom(&actions, 3)
    let rc = posix_spawn(&pid, args[0], &actions, &attr, argv, envStrings)
    guard rc == 0 else { throw TestFailure("spawn \(args[0]) failed: \(rc)") }
    return pid
}

/// Runs a program as nobody:nogroup with no supplementary groups.
@discardableResult
public func runAsNobody(_ args: [String], cwd: String? = nil, environment: [String: String]? = nil) throws -> ProcessResult {
    try run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"] + args, cwd: cwd,
            environment: environment)
}

/// For a daemon run as nobody: a runtime directory of nobody's in `base`
/// (removed with it), as XDG_RUNTIME_DIR. nobody has none of its own, and
/// its daemon would otherwise leave /tmp/vanish-UID behind for its socket.
public func nobodyRuntimeDirectory(in base: String) throws -> [String: String] {
    let dir = base + "/run"
    mkdir(dir, 0o700)
    guard try run(["chown", "nobody:nogroup", dir]).ok else { throw TestFailure("chown \(dir) failed") }
    return ["XDG_RUNTIME_DIR": dir]
}

/// Runs `body` with /dev/fuse usable by every user, as Debian's udev rule
/// makes it (0666); some images leave it 0600. The old mode is put back.
public func withFUSEDeviceOpenToAll<R>(_ body: () throws -> R) rethrows -> R {
    var st = stat()
    stat("/dev/fuse", &st)
    let oldMode = st.st_mode & 0o777
    if oldMode != 0o666 { chmod("/dev/fuse", 0o666) }
    defer { if oldMode != 0o666 { chmod("/dev/fuse", oldMode) } }
    return try body()
}

/// Runs `body` with the directory where a fresh filesystem of `type`
/// (`ext4`, `xfs`) is mounted from a loop device (root only): for tests of
/// what depends on the backing filesystem. It is unmounted and its image
/// removed afterwards, also when the test fails.
public func withLoopFilesystem<R>(_ type: String, size: String = "320M", _ body: (String) throws -> R) throws -> R {
    let base = try makeTempDirectory("vanish-test-loop")
    let image = base + "/image", dir = base + "/fs"
    mkdir(dir, 0o755)
    defer {
        for _ in 0..<4 where mountType(at: dir) != nil { _ = try? run(["umount", "-l", dir]) }
        removeTree(base)
    }
    let make = type == "xfs" ? ["mkfs.xfs", "-q", "-f", image] : ["mkfs.\(type)", "-q", "-F", image]
    for step in [["truncate", "-s", size, image], make, ["mount", "-o", "loop", image, dir]] {
        let r = try run(step)
        guard r.ok else { throw TestFailure("\(step.joined(separator: " ")): \(r.stderr)") }
    }
    return try body(dir)
}

/// The lock file a mount or `vanish reap` of `source` holds (MountPaths.lockPath,
/// for root, who runs these tests): `flock -n` on it succeeds once the daemon let go.
public func sourceLock(_ source: String) -> String {
    var st = stat()
    stat(source, &st)
    return "/run/vanish/locks/\(st.st_dev)-\(st.st_ino)"
}

/// Runs `body` while a process of nobody's exchanges `a` and `b` in the
/// directory `dir` (a path on the source) in a loop with
/// `renameat2(RENAME_EXCHANGE)`, as an attacker racing the daemon's calls
/// would; the loop ends (and is waited for) when `body` does. `scratch`
/// holds its script and stop file.
public func whileNobodyExchanges(_ a: String, _ b: String, in dir: String, scratch: String,
                                 _ body: () throws -> Void) throws {
    let script = scratch + "/exchange.py"
    try """
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        os.chdir(sys.argv[1])
        a, b = sys.argv[3].encode(), sys.argv[4].encode()
        while not os.path.exists(sys.argv[2]):
            libc.renameat2(-100, a, -100, b, 2)  # RENAME_EXCHANGE
        """.write(toFile: script, atomically: true, encoding: .utf8)
    let stop = scratch + "/stop-exchanging"
    let attacker = try spawn(["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                              "/usr/bin/python3", script, dir, stop, a, b])
    defer {
        _ = FileManager.default.createFile(atPath: stop, contents: nil)
        var status: Int32 = 0
        waitpid(attacker, &status, 0)
    }
    try body()
}

/// `vanish trash list --json` of the mount, one object per entry.
public func trashList(_ m: VanishMount) throws -> [[String: Any]] {
    let r = try run([vanishBinary, "trash", "list", "--json", m.mountpoint])
    guard r.ok else { throw TestFailure("trash list failed: \(r.stderr)") }
    return r.stdout.split(separator: "\n").compactMap {
        (try? JSONSerialization.jsonObject(with: Data($0.utf8))) as? [String: Any]
    }
}

/// The paths of the mount's kept entries, sorted.
public func trashPaths(_ m: VanishMount) throws -> [String] {
    try trashList(m).compactMap { $0["path"] as? String }.sorted()
}

/// Runs `body` with `owner:first:count` added to /etc/subuid, as useradd
/// writes an account's subordinate range; the file is put back after.
/// Mount inside `body`: a daemon reads the file when it first needs it.
/// One test at a time (a lock file), as tests run in parallel.
public func withSubordinateRange<R>(owner: uid_t, first: uid_t, count: UInt32, _ body: () throws -> R) throws -> R {
    let lock = open("/tmp/vanish-test-subuid.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
    guard lock >= 0 else { throw TestFailure("cannot open the /etc/subuid test lock") }
    defer { close(lock) }
    while flock(lock, LOCK_EX) != 0 && errno == EINTR {}
    let original = try? String(contentsOfFile: "/etc/subuid", encoding: .utf8)
    defer {
        if let original { try? original.write(toFile: "/etc/subuid", atomically: true, encoding: .utf8) }
        else { unlink("/etc/subuid") }
    }
    try ((original ?? "") + "\(owner):\(first):\(count)\n").write(toFile: "/etc/subuid", atomically: true, encoding: .utf8)
    return try body()
}
