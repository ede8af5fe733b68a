import Testing
@testable import VanishFS

/// The set statahead keeps of the names it stat'ed while reading a
/// directory ahead (in-process: no mount). It must never miss a name it
/// holds, and hold few others, or lookups in another order than the
/// listing's would look like hits and keep it reading.
@Suite("statahead's set of names read")
struct StatedNamesTests {
    @Test("every name inserted is found; few others are")
    func membership() {
        let set = StatedNames()
        for i in 0..<200 { "f\(i)".withCString { set.insert($0) } }
        for i in 0..<200 { #expect("f\(i)".withCString { set.contains($0) }, "f\(i)") }
        // 200 of 4,096 bits set: about 5% of other names collide.
        let others = (1000..<11000).filter { i in "f\(i)".withCString { set.contains($0) } }.count
        #expect(others < 1000, "\(others) of 10,000 names not inserted were found")
    }

    @Test("the empty set finds nothing, the empty name included")
    func empty() {
        let set = StatedNames()
        #expect(!"".withCString { set.contains($0) })
        #expect(!"f0".withCString { set.contains($0) })
    }
}
