import ArgumentParser
import Glibc
import VanishClient

/// Runs `vanish rm` without starting the argument parser where it can
/// (see `RemoveCommand.fastPath`), everything else through it.
@main
enum Main {
    static func main() {
        // Paths are bytes: arguments that are not UTF-8 keep theirs (see RawArguments).
        let arguments = RawArguments.decode()
        if let code = RemoveCommand.fastPath(arguments.dropFirst()) { exit(code) }
        Vanish.main(Array(arguments.dropFirst()))
    }
}

/// `vanish`: the command-line face of the filesystem.
struct Vanish: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "vanish",
        abstract: "A FUSE overlay filesystem where deleting is instant.",
        discussion: """
            Exit codes: 0 success; 1 the operation failed (the message says why); \
            64 bad command-line arguments.
            """,
        version: VanishVersion.current,
        subcommands: [MountCommand.self, UnmountCommand.self, RemoveCommand.self, StatusCommand.self, ReapCommand.self,
                      TrashCommand.self, RestoreCommand.self, EventsCommand.self]
    )
}
