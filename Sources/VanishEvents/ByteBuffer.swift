/// A growable run of bytes for building event records and JSON lines: an
/// append is a capacity check and a memcpy. perf showed Array's generic
/// `append(contentsOf:)` (a call, a uniqueness check and a capacity check
/// for every key, quote and number) as the journal writer's largest cost.
///
/// Noncopyable, so no copy-on-write check is ever needed and the memory has
/// exactly one owner, which is what makes sending it between threads safe.
struct ByteBuffer: ~Copyable, @unchecked Sendable {
    private var base: UnsafeMutableRawPointer
    private(set) var count = 0
    private(set) var capacity: Int
    private let initialCapacity: Int

    init(capacity: Int) {
        initialCapacity = max(capacity, 16)
        self.capacity = initialCapacity
        base = .allocate(byteCount: initialCapacity, alignment: 8)
    }

    deinit { base.deallocate() }

    var isEmpty: Bool { count == 0 }

    /// The bytes appended so far; valid until the next change.
    var bytes: UnsafeRawBufferPointer { UnsafeRawBufferPointer(start: base, count: count) }

    @inline(__always)
    mutating func append(_ start: UnsafeRawPointer, count n: Int) {
        if count + n > capacity { grow(to: count + n) }
        (base + count).copyMemory(from: start, byteCount: n)
        count += n
    }

    @inline(__always)
    mutating func append(_ bytes: UnsafeRawBufferPointer) {
        if let start = bytes.baseAddress { append(start, count: bytes.count) }
    }

    @inline(__always)
    mutating func append(_ bytes: UnsafeBufferPointer<UInt8>) {
        append(UnsafeRawBufferPointer(bytes))
    }

    @inline(__always)
    mutating func append(_ byte: UInt8) {
        if count == capacity { grow(to: count + 1) }
        base.storeBytes(of: byte, toByteOffset: count, as: UInt8.self)
        count += 1
    }

    /// The in-memory representation of `value` (a header, a number).
    @inline(__always)
    mutating func append<T: BitwiseCopyable>(bytesOf value: T) {
        withUnsafeBytes(of: value) { append($0) }
    }

    private mutating func grow(to needed: Int) {
        let grown = max(needed, capacity * 2)
        let fresh = UnsafeMutableRawPointer.allocate(byteCount: grown, alignment: 8)
        fresh.copyMemory(from: base, byteCount: count)
        base.deallocate()
        base = fresh
        capacity = grown
    }

    /// Empties it. The memory is kept for the next burst unless it grew past
    /// `limit` bytes (a one-off flood's), which goes back to the allocator.
    mutating func removeAll(keepingAtMost limit: Int) {
        count = 0
        guard capacity > limit else { return }
        base.deallocate()
        capacity = initialCapacity
        base = .allocate(byteCount: capacity, alignment: 8)
    }
}
