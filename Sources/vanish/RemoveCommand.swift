import ArgumentParser
import CLinux
import Glibc
import VanishClient

struct RemoveCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "rm",
        abstract: "rm, with each tree inside a Vanish mount removed in one step whatever its size.",
        discussion: """
            A drop-in for coreutils rm (alias rm='vanish rm' is safe on any path): it takes rm's \
            options and operands. With -r (and neither -i, -I nor -v), a directory inside a Vanish \
            mount goes to the graveyard with one rename made with the caller's rights (the xattr \
            trigger user.vanish.delete, set with XATTR_CREATE|XATTR_REPLACE, which any program can \
            set too), and the reaper frees the \
            data later; moments later, what rm -r by the caller would have left (entries they may \
            not remove, and the directories on their paths) is put back where it was. Everything \
            else, on a Vanish mount or not, is removed by /bin/rm with the same options: files \
            (an unlink on a Vanish mount is the same single rename), prompts (also a tree holding \
            an entry the caller may not write, when run from a terminal without -f: rm asks about \
            it), -v, -d and a mount's root. A tree with a filesystem mounted inside is refused (EBUSY).
            """
    )

    @Flag(name: [.customShort("r"), .customShort("R"), .long], help: "Remove directories and their contents.")
    var recursive = false

    @Flag(name: .shortAndLong, help: "Ignore operands that do not exist; never prompt.")
    var force = false

    @Flag(name: .customShort("i"), help: "Prompt before every removal (rm removes then, entry by entry).")
    var interactive = false

    @Flag(name: .customShort("I"), help: "Prompt once before removing more than three files or recursively (rm, as -i).")
    var interactiveOnce = false

    @Flag(name: [.customShort("d"), .customLong("dir")], help: "Remove empty directories (rm).")
    var emptyDirectories = false

    @Flag(name: .shortAndLong, help: "Say what is removed (rm removes then, entry by entry).")
    var verbose = false

    @Flag(name: .customLong("one-file-system"), help: "As rm: skip directories on other filesystems.")
    var oneFileSystem = false

    @Flag(name: .customLong("preserve-root"), help: "As rm: do not remove / (the default).")
    var preserveRoot = false

    @Flag(name: .customLong("no-preserve-root"), help: "As rm: do not treat / specially.")
    var noPreserveRoot = false

    @Option(name: .customLong("interactive"), help: ArgumentHelp(
        "As rm: prompt never, once (as -I) or always (as -i); rm takes --interactive alone as always.",
        valueName: "when"))
    var interactiveWhen: String?

    @Flag(help: ArgumentHelp("""
        Wait until what was removed in one step is freed (or kept by the undo window) and what rm -r \
        would have left is back, then report each entry left as rm does, with exit status 1.
        """))
    var wait = false

    @Argument(help: "What to remove.")
    var paths: [String] = []

    /// Reached only for what `RmInvocation` leaves to the parser (--help, --version).
    func run() throws {
        let code = RemoveCommand.dropIn(RmInvocation(CommandLine.arguments.dropFirst(2)) ?? RmInvocation())
        if code != 0 { throw ExitCode(code) }
    }

    /// `vanish rm ARGS`, parsed as coreutils rm parses them, before the
    /// argument parser (whose first dynamic casts cost ~5 ms of a ~7 ms
    /// `vanish rm`). nil for --help and --version, which the parser answers.
    static func fastPath(_ arguments: ArraySlice<String>) -> Int32? {
        guard arguments.first == "rm", let invocation = RmInvocation(arguments.dropFirst()) else { return nil }
        return dropIn(invocation)
    }

    /// The operands removed in one step, then everything else by /bin/rm
    /// with the same options (by exec when nothing is Vanish's, so prompts,
    /// messages and the exit status are rm's own). The exit status: rm's,
    /// or 1 if a one-step removal failed.
    static func dropIn(_ r: RmInvocation) -> Int32 {
        let oneStep = r.recursive && !r.asks && !r.verbose && !r.unknownOption
        // rm run from a terminal asks before each write-protected entry
        // (not root, whom modes do not stop): such a tree is rm's to remove.
        let asksIfProtected = oneStep && !r.neverAsks && isatty(0) == 1 && geteuid() != 0
        var forRm: [String] = []
        var removed: [String] = []
        var code: Int32 = 0
        for operand in r.operands {
            guard oneStep, isTree(operand), !(asksIfProtected && WriteProtection.found(in: operand)) else {
                forRm.append(operand)
                continue
            }
            do {
                try remove(operand, recursive: true, force: r.force)
                removed.append(operand)
            } catch is NotOnVanish {
                forRm.append(operand)
            } catch let e as Refused where e.errno == EBUSY && MountPaths.mountType(at: MountPaths.lexicallyAbsolute(operand)) != nil {
                // A mount's root: rm -r empties it entry by entry; so does rm here.
                forRm.append(operand)
            } catch let e as Refused where e.errno == EBUSY {
                // A filesystem mounted inside: one rename would hide the mount in the
                // graveyard, and rm cannot tell it from a directory through the mount.
                FileHandleStderr.write("vanish rm: \(e) (a filesystem is mounted inside it: unmount that first)\n")
                code = 1
            } catch {
                FileHandleStderr.write("vanish rm: \(error)\n")
                code = 1
            }
        }
        if removed.isEmpty && !r.wait && code == 0 { execRm(r.options, forRm) }
        if !forRm.isEmpty || r.operands.isEmpty { code = max(code, runRm(r.options, forRm)) }
        if r.wait, reportLeftovers(removed) { code = max(code, 1) }
        return code
    }

    /// A directory (not a symlink to one) that rm -r would go into: not
    /// `.` or `..` (rm refuses those), not `/` (--preserve-root).
    private static func isTree(_ operand: String) -> Bool {
        let bytes = RawArguments.bytes(operand)
        var trimmed = bytes[...]
        while trimmed.count > 1 && trimmed.last == 0x2F { trimmed = trimmed.dropLast() }
        let last = trimmed.split(separator: 0x2F, omittingEmptySubsequences: true).last.map(Array.init) ?? []
        if last.isEmpty || last == [0x2E] || last == [0x2E, 0x2E] { return false }
        // Without its trailing slashes: `link/` names a symlink to a directory, which
        // rm -r empties through the link and then fails to remove; rm does that here.
        var st = stat()
        return (Array(trimmed) + [0]).withUnsafeBufferPointer { b in
            lstat(UnsafeRawPointer(b.baseAddress!).assumingMemoryBound(to: CChar.self), &st)
        } == 0 && st.st_mode & S_IFMT == S_IFDIR
    }

    static let rm = "/bin/rm"

    /// Becomes /bin/rm with `options` and `operands` (returns only if exec fails).
    private static func execRm(_ options: [String], _ operands: [String]) {
        let argv = (["rm"] + options + ["--"] + operands).map { a in RawArguments.withCString(a) { strdup($0) } } + [nil]
        execv(rm, argv)
        for a in argv { free(a) }
    }

    /// Runs /bin/rm with `options` and `operands`; its exit status.
    private static func runRm(_ options: [String], _ operands: [String]) -> Int32 {
        let argv = (["rm"] + options + ["--"] + operands).map { a in RawArguments.withCString(a) { strdup($0) } } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        guard posix_spawn(&pid, rm, nil, nil, argv, environ) == 0 else {
            FileHandleStderr.write("vanish rm: cannot run \(rm)\n")
            return 1
        }
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
        return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 1
    }

    private static func remove(_ argument: String, recursive: Bool, force: Bool) throws {
        try RawArguments.withCString(argument) { path in
            try remove(path, shown: RawArguments.display(argument), recursive: recursive, force: force)
        }
    }

    private static func remove(_ path: UnsafePointer<CChar>, shown: String, recursive: Bool, force: Bool) throws {
        // The directory is opened without following a symlink, and the
        // trigger is set on what was opened, not on the path again: a user
        // who may write a directory on the path cannot swap in a symlink
        // between the check and the delete (root's rm -r of their tree).
        let fd = open(path, VANISH_O_PATH | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else {
            if errno == ENOENT && force { return }
            throw Refused(shown, errno)
        }
        defer { close(fd) }
        var st = stat()
        guard fstatat(fd, "", &st, VANISH_AT_EMPTY_PATH) == 0 else {
            throw Refused(shown, errno)
        }
        guard st.st_mode & S_IFMT == S_IFDIR else {
            // One rule for files and trees: only inside a Vanish mount.
            guard vanish_filesystem_type(fd) == VANISH_FUSE_SUPER_MAGIC,
                  MountPaths.mountType(containing: MountPaths.lexicallyAbsolute(RawArguments.string(
                      UnsafeBufferPointer(start: UnsafeRawPointer(path).assumingMemoryBound(to: UInt8.self), count: strlen(path))))) == "fuse.vanish"
            else { throw notOnVanish(shown) }
            // unlink(2) acts on the name, as rm does, and never follows a symlink.
            guard unlink(path) == 0 else { throw Refused(shown, errno) }
            return
        }
        guard recursive else { throw Refused(shown, EISDIR) }
        // Not even FUSE: no Vanish mount, whatever attributes the directory has.
        guard vanish_filesystem_type(fd) == VANISH_FUSE_SUPER_MAGIC else { throw notOnVanish(shown) }
        // Through rmdir(2) where the daemon takes it, so the kernel drops the
        // entry and tells watchers (IN_DELETE) as for rm's own rmdir: the
        // directory opened above is armed through a handle of its own, and
        // the daemon removes the tree only if the rmdir reaches that same
        // directory (ENOTEMPTY otherwise, and the trigger below decides).
        let dir = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if dir >= 0 {
            defer { close(dir) }
            if vanish_ioctl_none(dir, VANISH_IOC_REMOVE_ON_RMDIR) == 0 {
                if rmdir(path) == 0 { return }
                let e = errno
                if e == ENOENT && force { return }
                if e != ENOTEMPTY && e != EEXIST { throw Refused(shown, e) }
            }
        }
        // XATTR_CREATE with XATTR_REPLACE: elsewhere the pair fails (ENODATA,
        // or EEXIST where the name is stored) and nothing is stored; on a
        // Vanish mount it is the trigger. This spares reading
        // /proc/self/mountinfo on every call. O_PATH fds refuse fsetxattr;
        // their /proc link reaches the same inode without a path walk.
        guard setxattr("/proc/self/fd/\(fd)", ControlProtocol.deleteAttribute, "", 0, ControlProtocol.deleteFlags) == 0 else {
            let e = errno
            if e == ENODATA || e == EEXIST || e == ENOTSUP || e == EOPNOTSUPP { throw notOnVanish(shown) }
            throw Refused(shown, e)
        }
        // The daemon answers once the kernel has expired the path: the next
        // lookup of it, by any process, gets ENOENT. Looking it up here
        // would make this process prune every cached entry below it, the
        // work the daemon leaves to the kernel's background.
    }
}

