import ArgumentParser
import FUSEKit
import VanishEvents
import VanishFS
import VanishGraveyard

/// Splits `-o` lists into Vanish's own settings and the options libfuse and
/// the kernel understand (allow_other, default_permissions, ro, fsname, ...).
struct MountOptionList {
    var filesystem = FilesystemOptions()
    var threads: Int?
    var cloneFD = false
    /// `spin=`: how long a worker reads on after a reply (µs).
    var spinMicroseconds: Int?
    /// `slice=`: the request threads' EEVDF slice (µs).
    var sliceMicroseconds: Int?
    /// `io_uring=`: whether requests may come over io_uring.
    var ring: RingMode = .auto
    /// Record every change in the event journal (`vanish events`).
    var events = true
    var journalLimits = Journal.Limits()
    /// `-o readahead=` was given (worth a warning if it cannot be set).
    var readaheadGiven = false
    var fuse: [String] = []

    /// Keys Vanish takes itself; everything else goes to libfuse.
    static let ownKeys: Set<String> = ["cache", "threads", "clone_fd", "writeback", "fd_cache", "reapers",
                                       "keep", "keep_max_bytes", "keep_min_free", "keep_min_age", "keep_exclude", "reap_rate", "reap_yield", "noevents",
                                       "events_max_bytes", "sync_unlink", "readdirplus", "readahead", "passthrough",
                                       "client", "lease", "spin", "slice", "watch", "nowatch", "io_uring"]

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
                case "readdirplus":
                    guard let v = value, let mode = ReaddirPlusMode(rawValue: v) else {
                        throw ValidationError("-o readdirplus= takes one of: \(ReaddirPlusMode.allCases.map(\.rawValue).joined(separator: ", "))")
                    }
                    filesystem.readdirPlus = mode
                case "threads":
                    guard let v = value, let n = Int(v), (1...256).contains(n) else {
                        throw ValidationError("-o threads= takes a number from 1 to 256")
                    }
                    threads = n
                case "spin":
                    guard let v = value, let n = Int(v), (0...1000).contains(n) else {
                        throw ValidationError("-o spin= takes a number of microseconds from 0 to 1000")
                    }
                    spinMicroseconds = n
                case "slice":
                    guard let v = value, let n = Int(v), n == 0 || (100...100_000).contains(n) else {
                        throw ValidationError("-o slice= takes 0 or a number of microseconds from 100 to 100000")
                    }
                    sliceMicroseconds = n
                case "io_uring":
                    guard let v = value, let mode = RingMode(rawValue: v) else {
                        throw ValidationError("-o io_uring= takes one of: \(RingMode.allCases.map(\.rawValue).joined(separator: ", "))")
                    }
                    ring = mode
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
                case "client":
                    do {
                        filesystem.client = try ClientID(value ?? "")
                    } catch {
                        throw ValidationError("-o client=: \(error)")
                    }
                case "lease":
                    guard let v = value, let ns = Quantity.duration(v), ns >= Duration.seconds(4).nanoseconds else {
                        throw ValidationError("-o lease= takes a duration of at least 4s, such as 30s or 2m")
                    }
                    filesystem.leaseLength = ns
                case "keep":
                    guard let v = value, let ns = Quantity.duration(v) else {
                        throw ValidationError("-o keep= takes a duration with a unit: 0, or e.g. 90s, 30m, 12h, 7d")
                    }
                    filesystem.reaping.keep = ns
                case "keep_max_bytes":
                    guard let v = value, let n = Quantity.bytes(v) else {
                        throw ValidationError("-o keep_max_bytes= takes a size such as 500M, 20G or 1T")
                    }
                    filesystem.reaping.keepMaxBytes = n
                case "keep_min_age":
                    guard let v = value, let ns = Quantity.duration(v) else {
                        throw ValidationError("-o keep_min_age= takes a duration with a unit: 0, or e.g. 5s, 1m")
                    }
                    filesystem.reaping.keepMinAge = ns
                case "keep_exclude":
                    guard let v = value, !v.isEmpty else {
                        throw ValidationError("-o keep_exclude= takes name patterns separated by colons, e.g. *.swp:*-journal")
                    }
                    filesystem.reaping.keepExclude += v.split(separator: ":").map(String.init)
                case "keep_min_free":
                    guard let v = value, let p = Double(v.hasSuffix("%") ? String(v.dropLast()) : v), (0...100).contains(p) else {
                        throw ValidationError("-o keep_min_free= takes a percentage from 0 to 100")
                    }
                    filesystem.reaping.keepMinFreePercent = p
                case "reap_rate":
                    guard let v = value, let r = Double(v), r > 0 else {
                        throw ValidationError("-o reap_rate= takes a number of files per second above 0")
                    }
                    filesystem.reaping.rate = r
                case "reap_yield":
                    guard let v = value, let ns = Quantity.duration(v), ns <= Duration.seconds(10).nanoseconds else {
                        throw ValidationError("-o reap_yield= takes a duration up to 10s, such as 0, 5ms or 50ms")
                    }
                    filesystem.reaping.yieldToForeground = ns
                case "noevents": events = false
                case "events_max_bytes":
                    guard let v = value, let n = Quantity.bytes(v), n >= 1 << 20 else {
                        throw ValidationError("-o events_max_bytes= takes a size of at least 1M")
                    }
                    journalLimits.maxBytes = n
                case "readahead":
                    guard let v = value, let n = Int(v), (0...65_536).contains(n) else {
                        throw ValidationError("-o readahead= takes a number of KiB from 0 to 65536")
                    }
                    filesystem.readaheadKB = n
                    readaheadGiven = true
                case "passthrough":
                    switch value {
                    case "auto"?, nil: filesystem.passthrough = true
                    case "off"?: filesystem.passthrough = false
                    default: throw ValidationError("-o passthrough= takes one of: auto, off")
                    }
                case "noatime":
                    filesystem.atime = .noatime
                    fuse.append(item)
                case "relatime": filesystem.atime = .relatime
                case "strictatime": filesystem.atime = .strictatime
                case "nodiratime": filesystem.atime = .nodiratime
                case "atime", "diratime", "norelatime", "nostrictatime": filesystem.atime = .backing
                // Accepted for fstab's sake; a FUSE mount has no lazy time updates to give.
                case "lazytime", "nolazytime": break
                case "clone_fd": cloneFD = true
                case "writeback": filesystem.writeback = true
                case "sync_unlink": filesystem.deferUnlink = false
                case "watch": filesystem.watchSource = true
                case "nowatch": filesystem.watchSource = false
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

/// Durations and sizes as people write them.
enum Quantity {
    /// "90", "90s", "5ms", "30m", "12h", "7d" → ns.
    /// A bare number other than 0 is refused: `--keep 1` meaning one
    /// second surprised everyone who meant something else.
    static func duration(_ text: String) -> UInt64? {
        let units: [Character: Double] = ["s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604_800]
        var number = Substring(text)
        var scale: Double? = nil
        if text.hasSuffix("ms") {
            number = number.dropLast(2); scale = 0.001
        } else if let last = text.last, let u = units[last] {
            number = number.dropLast(); scale = u
        }
        guard let v = Double(number), v >= 0, v == 0 || scale != nil, v * (scale ?? 1) < 3e9 else { return nil }
        return UInt64(v * (scale ?? 1) * 1e9)
    }

    /// "4096", "500K", "500M", "20G", "1T" (powers of 1024; a trailing "B" or "iB" is allowed) → bytes.
    static func bytes(_ text: String) -> UInt64? {
        var t = Substring(text.uppercased())
        if t.hasSuffix("IB") { t = t.dropLast(2) } else if t.hasSuffix("B") { t = t.dropLast() }
        let units: [Character: Double] = ["K": 0x1p10, "M": 0x1p20, "G": 0x1p30, "T": 0x1p40, "P": 0x1p50]
        var scale = 1.0
        if let last = t.last, let u = units[last] { t = t.dropLast(); scale = u }
        guard let v = Double(t), v >= 0, v * scale < 9e18 else { return nil }
        return UInt64(v * scale)
    }
}
