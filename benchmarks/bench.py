#!/usr/bin/env python3
"""Vanish's benchmark harness.

Runs the same workloads, in one run, on the native backing directory, on
libfuse's own C passthrough (passthrough_ll), on bindfs, mergerfs and Vanish,
and writes a Markdown table and a JSON file with medians, min-max and ratios
to native and to passthrough_ll.

    sudo benchmarks/bench.py --quick          # smoke run, a few minutes
    sudo benchmarks/bench.py                  # full sizes, tens of minutes
    sudo benchmarks/bench.py --only create,rm-rf --peers native,vanish
    sudo benchmarks/bench.py --quick --ramdisk ext4   # steadier daemon-vs-daemon ratios
    sudo benchmarks/bench.py --quick --ramdisk ext4 --ramdisk-device zram   # reads completed in the reader's context
    sudo VANISH_COMPARE=/path/to/other/vanish benchmarks/bench.py ...   # A/B: another build as a column
    sudo VANISH_COMPARE_OPTIONS=nowatch benchmarks/bench.py ...   # A/B: the same build with other -o items
    sudo benchmarks/bench.py --quick --backend glusterfs --runs 2   # on a GlusterFS replica-2 volume

Needs root (drop_caches, mounting as root like the other peers); installs
its Debian packages if they are missing.
"""

import argparse
import json
import hashlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLES = "/usr/share/doc/libfuse3-dev/examples"
PACKAGES = ["libfuse3-dev", "liburing-dev", "fuse3", "bindfs", "mergerfs", "fio", "git", "gcc", "pkg-config", "rsync", "python3",
            "stress-ng"]


def sh(cmd, check=True, **kw):
    """Runs a command; a failure raises with the first line the command wrote
    to stderr (passthrough_ll running out of fds made find print 80,000 lines)."""
    if "stderr" not in kw and "capture_output" not in kw:
        kw["stderr"] = subprocess.PIPE
    r = subprocess.run(cmd, shell=isinstance(cmd, str), check=False, **kw)
    if check and r.returncode != 0:
        err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else (r.stderr or "")
        first = next((l for l in err.splitlines() if l.strip()), "")
        shown = cmd if isinstance(cmd, str) else " ".join(cmd)
        raise RuntimeError(f"exit {r.returncode}: {first or shown}")
    return r


def spawn_wait(argv):
    """posix_spawn and waitpid, stderr to a file: the least a caller can add
    to a command's time. Raises on failure, with the command's first line."""
    with tempfile.TemporaryFile() as err:
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            first = next((l for l in err.read().decode(errors="replace").splitlines() if l.strip()), " ".join(argv))
            raise RuntimeError(f"exit {code}: {first}")


def quiesce(drop=True):
    """Flush and settle so one filesystem's deferred work doesn't land in the next figure."""
    os.sync()
    if drop:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    time.sleep(0.2)


def is_mounted(path):
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def wait_mounted(path, proc=None, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if is_mounted(path):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount daemon exited with {proc.returncode}")
        time.sleep(0.01)
    raise RuntimeError(f"{path} did not mount")


def unmount(path):
    if is_mounted(path):
        sh(["fusermount3", "-u", path], check=False)
    deadline = time.time() + 15
    while is_mounted(path) and time.time() < deadline:
        time.sleep(0.05)
    if is_mounted(path):
        sh(["fusermount3", "-uz", path], check=False)


# ---------------------------------------------------------------- peers

class Peer:
    name = ""
    fuse = True

    def mount(self, src, mnt):
        """Returns the directory the workload runs in."""
        raise NotImplementedError

    # How long to wait for a daemon to exit after its unmount (Vanish stays to
    # empty its graveyard; on a network backend that takes a while).
    exit_wait = 10

    def unmount(self, mnt):
        unmount(mnt)
        # The daemon may still be finishing; wait for it so it doesn't eat the next run's CPU.
        deadline = time.time() + self.exit_wait
        while getattr(self, "proc", None) is not None and self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)


class Native(Peer):
    name = "native"
    fuse = False

    def mount(self, src, mnt):
        return src

    def unmount(self, mnt):
        pass


class CommandPeer(Peer):
    """A FUSE filesystem started as `argv + [src, mnt]` in the foreground."""

    def __init__(self, name, argv, source_as_option=None):
        self.name = name
        self.argv = argv
        self.source_as_option = source_as_option

    def mount(self, src, mnt):
        if self.source_as_option:
            # passthrough_ll takes the source as -o source=DIR.
            cmd = self.argv + ["-o", self.source_as_option.format(src=src), mnt]
        else:
            cmd = self.argv + [src, mnt]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_mounted(mnt, self.proc)
        return mnt


