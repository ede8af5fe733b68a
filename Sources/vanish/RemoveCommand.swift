import ArgumentParser
import CLinux
import Glibc
import VanishClient

struct RemoveCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "rm",
        abstract: "Remove files or whole trees inside a Vanish mount, in one step whatever their size.",
        discussion: """
            A directory goes to the graveyard with one rename made with the caller's rights \
            (through the xattr trigger user.vanish.delete, which any program can set too); the \
            reaper frees the data later. Moments later, what rm -r by the caller would have left \
            (entries they may not remove, and the directories on their paths) is put back where \
            it was. Other entries are unlinked, which on a Vanish mount is the same single rename.
            """
    )

    @Flag(name: [.customShort("r"), .customShort("R"), .long], help: "Remove directories and their contents.")
    var recursive = false

    @Flag(name: .shortAndLong, help: "Ignore paths that do not exist.")
    var force = false

    @Flag(help: ArgumentHelp("""
        Wait until what was removed is freed (or kept by the undo window) and what rm -r would have \
        left is back, then report each entry left as rm does, with exit status 1.
        """))
    var wait = false

    @Argument(help: "What to remove.")
    var paths: [String]

    func validate() throws {
        if paths.isEmpty { throw ValidationError("name at least one path") }
    }

    func run() throws {
        var code = RemoveCommand.removeAll(paths, recursive: recursive, force: force)
        if wait, RemoveCommand.reportLeftovers(paths) { code = max(code, 1) }
        if code != 0 { throw ExitCode(code) }
    }

    /// `vanish rm` in its common forms (`-r`, `-f`, `-rf`, `--recursive`,
    /// `--force`, `--`, then paths), run before the argument parser: its
    /// first dynamic casts scan every protocol conformance in the binary,
    /// which cost ~5 ms of a ~7 ms `vanish rm`. Returns the exit code, or
    /// nil for anything else (help, a flag after a path, errors), which the
    /// full parser then handles as before.
    static func fastPath(_ arguments: ArraySlice<String>) -> Int32? {
        guard arguments.first == "rm" else { return nil }
        var recursive = false, force = false
        var paths: [String] = []
        var optionsEnded = false
        for a in arguments.dropFirst() {
            if optionsEnded || !a.hasPrefix("-") || a == "-" {
                paths.append(a)
                continue
            }
            if !paths.isEmpty { return nil }
            switch a {
            case "--": optionsEnded = true
            case "--recursive": recursive = true
            case "--force": force = true
            default:
                let letters = a.utf8.dropFirst()
                guard !a.hasPrefix("--"), !letters.isEmpty,
                      letters.allSatisfy({ $0 == UInt8(ascii: "r") || $0 == UInt8(ascii: "R") || $0 == UInt8(ascii: "f") })
                else { return nil }
                if letters.contains(UInt8(ascii: "f")) { force = true }
                if letters.contains(where: { $0 != UInt8(ascii: "f") }) { recursive = true }
            }
        }
        if paths.isEmpty { return nil }
        return removeAll(paths, recursive: recursive, force: force)
    }

    /// Removes each path, reporting failures on stderr. The exit code: 64 if
    /// a path is outside every Vanish mount (a bad argument, as for every
    /// subcommand), else 1 if a removal failed, else 0.
    static func removeAll(_ paths: [String], recursive: Bool, force: Bool) -> Int32 {
        var code: Int32 = 0
        for path in paths {
            do {
                try remove(path, recursive: recursive, force: force)
            } catch let e as NotOnVanish {
                FileHandleStderr.write("vanish rm: \(e.description)\n")
                code = 64
            } catch let e as RuntimeError {
                FileHandleStderr.write("vanish rm: \(e.description)\n")
                if code == 0 { code = 1 }
            } catch {
                FileHandleStderr.write("vanish rm: \(error)\n")
                if code == 0 { code = 1 }
            }
        }
        return code
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
            throw RuntimeError("cannot remove \(shown): \(String(cString: strerror(errno)))")
        }
        defer { close(fd) }
        var st = stat()
        guard fstatat(fd, "", &st, VANISH_AT_EMPTY_PATH) == 0 else {
            throw RuntimeError("cannot remove \(shown): \(String(cString: strerror(errno)))")
        }
        guard st.st_mode & S_IFMT == S_IFDIR else {
            // One rule for files and trees: only inside a Vanish mount.
            guard vanish_filesystem_type(fd) == VANISH_FUSE_SUPER_MAGIC,
                  MountPaths.mountType(containing: MountPaths.lexicallyAbsolute(RawArguments.string(
                      UnsafeBufferPointer(start: UnsafeRawPointer(path).assumingMemoryBound(to: UInt8.self), count: strlen(path))))) == "fuse.vanish"
            else { throw notOnVanish(shown) }
            // unlink(2) acts on the name, as rm does, and never follows a symlink.
            guard unlink(path) == 0 else { throw RuntimeError("cannot remove \(shown): \(String(cString: strerror(errno)))") }
            return
        }
        guard recursive else { throw RuntimeError("cannot remove \(shown): Is a directory (use -r)") }
        // Not even FUSE: no Vanish mount, whatever attributes the directory has.
        guard vanish_filesystem_type(fd) == VANISH_FUSE_SUPER_MAGIC else { throw notOnVanish(shown) }
        // XATTR_REPLACE: elsewhere no such attribute exists to be replaced,
        // so nothing is stored and the call fails (ENODATA); Vanish takes the
        // trigger whatever the flags. This spares reading /proc/self/mountinfo
        // on every call. O_PATH fds refuse fsetxattr; their /proc link
        // reaches the same inode without a path walk.
        guard setxattr("/proc/self/fd/\(fd)", ControlProtocol.deleteAttribute, "", 0, Int32(XATTR_REPLACE)) == 0 else {
            let e = errno
            if e == ENODATA || e == ENOTSUP || e == EOPNOTSUPP { throw notOnVanish(shown) }
            if e == EBUSY {
                throw RuntimeError("cannot remove \(shown): \(String(cString: strerror(e))) "
                                   + "(the mount's root, or a filesystem is mounted inside it: unmount that first)")
            }
            throw RuntimeError("cannot remove \(shown): \(String(cString: strerror(e)))")
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

/// A path outside every Vanish mount: a bad argument (exit 64).
private struct NotOnVanish: Error, CustomStringConvertible {
    var description: String
}

private func notOnVanish(_ path: String) -> NotOnVanish {
    NotOnVanish(description: "cannot remove \(path): not inside a Vanish mount (use rm there)")
}

/// Writes to stderr without Foundation.
enum FileHandleStderr {
    static func write(_ s: String) { _ = s.withCString { Glibc.write(2, $0, strlen($0)) } }
}