extension RemoveCommand {
    /// For `--wait`: waits until each path's mount has settled its deletes,
    /// then reports what is back at each path as `rm -r` would have reported
    /// it failing. Returns whether anything was left.
    static func reportLeftovers(_ paths: [String]) -> Bool {
        var mounts: Set<String> = []
        for path in paths {
            if let m = MountPaths.mount(containing: MountPaths.lexicallyAbsolute(path)), m.type == "fuse.vanish" {
                mounts.insert(m.point)
            }
        }
        for mountpoint in mounts { waitUntilSettled(mountpoint) }
        var left = false
        for path in paths {
            var st = stat()
            guard lstat(path, &st) == 0 else { continue }
            left = true
            report(path, st)
        }
        return left
    }

    /// Until the mount's one-step deletes are sorted and its reaper has
    /// nothing due (kept entries aside).
    private static func waitUntilSettled(_ mountpoint: String) {
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        while true {
            let n = getxattr(mountpoint, ControlProtocol.statusAttribute, &buffer, buffer.count)
            guard n > 0, let json = JSON.parse(buffer[..<n]), let status = MountStatus(json: json) else { return }
            if status.settled { return }
            usleep(20_000)
        }
    }

    /// What `rm -r` says of what it could not remove at `path` (stat `st`):
    /// each entry left whose own removal failed (a directory left only
    /// because something in it was is not named), with the errno the
    /// caller met: EACCES where they may not write the directory, EPERM
    /// where a sticky bit or a flag stopped them.
    private static func report(_ path: String, _ st: stat) {
        let shown = "'" + TerminalText.escaped(path) + "'"
        let isDirectory = st.st_mode & S_IFMT == S_IFDIR
        // One rm -r cannot list: it says so of the directory itself.
        if isDirectory && access(path, R_OK | X_OK) != 0 {
            FileHandleStderr.write("vanish rm: cannot remove \(shown): \(String(cString: strerror(EACCES)))\n")
            return
        }
        if isDirectory, let dir = opendir(path) {
            var children: [String] = []
            while let d = readdir(dir) {
                let name = String(cString: vanish_dirent_name(d)!)
                if name != "." && name != ".." { children.append(name) }
            }
            closedir(dir)
            if !children.isEmpty {
                for child in children.sorted() {
                    var cst = stat()
                    if lstat(path + "/" + child, &cst) == 0 { report(path + "/" + child, cst) }
                }
                return
            }
        }
        let parent = path.contains("/") ? String(path[..<path.lastIndex(of: "/")!]) : "."
        let why = access(parent.isEmpty ? "/" : parent, W_OK | X_OK) == 0 ? EPERM : errno
        FileHandleStderr.write("vanish rm: cannot remove \(shown): \(String(cString: strerror(why)))\n")
    }
}

