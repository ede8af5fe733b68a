import Testing
import VanishClient

/// The status schema the daemon writes and the CLI reads: one type for both.
@Suite("mount status")
struct MountStatusTests {
    @Test("every field survives the JSON the daemon writes and the CLI reads; an older daemon's missing fields keep defaults")
    func roundTrip() throws {
        var s = MountStatus()
        s.version = "0.1.0"; s.pid = 42; s.source = "/srv/a\"b"; s.stateDirectory = "/var/lib/vanish/in-place/a-0/.vanish"
        s.graveyard = true; s.pendingEntries = 7; s.etaSeconds = 3; s.reaperIdle = false
        s.reapFilesPerSecond = 1000; s.reapEntriesPerSecond = 9; s.reapedEntries = 5; s.freedFiles = 4005
        s.freedDirectories = 5; s.freedDataBytes = 123; s.freedBytes = 1 << 40; s.buriedEntries = 11
        s.reaperWorkers = 2; s.freeBytes = 1 << 33; s.restorableEntries = 1; s.stuckEntries = 1
        s.restorableBytes = 4096; s.keepSeconds = 3600; s.graveyardBytes = 8 << 20; s.socket = "/run/vanish/x.sock"
        s.knownInodes = 9; s.stataheadEntries = 3; s.cachedFDs = 2; s.fdCacheLimit = 100
        s.kernelFeatures = "passthrough"; s.passthrough = "on"; s.spinMicroseconds = 50; s.cacheSeconds = 3600
        s.fileHandles = "exportable"; s.requests.channel = "io_uring"; s.requests.queues = 2; s.requests.queueDepth = 8
        s.requests.threads = 8; s.requests.bufferBytes = 1 << 24; s.requests.spinMicroseconds = 50
        s.client = "host-0123456789ab"; s.leaseSeconds = 60
        s.otherClients = [.init(client: "b-1", pendingEntries: 3, silentSeconds: 70, leaseExpired: true)]
        let text = s.json.serialized
        let parsed = try #require(JSON.parse(text))
        let back = try #require(MountStatus(json: parsed))
        #expect(back == s)
        #expect(text.contains(#""eta_seconds":3"#) && text.contains(#""state_directory":"/var/lib"#))

        var unknown = s
        unknown.etaSeconds = nil; unknown.buriedEntries = nil; unknown.client = nil
        let unknownParsed = try #require(JSON.parse(unknown.json.serialized))
        #expect(MountStatus(json: unknownParsed) == unknown)

        let oldParsed = try #require(JSON.parse(#"{"source":"/s","pending_entries":2}"#))
        let old = try #require(MountStatus(json: oldParsed))
        #expect(old.source == "/s" && old.pendingEntries == 2 && old.version == "unknown" && old.etaSeconds == nil)
        #expect(MountStatus(json: .array([])) == nil)
    }
}
