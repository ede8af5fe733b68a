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

    init(_ lists: [String]) throws {
        for list in lists {
            for item in MountOptionList.split(list) where !item.isEmpty {
                let (key, value) = MountOptionList.keyValue(item)
                if let spec = MountOptionList.specs[key] {
                    try spec.apply(&self, value, item)
                } else {
                    fuse.append(item)
                }
            }
        }
    }

    /// One `-o` option Vanish takes itself: its key, how its value is
    /// written (`vanish help mount` lists it so), and what it sets.
    struct OptionSpec: Sendable {
        let key: String
        /// "" for a flag, else how its value is written: `DURATION`, `auto|off`.
        let value: String
        /// Listed in `vanish help mount` (not the atime options every mount knows).
        var listed = true
        /// Sets what `value` (nil for a flag) says; `item` is the whole `key=value`.
        let apply: @Sendable (inout MountOptionList, _ value: String?, _ item: String) throws -> Void

        var usage: String { value.isEmpty ? key : key + "=" + value }
    }

    /// Every option Vanish takes itself, in the order help lists them;
    /// everything else goes to libfuse.
    static let table: [OptionSpec] = [
        .init(key: "cache", value: choices(CacheMode.self)) { o, v, _ in o.filesystem.cache = try choice(v, "cache") },
        .init(key: "threads", value: "N") { o, v, _ in o.threads = try number(v, "threads", 1...256, "a number from 1 to 256") },
        .init(key: "spin", value: "MICROSECONDS") { o, v, _ in
            o.spinMicroseconds = try number(v, "spin", 0...1000, "a number of microseconds from 0 to 1000")
        },
        .init(key: "slice", value: "MICROSECONDS") { o, v, _ in
            let n = try number(v, "slice", 0...100_000, "0 or a number of microseconds from 100 to 100000")
            guard n == 0 || n >= 100 else { throw ValidationError("-o slice= takes 0 or a number of microseconds from 100 to 100000") }
            o.sliceMicroseconds = n
        },
        .init(key: "io_uring", value: choices(RingMode.self)) { o, v, _ in o.ring = try choice(v, "io_uring") },
        .init(key: "clone_fd", value: "") { o, _, _ in o.cloneFD = true },
        .init(key: "writeback", value: "") { o, _, _ in o.filesystem.writeback = true },
        .init(key: "fd_cache", value: "N") { o, v, _ in
            o.filesystem.fdCacheLimit = try number(v, "fd_cache", 8...Int.max, "a number of fds, at least 8")
        },
        .init(key: "reapers", value: "N") { o, v, _ in
            o.filesystem.deleting.reaperWorkers = try number(v, "reapers", 1...64, "a number from 1 to 64")
        },
        .init(key: "sync_unlink", value: "") { o, _, _ in o.filesystem.deleting.deferUnlink = false },
        .init(key: "readdirplus", value: choices(ReaddirPlusMode.self)) { o, v, _ in
            o.filesystem.readdirPlus = try choice(v, "readdirplus")
        },
        .init(key: "readahead", value: "KB") { o, v, _ in
            o.filesystem.readaheadKB = try number(v, "readahead", 0...65_536, "a number of KiB from 0 to 65536")
            o.readaheadGiven = true
        },
        .init(key: "passthrough", value: "auto|off") { o, v, _ in
            switch v {
            case "auto"?, nil: o.filesystem.passthrough = true
            case "off"?: o.filesystem.passthrough = false
            default: throw ValidationError("-o passthrough= takes one of: auto, off")
            }
        },
        .init(key: "watch", value: "") { o, _, _ in o.filesystem.watchSource = true },
        .init(key: "nowatch", value: "") { o, _, _ in o.filesystem.watchSource = false },
        .init(key: "keep", value: "DURATION") { o, v, _ in
            o.filesystem.deleting.reaping.keep = try duration(v, "keep", "a duration with a unit: 0, or e.g. 90s, 30m, 12h, 7d")
        },
        .init(key: "keep_max_bytes", value: "SIZE") { o, v, _ in
            guard let v, let n = Quantity.bytes(v) else {
                throw ValidationError("-o keep_max_bytes= takes a size such as 500M, 20G or 1T")
            }
            o.filesystem.deleting.reaping.keepMaxBytes = n
        },
        .init(key: "keep_min_free", value: "PERCENT") { o, v, _ in
            guard let v, let p = Double(v.hasSuffix("%") ? String(v.dropLast()) : v), (0...100).contains(p) else {
                throw ValidationError("-o keep_min_free= takes a percentage from 0 to 100")
            }
            o.filesystem.deleting.reaping.keepMinFreePercent = p
        },
        .init(key: "keep_min_age", value: "DURATION") { o, v, _ in
            o.filesystem.deleting.reaping.keepMinAge = try duration(v, "keep_min_age", "a duration with a unit: 0, or e.g. 5s, 1m")
        },
        .init(key: "keep_exclude", value: "PATTERNS") { o, v, _ in
            guard let v, !v.isEmpty else {
                throw ValidationError("-o keep_exclude= takes name patterns separated by colons, e.g. *.swp:*-journal")
            }
            o.filesystem.deleting.reaping.keepExclude += v.split(separator: ":").map(String.init)
        },
        .init(key: "reap_rate", value: "FILES_PER_SECOND") { o, v, _ in
            guard let v, let r = Double(v), r > 0 else {
                throw ValidationError("-o reap_rate= takes a number of files per second above 0")
            }
            o.filesystem.deleting.reaping.rate = r
        },
        .init(key: "reap_yield", value: "DURATION") { o, v, _ in
            let ns = try duration(v, "reap_yield", "a duration up to 10s, such as 0, 5ms or 50ms")
            guard ns <= Duration.seconds(10).nanoseconds else {
                throw ValidationError("-o reap_yield= takes a duration up to 10s, such as 0, 5ms or 50ms")
            }
            o.filesystem.deleting.reaping.yieldToForeground = ns
        },
        .init(key: "client", value: "ID") { o, v, _ in
            do {
                o.filesystem.deleting.client = try ClientID(v ?? "")
            } catch {
                throw ValidationError("-o client=: \(error)")
            }
        },
        .init(key: "lease", value: "DURATION") { o, v, _ in
            let ns = try duration(v, "lease", "a duration of at least 4s, such as 30s or 2m")
            guard ns >= Duration.seconds(4).nanoseconds else {
                throw ValidationError("-o lease= takes a duration of at least 4s, such as 30s or 2m")
            }
            o.filesystem.deleting.leaseLength = ns
        },
        .init(key: "noevents", value: "") { o, _, _ in o.events = false },
        .init(key: "events_max_bytes", value: "SIZE") { o, v, _ in
            guard let v, let n = Quantity.bytes(v), n >= 1 << 20 else {
                throw ValidationError("-o events_max_bytes= takes a size of at least 1M")
            }
            o.journalLimits.maxBytes = n
        },
        // The atime options every mount knows: they apply to the source (see AtimeMode).
        .init(key: "noatime", value: "", listed: false) { o, _, item in
            o.filesystem.atime = .noatime
            o.fuse.append(item)
        },
        .init(key: "relatime", value: "", listed: false) { o, _, _ in o.filesystem.atime = .relatime },
        .init(key: "strictatime", value: "", listed: false) { o, _, _ in o.filesystem.atime = .strictatime },
        .init(key: "nodiratime", value: "", listed: false) { o, _, _ in o.filesystem.atime = .nodiratime },
    ] + ["atime", "diratime", "norelatime", "nostrictatime"].map { key in
        OptionSpec(key: key, value: "", listed: false) { o, _, _ in o.filesystem.atime = .backing }
    } + ["lazytime", "nolazytime"].map { key in
        // Accepted for fstab's sake; a FUSE mount has no lazy time updates to give.
        OptionSpec(key: key, value: "", listed: false) { _, _, _ in }
    } + ["no_default_permissions", "nodefault_permissions"].map { key in
        OptionSpec(key: key, value: "", listed: false) { _, _, _ in
            throw ValidationError("""
                Vanish always lets the kernel check permissions when other users may \
                use the mount; without that they would act with the daemon's rights.
                """)
        }
    }

    static let specs = Dictionary(uniqueKeysWithValues: table.map { ($0.key, $0) })

    /// The options `vanish help mount` lists, as they are written.
    static var usage: String { table.filter(\.listed).map(\.usage).joined(separator: ", ") }

    private static func choices<E: CaseIterable & RawRepresentable>(_: E.Type) -> String where E.RawValue == String {
        E.allCases.map(\.rawValue).joined(separator: "|")
    }

    private static func choice<E: CaseIterable & RawRepresentable>(_ v: String?, _ key: String) throws -> E
        where E.RawValue == String {
        guard let v, let mode = E(rawValue: v) else {
            throw ValidationError("-o \(key)= takes one of: \(E.allCases.map(\.rawValue).joined(separator: ", "))")
        }
        return mode
    }

    private static func number(_ v: String?, _ key: String, _ range: ClosedRange<Int>, _ what: String) throws -> Int {
        guard let v, let n = Int(v), range.contains(n) else { throw ValidationError("-o \(key)= takes \(what)") }
        return n
    }

    private static func duration(_ v: String?, _ key: String, _ what: String) throws -> UInt64 {
        guard let v, let ns = Quantity.duration(v) else { throw ValidationError("-o \(key)= takes \(what)") }
        return ns
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
        return Duration.seconds(v * (scale ?? 1)).nanoseconds
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