/// A removal the kernel refused, in rm's words.
private struct Refused: Error, CustomStringConvertible {
    let shown: String
    let errno: Int32
    init(_ shown: String, _ errno: Int32) { (self.shown, self.errno) = (shown, errno) }
    var description: String { "cannot remove '\(shown)': \(String(cString: strerror(errno)))" }
}

/// A path outside every Vanish mount: /bin/rm's to remove.
private struct NotOnVanish: Error, CustomStringConvertible {
    var description: String
}

private func notOnVanish(_ path: String) -> NotOnVanish {
    NotOnVanish(description: "cannot remove \(path): not inside a Vanish mount")
}

/// Writes to stderr without Foundation.
enum FileHandleStderr {
    static func write(_ s: String) { _ = s.withCString { Glibc.write(2, $0, strlen($0)) } }
}

/// coreutils rm's options as `vanish rm` reads them, one row each: its
/// letters, its long name and what it changes. `RemoveCommand`'s flags show
/// them in --help; a test keeps the two the same.
struct RmOption {
    enum Effect { case recursive, force, asks, asksUnlessNever, verbose, wait, none }
    let letters: String
    let long: String?
    let effect: Effect

    static let table: [RmOption] = [
        .init(letters: "rR", long: "--recursive", effect: .recursive),
        .init(letters: "f", long: "--force", effect: .force),
        .init(letters: "iI", long: nil, effect: .asks),
        .init(letters: "", long: "--interactive", effect: .asksUnlessNever),
        .init(letters: "d", long: "--dir", effect: .none),
        .init(letters: "v", long: "--verbose", effect: .verbose),
        .init(letters: "", long: "--one-file-system", effect: .none),
        .init(letters: "", long: "--preserve-root", effect: .none),
        .init(letters: "", long: "--no-preserve-root", effect: .none),
        // Vanish's own: not passed to rm.
        .init(letters: "", long: "--wait", effect: .wait),
    ]
}

