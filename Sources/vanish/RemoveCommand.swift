import ArgumentParser
import CLinux
import Glibc
import VanishClient

struct RemoveCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "rm",
        abstract: "Remove files or whole trees inside a Vanish mount, in one step whatever their size.",
        discussion: """
            A directory goes to the graveyard with one rename (through the xattr trigger \
            user.vanish.delete, which any program can set too); the reaper frees the data later. \
            It is refused exactly where rm -r by the calling user would fail to empty the tree: \
            the daemon checks every directory in it with the caller's own rights (modes, ACLs, \
            sticky bits, immutable entries, mounts inside), a walk that takes a fraction of what \
            deleting would. Other entries are unlinked, which on a Vanish mount is the same \
            single rename.
            """
    )

    @Flag(name: [.customShort("r"), .customShort("R"), .long], help: "Remove directories and their contents.")
    var recursive = false

    @Flag(name: .shortAndLong, help: "Ignore paths that do not exist.")
    var force = false

    @Argument(help: "What to remove.")
    var paths: [String]

    func validate() throws {
        if paths.isEmpty { throw ValidationError("name at least one path") }
    }

    func run() throws {
        let code = RemoveCommand.removeAll(paths, recursive: recursive, force: force)
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