class Vanish(Peer):
    name = "vanish"
    # Variants (events off, a subscriber attached) only run where a workload asks for them.
    variant = False

    def __init__(self, binary, options="", subscriber=False, name=None, data_only=False):
        self.binary = binary
        self.options = options
        self.subscriber = subscriber
        self.events = None
        # A variant for file data workloads (passthrough off), shown as a column of its own.
        self.data_only = data_only
        if name:
            self.name = name
            self.variant = True

    def mount(self, src, mnt):
        cmd = [self.binary, "mount", "-f"] + (["-o", self.options] if self.options else []) + [src, mnt]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_mounted(mnt, self.proc)
        if self.subscriber:
            # A live subscriber that reads every event as it comes, as an indexer would.
            self.events = subprocess.Popen([self.binary, "events", "--json", mnt], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
            # Attached once it has seen the event its own connection cannot miss: mounted.
            deadline = time.time() + 10
            while time.time() < deadline and not attached(self.proc.pid, self.events.pid):
                time.sleep(0.01)
        return mnt

    def unmount(self, mnt):
        if self.events is not None:
            self.events.terminate()
            self.events.wait()
            self.events = None
        super().unmount(mnt)


def attached(daemon, client):
    """Whether `client` has a connected Unix socket (to the daemon's control socket)."""
    try:
        return any(os.readlink(f"/proc/{client}/fd/{fd}").startswith("socket:")
                   for fd in os.listdir(f"/proc/{client}/fd"))
    except OSError:
        return False


# ---------------------------------------------------------------- workloads

def make_tree(root, dirs, per_dir, size=100):
    data = b"x" * size
    for d in range(dirs):
        dp = os.path.join(root, f"d{d:03}")
        os.mkdir(dp)
        for i in range(per_dir):
            fd = os.open(os.path.join(dp, f"f{i:05}"), os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)


class Workload:
    """prepare_source runs natively before mounting; prepare_mounted through the
    mount, untimed; run is what is timed."""
    name = ""
    cold = True   # drop caches after mounting, before the timed step
    read_only = False  # the timed step only reads: one prepared source serves every run
    vanish_only = False
    peer = None   # the peer being measured, for workloads that differ by peer

    def prepare_source(self, src, cache):
        pass

    def prepare_mounted(self, target):
        pass

    def run(self, target):
        raise NotImplementedError


class Create(Workload):
    def __init__(self, files):
        self.files = files
        self.name = f"create {files // 1000}k files in 100 dirs"

    def run(self, target):
        os.mkdir(os.path.join(target, "tree"))
        make_tree(os.path.join(target, "tree"), 100, self.files // 100)


class Walk(Workload):
    read_only = True

    def __init__(self, files, warm):
        self.files = files
        self.cold = not warm
        self.name = f"find -ls walk of {files // 1000}k files, {'warm' if warm else 'cold'}"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "tree"))
        make_tree(os.path.join(src, "tree"), 100, self.files // 100)

    def prepare_mounted(self, target):
        if not self.cold:
            self.run(target)

    def run(self, target):
        sh(f"find {target}/tree -ls > /dev/null")


class NamesWalk(Walk):
    """A walk that needs names only (find -name, fd, a build's directory scan):
    attributes fetched with the listing are work nobody asked for."""
    def __init__(self, files):
        super().__init__(files, warm=False)
        self.name = f"find -name walk of {files // 1000}k files (names only), cold"

    def run(self, target):
        sh(f"find {target}/tree -name no-such-name > /dev/null")


class DiskUsage(Walk):
    def __init__(self, files):
        super().__init__(files, warm=False)
        self.name = f"du -s of {files // 1000}k files, cold"

    def run(self, target):
        sh(f"du -s {target}/tree > /dev/null")


class HeaderProbe(Workload):
    """What a compiler does with -I: each header is looked for in every include
    directory in turn until found, and every translation unit asks again, so
    most lookups fail and the same ones fail repeatedly."""
    read_only = True
    dirs, headers, units = 20, 500, 5

    def __init__(self):
        self.name = f"header probing: {self.headers} headers in {self.dirs} include dirs, {self.units} units (failed lookups)"

    def prepare_source(self, src, cache):
        for d in range(self.dirs):
            os.makedirs(os.path.join(src, "inc", f"i{d:02}"))
        for h in range(self.headers):
            open(os.path.join(src, "inc", f"i{h % self.dirs:02}", f"h{h:04}.h"), "w").close()

    def run(self, target):
        sh(f"""python3 -c '
import os, sys
root = sys.argv[1]
for unit in range({self.units}):
    for h in range({self.headers}):
        for d in range({self.dirs}):
            try:
                os.stat(f"{{root}}/inc/i{{d:02}}/h{{h:04}}.h")
                break
            except FileNotFoundError:
                pass
' {target}""")


class ListBigDir(Workload):
    read_only = True

    def __init__(self, files):
        self.files = files
        self.name = f"ls -l of one dir with {files // 1000}k entries"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "big"))
        make_tree(os.path.join(src, "big"), 1, self.files, size=0)

    def run(self, target):
        sh(f"ls -l {target}/big/d000 > /dev/null")


class SeqWrite(Workload):
    data = True

    def __init__(self, mib, direct=False):
        self.mib = mib
        self.direct = direct
        self.name = f"sequential write {mib} MiB{' O_DIRECT' if direct else ''} (dd bs=1M, fsync)"

    def run(self, target):
        flag = "oflag=direct" if self.direct else "conv=fsync"
        sh(f"dd if=/dev/zero of={target}/seq bs=1M count={self.mib} {flag} status=none")


class SeqRead(Workload):
    read_only = True
    data = True

    def __init__(self, mib, direct=False):
        self.mib = mib
        self.direct = direct
        self.name = f"sequential read {mib} MiB{' O_DIRECT' if direct else ''} (dd bs=1M)"

    def prepare_source(self, src, cache):
        sh(f"dd if=/dev/urandom of={src}/seq bs=1M count={self.mib} status=none")

    def run(self, target):
        flag = "iflag=direct" if self.direct else ""
        sh(f"dd if={target}/seq of=/dev/null bs=1M {flag} status=none")


class RandRead(Workload):
    """4 KiB random reads of a quarter of a file, with read(2) (psync) or
    through a shared mapping (mmap)."""
    read_only = True
    data = True

    def __init__(self, mib, engine="psync"):
        self.mib = mib
        self.engine = engine
        how = "" if engine == "psync" else " through mmap"
        self.name = f"4 KiB random reads{how}, {mib // 4} MiB of a {mib} MiB file (fio {engine})"

    def prepare_source(self, src, cache):
        sh(f"dd if=/dev/urandom of={src}/rand bs=1M count={self.mib} status=none")

    def run(self, target):
        sh(["fio", "--name=r", f"--filename={target}/rand", "--rw=randread", "--bs=4k",
            f"--size={self.mib}M", f"--io_size={self.mib // 4}M", f"--ioengine={self.engine}",
            "--randrepeat=1", "--output=/dev/null"])


class WarmRead(SeqRead):
    """The file read once through the mount before the timed read: what the
    page cache gives back (for FUSE without passthrough, its own cache)."""
    cold = False

    def __init__(self, mib):
        super().__init__(mib)
        self.name = f"sequential read {mib} MiB, page cache warm (dd bs=1M)"

    def prepare_mounted(self, target):
        self.run(target)


class TarExtract(Workload):
    name = "extract a source tarball (/usr/include)"

    def run(self, target):
        sh(f"tar xf {self.tarball} -C {target}")


class AgainLater:
    """Mixed into a workload: the timed step repeats, two seconds later, what
    the untimed preparation did through the mount, as a user does at every
    prompt once a one-second attribute cache has run out."""
    cold = False

    def prepare_mounted(self, target):
        self.run(target)
        time.sleep(2)


class ExtractedTarball(Workload):
    """A workload over the source tarball (/usr/include), extracted before mounting."""
    def prepare_source(self, src, cache):
        sh(f"tar xf {self.tarball} -C {src}")


class ListTreeAgain(AgainLater, ExtractedTarball):
    """ls -lR of a source tree it walked a moment ago."""
    name = "ls -lR of the extracted tarball again 2 s later"

    def run(self, target):
        sh(f"ls -lR {target} > /dev/null")


class RsyncNoop(Workload):
    """rsync -aHAX between two identical copies: stats, ACLs and xattrs of
    every file on both sides, nothing copied."""
    name = "rsync -aHAX --dry-run, nothing to copy (two copies of the tarball), cold"

    def prepare_source(self, src, cache):
        for side in ("a", "b"):
            os.mkdir(f"{src}/{side}")
            sh(f"tar xf {self.tarball} -C {src}/{side}")

    def run(self, target):
        sh(f"rsync -aHAX --dry-run {target}/a/ {target}/b/ > /dev/null")


def tag_tree(root):
    """Gives every tenth file of `root` an access ACL and a user xattr, and
    every directory a default ACL: a tree as backups and CI caches meet it."""
    sh(f"find {root} -type d -exec setfacl -m d:u:nobody:rx {{}} +")
    sh(f"find {root} -type f | awk 'NR % 10 == 0' | xargs -r setfacl -m u:nobody:r")
    sh(f"find {root} -type f | awk 'NR % 10 == 5' | xargs -r -n 200 setfattr -n user.origin -v bench")


