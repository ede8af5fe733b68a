#!/usr/bin/env python3
"""How long a serving mount's reaper takes to free a tree while CPU-bound work
runs beside it: the time from `vanish rm -r` until `vanish status --wait`
returns, for `vanish mount -f` started from this script, so the daemon shares
the script's session (and autogroup) with the busy loops, as a foreground
daemon in a busy shell does. Rounds alternate between the binaries given.

    sudo benchmarks/reaper_drain.py --dir /mnt/ramdisk [--files 20000] [--hogs 4] \\
        [--binary OLD --binary NEW] [--rounds 3] [--timeout 300]

Without --binary it builds and measures this tree. A round that does not
finish within --timeout is reported as such.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import time

from bench import build_vanish, make_tree, start_foreground_vanish, stop_foreground_vanish


def one_round(binary, base, files, hogs, timeout):
    src, mnt = base + "/src", base + "/mnt"
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(src)
    os.makedirs(mnt)
    os.mkdir(f"{src}/tree")
    make_tree(f"{src}/tree", max(1, files // 1000), min(files, 1000))
    subprocess.run(["sync"])
    daemon = start_foreground_vanish(binary, src, mnt)
    busy = []
    try:
        busy = [subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"]) for _ in range(hogs)]
        start = time.perf_counter()
        subprocess.run([binary, "rm", "-r", f"{mnt}/tree"], check=True)
        try:
            subprocess.run([binary, "status", "--wait", mnt], stdout=subprocess.DEVNULL, timeout=timeout, check=True)
            return time.perf_counter() - start
        except subprocess.TimeoutExpired:
            return None
    finally:
        for p in busy:
            p.kill()
            p.wait()
        # An unfinished round's rest goes with the directory, not to a lingering daemon.
        stop_foreground_vanish(daemon, mnt, terminate=True)
        shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/vanish-drain", help="work directory (its filesystem is measured)")
    ap.add_argument("--binary", action="append", help="a vanish binary to measure (repeat to compare)")
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--hogs", type=int, default=4, help="busy loops beside the daemon")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a round counts as not finished")
    args = ap.parse_args()
    binaries = args.binary or [build_vanish()]
    base = os.path.join(args.dir, "reaper-drain")
    results = {b: [] for b in binaries}
    for _ in range(args.rounds):
        for b in binaries:
            results[b].append(one_round(b, base, args.files, args.hogs, args.timeout))
    print(f"freeing {args.files} files through a serving vanish mount -f beside {args.hogs} busy loops, "
          f"on {args.dir}, {args.rounds} rounds")
    print("| binary | median | rounds |")
    print("|---|---|---|")
    for b, times in results.items():
        done = [t for t in times if t is not None]
        shown = " ".join(f"{t:.1f} s" if t is not None else f">{args.timeout:.0f} s" for t in times)
        median = f"{statistics.median(done):.1f} s" if len(done) == len(times) else "not finished"
        print(f"| {b} | {median} | {shown} |")


if __name__ == "__main__":
    main()
