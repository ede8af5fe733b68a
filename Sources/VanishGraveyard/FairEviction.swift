/// Which kept entries the undo window gives up when its limits
/// (`keep_max_bytes`, `keep_min_free`) need `wanted` bytes back: the
/// largest users' oldest entries first. Every user may keep up to one
/// common cap, the largest for which what all of them keep fits (max-min
/// fairness), so no user's entries go because another user deleted a lot:
/// nobody's 32 MiB of junk cannot push out root's one kept file.
enum FairEviction {
    /// `items` are the candidates, oldest first, with their owners and
    /// known sizes (0 for unknown); returns the indices of those to give up.
    /// Where sizes are unknown and the fair share frees too little, the
    /// oldest of the rest go too: under pressure, freeing too much beats
    /// running out.
    static func choose(_ items: [(uid: UInt32, bytes: UInt64)], wanted: UInt64) -> [Int] {
        guard wanted > 0, !items.isEmpty else { return [] }
        var totals: [UInt32: UInt64] = [:]
        for item in items { totals[item.uid, default: 0] += item.bytes }
        let total = totals.values.reduce(0, +)
        let cap = Self.cap(totals.values.sorted(), keeping: total > wanted ? total - wanted : 0)
        var kept = totals
        var chosen: [Int] = []
        var freed: UInt64 = 0
        var taken = [Bool](repeating: false, count: items.count)
        for (i, item) in items.enumerated() where kept[item.uid, default: 0] > cap {
            kept[item.uid, default: 0] -= item.bytes
            freed += item.bytes
            chosen.append(i)
            taken[i] = true
        }
        for (i, item) in items.enumerated() where freed < wanted && !taken[i] {
            freed += item.bytes
            chosen.append(i)
        }
        return chosen
    }

    /// The largest cap such that the users' totals (ascending), each held
    /// to it, add up to no more than `keeping`.
    static func cap(_ totals: [UInt64], keeping: UInt64) -> UInt64 {
        var left = keeping
        var users = UInt64(totals.count)
        for t in totals {
            let share = left / users
            if t > share { return share }
            left -= t
            users -= 1
        }
        return .max
    }
}
