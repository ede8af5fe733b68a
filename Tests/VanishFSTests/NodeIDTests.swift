import Glibc
import Testing
@testable import VanishFS

/// Node ids that carry backing handles, and the handle layouts they are
/// rebuilt from (in-process: no mount).
@Suite("node ids and handle layouts")
struct NodeIDTests {
    @Test("an encoded id gives back its number and generation; counted ids and the root never decode")
    func roundTrip() {
        for (ino, generation) in [(UInt64(2), UInt32(0)), (12, 0xDEAD_BEEF), (0x7FFF_FFFF, UInt32.max)] {
            let id = NodeID.encoded(ino: ino, generation: generation)
            #expect(id != nil)
            #expect(id.flatMap(NodeID.decoded).map { [$0.ino, UInt64($0.generation)] } == [ino, UInt64(generation)])
        }
        #expect(NodeID.encoded(ino: 1, generation: 0) == nil)
        #expect(NodeID.encoded(ino: 0x8000_0000, generation: 7) == nil)
        for n: UInt64 in [1, 2, 0x7FFF_FFFF, 0x8000_0000, 1 << 40] {
            #expect(NodeID.decoded(NodeID.counted(n)) == nil)
        }
        // Counted ids are distinct.
        let ids = Set((1...5000).map { NodeID.counted(UInt64($0) * 0x10001) })
        #expect(ids.count == 5000)
    }

    /// A handle as `vanish_file_handle` gives it: type, then the bytes.
    func handle(type: UInt32, _ fields: [(UInt64, Int)]) -> [UInt8] {
        var out = withUnsafeBytes(of: type) { Array($0) }
        for (value, width) in fields {
            out += width == 4 ? withUnsafeBytes(of: UInt32(truncatingIfNeeded: value)) { Array($0) }
                              : withUnsafeBytes(of: value) { Array($0) }
        }
        return out
    }

    @Test("the layouts of ext4, tmpfs, XFS and btrfs handles are learnt from the root's and rebuilt exactly")
    func layouts() throws {
        // (root handle, its number, another file's handle, its number, its generation)
        let cases: [([UInt8], UInt64, [UInt8], UInt64, UInt32)] = [
            (handle(type: 1, [(2, 4), (0, 4)]), 2, handle(type: 1, [(5000, 4), (0xABCD, 4)]), 5000, 0xABCD),
            (handle(type: 1, [(0x11, 4), (1, 8)]), 1, handle(type: 1, [(0x22, 4), (77, 8)]), 77, 0x22),
            (handle(type: 0x81, [(128, 8), (9, 4)]), 128, handle(type: 0x81, [(131, 8), (0x19C0_046F, 4)]), 131, 0x19C0_046F),
            (handle(type: 0x4D, [(256, 8), (5, 8), (3, 4)]), 256, handle(type: 0x4D, [(300, 8), (5, 8), (8, 4)]), 300, 8),
        ]
        for (root, rootIno, other, ino, generation) in cases {
            let codec = try #require(root.withUnsafeBytes { HandleCodec(root: $0, ino: rootIno) })
            #expect(other.withUnsafeBytes { codec.generation(of: $0, ino: ino) } == generation)
            #expect(codec.withHandle(ino: ino, generation: generation) { Array($0) } == other)
            // Another number than the file's, or another subvolume, is not this layout.
            #expect(other.withUnsafeBytes { codec.generation(of: $0, ino: ino + 1) } == nil)
        }
        let otherSubvolume = handle(type: 0x4D, [(300, 8), (6, 8), (8, 4)])
        let btrfs = try #require(handle(type: 0x4D, [(256, 8), (5, 8), (3, 4)]).withUnsafeBytes { HandleCodec(root: $0, ino: 256) })
        #expect(otherSubvolume.withUnsafeBytes { btrfs.generation(of: $0, ino: 300) } == nil)
        // A handle of a shape not known here (overlayfs, FUSE) gives no codec.
        #expect(handle(type: 0xFB, [(1, 8), (2, 8), (3, 8)]).withUnsafeBytes { HandleCodec(root: $0, ino: 1) } == nil)
    }
}