class CopyWithAcls(Workload):
    """cp -a of a tree with ACLs and xattrs, inside the mount: every file's
    stat, ACLs and xattrs read and written."""
    name = "cp -a of the tarball's tree with ACLs and xattrs"

    def prepare_source(self, src, cache):
        os.mkdir(f"{src}/a")
        sh(f"tar xf {self.tarball} -C {src}/a")
        tag_tree(f"{src}/a")

    def run(self, target):
        sh(f"cp -a {target}/a {target}/b")


class TarWithAcls(CopyWithAcls):
    """tar -c and -x with --xattrs --acls of that tree, inside the mount."""
    name = "tar --xattrs --acls of the tarball's tree through a pipe"

    def run(self, target):
        os.mkdir(f"{target}/b")
        sh(f"tar --xattrs --acls -cf - -C {target}/a . | tar --xattrs --acls -xf - -C {target}/b")


class CompileallNoop(AgainLater, Workload):
    """python -m compileall where everything is compiled already: what a
    rebuild with nothing to do costs."""
    name = "python -m compileall with nothing to do (six stdlib packages) again 2 s later"

    def prepare_source(self, src, cache):
        lib = f"/usr/lib/python3.{sys.version_info.minor}"
        if not os.path.isdir(lib):
            lib = next(d for d in sorted(os.listdir("/usr/lib")) if d.startswith("python3."))
            lib = f"/usr/lib/{lib}"
        os.mkdir(f"{src}/py")
        for package in ("email", "json", "http", "xml", "logging", "unittest"):
            if os.path.isdir(f"{lib}/{package}"):
                shutil.copytree(f"{lib}/{package}", f"{src}/py/{package}")
        sh(f"python3 -m compileall -q {src}/py > /dev/null")

    def run(self, target):
        sh(f"python3 -m compileall -q {target}/py > /dev/null")


class TarCreate(ExtractedTarball):
    name = "re-archive the extracted tarball (tar cf - | cat)"

    def run(self, target):
        sh(f"tar cf - -C {target} . | cat > /dev/null")


class GitStatus(Workload):
    def __init__(self, files):
        self.files = files
        self.name = f"git status, {files // 1000}k-file repository"

    def prepare_source(self, src, cache):
        sh(f"tar xf {cache}/repo-{self.files}.tar -C {src}")

    def run(self, target):
        sh(f"git -C {target}/repo status --porcelain > /dev/null")


class GitStatusAgain(AgainLater, GitStatus):
    """The second git status of a session."""
    def __init__(self, files):
        super().__init__(files)
        self.name = f"git status again 2 s later, {files // 1000}k-file repository"


class GitCheckout(GitStatus):
    def __init__(self, files):
        super().__init__(files)
        self.name = f"git checkout of another branch, {files // 1000}k-file repository"

    def run(self, target):
        sh(f"git -C {target}/repo checkout -q other")


