import Testing
import VanishClient

@Suite("control protocol")
struct ControlProtocolTests {
    @Test("entry ids: the daemon's own and another deleter's are ids; paths and near misses are not", arguments: [
        ("18eebfff6ee0310f-00003e2b-0000000003", true),
        ("0000000000000000-00004c8f-0000000004-0000fffe0000fffecb4984598ed09b6b", true),
        ("18eebfff6ee0310f-00003e2b-000000000", false),
        ("18EEBFFF6EE0310F-00003E2B-0000000003", false),
        ("18eebfff6ee0310f-00003e2b-0000000003-0000fffe0000fffecb4984598ed09b6", false),
        ("some/file/named/like/an/id/of/36/c", false),
    ])
    func entryIDs(_ id: String, _ valid: Bool) {
        #expect(ControlProtocol.isEntryID(id) == valid)
    }

    @Test("an event cursor reads and writes INSTANCE:SEQ, and nothing else")
    func eventCursor() {
        let c = EventCursor("7dd570b89469b270:1234")
        #expect(c == EventCursor(instance: "7dd570b89469b270", sequence: 1234))
        #expect(c?.description == "7dd570b89469b270:1234")
        for bad in ["", ":", "abc", "abc:", ":12", "a:b", "a:1:2", "a:-1", "a:18446744073709551616"] {
            #expect(EventCursor(bad) == nil, "\(bad)")
        }
    }
}
