import Testing
@testable import VanishClient

/// The control protocol's JSON, which every `vanish` subcommand and subscriber relies on.
@Suite("JSON values")
struct JSONTests {
    @Test("objects round-trip with sorted keys, no spaces and no \\/ escapes")
    func roundTrip() throws {
        let text = #"{"b":[1,-2.5,true,false,null],"a":"x/y","c":{"n":18446744073709551615}}"#
        let v = try #require(JSON.parse(text))
        #expect(v.serialized == #"{"a":"x/y","b":[1,-2.5,true,false,null],"c":{"n":18446744073709551615}}"#)
        #expect(v["c"]?["n"]?.uint64 == UInt64.max, "a UInt64 keeps every digit")
        #expect(v["b"]?.array?[1].double == -2.5)
        #expect(v["b"]?.array?[0].int == 1)
        #expect(JSON.parse(v.serialized) == v)
    }

    @Test("string escapes: quotes, backslashes, control characters, \\u escapes and surrogate pairs")
    func escapes() throws {
        let v = try #require(JSON.parse(#"{"s":"a\"b\\c\nd\te\u0001\u00e9\ud83d\ude00/"}"#))
        #expect(v["s"]?.string == "a\"b\\c\nd\te\u{1}é😀/")
        #expect(JSON.string("a\"b\\c\nd\u{1}é").serialized == #""a\"b\\c\nd\u0001é""#)
        #expect(JSON.parse(JSON.string("line\nbreak \u{7f} ünï").serialized)?.string == "line\nbreak \u{7f} ünï")
    }

    @Test("what is not JSON is refused, not half-read")
    func invalid() {
        for bad in ["", "{", #"{"a":}"#, #"{"a":1,}"#, "[1 2]", #""open"#, "tru", "{}x", #"{"a":"\q"}"#,
                    String(repeating: "[", count: 10_000)] {
            #expect(JSON.parse(bad) == nil, "\(bad.prefix(20))")
        }
        #expect(JSON.parse(" \n{} \t") == .object([:]))
    }

    @Test("path bytes that are not UTF-8 travel as base64 beside a display string")
    func pathBytes() throws {
        for bytes: [UInt8] in [[], [0xFF], [0x61, 0xFE, 0x0A], Array(0...255), [0x66, 0x6F, 0x6F]] {
            var o: [String: JSON] = [:]
            PathBytes(bytes).put(into: &o, key: "path")
            let back = try #require(JSON.parse(JSON.object(o).serialized))
            #expect(PathBytes.get(back, key: "path")?.bytes == bytes)
            #expect((back["path_b64"] != nil) == (String(validating: bytes, as: UTF8.self) == nil))
        }
        #expect(Base64.encode(Array("Man".utf8)) == "TWFu")
        #expect(Base64.encode(Array("Ma".utf8)) == "TWE=")
        #expect(Base64.decode("TQ==") == Array("M".utf8))
        #expect(Base64.decode("T") == nil)
    }
}
