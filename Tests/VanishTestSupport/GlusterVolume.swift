import Foundation
import Glibc
import Synchronization

/// Whether the GlusterFS tests can run: glusterd, the gluster CLI and the
/// client's mount helper (Debian's glusterfs-server and glusterfs-client,
/// which `mount-scripts/install --deps-only` installs). Under CI=true they
/// always run, so a missing one fails instead of skipping.
public enum GlusterAvailability {
    public static var missing: String? {
        for tool in ["glusterd", "gluster", "mount.glusterfs"] where which(tool) == nil {
            return "\(tool) not found (Debian: apt-get install glusterfs-server glusterfs-client)"
        }
        if !FUSEAvailability.isRoot { return "GlusterFS volumes need root" }
        return nil
    }

    public static var shouldRun: Bool { FUSEAvailability.shouldRun && (missing == nil || FUSEAvailability.isCI) }
}

/// A replica-2 GlusterFS volume on two brick directories of this machine,
/// mounted by several separate clients (each `mount -t glusterfs` is one),
/// as machines sharing a volume would see it. glusterd is started if it
/// does not run, and stopped again; the volume, its mounts and bricks are
/// removed by `close`, also when a test fails.
public final class GlusterVolume {
    public let name: String
    public let base: String
    /// Each client's mount of the volume.
    public let clients: [String]
    public let bricks: [String]
    private var startedDaemon = false
    private var created = false
    private var closed = false

    private static let counter = Mutex(0)

    public init(clients count: Int = 2) throws {
        if let why = GlusterAvailability.missing { throw TestFailure("GlusterFS tests cannot run: \(why)") }
        let dir = try makeTempDirectory("vanish-gluster")
        base = dir
        name = "vanishtest\(getpid())x\(GlusterVolume.counter.withLock { $0 += 1; return $0 })"
        bricks = [dir + "/brick1", dir + "/brick2"]
        clients = (1...count).map { dir + "/client\($0)" }
        do {
            for dir in bricks + clients { mkdir(dir, 0o755) }
            try startDaemon()
            let host = try GlusterVolume.hostName()
            try gluster(["volume", "create", name, "replica", "2"] + bricks.map { "\(host):\($0)" } + ["force"])
            created = true
            try gluster(["volume", "start", name])
            for dir in clients {
                let r = try run(["mount", "-t", "glusterfs", "\(host):/\(name)", dir])
                guard r.ok else { throw TestFailure("mounting the volume at \(dir): \(r.stderr)") }
            }
            let mounts = clients
            try waitFor("the clients to see the volume", timeout: 30) {
                mounts.allSatisfy { mountType(at: $0) == "fuse.glusterfs" && access($0 + "/.", W_OK) == 0 }
            }
        } catch {
            close()
            throw error
        }
    }

    deinit { close() }

    /// Runs the gluster CLI without questions; a failure throws with its output.
    @discardableResult
    public func gluster(_ arguments: [String]) throws -> String {
        let r = try run(["gluster", "--mode=script"] + arguments)
        guard r.ok else { throw TestFailure("gluster \(arguments.joined(separator: " ")): \(r.stdout) \(r.stderr)") }
        return r.stdout
    }

    private func startDaemon() throws {
        // One the previous test stopped may still be on its way out.
        try waitFor("a stopping glusterd to exit or answer", timeout: 30) {
            try !run(["pgrep", "-x", "glusterd"]).ok || run(["gluster", "--mode=script", "volume", "list"]).ok
        }
        if try run(["pgrep", "-x", "glusterd"]).ok { return }
        let r = try run(["glusterd"])
        guard r.ok else { throw TestFailure("glusterd did not start: \(r.stderr)") }
        startedDaemon = true
        try waitFor("glusterd to answer", timeout: 30) { (try? run(["gluster", "--mode=script", "volume", "list"]))?.ok == true }
    }

    /// glusterd refuses loopback addresses in brick names; the host name resolves to this machine.
    private static func hostName() throws -> String {
        var buffer = [CChar](repeating: 0, count: 256)
        gethostname(&buffer, 255)
        let host = String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        guard try run(["getent", "hosts", host]).ok else { throw TestFailure("the host name \(host) does not resolve") }
        return host
    }

    public func close() {
        guard !closed else { return }
        closed = true
        for dir in clients where mountType(at: dir) != nil {
            if (try? run(["umount", dir]))?.ok != true { _ = try? run(["umount", "-l", dir]) }
        }
        if created {
            _ = try? run(["gluster", "--mode=script", "volume", "stop", name, "force"])
            _ = try? run(["gluster", "--mode=script", "volume", "delete", name])
        }
        if startedDaemon {
            // glusterd, and the self-heal daemon it started for the volume.
            _ = try? run(["pkill", "-x", "glusterd"])
            _ = try? run(["pkill", "-f", "glustershd"])
            try? waitFor("glusterd to exit", timeout: 30) { (try? run(["pgrep", "-x", "glusterd"]))?.ok == false }
        }
        removeLocalLogs()
        removeTree(base)
    }

    /// On a network volume each client mount's log of answered unlinks is
    /// kept on the machine, named after the client and a 64-bit FNV-1a hash
    /// of the source path (see `UnlinkIntents.open`): the ones of mounts of
    /// this volume go with it.
    private func removeLocalLogs() {
        let dir = "/var/lib/vanish"
        guard let names = try? FileManager.default.contentsOfDirectory(atPath: dir) else { return }
        let hashes = clients.map { path -> String in
            var h: UInt64 = 0xcbf2_9ce4_8422_2325
            for b in path.utf8 { h = (h ^ UInt64(b)) &* 0x0000_0100_0000_01b3 }
            let hex = String(h, radix: 16)
            return String(repeating: "0", count: 16 - hex.count) + hex
        }
        for name in names where name.hasPrefix("unlinks-") && hashes.contains(where: { name.hasSuffix("-" + $0) }) {
            unlink(dir + "/" + name)
        }
    }
}

/// A fresh volume with `clients` mounts for `body`; everything goes afterwards.
public func withGlusterVolume<R>(clients: Int = 2, _ body: (GlusterVolume) throws -> R) throws -> R {
    let volume = try GlusterVolume(clients: clients)
    defer { volume.close() }
    return try body(volume)
}
