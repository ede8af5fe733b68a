/// Vanish's release, as `vanish --version` prints it and a daemon reports it
/// in its status (`version`): a daemon may run an older binary than the CLI.
public enum VanishVersion {
    public static let current = "0.1.0"
}
