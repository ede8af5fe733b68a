import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import Synchronization
import SystemPackage
import Testing
import VanishGraveyard
import VanishTestSupport
@testable import VanishFS

/// The namespace's invariant, in-process on a scratch directory: no name
/// whose burial is pending can be seen through it, however the handlers
/// reach the backing directory, and concurrent use keeps it.
@Suite("backing namespace")
struct BackingNamespaceTests {
    /// A namespace over a fresh directory holding `dir/` and a `grave/`
    /// that queued burials land in (by rename, as the graveyard does).
    final class Fixture: @unchecked Sendable {
        let base: String
        let namespace: BackingNamespace
        let burials: DeferredBurials
        let dir: VanishFS.Inode
        let graveFD: Int32
        let landed = Atomic<Int>(0)
        /// Directories the burials told of (`landed` hook), in order.
        let directoriesTold = Mutex<[InodeKey]>([])
        private let counter = Atomic<Int>(0)

        init() throws {
            base = try makeTempDirectory()
            mkdir(base + "/dir", 0o755)
            mkdir(base + "/grave", 0o755)
            let rootFD = try Sys.open(base, VANISH_O_PATH | O_DIRECTORY)
            let rootStat = try Sys.fstat(rootFD)
            let root = VanishFS.Inode(key: InodeKey(dev: rootStat.st_dev, ino: rootStat.st_ino), type: S_IFDIR, id: 1, generation: 0,
                             parent: nil, name: "")
            root.cache.fd = rootFD
            root.place.lookups = 1
            let table = InodeTable(root: root, codec: nil)
            let burials = DeferredBurials(intents: nil)
            self.burials = burials
            namespace = BackingNamespace(table: table, fdLimit: 64, burials: burials)
            let st = try Sys.lstatat(rootFD, "dir")
            dir = table.remember(st, birth: 0, parent: root, name: "dir")
            graveFD = try Sys.open(base + "/grave", O_RDONLY | O_DIRECTORY)
            // Weak: a strong capture kept the fixture alive for ever, and its directory with it.
            burials.start(land: { [weak self] q in
                guard let self else { return }
                try? namespace.landing(in: q.directory) { pfd in
                    let n = counter.wrappingAdd(1, ordering: .relaxed).newValue
                    _ = q.name.withUnsafeBufferPointer { renameat(pfd, $0.baseAddress!, graveFD, "g\(n)") }
                    landed.wrappingAdd(1, ordering: .relaxed)
                }
            }, landed: { [weak self] dir in
                self?.directoriesTold.withLock { $0.append(dir.key) }
            })
        }

        deinit {
            burials.stop()
            close(graveFD)
            removeTree(base)
        }

        func make(_ name: String) {
            close(open(base + "/dir/" + name, O_CREAT | O_WRONLY, 0o644))
        }

        func onDisk(_ name: String) -> Bool { access(base + "/dir/" + name, F_OK) == 0 }

        /// What unlink does after its checks: a burial begun and queued on its
        /// directory. False if it could not be queued.
        /// `kept`: with a trash record, as an undo window makes.
        @discardableResult
        func queueBurial(_ name: String, by uid: uid_t = 0, kept: Bool = false) throws -> Bool {
            let st = try Sys.lstatat(AT_FDCWD, base + "/dir/" + name)
            let ticket = burials.begin(dir, name, by: uid)
            let file = DeferredBurials.File(st: st, inPlace: false, deleted: 0)
            let record = kept ? TrashRecord(path: Array(("dir/" + name).utf8), uid: uid, gid: uid, bytes: 0, kind: .file,
                                            window: 3_600_000_000_000) : nil
            if let back = burials.queue(ticket, file, in: dir, name: name, caller: Caller(uid: uid, gid: uid, pid: 1, umask: 0),
                                      record: record) {
                back.end()
                return false
            }
            return true
        }

        /// A lookup as the handler makes it.
        func lookup(_ name: String) -> Bool {
            (try? namespace.atName(dir, name) { pfd throws(Errno) in try Sys.lstatat(pfd, name) }) != nil
        }
    }

    @Test("the burial ticket: a name is hidden from begin until the ticket is ended, queued or dropped, and only the first of a directory says so")
    func ticketRule() throws {
        let f = try Fixture()
        f.make("a")
        f.make("b")
        do {
            let first = f.burials.begin(f.dir, "a", by: 0)
            let firstIsFirst = first.first
            #expect(firstIsFirst && f.burials.count == 1)
            let second = f.burials.begin(f.dir, "b", by: 0)
            let secondIsFirst = second.first
            #expect(!secondIsFirst, "another burial was pending in the directory")
            #expect(f.burials.count == 2)
            first.end()
            #expect(f.burials.count == 1)
            // `second` goes out of scope unconsumed: it ends as `end` would.
        }
        #expect(f.burials.count == 0)
        #expect(f.lookup("a") && f.lookup("b"), "an ended burial hides nothing (nothing was renamed)")
        // Queued: the queue holds the claim until it lands the file.
        #expect(try f.queueBurial("a"))
        #expect(f.burials.count == 1)
        #expect(!f.lookup("a"))
        #expect(f.burials.count == 0 && !f.onDisk("a"))
    }