/// coreutils rm's arguments, as `vanish rm` takes them: options anywhere
/// before `--` (GNU order), clustered short ones, `--wait` of its own.
struct RmInvocation {
    var recursive = false
    var force = false
    var wait = false
    /// -i, -I, --interactive (but =never): rm asks before removing.
    var asks = false
    /// -f or --interactive=never last: rm asks nothing, not even before a
    /// write-protected entry on a terminal.
    var neverAsks = false
    /// -v: rm names each entry it removes.
    var verbose = false
    /// An option rm may know (an abbreviation) or refuse: everything is rm's then.
    var unknownOption = false
    /// The options as given, --wait aside, for rm.
    var options: [String] = []
    var operands: [String] = []

    init() {}

    /// nil for --help and --version (the argument parser's).
    init?(_ arguments: ArraySlice<String>) {
        var optionsEnded = false
        for a in arguments {
            if optionsEnded || !a.hasPrefix("-") || a == "-" {
                operands.append(a)
                continue
            }
            if a == "--" {
                optionsEnded = true
                continue
            }
            if a.hasPrefix("--") {
                let name = a.split(separator: "=", maxSplits: 1).first.map(String.init) ?? a
                if name == "--help" || name == "--version" { return nil }
                guard let option = RmOption.table.first(where: { $0.long == name }) else {
                    unknownOption = true
                    options.append(a)
                    continue
                }
                apply(option.effect, as: a)
                if option.effect != .wait { options.append(a) }
                continue
            }
            for letter in a.dropFirst() {
                if let option = RmOption.table.first(where: { $0.letters.contains(letter) }) {
                    apply(option.effect, as: a)
                } else {
                    unknownOption = true
                }
            }
            options.append(a)
        }
    }

    private mutating func apply(_ effect: RmOption.Effect, as given: String) {
        switch effect {
        case .recursive: recursive = true
        case .force: (force, asks, neverAsks) = (true, false, true)
        case .asks: (asks, neverAsks) = (true, false)
        case .asksUnlessNever:
            asks = !["--interactive=never", "--interactive=no", "--interactive=none"].contains(given)
            neverAsks = !asks
        case .verbose: verbose = true
        case .wait: wait = true
        case .none: break
        }
    }
}
