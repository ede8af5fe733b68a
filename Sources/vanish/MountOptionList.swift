import ArgumentParser
import VanishFS

/// Splits `-o` lists into Vanish's own settings and the options libfuse and
/// the kernel understand (allow_other, default_permissions, ro, fsname, ...).
struct MountOptionList {
    var filesystem = FilesystemOptions()
    var threads: Int?
    var cloneFD = false
    var fuse: [String] = []

    /// Keys Vanish takes itself; everything else goes to libfuse.
    static let ownKeys: Set<String> = ["cache", "threads", "clone_fd", "writeback", "fd_cache", "reapers"]

    init(_ lists: [String]) throws {
        for list in lists {
            for item in MountOptionList.split(list) where !item.isEmpty {
                let (key, value) = MountOptionList.keyValue(item)
                switch key {
                case "cache":
                    guard let v = value, let mode = CacheMode(rawValue: v) else {
                        throw ValidationError("-o cache= takes one of: \(CacheMode.allCases.map(\.rawValue).joined(separator: ", "))")
                    }
                    filesystem.cache = mode
                case "threads":
                    guard let v = value, let n = Int(v), (1...256).contains(n) else {
                        throw ValidationError("-o threads= takes a number from 1 to 256")
                    }
                    threads = n
                case "fd_cache":
                    guard let v = value, let n = Int(v), n >= 8 else {
                        throw ValidationError("-o fd_cache= takes a number of fds, at least 8")
                    }
                    filesystem.fdCacheLimit = n
                case "reapers":
                    guard let v = value, let n = Int(v), (1...64).contains(n) else {
                        throw ValidationError("-o reapers= takes a number from 1 to 64")
                    }
                    filesystem.reaperWorkers = n
                case "clone_fd": cloneFD = true
                case "writeback": filesystem.writeback = true
                case "no_default_permissions", "nodefault_permissions":
                    throw ValidationError("""
                        Vanish always lets the kernel check permissions when other users may \
                        use the mount; without that they would act with the daemon's rights.
                        """)
                default: fuse.append(item)
                }
            }
        }
    }

    var allowsOthers: Bool { fuse.contains("allow_other") }

    /// libfuse's options, with the ones every Vanish mount needs.
    func fuseOptions(source: String) -> [String] {
        var out = fuse
        if !out.contains(where: { $0.hasPrefix("fsname=") }) { out.append("fsname=" + MountOptionList.escape(source)) }
        if !out.contains(where: { $0.hasPrefix("subtype=") }) { out.append("subtype=vanish") }
        // Other users may only do what the file modes allow them.
        if allowsOthers && !out.contains("default_permissions") { out.append("default_permissions") }
        return out
    }

    /// Splits on commas not escaped with a backslash (libfuse's own rule).
    static func split(_ list: String) -> [String] {
        var items: [String] = []
        var current = ""
        var escaped = false
        for c in list {
            if escaped { current.append(c); escaped = false; continue }
            if c == "\\" { escaped = true; current.append(c); continue }
            if c == "," { items.append(current); current = ""; continue }
            current.append(c)
        }
        items.append(current)
        return items
    }

    static func keyValue(_ item: String) -> (String, String?) {
        guard let eq = item.firstIndex(of: "=") else { return (item, nil) }
        return (String(item[..<eq]), String(item[item.index(after: eq)...]))
    }

    static func escape(_ s: String) -> String {
        var out = ""
        for c in s {
            if c == "\\" || c == "," { out.append("\\") }
            out.append(c)
        }
        return out
    }
}