    @Test("each landing tells of its directory once, after its files left it, so the kernel asks for its size again")
    func landingTellsTheDirectory() throws {
        let f = try Fixture()
        for n in ["a", "b", "c"] { f.make(n) }
        for n in ["a", "b", "c"] { try f.queueBurial(n) }
        #expect(f.directoriesTold.withLock { $0.isEmpty }, "nothing landed yet")
        f.burials.landQueued()
        #expect(!f.onDisk("a") && !f.onDisk("b") && !f.onDisk("c"))
        #expect(f.directoriesTold.withLock { $0 } == [f.dir.key])
        // One burial landed on its own, as a lookup of its name does.
        f.make("d")
        try f.queueBurial("d")
        #expect(!f.lookup("d"))
        #expect(f.directoriesTold.withLock { $0 } == [f.dir.key, f.dir.key])
    }

    @Test("a user's look at their trash lands only their own kept burials, after their unlinks still on the way; a pending name is known as such")
    func landsOnlyTheUsersOwn() throws {
        let f = try Fixture()
        for n in ["mine", "theirs", "plain", "late"] { f.make(n) }
        try f.queueBurial("mine", by: 1000, kept: true)
        try f.queueBurial("theirs", by: 0, kept: true)
        try f.queueBurial("plain", by: 1000, kept: false)
        let dirKey = f.dir.key
        #expect("mine".withCString { f.burials.isPending(dirKey, $0) })
        #expect(!"late".withCString { f.burials.isPending(dirKey, $0) })
        f.burials.landQueued(keptFor: 1000)
        #expect(!f.onDisk("mine"), "uid 1000's kept burial landed")
        #expect(f.onDisk("theirs") && f.onDisk("plain"), "root's and the unkept one stay queued")
        #expect(!"mine".withCString { f.burials.isPending(dirKey, $0) })
        #expect("theirs".withCString { f.burials.isPending(dirKey, $0) })
        // An unlink answered but not yet queued: the control socket's listing waits for it.
        let ticket = f.burials.begin(f.dir, "late", by: 1000)
        final class Done: Sendable { let value = Atomic<Bool>(false) }
        let done = Done()
        spawnThread("test-lister") {
            f.burials.landQueued(keptFor: 1000, answered: true)
            done.value.store(true, ordering: .releasing)
        }
        usleep(50_000)
        let early = done.value.load(ordering: .acquiring)
        #expect(!early, "waits for uid 1000's burial on its way")
        let st = try Sys.lstatat(AT_FDCWD, f.base + "/dir/late")
        let record = TrashRecord(path: Array("dir/late".utf8), uid: 1000, gid: 1000, bytes: 0, kind: .file, window: 1)
        if let back = f.burials.queue(ticket, DeferredBurials.File(st: st, inPlace: false, deleted: 0), in: f.dir, name: "late",
                                      caller: Caller(uid: 1000, gid: 1000, pid: 1, umask: 0), record: record) {
            back.end()
            Issue.record("not queued")
        }
        try waitFor("the listing to go on") { done.value.load(ordering: .acquiring) }
        #expect(!f.onDisk("late"), "landed for the listing")
        #expect(f.onDisk("theirs"))
    }

    @Test("a queued burial stays on disk until something could see its name, then lands first")
    func nameSettles() throws {
        let f = try Fixture()
        f.make("a")
        #expect(try f.queueBurial("a"))
        #expect(f.onDisk("a"), "queued, not landed yet")
        #expect(!f.lookup("a"), "a lookup never sees a name whose burial is pending")
        #expect(!f.onDisk("a"))
        #expect(f.burials.count == 0)
    }

    @Test("removing a sibling waits for nothing; the directory's own fd lands its whole queue")
    func directorySettles() throws {
        let f = try Fixture()
        for n in ["a", "b", "c"] { f.make(n) }
        try f.queueBurial("a")
        try f.queueBurial("b")
        // unlink of c, as rm -rf sends it: a and b stay queued for their directory.
        try f.namespace.removing(f.dir, "c") { pfd throws(Errno) in try Sys.unlinkat(pfd, "c", 0) }
        #expect(f.onDisk("a") && f.onDisk("b"))
        // A listing (or its attributes) through the directory's fd sees neither.
        let names = try f.namespace.withFD(f.dir) { fd throws(Errno) -> [String] in
            let d = fdopendir(try Sys.openat(fd, ".", O_RDONLY | O_DIRECTORY))!
            defer { closedir(d) }
            var out: [String] = []
            while let e = readdir(d) { out.append(String(cString: vanish_dirent_name(e))) }
            return out.filter { $0 != "." && $0 != ".." }
        }
        #expect(names.isEmpty, "\(names)")
        #expect(f.landed.load(ordering: .relaxed) == 2)
    }

