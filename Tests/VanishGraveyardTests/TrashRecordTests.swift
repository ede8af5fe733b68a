import Testing
@testable import VanishGraveyard

/// The sidecar format, in process: each version reads back as written, and
/// an ordinary record stays in the version older daemons read.
@Suite("trash records")
struct TrashRecordTests {
    @Test("records round-trip; only held ones use version 3, directories with their origin version 4; a newline in the path survives")
    func roundTrip() throws {
        let path = Array("a dir/with\nnewline".utf8)
        let plain = TrashRecord(path: path, uid: 65534, gid: 65534, bytes: 4096, kind: .file, window: 3_600_000_000_000)
        #expect(Array(plain.encoded().prefix(15)) == Array("vanish-trash 2\n".utf8))
        #expect(TrashRecord(decoding: plain.encoded()) == plain)
        for held in [TrashRecord.Held.taken, .gone, .failed] {
            let kept = TrashRecord(path: path, uid: 1, gid: 2, bytes: nil, kind: .directory, window: 0, held: held)
            #expect(Array(kept.encoded().prefix(15)) == Array("vanish-trash 3\n".utf8))
            #expect(TrashRecord(decoding: kept.encoded()) == kept)
        }
        // Where a directory was deleted from: version 4, held or not.
        for held in [nil, TrashRecord.Held.stuck] {
            let from = TrashRecord.Origin(inode: 1 << 40, birth: 1_700_000_000_123_456_789)
            let dir = TrashRecord(path: path, uid: 7, gid: 8, bytes: nil, kind: .directory, window: 5, held: held, from: from)
            #expect(Array(dir.encoded().prefix(15)) == Array("vanish-trash 4\n".utf8))
            #expect(TrashRecord(decoding: dir.encoded()) == dir)
        }
        let first = Array("vanish-trash 1\n0 0 - f\nold".utf8)
        #expect(TrashRecord(decoding: first) == TrashRecord(path: Array("old".utf8), uid: 0, gid: 0, bytes: nil, kind: .file))
    }

    @Test("bad records are refused, not misread", arguments: [
        "vanish-trash 3\n0 0 - f - \nx",          // version 3 without a reason
        "vanish-trash 3\n0 0 - f - lost\nx",      // an unknown reason
        "vanish-trash 2\n0 0 - f - taken\nx",     // a reason in version 2
        "vanish-trash 9\n0 0 - f -\nx",
        "vanish-trash 2\n0 0 - q -\nx",           // an unknown kind
        "vanish-trash 2\n",
        "vanish-trash 4\n0 0 - d - - 12\nx",     // an origin without a birth time
        "vanish-trash 4\n0 0 - d - - x:1\nx",
        "vanish-trash 4\n0 0 - d - -\nx",       // no origin
    ])
    func refused(_ text: String) {
        #expect(TrashRecord(decoding: Array(text.utf8)) == nil)
    }
}
