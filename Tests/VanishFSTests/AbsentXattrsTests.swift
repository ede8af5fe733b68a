import Glibc
import Synchronization
import SystemPackage
import Testing
import VanishTestSupport
@testable import VanishFS

/// Files known to have no xattrs are answered without asking the backing
/// file; every xattr that appears, through the mount or behind it, shows
/// within what the cache mode promises for attributes.
@Suite("xattrs known absent")
struct AbsentXattrsTests {
    /// A regular file's inode whose attributes were just sent with `ctime`.
    func inode(ctime: Int) -> VanishFS.Inode {
        let node = VanishFS.Inode(key: InodeKey(dev: 7, ino: 42), type: S_IFREG, id: 42, generation: 0, parent: nil, name: "f")
        var st = stat()
        st.st_mode = S_IFREG | 0o644
        st.st_ctim = timespec(tv_sec: ctime, tv_nsec: 5)
        node.sawAttributes(st)
        return node
    }

    @Test("the rule, in process: none while the ctime and the kernel's trust last, never for a file that has some")
    func rule() {
        let absent = AbsentXattrs(enabled: true, device: 7, timeout: 3600)
        let node = inode(ctime: 100)
        #expect(!absent.knownNone(node), "nothing learnt yet")
        absent.learn(node) { () throws(Errno) in 0 }
        #expect(absent.knownNone(node))
        // The listing is asked once per ctime.
        absent.learn(node) { () throws(Errno) in Issue.record("listed again at the same ctime"); return 0 }

        absent.changed(node)  // set through the mount
        #expect(!absent.knownNone(node))
        absent.learn(node) { () throws(Errno) in 12 }
        #expect(!absent.knownNone(node), "it has xattrs")

        let later = inode(ctime: 100)
        absent.learn(later) { () throws(Errno) in 0 }
        var st = stat()
        st.st_ctim = timespec(tv_sec: 101, tv_nsec: 0)
        later.sawAttributes(st)  // the kernel was sent a newer ctime: unknown again
        #expect(!absent.knownNone(later))

        let dropped = inode(ctime: 100)
        absent.learn(dropped) { () throws(Errno) in 0 }
        dropped.attributesDropped.store(true, ordering: .releasing)  // the watch saw a change behind the mount
        #expect(!absent.knownNone(dropped))
        absent.learn(dropped) { () throws(Errno) in Issue.record("learnt from attributes the kernel dropped"); return 0 }

        let failing = inode(ctime: 100)
        absent.learn(failing) { () throws(Errno) in throw .permissionDenied }
        #expect(!absent.knownNone(failing))

        let never = AbsentXattrs(enabled: true, device: 7, timeout: 0)  // cache=never
        let uncached = inode(ctime: 100)
        never.learn(uncached) { () throws(Errno) in 0 }
        #expect(!never.knownNone(uncached))
        let otherDevice = AbsentXattrs(enabled: true, device: 8, timeout: 3600)  // a filesystem mounted inside
        otherDevice.learn(uncached) { () throws(Errno) in 0 }
        #expect(!otherDevice.knownNone(uncached))
    }

    /// `getfattr -n NAME --only-values PATH`, or "absent" when it has no such attribute.
    func value(_ name: String, _ path: String, in dir: String) throws -> String {
        let r = try run(["getfattr", "-n", name, "--only-values", path], cwd: dir)
        return r.ok ? r.stdout : (r.stderr.contains("No such attribute") ? "absent" : "error: \(r.stderr)")
    }

    @Test("an xattr or ACL added to a file the mount knew had none shows through it: at once when set through the mount, within the attribute promise when set behind it",
          .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"),
          arguments: [[String](), ["nowatch"], ["passthrough=off"]])
    func appears(options: [String]) throws {
        try withVanishMount(options: options, prepare: { src in
            guard try sh("echo one > f && echo two > g && mkdir d", cwd: src).ok else { throw TestFailure("prepare") }
        }) { m in
            let mnt = m.mountpoint
            // Asked twice: the second answer comes from what the first learnt.
            for _ in 0..<2 {
                #expect(try value("user.x", "f", in: mnt) == "absent")
                #expect(try value("security.selinux", "g", in: mnt) == "absent")
                #expect(try run(["getfattr", "-d", "-m", "-", "f", "g", "d"], cwd: mnt).stdout == "")
                // listxattr with a buffer at once, as rsync and Python call it.
                let listed = try run(["python3", "-c", "import os; print([os.listxattr(n) for n in ('f', 'g', 'd')])"], cwd: mnt)
                #expect(listed.stdout == "[[], [], []]\n", "\(listed.stderr)")
            }
            // Through the mount: at once, both ways.
            #expect(try run(["setfattr", "-n", "user.y", "-v", "yes", "g"], cwd: mnt).ok)
            #expect(try value("user.y", "g", in: mnt) == "yes")
            #expect(try run(["setfattr", "-x", "user.y", "g"], cwd: mnt).ok)
            #expect(try value("user.y", "g", in: mnt) == "absent")
            #expect(try value("user.y", "g", in: mnt) == "absent")
            #expect(try run(["setfacl", "-m", "u:nobody:r", "g"], cwd: mnt).ok)
            #expect(try run(["getfacl", "-cp", "g"], cwd: mnt).stdout.contains("user:nobody:r--"))

            // Behind the mount, on the source: as soon as the kernel's attributes are refreshed.
            #expect(try run(["setfattr", "-n", "user.x", "-v", "behind", "f"], cwd: m.source).ok)
            try waitFor("user.x set behind the mount to show through it", timeout: 5) {
                try value("user.x", "f", in: mnt) == "behind"
            }
            #expect(try run(["getfattr", "-d", "f"], cwd: mnt).stdout.contains("user.x=\"behind\""))
            #expect(try run(["setfacl", "-m", "u:nobody:rx", "d"], cwd: m.source).ok)
            try waitFor("an ACL set behind the mount to show through it", timeout: 5) {
                try run(["getfacl", "-cp", "d"], cwd: mnt).stdout.contains("user:nobody:r-x")
            }
        }
    }
}