    @Test("rmdir takes the directory's queue to bury with it; nothing stays pending")
    func directoryRemovalTakesQueue() throws {
        let f = try Fixture()
        for n in ["a", "b"] { f.make(n) }
        try f.queueBurial("a")
        try f.queueBurial("b")
        let taken = f.burials.takeDirectory(f.dir.key)
        #expect(taken.items.count == 2)
        #expect(rename(f.base + "/dir", f.base + "/grave/dir") == 0)
        taken.wentWithDirectory()
        #expect(f.burials.count == 0)
        #expect(f.landed.load(ordering: .relaxed) == 0, "they went with their directory, not one by one")
    }

    @Test("burials taken for an rmdir that cannot take them along land one by one")
    func directoryRemovalLandsQueue() throws {
        let f = try Fixture()
        for n in ["a", "b"] { f.make(n) }
        try f.queueBurial("a")
        try f.queueBurial("b")
        f.burials.takeDirectory(f.dir.key).land()
        #expect(f.burials.count == 0)
        #expect(f.landed.load(ordering: .relaxed) == 2)
    }

    @Test("a directory about to be renamed lets every pending burial land first")
    func renameSettles() throws {
        let f = try Fixture()
        mkdir(f.base + "/dir/sub", 0o755)
        f.make("a")
        try f.queueBurial("a")
        try f.namespace.renaming(f.dir, "sub", f.dir, "moved", exchange: false) { pfd, npfd throws(Errno) in
            try Sys.renameat2(pfd, "sub", npfd, "moved", 0)
        } answer: {}
        #expect(!f.onDisk("a"))
        #expect(f.burials.count == 0)
    }

    @Test("making a name answers first, then lands the burials queued in its directory")
    func makingLandsQueueAfterAnswer() throws {
        let f = try Fixture()
        f.make("a")
        try f.queueBurial("a")
        var queuedAtAnswer = -1
        try f.namespace.making(f.dir, "b") { pfd throws(Errno) in
            try Sys.mkdirat(pfd, "b", 0o755)
        } answer: {
            queuedAtAnswer = f.burials.count
        }
        #expect(queuedAtAnswer == 1, "the answer does not wait for the directory's queue")
        #expect(!f.onDisk("a"))
        #expect(f.burials.count == 0)
    }

    @Test("threads making, burying and looking up names in one directory, beside a lister, never see a pending one")
    func concurrentNames() throws {
        let f = try Fixture()
        let failures = Atomic<Int>(0)
        let done = Atomic<Int>(0)
        let threads = 4, rounds = 400
        for t in 0..<threads {
            spawnThread("ns-test") {
                for r in 0..<rounds {
                    // Names come back: each make must first land the name's earlier burial.
                    let name = "t\(t)-\(r % 7)"
                    let made = (try? f.namespace.atName(f.dir, name) { pfd throws(Errno) in
                        Sys.close(try Sys.openat(pfd, name, O_CREAT | O_EXCL | O_WRONLY, 0o644))
                    }) != nil
                    // Queued, not landed: the lookup right after must not find it.
                    if !made || (try? f.queueBurial(name)) != true || f.lookup(name) {
                        failures.wrappingAdd(1, ordering: .relaxed)
                    }
                }
                done.wrappingAdd(1, ordering: .relaxed)
            }
        }
        // Meanwhile listings land whole queues under the threads' feet.
        var listings = 0
        while done.load(ordering: .relaxed) < threads {
            _ = try f.namespace.withFD(f.dir) { fd throws(Errno) in try Sys.fstat(fd) }
            listings += 1
            sched_yield()
        }
        f.namespace.settle()
        #expect(failures.load(ordering: .relaxed) == 0)
        #expect(f.burials.count == 0)
        #expect(try FileManagerless.list(f.base + "/dir").isEmpty)
        #expect(try FileManagerless.list(f.base + "/grave").count == threads * rounds)
        #expect(listings > 0)
    }
}

/// Directory listing without Foundation.
enum FileManagerless {
    static func list(_ path: String) throws -> [String] {
        guard let d = opendir(path) else { throw TestFailure("opendir \(path)") }
        defer { closedir(d) }
        var out: [String] = []
        while let e = readdir(d) {
            let n = String(cString: vanish_dirent_name(e))
            if n != "." && n != ".." { out.append(n) }
        }
        return out
    }
}