class RmRf(Workload):
    def __init__(self, files):
        self.files = files
        self.name = f"rm -rf of {files // 1000}k files made before mounting"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "tree"))
        make_tree(os.path.join(src, "tree"), 100, self.files // 100)

    def run(self, target):
        sh(f"rm -rf {target}/tree")


class RemoveTreeOneStep(Workload):
    """What a user runs to get rid of a tree: `vanish rm -r` on Vanish, `rm -rf` elsewhere.
    Warm: the command's binary and libraries are in the page cache, as when a user runs it."""
    cold = False

    def __init__(self, files):
        self.files = files
        self.name = f"remove a {files // 1000}k-file tree in one step (vanish rm -r; rm -rf elsewhere)"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "tree"))
        make_tree(os.path.join(src, "tree"), 100, self.files // 100)

    def run(self, target):
        # Spawned and waited for as a shell does: subprocess.run's own work
        # (pipes, selectors) added about a millisecond to a 4 ms command.
        if isinstance(self.peer, Vanish):
            spawn_wait([self.peer.binary, "rm", "-r", f"{target}/tree"])
        else:
            spawn_wait(["/bin/rm", "-rf", f"{target}/tree"])


class RemoveCachedTreeOneStep(RemoveTreeOneStep):
    """The same, after a walk through the mount has put every entry in the kernel's
    dentry cache (as for a tree just built there): Vanish waits until the kernel
    has dropped them all, so the path is gone for every process when it returns."""
    def __init__(self, files):
        super().__init__(files)
        self.name = f"remove a {files // 1000}k-file tree the kernel has cached, in one step (vanish rm -r; rm -rf elsewhere)"

    def prepare_mounted(self, target):
        sh(["find", f"{target}/tree"], stdout=subprocess.DEVNULL)


class RemoveTreeOneStepAsUser(RemoveTreeOneStep):
    """The same, run by an ordinary user (nobody) on a tree of theirs: Vanish
    makes the one rename with their credentials. Vanish needs
    `--vanish-options allow_other` for nobody to reach the mount. `cached`:
    after a walk through the mount as nobody, as RemoveCachedTreeOneStep."""
    def __init__(self, files, cached=False):
        super().__init__(files)
        self.cached = cached
        what = " the kernel has cached" if cached else ""
        self.name = f"remove a {files // 1000}k-file tree{what} in one step as nobody (vanish rm -r; rm -rf elsewhere)"

    @staticmethod
    def as_nobody(argv):
        return ["/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"] + argv

    def prepare_source(self, src, cache):
        super().prepare_source(src, cache)
        sh(["chown", "-R", "nobody:nogroup", os.path.join(src, "tree")])
        sh(["chown", "nobody:nogroup", src])
        # The run's directories (mkdtemp's, 0700) must let nobody through.
        for d in (os.path.dirname(src), os.path.dirname(os.path.dirname(src))):
            os.chmod(d, 0o755)

    def binary(self):
        """A copy of the peer's binary nobody may execute (the build directory
        may be closed to it), one per build: an A/B run alternates two."""
        digest = hashlib.sha256(os.path.realpath(self.peer.binary).encode()).hexdigest()[:12]
        return f"/tmp/vanish-bench-nobody-{digest}"

    def prepare_mounted(self, target):
        if isinstance(self.peer, Vanish):
            # Copied untimed, and read once so the run finds it in the page cache.
            copy = self.binary()
            if not os.path.exists(copy) or os.path.getmtime(copy) < os.path.getmtime(self.peer.binary):
                shutil.copy2(self.peer.binary, copy)
                os.chmod(copy, 0o755)
            sh(self.as_nobody([copy, "--version"]), stdout=subprocess.DEVNULL)
        if self.cached:
            sh(self.as_nobody(["find", f"{target}/tree"]), stdout=subprocess.DEVNULL)

    def run(self, target):
        if isinstance(self.peer, Vanish):
            spawn_wait(self.as_nobody([self.binary(), "rm", "-r", f"{target}/tree"]))
        else:
            spawn_wait(self.as_nobody(["/bin/rm", "-rf", f"{target}/tree"]))


class RemoveTreeInProcess(RemoveTreeOneStep):
    """The time a program waits: Vanish's in-band trigger (setxattr user.vanish.delete,
    then the path is gone) versus shutil.rmtree elsewhere, with no process start-up."""
    def __init__(self, files):
        super().__init__(files)
        self.name = f"remove a {files // 1000}k-file tree in-process (user.vanish.delete; shutil.rmtree elsewhere)"

    def run(self, target):
        path = f"{target}/tree"
        if isinstance(self.peer, Vanish):
            os.setxattr(path, "user.vanish.delete", b"", os.XATTR_CREATE | os.XATTR_REPLACE)
            while os.path.lexists(path):
                pass
        else:
            shutil.rmtree(path)


class ReaperDrain(Workload):
    """Vanish only: time for the reaper to free a tree `vanish rm` just buried."""
    vanish_only = True

    def __init__(self, files):
        self.files = files
        self.name = f"reaper: free a {files // 1000}k-file tree after vanish rm (status --wait)"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "tree"))
        make_tree(os.path.join(src, "tree"), 100, self.files // 100)

    def prepare_mounted(self, target):
        sh([self.peer.binary, "rm", "-r", f"{target}/tree"])

    def run(self, target):
        t0 = time.perf_counter()
        sh([self.peer.binary, "status", "--wait", target], stdout=subprocess.DEVNULL)
        elapsed = time.perf_counter() - t0
        status = json.loads(os.getxattr(target, "user.vanish.status"))
        self.metrics = {"reaper files/s": (self.files + 101) / elapsed,
                        "reaper MB/s freed": status.get("freed_bytes", 0) / elapsed / 1e6}


def vanish_status(target):
    return json.loads(os.getxattr(target, "user.vanish.status"))


def probe_latency(target, tag, first, count):
    """Times `count` stats of files never looked up before (each one a FUSE
    LOOKUP the daemon answers) and `count` creates; returns µs lists."""
    stats, creates = [], []
    for i in range(count):
        t0 = time.perf_counter_ns()
        os.lstat(f"{target}/probe/p{first + i:05}")
        t1 = time.perf_counter_ns()
        os.close(os.open(f"{target}/probe/new-{tag}-{i}", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
        t2 = time.perf_counter_ns()
        stats.append((t1 - t0) / 1000)
        creates.append((t2 - t1) / 1000)
    return stats, creates


def percentile(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


class LatencyWhileReaping(Workload):
    """Vanish only: stat and create latency through the mount with the reaper
    idle, then while it frees a tree `vanish rm` just buried (the foreground
    must not pay for the background). Timed: the probe under reaping."""
    vanish_only = True
    probes = 2000

    def __init__(self, files):
        self.files = files
        self.name = f"stat/create latency, idle vs reaper freeing {files // 1000}k files"

    def prepare_source(self, src, cache):
        os.mkdir(os.path.join(src, "tree"))
        make_tree(os.path.join(src, "tree"), 100, self.files // 100)
        os.mkdir(os.path.join(src, "probe"))
        for i in range(2 * self.probes):
            with open(os.path.join(src, "probe", f"p{i:05}"), "w") as f:
                f.write("p")

    def run(self, target):
        n = self.probes
        idle_s, idle_c = probe_latency(target, "idle", 0, n)
        sh([self.peer.binary, "rm", "-r", f"{target}/tree"])
        t0 = time.perf_counter()
        # The second half of the probe files: as cold as the first half was.
        stats, creates = probe_latency(target, "busy", n, n)
        elapsed = time.perf_counter() - t0
        st = vanish_status(target)
        busy = st.get("pending_entries", 0) > 0 or not st.get("reaper_idle", True)
        self.metrics = {"stat p50 µs idle": percentile(idle_s, 50), "stat p99 µs idle": percentile(idle_s, 99),
                        "stat p50 µs reaping": percentile(stats, 50), "stat p99 µs reaping": percentile(stats, 99),
                        "create p50 µs idle": percentile(idle_c, 50), "create p99 µs idle": percentile(idle_c, 99),
                        "create p50 µs reaping": percentile(creates, 50), "create p99 µs reaping": percentile(creates, 99),
                        "reaper still busy at the end (1 = yes)": 1 if busy else 0}
        return elapsed


class MetadataOps(Workload):
    """In-process create, chmod, utime, rename and unlink of small files: the
    metadata path each change event rides on. Run on Vanish with events off,
    on (the default) and with a subscriber attached, to show what events cost."""
    cold = False
    variants = True

    def __init__(self, files):
        self.files = files
        self.name = f"metadata ops: create, chmod, touch, rename, unlink {files // 1000}k files"

    def prepare_mounted(self, target):
        for d in range(10):
            os.mkdir(os.path.join(target, f"m{d}"))

    def run(self, target):
        per = self.files // 10
        for d in range(10):
            dp = os.path.join(target, f"m{d}")
            for i in range(per):
                p = f"{dp}/f{i}"
                os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
                os.chmod(p, 0o600)
                os.utime(p)
                os.rename(p, p + ".r")
                os.unlink(p + ".r")


class ParallelStat(ListBigDir):
    """Four processes stat the names of the same cold directory, each its own
    quarter: how far lookups in one directory run side by side
    (FUSE_PARALLEL_DIROPS; without it the kernel sends them one at a time)."""

    def __init__(self, files):
        super().__init__(files)
        self.name = f"stat {files // 1000}k names of one directory from 4 processes, cold"

    def run(self, target):
        # Timed from when all four are up and waiting to when the last is
        # done: the interpreters' start (9 ms each for Debian's python3, 30
        # for a pyenv build) is the same in every column and not the stats'.
        code = ("import os, sys\n"
                "d, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
                "names = [f'{d}/f{i:05}' for i in range(k, n, 4)]\n"
                "sys.stdout.write('r'); sys.stdout.flush(); sys.stdin.read(1)\n"
                "for p in names: os.stat(p)\n")
        procs = [subprocess.Popen([sys.executable, "-c", code, f"{target}/big/d000", str(k), str(self.files)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                 for k in range(4)]
        try:
            for p in procs:
                if p.stdout.read(1) != b"r":
                    raise RuntimeError("a stat process did not start")
            t0 = time.perf_counter()
            for p in procs:
                p.stdin.write(b"g")
                p.stdin.close()
            for p in procs:
                if p.wait() != 0:
                    raise RuntimeError("a stat process failed")
            return time.perf_counter() - t0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()
                if not p.stdin.closed:
                    p.stdin.close()


class XattrRoundTrip(Workload):
    """One request per call whatever the cache: the kernel keeps no xattrs
    of a FUSE file but POSIX ACLs, so each getxattr of security.selinux
    (GNU ls -l asks it of every entry) is a round trip to the daemon. The
    time per call is the round trip's floor."""
    read_only = True
    cold = False

    def __init__(self, calls):
        self.calls = calls
        self.name = f"getxattr round trip, {calls // 1000}k calls on one file"

    def prepare_source(self, src, cache):
        with open(os.path.join(src, "f"), "w") as f:
            f.write("x")

    def run(self, target):
        code = ("import os, sys\n"
                "p, n = sys.argv[1], int(sys.argv[2])\n"
                "for _ in range(n):\n"
                "    try: os.getxattr(p, 'security.selinux', follow_symlinks=False)\n"
                "    except OSError: pass\n")
        sh([sys.executable, "-c", code, os.path.join(target, "f"), str(self.calls)])


class UnlinkBig(Workload):
    """The unlink alone, of a file the caller has just looked at (as rm does:
    it stats before it unlinks), so the figure is what deleting costs and how
    it grows with size, not a cold lookup's disk read."""
    cold = False

    def __init__(self, gib):
        self.gib = gib
        self.name = f"unlink of a {gib} GiB file (just stat'ed)"

    def prepare_source(self, src, cache):
        sh(f"fallocate -l {self.gib}G {src}/big")

    def prepare_mounted(self, target):
        os.lstat(f"{target}/big")

    def run(self, target):
        os.unlink(f"{target}/big")


def make_repo(cache, files):
    """A git repository with `files` files and a branch `other` that changes a tenth of them."""
    out = f"{cache}/repo-{files}.tar"
    if os.path.exists(out):
        return
    work = tempfile.mkdtemp(dir=cache)
    repo = os.path.join(work, "repo")
    os.mkdir(repo)
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b", GIT_CONFIG_NOSYSTEM="1")
    sh(["git", "init", "-q", "-b", "main", repo], env=env)
    # A background auto-gc would remove loose objects while tar reads them.
    sh(["git", "-C", repo, "config", "gc.auto", "0"], env=env)
    for i in range(files):
        d = os.path.join(repo, f"src/m{i % 200:03}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i}.c"), "w") as f:
            f.write(f"int f{i}(void) {{ return {i}; }}\n")
    sh(["git", "-C", repo, "add", "-A"], env=env)
    sh(["git", "-C", repo, "commit", "-qm", "one"], env=env)
    sh(["git", "-C", repo, "checkout", "-qb", "other"], env=env)
    for i in range(0, files, 10):
        with open(os.path.join(repo, f"src/m{i % 200:03}/f{i}.c"), "a") as f:
            f.write("/* changed */\n")
    sh(["git", "-C", repo, "commit", "-qam", "two"], env=env)
    sh(["git", "-C", repo, "checkout", "-q", "main"], env=env)
    sh(["tar", "cf", out, "-C", work, "repo"])
    shutil.rmtree(work)


# ---------------------------------------------------------------- running

def start_foreground_vanish(binary, src, mnt, options=""):
    """`vanish mount -f` as a child of this process (so in its session and
    autogroup); returns the daemon once the mount is up."""
    cmd = [binary, "mount", "-f"] + (["-o", options] if options else []) + [src, mnt]
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not os.path.ismount(mnt):
        if daemon.poll() is not None or time.time() > deadline:
            daemon.kill()
            sys.exit("vanish did not mount")
        time.sleep(0.01)
    return daemon


def stop_foreground_vanish(daemon, mnt, terminate=False):
    """Unmounts and waits for the daemon; `terminate` also sends SIGTERM, so a
    daemon that stays to finish its graveyard leaves the rest for no one."""
    subprocess.run(["fusermount3", "-u", mnt], stderr=subprocess.DEVNULL)
    if terminate:
        daemon.terminate()
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    subprocess.run(["fusermount3", "-uz", mnt], stderr=subprocess.DEVNULL)


def build_vanish():
    """Builds vanish as mount-scripts/install does; returns the binary's path
    (VANISH_BINARY, if set, names one to use instead: for A/B runs)."""
    if os.environ.get("VANISH_BINARY"):
        return os.environ["VANISH_BINARY"]
    # The build's progress and errors go to the terminal (stderr); its path comes on stdout.
    out = sh([os.path.join(REPO, "mount-scripts", "build")], stdout=subprocess.PIPE, stderr=None, text=True).stdout
    return out.strip().splitlines()[-1]


def build_peers(cache, only, vanish_options=""):
    peers = []
    want = lambda n: not only or n in only
    if want("native"):
        peers.append(Native())
    if want("passthrough_ll"):
        # With xattr support on, as Vanish, bindfs and mergerfs have it; without it the
        # kernel stops asking after one ENOSYS, and `ls -l` looks cheaper than it is.
        binary = f"{cache}/passthrough_ll"
        if not os.path.exists(binary):
            flags = sh(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True,
                       text=True).stdout.split()
            sh(["gcc", "-O2", "-DHAVE_FALLOCATE", "-DHAVE_COPY_FILE_RANGE", f"-I{EXAMPLES}",
                f"{EXAMPLES}/passthrough_ll.c", "-o", binary] + flags)
        peers.append(CommandPeer("passthrough_ll", [binary, "-f"], source_as_option="source={src},cache=auto,xattr"))
    if want("bindfs"):
        peers.append(CommandPeer("bindfs", ["bindfs", "-f"]))
    if want("mergerfs"):
        peers.append(CommandPeer("mergerfs", ["mergerfs", "-f"]))
    if want("vanish"):
        binary = build_vanish()
        extra = [vanish_options] if vanish_options else []
        peers.append(Vanish(binary, options=",".join(extra)))
        # io_uring against /dev/fuse: an A/B column on every row (see main for the kernel's switch).
        peers.append(Vanish(binary, options=",".join(extra + ["io_uring=off"]), name="vanish, /dev/fuse"))
        peers[-1].variant = False
        peers.append(Vanish(binary, options=",".join(extra + ["noevents"]), name="vanish, events off"))
        peers.append(Vanish(binary, options=",".join(extra), subscriber=True, name="vanish + subscriber"))
        peers.append(Vanish(binary, options=",".join(extra + ["passthrough=off"]), name="vanish, passthrough off",
                            data_only=True))
        if os.environ.get("VANISH_COMPARE") or os.environ.get("VANISH_COMPARE_OPTIONS"):
            # Another build, or this one with other options, as a column of its own,
            # interleaved with this one: an A/B in one run.
            compared = [os.environ["VANISH_COMPARE_OPTIONS"]] if os.environ.get("VANISH_COMPARE_OPTIONS") else []
            other = Vanish(os.environ.get("VANISH_COMPARE") or binary, options=",".join(extra + compared),
                           name="vanish, compared build")
            other.variant = False
            peers.append(other)
    return peers


def gluster_workloads(quick):
    """What a shared volume is about: deleting (where every unlink is a round
    trip to each replica), and what a mount over it costs to create and read."""
    n = 10_000
    mib = 64 if quick else 256
    return [Create(n), RmRf(n), RemoveTreeOneStep(n), ReaperDrain(n), SeqWrite(mib), SeqRead(mib), WarmRead(mib)]


class GlusterVolume:
    """A replica-2 GlusterFS volume on two brick directories under `base`,
    mounted by one client at base/client: the runs' backing directory.
    glusterd is started if it does not run (and stopped after)."""
    def __init__(self, base):
        self.base = os.path.join(base, "gluster")
        self.name = f"vanishbench{os.getpid()}"
        self.bricks = [os.path.join(self.base, b) for b in ("brick1", "brick2")]
        self.client = os.path.join(self.base, "client")
        self.started = False
        self.created = False

    def __enter__(self):
        missing = [p for p in ("glusterfs-server", "glusterfs-client")
                   if sh(["dpkg", "-s", p], check=False, capture_output=True).returncode]
        if missing:
            sh(["apt-get", "install", "-y", "-qq"] + missing, stdout=subprocess.DEVNULL)
        for d in self.bricks + [self.client]:
            os.makedirs(d, exist_ok=True)
        try:
            if sh(["pgrep", "-x", "glusterd"], check=False, capture_output=True).returncode:
                sh(["glusterd"])
                self.started = True
                deadline = time.time() + 30
                while sh(["gluster", "volume", "list"], check=False, capture_output=True).returncode:
                    if time.time() > deadline:
                        raise RuntimeError("glusterd does not answer")
                    time.sleep(0.2)
            host = platform.node()
            sh(["gluster", "--mode=script", "volume", "create", self.name, "replica", "2"]
               + [f"{host}:{b}" for b in self.bricks] + ["force"], stdout=subprocess.DEVNULL)
            self.created = True
            sh(["gluster", "--mode=script", "volume", "start", self.name], stdout=subprocess.DEVNULL)
            sh(["mount", "-t", "glusterfs", f"{host}:/{self.name}", self.client])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        sh(["umount", self.client], check=False)
        if self.created:
            sh(["gluster", "--mode=script", "volume", "stop", self.name, "force"], check=False, stdout=subprocess.DEVNULL)
            sh(["gluster", "--mode=script", "volume", "delete", self.name], check=False, stdout=subprocess.DEVNULL)
        if self.started:
            sh(["pkill", "-x", "glusterd"], check=False)
            sh(["pkill", "-f", "glustershd"], check=False)
        sh(["rm", "-rf", "--one-file-system", self.base], check=False)


def workloads(quick):
    n = 10_000 if quick else 100_000
    mib = 256 if quick else 1024
    repo = 5_000 if quick else 20_000
    return [
        XattrRoundTrip(20_000),
        Create(n), NamesWalk(n), Walk(n, warm=False), Walk(n, warm=True), DiskUsage(n), ListBigDir(n), ParallelStat(n),
        HeaderProbe(),
        SeqWrite(mib), SeqRead(mib), WarmRead(mib), SeqWrite(mib, direct=True), SeqRead(mib, direct=True),
        RandRead(mib), RandRead(mib, engine="mmap"), TarExtract(), TarCreate(), ListTreeAgain(), RsyncNoop(), CopyWithAcls(), TarWithAcls(), CompileallNoop(), GitStatus(repo), GitStatusAgain(repo), GitCheckout(repo),
        MetadataOps(n // 5 if not quick else n), RmRf(n), RemoveTreeOneStep(n), RemoveCachedTreeOneStep(n), RemoveTreeInProcess(n),
        RemoveTreeOneStepAsUser(n), RemoveTreeOneStepAsUser(n, cached=True), ReaperDrain(n),
        LatencyWhileReaping(n), UnlinkBig(1 if quick else 10),
    ]


def process_cpu(pid):
    """User and system CPU seconds of process `pid`, all its threads (those
    that exited too), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def measure_once(peer, work, base_dir, cache, shared_src=None):
    """One timed run: fresh source (or the shared one of a read-only workload),
    mount, untimed preparation, the timed step, unmount. Returns the time,
    the workload's own figures, and the daemon's CPU time in the timed step
    (None for native)."""
    base = tempfile.mkdtemp(prefix="run.", dir=base_dir)
    src, mnt = shared_src or os.path.join(base, "src"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    try:
        if not shared_src:
            os.mkdir(src)
            work.prepare_source(src, cache)
        quiesce()
        target = peer.mount(src, mnt)
        try:
            work.prepare_mounted(target)
            quiesce(drop=work.cold)
            work.metrics = {}
            daemon = getattr(peer, "proc", None)
            cpu0 = process_cpu(daemon.pid) if daemon else None
            t0 = time.perf_counter()
            timed = work.run(target)
            elapsed = time.perf_counter() - t0
            cpu1 = process_cpu(daemon.pid) if daemon else None
            cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
            # A workload may time only its own part, and report figures besides.
            return (timed if timed is not None else elapsed), dict(work.metrics), cpu
        finally:
            peer.unmount(mnt)
    finally:
        unmount(mnt)
        sh(["rm", "-rf", "--one-file-system", base], check=False)
        quiesce(drop=False)


def measure(peers, work, runs, base_dir, cache):
    """Runs peers round-robin, run by run, so slow drift of the machine (the disk's
    deferred discards, page cache, thermal) spreads over all of them alike."""
    times = {p.name: [] for p in peers}
    metrics = {p.name: [] for p in peers}
    cpus = {p.name: [] for p in peers}
    errors = {}
    if getattr(work, "vanish_only", False):
        peers = [p for p in peers if isinstance(p, Vanish)]
    # The passthrough-off column runs where file data is measured; the events
    # variants where a workload asks for them.
    peers = [p for p in peers if not getattr(p, "data_only", False) or getattr(work, "data", False)]
    if not getattr(work, "variants", False):
        peers = [p for p in peers if not getattr(p, "variant", False) or getattr(p, "data_only", False)]
    # A workload that only reads its tree gets one source for every peer and
    # run (preparing 100k files took ~40 s on this disk, per run and peer).
    shared = None
    if work.read_only:
        shared = tempfile.mkdtemp(prefix="shared.", dir=base_dir)
        work.prepare_source(shared, cache)
    for _ in range(runs):
        for p in peers:
            if p.name in errors:
                continue
            work.peer = p
            try:
                t, m, c = measure_once(p, work, base_dir, cache, shared_src=shared)
                times[p.name].append(t)
                metrics[p.name].append(m)
                if c is not None:
                    cpus[p.name].append(c)
            except (subprocess.CalledProcessError, OSError, RuntimeError) as e:
                errors[p.name] = str(e).splitlines()[0][:120]
    if shared:
        sh(["rm", "-rf", "--one-file-system", shared], check=False)
    out = {}
    for p in peers:
        t = times[p.name]
        out[p.name] = {"error": errors[p.name]} if p.name in errors else \
            {"median": statistics.median(t), "min": min(t), "max": max(t), "runs": t}
        if cpus[p.name] and "median" in out[p.name]:
            out[p.name]["daemon_cpu"] = statistics.median(cpus[p.name])
        if metrics[p.name] and metrics[p.name][0]:
            out[p.name]["metrics"] = {k: statistics.median(m[k] for m in metrics[p.name]) for k in metrics[p.name][0]}
    return out


def fmt_ratio(x):
    """0.02× hides how large a win is: small ratios read as fractions (1/506)."""
    return f"1/{1 / x:.0f}" if x < 0.1 else f"{x:.2f}×"


def fmt_time(s):
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


class RamDisk:
    """A fresh filesystem of `fstype` in RAM: the backing filesystem's own
    code runs (journal, allocator, page cache, drop_caches), but no disk's
    queue, discards or write-back bursts add their noise, so daemon-to-daemon
    ratios settle. It says nothing about a real disk's latency: quote both.

    `device` "loop": a loop device over a sparse file in /dev/shm, whose
    reads a kernel worker thread completes, waking the reader from there (so
    a program that waits for reads tends to move between CPUs). "zram": a
    zram device, which completes each read in the reader's own context, as
    an NVMe queue of the reader's CPU does."""
    def __init__(self, fstype, size_gib, device="loop"):
        self.fstype = fstype
        self.device = device
        self.image = f"/dev/shm/vanish-bench-{fstype}.img"
        self.zram = None
        self.mountpoint = f"/var/tmp/vanish-bench-{fstype}-ram"
        self.size_gib = size_gib

    def describe(self):
        if self.zram:
            return f"on {self.zram} (zram: RAM, no disk; reads complete in the reader's context)"
        return f"on a loop device over {self.image}: RAM, no disk"

    def __enter__(self):
        mkfs = {"ext4": ["mkfs.ext4", "-q", "-F"], "xfs": ["mkfs.xfs", "-q", "-f"],
                "btrfs": ["mkfs.btrfs", "-q", "-f"]}[self.fstype]
        unmount(self.mountpoint)
        os.makedirs(self.mountpoint, exist_ok=True)
        if self.device == "zram":
            try:
                with open("/sys/class/zram-control/hot_add") as f:
                    self.zram = f"/dev/zram{int(f.read())}"
            except OSError as e:
                sys.exit(f"--ramdisk-device zram: no zram device to add ({e}); use loop")
            with open(f"/sys/block/{os.path.basename(self.zram)}/disksize", "w") as f:
                f.write(f"{self.size_gib}G")
            sh(mkfs + [self.zram])
            sh(["mount", self.zram, self.mountpoint])
            return self
        with open(self.image, "wb") as f:
            f.truncate(self.size_gib << 30)
        sh(mkfs + [self.image])
        sh(["mount", "-o", "loop", self.image, self.mountpoint])
        return self

    def __exit__(self, *exc):
        sh(["umount", self.mountpoint], check=False)
        if self.zram:
            number = self.zram.removeprefix("/dev/zram")
            try:
                with open(f"/sys/block/zram{number}/reset", "w") as f:
                    f.write("1")
                with open("/sys/class/zram-control/hot_remove", "w") as f:
                    f.write(number)
            except OSError as e:
                print(f"could not remove {self.zram} ({e}): echo 1 > /sys/block/zram{number}/reset, "
                      f"then echo {number} > /sys/class/zram-control/hot_remove", file=sys.stderr)
        if os.path.exists(self.image):
            os.unlink(self.image)


def machine_facts(base_dir, ramdisk=None, backend=None):
    # findmnt names ext4 as ext4 (stat -f only sees the ext2/3/4 magic).
    fstype = sh(["findmnt", "-n", "-o", "FSTYPE,OPTIONS", "-T", base_dir], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal")), "0")
    if ramdisk:
        fstype += f" (fresh, {ramdisk.describe()})"
    if backend:
        bricks = sh(["findmnt", "-n", "-o", "FSTYPE", "-T", backend.bricks[0]], capture_output=True, text=True).stdout.strip()
        version = sh(["glusterfs", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        fstype = f"{version} replica-2 volume, two bricks on local {bricks}{' (RAM)' if ramdisk else ''}, one client mount"
    return {"kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(int(mem) / 2**20), "backing_fs": fstype, "backing_dir": base_dir,
            "libfuse": sh(["pkg-config", "--modversion", "fuse3"], capture_output=True, text=True).stdout.strip(),
            "page_reporting_held_off": os.path.exists(PageReportingOff.PATH)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 runs: a smoke run")
    ap.add_argument("--runs", type=int, help="runs per figure (default 3 quick, 5 full)")
    ap.add_argument("--dir", default="/var/tmp/vanish-bench", help="backing directory (its filesystem is measured)")
    ap.add_argument("--peers", help="comma list: native,passthrough_ll,bindfs,mergerfs,vanish")
    ap.add_argument("--only", help="comma list of workload name prefixes")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where to write results")
    ap.add_argument("--ramdisk", choices=["ext4", "xfs", "btrfs"],
                    help="run on a fresh FSTYPE over a RAM-backed loop device instead of --dir's disk "
                         "(--dir still holds the build cache)")
    ap.add_argument("--ramdisk-device", choices=["loop", "zram"], default="loop",
                    help="what holds --ramdisk's filesystem: a loop device over /dev/shm, or a zram device "
                         "(reads complete in the reader's context, as on a per-CPU NVMe queue)")
    ap.add_argument("--backend", choices=["local", "glusterfs"], default="local",
                    help="glusterfs: run on a fresh replica-2 GlusterFS volume (two local bricks under the "
                         "backing directory, one client mount): rm -rf, vanish rm, reaper drain, create and read rows")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N CPU hogs (stress-ng --cpu N) for the whole run, started and stopped here: "
                         "a busy machine, each ratio to native under the same load")
    ap.add_argument("--vanish-options", default="",
                    help="extra -o items for every Vanish mount, e.g. reap_yield=40ms (named in the results)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench.py needs root (drop_caches, mounting peers as root)")
    missing = [p for p in PACKAGES if sh(["dpkg", "-s", p], check=False, capture_output=True).returncode]
    if missing:
        sh(["apt-get", "install", "-y", "-qq"] + missing, stdout=subprocess.DEVNULL)

    runs = args.runs or (3 if args.quick else 5)
    os.makedirs(args.dir, exist_ok=True)
    cache = os.path.join(args.dir, "cache")
    os.makedirs(cache, exist_ok=True)
    with PageReportingOff(), RingOffered(), CPUHogs(args.load):
        if args.ramdisk:
            # Room for the full run's 10 GiB unlink (fallocated, so nearly free) and its trees.
            with RamDisk(args.ramdisk, 16 if args.quick else 32, args.ramdisk_device) as disk:
                run_backend(args, runs, disk.mountpoint, cache, ramdisk=disk)
        else:
            run_backend(args, runs, args.dir, cache)


def run_backend(args, runs, base_dir, cache, ramdisk=None):
    if args.backend == "glusterfs":
        with GlusterVolume(base_dir) as volume:
            # A daemon reaping over the network outlives its unmount for a while;
            # the next run must not share the volume with it.
            Peer.exit_wait = 600
            run_all(args, runs, volume.client, cache, ramdisk=ramdisk, backend=volume)
    else:
        run_all(args, runs, base_dir, cache, ramdisk=ramdisk)


class KernelSetting:
    """A sysfs setting held at VALUE for the run, restored after (left alone
    where the file does not exist)."""
    PATH, VALUE = "", ""

    def __enter__(self):
        self.saved = None
        try:
            with open(self.PATH) as f:
                saved = f.read().strip()
            with open(self.PATH, "w") as f:
                f.write(self.VALUE + "\n")
            self.saved = saved
        except OSError:
            pass
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            with open(self.PATH, "w") as f:
                f.write(self.saved + "\n")


class CPUHogs:
    """N busy loops at nice 0 for the run (`stress-ng --cpu N`), as a build
    beside the user's work: every peer's figures, native's too, are taken
    under the same load. None for N = 0."""
    def __init__(self, n):
        self.n, self.proc = n, None

    def __enter__(self):
        if self.n > 0:
            self.proc = subprocess.Popen(["stress-ng", "--cpu", str(self.n), "--quiet"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            time.sleep(1)  # the hogs up before the first figure (not a wait for a condition: a warm-up)
            if self.proc.poll() is not None:
                raise RuntimeError("stress-ng did not start")
        return self

    def __exit__(self, *exc):
        if self.proc:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class RingOffered(KernelSetting):
    """Lets the kernel offer FUSE over io_uring for the run, so that the
    "vanish" column runs over it and "vanish, /dev/fuse" does not
    (io_uring=off). The switch only offers: the other peers do not ask."""
    PATH, VALUE = "/sys/module/fuse/parameters/enable_uring", "Y"


class PageReportingOff(KernelSetting):
    """Holds a VM's free page reporting off for the run (restored after).

    With virtio_balloon's free page reporting, memory that stays free for
    about 2 s is handed back to the host, and whatever the guest runs while
    that happens slows down: after one run freed its 256 MiB page cache,
    the next cold 256 MiB read took 35 ms or 560 ms natively depending on
    whether the reporting overlapped it, and likewise for every peer that
    reads through the page cache, so a figure said more about the order of
    the peers than about them. Free blocks are reported from
    page_reporting_order up; past the largest order there are none."""
    PATH, VALUE = "/sys/module/page_reporting/parameters/page_reporting_order", "11"


def run_all(args, runs, base_dir, cache, ramdisk=None, backend=None):
    peers = build_peers(cache, set(args.peers.split(",")) if args.peers else None, args.vanish_options)
    works = gluster_workloads(args.quick) if backend else workloads(args.quick)
    if args.only:
        prefixes = args.only.split(",")
        works = [w for w in works if any(w.name.startswith(p) for p in prefixes)]
    tarball = f"{cache}/include.tar"
    if not os.path.exists(tarball):
        sh(["tar", "cf", tarball, "-C", "/usr", "include"])
    for w in works:
        w.tarball = tarball
        if isinstance(w, GitStatus):
            make_repo(cache, w.files)

    results = {"mode": "quick" if args.quick else "full", "runs": runs, "machine": machine_facts(base_dir, ramdisk, backend),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "vanish_options": args.vanish_options, "load": args.load, "workloads": []}
    for w in works:
        row = {"workload": w.name, "peers": measure(peers, w, runs, base_dir, cache)}
        for name, r in row["peers"].items():
            print(f"{w.name:<60} {name:<16} {r.get('error') or fmt_time(r['median'])}", flush=True)
        results["workloads"].append(row)

    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"bench-{stamp}.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = markdown(results, [p.name for p in peers if not getattr(p, "variant", False) or getattr(p, "data_only", False)],
                     [p.name for p in peers if isinstance(p, Vanish) and not getattr(p, "data_only", False)])
    with open(os.path.join(args.out, f"bench-{stamp}.md"), "w") as f:
        f.write(table)
    print()
    print(table)


def md_cell(text):
    """A Markdown table cell: a workload such as `tar cf - | cat` must not split its row."""
    return text.replace("|", "\\|")


def markdown(results, names, vanish_names=()):
    m = results["machine"]
    lines = [f"{results['mode']} run, median of {results['runs']} (min–max); ratio to native / to passthrough_ll. "
             f"{m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}, backing {m['backing_fs']}, "
             f"libfuse {m['libfuse']}."
             + (" The VM's free page reporting held off." if m.get("page_reporting_held_off") else "")
             + (f" Vanish mounted with -o {results['vanish_options']}." if results.get("vanish_options") else "")
             + (f" Busy machine: {results['load']} CPU hogs (stress-ng --cpu {results['load']}) throughout, "
                "native's figures too." if results.get("load") else ""), "",
             "| workload | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in results["workloads"]:
        native = row["peers"].get("native", {}).get("median")
        ll = row["peers"].get("passthrough_ll", {}).get("median")
        cells = []
        for n in names:
            r = row["peers"].get(n, {})
            if "error" in r:
                cells.append(f"failed: {r['error']}")
                continue
            if "median" not in r:
                cells.append("–")
                continue
            cell = f"{fmt_time(r['median'])} ({fmt_time(r['min'])}–{fmt_time(r['max'])})"
            ratios = []
            if native and n != "native":
                ratios.append(fmt_ratio(r['median'] / native))
            if ll and n not in ("native", "passthrough_ll"):
                ratios.append(fmt_ratio(r['median'] / ll) + " ll")
            if ratios:
                cell += " " + " / ".join(ratios)
            cells.append(cell)
        lines.append(f"| {md_cell(row['workload'])} | " + " | ".join(cells) + " |")
    # What events cost: the same workload on Vanish with the observer off, on, and read live.
    variant_rows = [r for r in results["workloads"] if len([n for n in vanish_names if n in r["peers"]]) > 1]
    if variant_rows:
        lines += ["", "Change events (ratio to events off, same run):", "",
                  "| workload | " + " | ".join(vanish_names) + " |", "|---|" + "---|" * len(vanish_names)]
        for row in variant_rows:
            off = row["peers"].get("vanish, events off", {}).get("median")
            cells = []
            for n in vanish_names:
                r = row["peers"].get(n, {})
                if "median" not in r:
                    cells.append(r.get("error", "–"))
                    continue
                cell = f"{fmt_time(r['median'])} ({fmt_time(r['min'])}–{fmt_time(r['max'])})"
                if off and n != "vanish, events off":
                    cell += f" {r['median'] / off:.2f}×"
                cells.append(cell)
            lines.append(f"| {md_cell(row['workload'])} | " + " | ".join(cells) + " |")
    # What each daemon spent: CPU is what other work on the machine loses.
    fuse_names = [n for n in names if n != "native"]
    cpu_rows = [r for r in results["workloads"] if any("daemon_cpu" in r["peers"].get(n, {}) for n in fuse_names)]
    if cpu_rows:
        lines += ["", "Daemon CPU in the timed step (user + system, all threads; median; ratio to the first Vanish column):",
                  "", "| workload | " + " | ".join(fuse_names) + " |", "|---|" + "---|" * len(fuse_names)]
        for row in cpu_rows:
            first = next((n for n in fuse_names
                          if n.startswith("vanish") and "daemon_cpu" in row["peers"].get(n, {})), None)
            base = row["peers"][first]["daemon_cpu"] if first else None
            cells = []
            for n in fuse_names:
                c = row["peers"].get(n, {}).get("daemon_cpu")
                if c is None:
                    cells.append("–")
                    continue
                shown = base and n != first and n.startswith("vanish")
                cells.append(fmt_time(c) + (f" {c / base:.2f}×" if shown else ""))
            lines.append(f"| {md_cell(row['workload'])} | " + " | ".join(cells) + " |")
    metric_rows = [(row["workload"], name, r["metrics"]) for row in results["workloads"]
                   for name, r in row["peers"].items() if "metrics" in r]
    if metric_rows:
        lines += ["", "Figures besides time (medians over runs):", "", "| workload | figure | value |", "|---|---|---|"]
        for workload, name, m in metric_rows:
            for k, v in m.items():
                lines.append(f"| {md_cell(workload)} ({name}) | {k} | {v:,.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
