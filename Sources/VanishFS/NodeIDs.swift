import CFuse
import CLinux
import Glibc

/// FUSE node ids that name their backing file by themselves, so that the
/// kernel's file handles of the mount (a node id and a generation) outlive
/// its inode cache and the mount itself (see docs/design.md, "Exportable
/// file handles").
///
/// An id carries the backing inode number (below 2^31) in its low half and
/// the backing file's generation in its high half: from the id alone the
/// daemon rebuilds the backing file's handle (`HandleCodec`) and opens it,
/// which is what the kernel asks (a LOOKUP of ".") when it meets a handle of
/// a file it no longer holds. Other files (a larger number, another
/// filesystem than the source's, handles of a shape not known here) get
/// counted ids, with bit 31 set so the two never meet, valid while the
/// kernel holds them.
enum NodeID {
    static let countedBit: UInt64 = 0x8000_0000

    /// The id for backing inode `ino` of generation `generation`, if it fits.
    static func encoded(ino: UInt64, generation: UInt32) -> UInt64? {
        guard ino < countedBit else { return nil }
        let id = UInt64(generation) << 32 | ino
        return id > UInt64(FUSE_ROOT_ID) ? id : nil
    }

    /// The inode number and generation an encoded id carries; nil for a counted id.
    static func decoded(_ id: UInt64) -> (ino: UInt64, generation: UInt32)? {
        guard id & countedBit == 0, id > UInt64(FUSE_ROOT_ID) else { return nil }
        return (id & (countedBit - 1), UInt32(truncatingIfNeeded: id >> 32))
    }

    /// The `n`th counted id (n ≥ 1): bit 31 set, the count in the other 63 bits.
    static func counted(_ n: UInt64) -> UInt64 {
        (n >> 31) << 32 | countedBit | (n & (countedBit - 1))
    }
}

/// The layout of the backing filesystem's file handles, learnt from the
/// source root's own handle: where the inode number and the generation sit.
/// Every other byte of a handle must equal the root's (a btrfs subvolume's
/// id, say), and every handle is checked against the layout before its
/// generation is trusted, so a filesystem that does not fit gets counted
/// ids, never a wrong file.
struct HandleCodec: Sendable {
    /// Byte offsets into the handle (after its 4-byte type).
    struct Shape: Sendable, Equatable {
        let length: Int
        let ino: Int
        let inoWidth: Int
        let generation: Int
    }

    /// The shapes of handles Linux filesystems give without a parent: ext2-4
    /// (and XFS with 32-bit numbers): number, generation; tmpfs: generation,
    /// 64-bit number; XFS: 64-bit number, generation; btrfs: 64-bit number,
    /// subvolume, generation.
    static let shapes = [
        Shape(length: 8, ino: 0, inoWidth: 4, generation: 4),
        Shape(length: 12, ino: 4, inoWidth: 8, generation: 0),
        Shape(length: 12, ino: 0, inoWidth: 8, generation: 8),
        Shape(length: 20, ino: 0, inoWidth: 8, generation: 16),
    ]

    /// The root's handle as `vanish_file_handle` gives it: its type (4 bytes), then the handle.
    let template: [UInt8]
    let shape: Shape
    /// A directory of the filesystem opened for reading (open_by_handle_at
    /// takes no O_PATH fd), set by the mount; -1 in tests of the layout.
    var mountFD: Int32 = -1

    /// The codec for handles like `root` (the handle of the directory numbered `ino`).
    init?(root: UnsafeRawBufferPointer, ino: UInt64) {
        guard let shape = Self.shapes.first(where: {
            root.count == 4 + $0.length && Self.field(root, 4 + $0.ino, $0.inoWidth) == ino
        }) else { return nil }
        self.shape = shape
        template = Array(root)
    }

    /// The generation in `handle`, the handle of the file numbered `ino`;
    /// nil if the handle does not have the root's layout.
    func generation(of handle: UnsafeRawBufferPointer, ino: UInt64) -> UInt32? {
        guard let (number, generation) = numberAndGeneration(of: handle), number == ino else { return nil }
        return generation
    }

    /// The inode number and generation `handle` carries; nil if it does not have the root's layout.
    func numberAndGeneration(of handle: UnsafeRawBufferPointer) -> (ino: UInt64, generation: UInt32)? {
        guard handle.count == template.count else { return nil }
        let inoRange = (4 + shape.ino)..<(4 + shape.ino + shape.inoWidth)
        let generationRange = (4 + shape.generation)..<(4 + shape.generation + 4)
        for i in 0..<template.count where !inoRange.contains(i) && !generationRange.contains(i) {
            if handle[i] != template[i] { return nil }
        }
        return (Self.field(handle, 4 + shape.ino, shape.inoWidth),
                UInt32(truncatingIfNeeded: Self.field(handle, 4 + shape.generation, 4)))
    }

    /// Calls `body` with the handle of the file numbered `ino` of generation `generation`.
    func withHandle<R>(ino: UInt64, generation: UInt32, _ body: (UnsafeRawBufferPointer) -> R) -> R {
        withUnsafeTemporaryAllocation(byteCount: template.count, alignment: 8) { out in
            template.withUnsafeBytes { out.copyMemory(from: $0) }
            if shape.inoWidth == 4 {
                out.storeBytes(of: UInt32(truncatingIfNeeded: ino), toByteOffset: 4 + shape.ino, as: UInt32.self)
            } else {
                out.storeBytes(of: ino, toByteOffset: 4 + shape.ino, as: UInt64.self)
            }
            out.storeBytes(of: generation, toByteOffset: 4 + shape.generation, as: UInt32.self)
            return body(UnsafeRawBufferPointer(out))
        }
    }

    /// Opens (with `flags`) the file numbered `ino` of generation
    /// `generation`; the fd, or -1 with errno.
    func open(ino: UInt64, generation: UInt32, flags: Int32) -> Int32 {
        withHandle(ino: ino, generation: generation) { h in
            vanish_open_by_handle(mountFD, h.baseAddress!.assumingMemoryBound(to: UInt8.self), Int32(h.count), flags)
        }
    }

    /// A field of `width` bytes (4 or 8) at `offset`, in the machine's byte order as the kernel writes it.
    private static func field(_ bytes: UnsafeRawBufferPointer, _ offset: Int, _ width: Int) -> UInt64 {
        width == 4 ? UInt64(bytes.loadUnaligned(fromByteOffset: offset, as: UInt32.self))
                   : bytes.loadUnaligned(fromByteOffset: offset, as: UInt64.self)
    }
}
