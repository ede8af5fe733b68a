import ArgumentParser
import Glibc
import VanishClient

struct TrashCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "trash",
        abstract: "See what the undo window (vanish mount --keep) still holds.",
        subcommands: [List.self]
    )

    struct List: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "List restorable entries: yours, or everyone's for root.",
            discussion: "Columns: id, deletion time, size (- when unknown: a whole tree), deleting user, original path."
        )

        @Flag(help: "One JSON object per line (fields: id, path, path_b64 if not UTF-8, deleted_ns, bytes, kind, uid, gid).")
        var json = false

        @OptionGroup var target: MountpointArgument
        var mountpoint: String { target.mountpoint }

        func validate() throws { try target.requireVanishRoot() }

        func run() throws {
            let entries = try TrashCommand.list(mountpoint)
            if json {
                for e in entries { print(e.serialized) }
                return
            }
            if entries.isEmpty {
                print("nothing restorable on \(mountpoint)")
                return
            }
            for e in entries {
                let when = localTime(nanoseconds: e["deleted_ns"]?.uint64 ?? 0)
                let size = e["bytes"]?.int.map { bytes($0) } ?? "-"
                let uid = UInt32(e["uid"]?.int ?? 0)
                let user = TerminalText.escaped(getpwuid(uid).map { String(cString: $0.pointee.pw_name) } ?? "\(uid)")
                let path = TerminalText.escaped(PathBytes.get(e, key: "path")?.description ?? "?")
                let kind = e["kind"]?.string == "directory" ? "/" : ""
                print("\(e["id"]?.string ?? "?")  \(when)  \(pad(size, 9)) \(pad(user, 8)) \(path)\(kind)")
            }
        }
    }

    /// The entries the calling user may see on the mount at `mountpoint`.
    static func list(_ mountpoint: String) throws -> [JSON] {
        do {
            let client = try ControlClient(mountpoint: mountpoint)
            let answer = try client.call(["op": JSON(ControlProtocol.Operation.trashList.rawValue)])
            return answer["entries"]?.array ?? []
        } catch {
            throw RuntimeError(error.description)
        }
    }
}

struct RestoreCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "restore",
        abstract: "Put a deleted entry back while its undo window lasts.",
        discussion: """
            Name it by its original path (its latest deletion is restored; a directory comes back with \
            everything deleted inside it since, as after rm -rf) or by the id `vanish trash list` shows. \
            Nothing is ever overwritten: if the path is taken, restore elsewhere with --to. Only the user \
            who deleted an entry, or root, may restore it.
            """
    )

    @Option(help: "Restore here instead (a path inside the same mount).")
    var to: String?

    @Option(help: "The mount to look in (default: the one holding PATH; for an id, every Vanish mount).")
    var mount: String?

    @Argument(help: "The original path, or an id from `vanish trash list`.")
    var entry: String

    static func isID(_ s: String) -> Bool {
        s.utf8.count == 36 && s.utf8.allSatisfy { ($0 >= 0x30 && $0 <= 0x39) || ($0 >= 0x61 && $0 <= 0x66) || $0 == 0x2D }
    }

    /// A path outside every Vanish mount is a bad argument (exit 64, this command's usage).
    func validate() throws {
        if mount == nil && !(RestoreCommand.isID(entry) && access(entry, F_OK) != 0) {
            _ = try RestoreCommand.vanishMount(holding: MountPaths.lexicallyAbsolute(entry))
        }
    }

    func run() throws {
        var request: [String: JSON] = ["op": JSON(ControlProtocol.Operation.restore.rawValue)]
        let mountpoint: String
        if RestoreCommand.isID(entry) && access(entry, F_OK) != 0 {
            request["id"] = JSON(entry)
            if let mount {
                mountpoint = MountPaths.lexicallyAbsolute(mount)
            } else {
                let candidates = MountPaths.mounts().filter { $0.type == "fuse.vanish" }.map(\.point)
                guard let found = candidates.first(where: { point in
                    ((try? TrashCommand.list(point)) ?? []).contains { $0["id"]?.string == entry }
                }) else {
                    throw RuntimeError("no Vanish mount has a restorable entry \(entry) of yours")
                }
                mountpoint = found
            }
        } else {
            let path = MountPaths.lexicallyAbsolute(entry)
            mountpoint = try mount.map(MountPaths.lexicallyAbsolute) ?? RestoreCommand.vanishMount(holding: path)
            PathBytes(try RestoreCommand.relative(path, in: mountpoint)).put(into: &request, key: "path")
        }
        if let to {
            PathBytes(try RestoreCommand.relative(MountPaths.lexicallyAbsolute(to), in: mountpoint)).put(into: &request, key: "to")
        }
        let answer: JSON
        do {
            answer = try ControlClient(mountpoint: mountpoint).call(.object(request))
        } catch {
            throw RuntimeError("cannot restore \(entry): \(error.description)")
        }
        for item in answer["restored"]?.array ?? [] {
            let p = PathBytes.get(item, key: "path")?.description ?? "?"
            print("restored " + TerminalText.escaped("\(mountpoint == "/" ? "" : mountpoint)/\(p)"))
        }
    }

    static func vanishMount(holding path: String) throws -> String {
        guard let m = MountPaths.mount(containing: path), m.type == "fuse.vanish" else {
            throw ValidationError("\(path) is not inside a Vanish mount (name the mount with --mount)")
        }
        return m.point
    }

    static func relative(_ path: String, in mountpoint: String) throws -> [UInt8] {
        let prefix = mountpoint == "/" ? "/" : mountpoint + "/"
        guard path.hasPrefix(prefix) else { throw RuntimeError("\(path) is not inside the mount at \(mountpoint)") }
        return RawArguments.bytes(String(path.dropFirst(prefix.count)))
    }
}

/// `s` padded with spaces to at least `width` characters.
func pad(_ s: String, _ width: Int) -> String { s.count >= width ? s : s + String(repeating: " ", count: width - s.count) }

/// "YYYY-MM-DD HH:MM:SS" in local time (localtime_r and strftime, not Foundation).
func localTime(nanoseconds ns: UInt64) -> String {
    var t = time_t(ns / 1_000_000_000)
    var parts = tm()
    localtime_r(&t, &parts)
    var buffer = [CChar](repeating: 0, count: 32)
    let n = strftime(&buffer, buffer.count, "%Y-%m-%d %H:%M:%S", &parts)
    return String(decoding: buffer[..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self)
}
