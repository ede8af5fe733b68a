import Foundation
import Glibc
import Testing
import VanishTestSupport

/// Real programs working inside a mount, as users run them.
@Suite("real programs", .enabled(if: FUSEAvailability.shouldRun, "needs /dev/fuse and fusermount3"))
struct ProgramsTests {
    let gitEnv = ["GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                  "GIT_COMMITTER_EMAIL": "t@e", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp"]

    @Test("git init, add, commit, status, branch and checkout")
    func git() throws {
        try withVanishMount { m in
            let r = try sh("""
                set -e
                git init -q -b main repo && cd repo
                for i in $(seq 1 50); do mkdir -p src/d$((i % 5)); echo "line $i" > src/d$((i % 5))/f$i.c; done
                git add -A && git commit -qm one
                git checkout -qb other
                echo changed > src/d1/f1.c && git rm -q src/d2/f2.c && echo new > src/new.c
                git add -A && git commit -qm two
                git checkout -q main
                test ! -e src/new.c && test -e src/d2/f2.c && grep -q 'line 1' src/d1/f1.c
                git checkout -q other
                test -e src/new.c && test ! -e src/d2/f2.c
                git status --porcelain
                git fsck --no-progress 2>&1
                git log --oneline | wc -l
                """, cwd: m.mountpoint, environment: gitEnv)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "2")
            // The backing repository is the same repository.
            let b = try sh("git status --porcelain && git rev-parse --abbrev-ref HEAD", cwd: m.backing("repo"),
                           environment: gitEnv)
            #expect(b.ok && b.stdout == "other\n")
        }
    }

    @Test("tar create and extract with xattrs, cp -a and mv across directories")
    func tarCpMv() throws {
        try withVanishMount { m in
            let r = try sh("""
                set -e
                mkdir -p tree/a/b && echo one > tree/a/one && echo two > tree/a/b/two
                ln -s one tree/a/link && ln tree/a/one tree/a/hard && chmod 0640 tree/a/b/two
                setfattr -n user.tag -v hello tree/a/one
                touch -d '2001-02-03 04:05:06' tree/a/b/two
                tar --xattrs -cf t.tar tree
                mkdir out && tar --xattrs -xf t.tar -C out
                test "$(getfattr --only-values -n user.tag out/tree/a/one)" = hello
                cp -a tree copy
                test "$(stat -c %i copy/a/one)" = "$(stat -c %i copy/a/hard)"
                test "$(getfattr --only-values -n user.tag copy/a/one)" = hello
                test "$(readlink copy/a/link)" = one
                mv copy/a/b moved && mv moved tree/
                diff -r tree/a/b tree/moved
                stat -c '%a %Y' tree/moved/two
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "640 981173106\n")
        }
    }

    @Test("sqlite in WAL mode with two concurrent writer processes")
    func sqliteWAL() throws {
        try #require(which("sqlite3") != nil, "sqlite3 is not installed (apt-get install sqlite3)")
        try withVanishMount { m in
            let setup = try sh("sqlite3 db 'PRAGMA journal_mode=WAL; CREATE TABLE t(w INTEGER, i INTEGER);'",
                               cwd: m.mountpoint)
            #expect(setup.ok && setup.stdout == "wal\n", "\(setup.stderr)")
            // Two processes insert 300 rows each, one transaction per row, at the same time.
            let r = try sh("""
                writer() { for i in $(seq 1 300); do echo "INSERT INTO t VALUES($1, $i);"; done | \
                  sqlite3 -cmd '.timeout 20000' db; }
                writer 1 & writer 2 & wait
                sqlite3 db 'SELECT w, count(*) FROM t GROUP BY w; PRAGMA integrity_check;'
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "1|300\n2|300\nok\n")
        }
    }

    @Test("a C build with make")
    func make() throws {
        try #require(which("cc") != nil && which("make") != nil, "needs cc and make")
        try withVanishMount { m in
            let r = try sh("""
                set -e
                mkdir proj && cd proj
                printf 'int add(int a, int b);\\n' > add.h
                printf '#include "add.h"\\nint add(int a, int b) { return a + b; }\\n' > add.c
                printf '#include <stdio.h>\\n#include "add.h"\\nint main(void) { printf("%%d\\\\n", add(2, 3)); return 0; }\\n' > main.c
                printf 'app: main.o add.o\\n\\tcc -o app main.o add.o\\n%%.o: %%.c add.h\\n\\tcc -c -o $@ $<\\n' > Makefile
                make -s && ./app
                touch add.h && make -s && ./app
                make -q app || true
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "5\n5\n")
        }
    }

    @Test("flock and POSIX record locks conflict across processes using the mount")
    func locks() throws {
        try #require(which("flock") != nil)
        try withVanishMount { m in
            let r = try sh("""
                touch lockfile
                flock -n lockfile -c 'flock -n lockfile -c true && echo second-got-it || echo second-refused'
                python3 - <<'PY'
                import fcntl, os
                fd = os.open("lockfile", os.O_RDWR)
                fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
                pid = os.fork()
                if pid == 0:
                    fd2 = os.open("lockfile", os.O_RDWR)
                    try:
                        fcntl.lockf(fd2, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0); print("child-got-it")
                    except OSError:
                        print("child-refused")
                    fcntl.lockf(fd2, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 20); print("child-other-range")
                    os._exit(0)
                os.waitpid(pid, 0)
                PY
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "second-refused\nchild-refused\nchild-other-range\n")
        }
    }

    /// With passthrough, a writer writes the backing file itself, and on a
    /// local filesystem that file's close reports nothing: no handle needs a
    /// FLUSH. Through the daemon (passthrough=off), a writer's close still
    /// flushes. Locks go with every close either way (the kernel keeps them).
    @Test("closing a file costs no FLUSH round trip unless the close may report something or follow mapped writes; locks go with the close",
          arguments: [[], ["passthrough=off"]])
    func closeSkipsFlush(options: [String]) throws {
        try withVanishMount(options: options, arguments: ["-d"], prepare: { src in
            try "data\n".write(toFile: src + "/r", atomically: false, encoding: .utf8)
        }) { m in
            let flushes = { m.log.components(separatedBy: "opcode: FLUSH").count - 1 }
            let r = try sh("""
                cat r r r >/dev/null && cat r
                python3 - <<'PY'
                import fcntl, os
                # A read lock through a reader, and a write lock through a
                # writer, each go with its close: a child may then lock it all.
                for flags, lock in ((os.O_RDONLY, fcntl.LOCK_SH), (os.O_RDWR, fcntl.LOCK_EX)):
                    fd = os.open("r", flags)
                    fcntl.lockf(fd, lock, 0, 0)
                    os.close(fd)
                    if os.fork() == 0:
                        fd = os.open("r", os.O_RDWR)
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)
                        os._exit(0)
                    print(os.waitstatus_to_exitcode(os.wait()[1]))
                PY
                echo more >> r && cat r
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "data\n0\n0\ndata\nmore\n")
            // A FLUSH is logged as it arrives, before close() returns.
            if options.isEmpty {
                // Read-write handles only (the python's writer and its two children's):
                // writes through a shared mapping need one, and only FLUSH comes before
                // close() returns. Never the cats' or the append's.
                #expect(flushes() == 3, "\(m.log)")
            } else {
                // The children's and the python's writers, and the shell's
                // append (twice: its fd is dup'ed onto stdout); never the cats'.
                #expect(flushes() == 5, "\(m.log)")
            }
        }
    }

    @Test("dd with O_DIRECT reads 1 MiB requests byte for byte, several at once, without a fresh buffer per request")
    func directReads() throws {
        // 40 MiB and a partial last chunk, so short reads at the end are covered too.
        try withVanishMount(prepare: { src in
            try sh("head -c 41955328 /dev/urandom > big", cwd: src)
        }) { m in
            // Page faults the daemon takes: libfuse's fallback for a read its
            // pipe cannot hold maps and faults in a new 1 MiB buffer each time.
            func faults() throws -> Int {
                let stat = try String(contentsOfFile: "/proc/\(m.pid)/stat", encoding: .utf8)
                let fields = stat[stat.range(of: ")")!.upperBound...].split(separator: " ")
                return Int(fields[7])!  // minflt, field 10 of proc(5)
            }
            let before = try faults()
            let r = try sh("""
                dd if=big of=\(m.base)/copy bs=1M iflag=direct status=none
                cmp big \(m.backing("big")) && cmp \(m.base)/copy big
                for skip in 0 13 27; do
                    dd if=big of=\(m.base)/part$skip bs=1M skip=$skip count=13 iflag=direct status=none &
                done
                wait
                for skip in 0 13 27; do
                    dd if=\(m.backing("big")) of=\(m.base)/ref bs=1M skip=$skip count=13 status=none
                    cmp \(m.base)/part$skip \(m.base)/ref || echo "part $skip differs"
                done
                dd if=big bs=1M skip=100 iflag=direct status=none | wc -c
                """, cwd: m.mountpoint)
            #expect(r.ok, "\(r.stderr)")
            #expect(r.stdout == "0\n")
            let taken = try faults() - before
            // 80 reads of 1 MiB: over 20,000 faults when each gets a new buffer.
            #expect(taken < 5_000, "the daemon took \(taken) page faults")
        }
    }
}
