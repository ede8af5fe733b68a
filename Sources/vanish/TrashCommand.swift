import ArgumentParser
import Glibc
import LinuxSyscalls
import VanishClient

struct TrashCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "trash",
        abstract: "See what the undo window (vanish mount --keep) still holds.",
        subcommands: [List.self, Empty.self]
    )

    struct List: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "List restorable entries: yours, or everyone's for root.",
            discussion: """
                One line per deletion: a directory removed with rm -r comes with what was deleted \
                inside it (restoring it brings all of that back), shown as its count. Columns: id, \
                deletion time, size (the files' apparent sizes; - when unknown, as for a tree removed \
                with vanish rm), deleting user, original path.
                """
        )

        @Flag(help: "One line per entry, also for what was deleted inside a directory.")
        var expand = false

        @Flag(help: "Add a column with the disk space each entry holds.")
        var long = false

        @Flag(help: "One JSON object per line, one per entry (fields: id, path, path_b64 if not UTF-8, deleted_ns, size, bytes (disk usage), kind, uid, gid, and held: why it is kept until restored).")
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
            let groups = expand ? entries.map { TrashGroup(top: $0) } : TrashGroup.grouping(entries)
            print("ID" + String(repeating: " ", count: 36) + "DELETED              SIZE      "
                  + (long ? "DISK      " : "") + "USER     PATH")
            for g in groups {
                let e = g.top
                let when = localTime(nanoseconds: e["deleted_ns"]?.uint64 ?? 0)
                let size = g.size.map { bytes(Int($0)) } ?? "-"
                let disk = g.disk.map { bytes(Int($0)) } ?? "-"
                let uid = UInt32(e["uid"]?.int ?? 0)
                let user = TerminalText.escaped(UserDatabase.user(uid)?.name ?? "\(uid)")
                let named = PathBytes.get(e, key: "path")?.description ?? ""
                let path = named.isEmpty ? "(where it was is not known)" : TerminalText.escaped(named)
                let kind = e["kind"]?.string == "directory" ? "/" : ""
                print("\(e["id"]?.string ?? "?")  \(when)  \(pad(size, 9)) \(long ? pad(disk, 9) + " " : "")"
                      + "\(pad(user, 8)) \(path)\(kind)\(g.summary)")
                if let held = e["held"]?.string { print(String(repeating: " ", count: 38) + "kept: " + held) }
            }
        }
    }

    struct Empty: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Free kept entries now instead of at the end of their undo window: yours, or anyone's for root.",
            discussion: """
                With no ENTRY, every entry you may list goes (all of them for root). An ENTRY is an id \
                from `vanish trash list` or an original path (every deletion at it or inside it). \
                --older-than keeps the more recent ones. The reaper frees what goes at once; \
                `vanish status --wait` waits for it.
                """
        )

        @Option(help: ArgumentHelp("Only entries deleted at least this long ago (e.g. 30m, 12h, 7d).", valueName: "duration"))
        var olderThan: String?

        @OptionGroup var target: MountpointArgument
        var mountpoint: String { target.mountpoint }

        @Argument(help: "Ids or original paths of the entries to free (default: all of yours).")
        var entries: [String] = []

        func validate() throws {
            if let olderThan, Quantity.duration(olderThan) == nil {
                throw ValidationError("--older-than takes a duration with a unit: 90s, 30m, 12h, 7d")
            }
            try target.requireVanishRoot()
            for entry in entries where !isID(entry) {
                let path = MountPaths.lexicallyAbsolute(entry)
                guard (try? RestoreCommand.relative(path, in: mountpoint)) != nil else {
                    throw ValidationError("\(path) is not inside the mount at \(mountpoint)")
                }
            }
        }

        /// An id from `trash list`, unless a file of that name is there.
        func isID(_ entry: String) -> Bool { RestoreCommand.isID(entry) && access(entry, F_OK) != 0 }

        func run() throws {
            var request: [String: JSON] = ["op": JSON(ControlProtocol.Operation.trashEmpty.rawValue)]
            var ids: [JSON] = []
            var paths: [JSON] = []
            for entry in entries {
                if isID(entry) {
                    ids.append(JSON(entry))
                } else {
                    var o: [String: JSON] = [:]
                    let relative = try RestoreCommand.relative(MountPaths.lexicallyAbsolute(entry), in: mountpoint)
                    PathBytes(relative).put(into: &o, key: "path")
                    paths.append(.object(o))
                }
            }
            request["ids"] = .array(ids)
            request["paths"] = .array(paths)
            if let olderThan, let ns = Quantity.duration(olderThan) { request["older_than_ns"] = JSON(ns) }
            let answer: JSON
            do {
                answer = try ControlClient(mountpoint: mountpoint).call(.object(request))
            } catch {
                throw RuntimeError("cannot empty the trash of \(mountpoint): \(error.description)")
            }
            let count = answer["emptied"]?.int ?? 0
            print(count == 0 ? "nothing to free"
                  : "freeing \(count) entr\(count == 1 ? "y" : "ies") (\(bytes(answer["bytes"]?.int ?? 0)) of disk known); "
                    + "vanish status --wait \(TerminalText.escaped(mountpoint)) waits for the reaper")
            let unknown = (answer["unknown"]?.array ?? []).compactMap { PathBytes.get($0, key: "name") }
            for name in unknown {
                FileHandleStderr.write("vanish trash empty: nothing restorable of yours is known as "
                                       + TerminalText.escaped(name.description) + "\n")
            }
            if !unknown.isEmpty { throw ExitCode.failure }
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

    static func isID(_ s: String) -> Bool { ControlProtocol.isEntryID(s) }

    /// A path outside every Vanish mount is a bad argument (exit 64, this command's usage).
    func validate() throws {
        if mount == nil && !(RestoreCommand.isID(entry) && access(entry, F_OK) != 0) {
            _ = try RestoreCommand.vanishMount(holding: MountPaths.lexicallyAbsolute(entry))
        }
    }

    func run() throws {
        var request: [String: JSON] = ["op": JSON(ControlProtocol.Operation.restore.rawValue)]
        let mountpoint: String
        var named: [UInt8]?
        if RestoreCommand.isID(entry) && access(entry, F_OK) != 0 {
            request["id"] = JSON(entry)
            if let mount {
                mountpoint = MountPaths.lexicallyAbsolute(mount)
            } else if let to {
                // An entry goes back within its own mount: the destination's, no other daemon asked.
                mountpoint = try RestoreCommand.vanishMount(holding: MountPaths.lexicallyAbsolute(to))
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
            named = try RestoreCommand.relative(path, in: mountpoint)
            PathBytes(named!).put(into: &request, key: "path")
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
        // One line: what was named, and how much of what was deleted inside it came back with it.
        let restored = (answer["restored"]?.array ?? []).compactMap { PathBytes.get($0, key: "path") }
        guard let first = restored.first else { return }
        func shown(_ p: PathBytes) -> String { TerminalText.escaped("\(mountpoint == "/" ? "" : mountpoint)/\(p.description)") }
        func entries(_ n: Int) -> String { "\(n) entr\(n == 1 ? "y" : "ies")" }
        if let named, first.bytes != named, to == nil {
            // The directory itself was not deleted: what was deleted inside it came back.
            print("restored \(entries(restored.count)) inside \(shown(PathBytes(named)))")
        } else {
            let inside = restored.count - 1
            print("restored \(shown(first))" + (inside > 0 ? " and \(entries(inside)) inside it" : ""))
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
    String(decoding: Sys.localTime(nanoseconds: ns, format: "%Y-%m-%d %H:%M:%S"), as: UTF8.self)
}

/// One line of `vanish trash list`: a deletion, and for a directory what was
/// deleted inside it with it (rm -r removes the children first), by the rule
/// `vanish restore PATH` follows: an entry inside a kept directory, of the
/// same user, deleted after that path's previous deletion and not after the
/// directory's.
struct TrashGroup {
    var top: JSON
    var files = 0
    var directories = 0
    /// Apparent bytes of the files (nil: none known).
    var size: UInt64?
    /// Disk bytes the record counts (nil: unknown).
    var disk: UInt64?

    init(top: JSON) {
        self.top = top
        size = top["size"]?.uint64
        disk = top["bytes"]?.uint64
        // A tree `vanish rm` took whole: what the reaper will meet in it.
        files = top["files_inside"]?.int ?? 0
        directories = top["directories_inside"]?.int ?? 0
    }

    mutating func add(_ e: JSON) {
        if e["kind"]?.string == "directory" { directories += 1 } else { files += 1 }
        files += e["files_inside"]?.int ?? 0
        directories += e["directories_inside"]?.int ?? 0
        if let s = e["size"]?.uint64 { size = (size ?? 0) + s }
        if let b = e["bytes"]?.uint64 { disk = (disk ?? 0) + b }
    }

    /// " (3 files, 1 directory inside)", or nothing when alone.
    var summary: String {
        guard files + directories > 0 else { return "" }
        var parts: [String] = []
        if files > 0 { parts.append("\(files) file\(files == 1 ? "" : "s")") }
        if directories > 0 { parts.append("\(directories) director\(directories == 1 ? "y" : "ies")") }
        return "  (" + parts.joined(separator: ", ") + " inside)"
    }

    /// `entries` (oldest first) folded into one group per deletion, in the
    /// order of their top entries. Each entry looks for kept directories at
    /// its ancestors' paths, the outermost first: O(entries × depth).
    static func grouping(_ entries: [JSON]) -> [TrashGroup] {
        struct Key: Hashable { var uid: Int; var path: [UInt8] }
        let paths = entries.map { PathBytes.get($0, key: "path")?.bytes ?? [] }
        let times = entries.map { $0["deleted_ns"]?.uint64 ?? 0 }
        // Each kept directory's deletions, oldest first (entries come oldest first).
        var directories: [Key: [Int]] = [:]
        for (i, e) in entries.enumerated() where e["kind"]?.string == "directory" {
            directories[Key(uid: e["uid"]?.int ?? -1, path: paths[i]), default: []].append(i)
        }
        var owner = Array(entries.indices)
        for (i, e) in entries.enumerated() {
            let uid = e["uid"]?.int ?? -1
            let path = paths[i]
            for cut in path.indices where path[cut] == 0x2F && cut > 0 {
                // The first deletion of this ancestor at or after this entry's own.
                guard let deletions = directories[Key(uid: uid, path: Array(path[..<cut]))],
                      let d = deletions.first(where: { times[$0] >= times[i] && $0 != i }) else { continue }
                owner[i] = d
                break
            }
        }
        // An owner may itself be inside another: follow to the outermost.
        func outermost(_ i: Int) -> Int {
            var j = i
            while owner[j] != j { j = owner[j] }
            return j
        }
        // Restoring a directory brings back the latest deletion of each path
        // inside it: an earlier deletion of the same path stays in the trash,
        // so it is a line of its own.
        struct Member: Hashable { var top: Int; var path: [UInt8] }
        var latest: [Member: Int] = [:]
        for i in entries.indices where outermost(i) != i { latest[Member(top: outermost(i), path: paths[i])] = i }
        // So is one whose path a directory deleted after it holds (`shadowed`).
        func folded(_ i: Int) -> Bool {
            outermost(i) != i && latest[Member(top: outermost(i), path: paths[i])] == i
                && entries[i]["shadowed"]?.bool != true
        }
        var groups: [Int: TrashGroup] = [:]
        var order: [Int] = []
        for i in entries.indices where !folded(i) {
            groups[i] = TrashGroup(top: entries[i])
            order.append(i)
        }
        for i in entries.indices where folded(i) { groups[outermost(i)]!.add(entries[i]) }
        return order.map { groups[$0]! }
    }
}
