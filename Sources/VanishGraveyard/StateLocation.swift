import CLinux
import Glibc
import SystemPackage
import LinuxSyscalls

/// Where a source's state directory (`.vanish`) lives when not in the source
/// itself. An in-place mount is a directory people work in: after the
/// unmount, `git status` would list an in-tree `.vanish` and `git clean -fdx`
/// would delete the kept trash with it. So an in-place mount keeps its state
/// in a directory of its own outside the tree, `BASE/NAME-HASH/.vanish`,
/// under the first base that is on the same mount as the source (a rename
/// into the graveyard works only within one mount), with NAME the source's
/// last component and HASH one of its whole path. Where no base qualifies
/// (another filesystem, a network source) the state stays in the tree.
public enum StateLocation {
    /// The daemon user's own state directory on this machine: /var/lib/vanish
    /// for root, else $XDG_STATE_HOME/vanish or ~/.local/state/vanish (the
    /// unlink log of a network source, and in-place mounts' state, live
    /// under it); nil without a home.
    public static var localBase: String? {
        if geteuid() == 0 { return "/var/lib/vanish" }
        if let state = getenv("XDG_STATE_HOME"), state[0] == 0x2F { return String(cString: state) + "/vanish" }
        if let home = getenv("HOME"), home[0] == 0x2F { return String(cString: home) + "/.local/state/vanish" }
        return nil
    }

    /// The directory under one of `bases` that holds (or, with `create`,
    /// will hold) the state of the source at `sourcePath`, open as the O_PATH
    /// `sourceFD`; nil if none of them is on the source's mount, or, without
    /// `create`, none has one yet. Bases are made (mode 700) as needed, and
    /// one that another user could write is passed over. Returns an O_PATH fd
    /// and the directory's path.
    public static func directory(for sourcePath: String, sourceFD: Int32, bases: [String],
                                 create: Bool) -> (fd: Int32, path: String)? {
        var sourceMount: UInt64 = 0
        guard vanish_mount_id(sourceFD, "", &sourceMount) == 0 else { return nil }
        let name = keyName(sourcePath)
        for base in bases {
            guard let baseDir = openBase(base, create: create) else { continue }
            let baseFD = baseDir.raw
            var mount: UInt64 = 0
            guard vanish_mount_id(baseFD, "", &mount) == 0, mount == sourceMount else { continue }
            if create {
                guard let fd = try? Graveyard.makeDirectory(baseFD, [name]) else { continue }
                writeNote(fd, sourcePath)
                return (fd, base + "/" + name)
            }
            guard let fd = try? Sys.opened(baseFD, name, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW) else { continue }
            if (try? Graveyard.checkPrivate(fd.raw, name)) != nil { return (fd.take(), base + "/" + name) }
        }
        return nil
    }

    /// Moves a state directory from the source (`sourceFD`) into `directory`,
    /// one rename on the same mount, unless `directory` has one already.
    /// Returns whether the source's own is gone (moved, or there was none).
    /// One the daemon's user does not own alone is refused where it is,
    /// before anything moves: another user may have planted it, and it must
    /// not reach the daemon's private base.
    @discardableResult
    public static func moveIn(from sourceFD: Int32, to directory: Int32) throws(GraveyardError) -> Bool {
        guard Graveyard.isStateDirectory(in: sourceFD) else { return true }
        let fd: OwnedDescriptor
        do throws(Errno) {
            fd = try Sys.opened(sourceFD, Graveyard.stateDirectoryName, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
        } catch {
            throw .cannotCreate(error)
        }
        try Graveyard.checkPrivate(fd.raw, Graveyard.stateDirectoryName)
        guard !Graveyard.isStateDirectory(in: directory) else { return false }
        return (try? Sys.renameNoReplace(sourceFD, Graveyard.stateDirectoryName, directory, Graveyard.stateDirectoryName)) != nil
    }

    /// `NAME-HASH`: the last component (characters safe in a file name,
    /// at most 40) and 16 hex digits of a hash of the whole path.
    static func keyName(_ path: String) -> String {
        let last = path.split(separator: "/").last.map { Array($0.utf8) } ?? Array("root".utf8)
        var label = Array(last.map { ClientID.allowed($0) ? $0 : 0x5F }.prefix(40))
        while label.first == 0x2E { label.removeFirst() }
        if label.isEmpty { label = Array("root".utf8) }
        var hash = FNV1a()
        hash.add(Array(path.utf8))
        return String(decoding: label, as: UTF8.self) + "-" + Graveyard.hex(hash.value, digits: 16)
    }

    /// Opens `base`, making it and its missing parents (mode 700) with `create`.
    /// A base another user owns, or could write, is refused.
    private static func openBase(_ base: String, create: Bool) -> OwnedDescriptor? {
        if create {
            var path = ""
            for part in base.split(separator: "/") {
                path += "/" + part
                if mkdir(path, 0o700) != 0 && errno != EEXIST { return nil }
            }
        }
        guard let fd = try? Sys.opened(base, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW),
              (try? Graveyard.checkPrivate(fd.raw, base)) != nil else { return nil }
        return fd
    }

    /// A line saying which source the directory belongs to, for people
    /// looking in the base.
    private static func writeNote(_ fd: Int32, _ sourcePath: String) {
        guard let note = try? Sys.opened(fd, "SOURCE", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0o600) else { return }
        let text = Array((sourcePath + "\n").utf8)
        _ = text.withUnsafeBytes { write(note.raw, $0.baseAddress, $0.count) }
    }
}
