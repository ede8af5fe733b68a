import Foundation
import Glibc
import Testing
import VanishTestSupport

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
}
