import Foundation
import Glibc
import Testing
import VanishTestSupport
@testable import vanish

@Suite("vanish command line")
struct CLITests {
    @Test("--version and --help")
    func versionAndHelp() throws {
        let v = try run([vanishBinary, "--version"])
        #expect(v.ok)
        #expect(v.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "0.1.0")
        let h = try run([vanishBinary, "--help"])
        #expect(h.ok)
        #expect(h.stdout.contains("mount"))
        #expect(h.stdout.contains("unmount"))
        #expect(h.stdout.contains("Exit codes"))
    }

    @Test("vanish rm reads rm's options from one table, and --help shows every option of it")
    func rmOptionsTable() throws {
        let help = RemoveCommand.helpMessage(columns: 200)
        for option in RmOption.table {
            for letter in option.letters { #expect(help.contains("-\(letter)"), "--help lacks -\(letter)") }
            if let long = option.long { #expect(help.contains(long), "--help lacks \(long)") }
        }
        let rf = try #require(RmInvocation(["-rf", "a", "--", "-v"]))
        #expect(rf.recursive && rf.force && !rf.asks && !rf.verbose && !rf.unknownOption)
        #expect(rf.options == ["-rf"] && rf.operands == ["a", "-v"])
        let asks = try #require(RmInvocation(["-R", "--interactive", "--wait", "b"]))
        #expect(asks.recursive && asks.asks && asks.wait && asks.options == ["-R", "--interactive"])
        let never = try #require(RmInvocation(["-ri", "--interactive=never", "-f", "c"]))
        #expect(!never.asks, "the last of -i, --interactive=never and -f wins, as in rm")
        #expect(try #require(RmInvocation(["-rx", "d"])).unknownOption)
        #expect(try #require(RmInvocation(["--recursiv", "d"])).unknownOption, "an abbreviation is rm's to read")
        #expect(RmInvocation(["-r", "--help"]) == nil)
    }
}
