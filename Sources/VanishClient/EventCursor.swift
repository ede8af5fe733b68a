/// A place in a mount's event stream, `INSTANCE:SEQ`: the journal's
/// instance and the sequence number of the last event seen. Every event
/// carries one; `--since` and `EventSubscription(since:)` resume after it.
public struct EventCursor: Sendable, Equatable, CustomStringConvertible {
    public var instance: String
    public var sequence: UInt64

    public init(instance: String, sequence: UInt64) {
        self.instance = instance
        self.sequence = sequence
    }

    /// Reads `INSTANCE:SEQ`; nil for anything else.
    public init?(_ text: String) {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 2, !parts[0].isEmpty, let sequence = UInt64(parts[1]) else { return nil }
        self.init(instance: String(parts[0]), sequence: sequence)
    }

    public var description: String { "\(instance):\(sequence)" }
}
