#!/usr/bin/env python3
"""Create latency through one Vanish mount, idle against while the reaper frees
a buried tree: the tail the foreground pays for the background.

bench.py's latency workload takes the median of per-run p99s over fresh mounts;
this one alternates idle and reaping phases inside one mount, round after round,
so slow drift of the machine hits both alike, and pools every create, which is
enough to read p99.9 too. Each round: make a tree of 10k empty files in the
source, create N files through the mount (idle), bury the tree with the in-band
trigger, create N more while the reaper frees it, wait for the graveyard to
empty.

    sudo benchmarks/reaper_latency.py --dir /mnt/ramdisk [--options reap_yield=40ms] [--rounds 4]
"""
import argparse
import os
import shutil
import subprocess
import time

from bench import build_vanish, make_tree, percentile, start_foreground_vanish, stop_foreground_vanish


def creates(directory, tag, count):
    out = []
    for i in range(count):
        t = time.perf_counter_ns()
        os.close(os.open(f"{directory}/{tag}-{i}", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/vanish-latency", help="work directory (its filesystem is measured)")
    ap.add_argument("--options", default="", help="-o items for the mount")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--creates", type=int, default=2000, help="creates per phase and round")
    args = ap.parse_args()
    binary = build_vanish()
    base = os.path.join(args.dir, "reaper-latency")
    src, mnt = base + "/src", base + "/mnt"
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(src)
    os.makedirs(mnt)
    daemon = start_foreground_vanish(binary, src, mnt, args.options)
    try:
        idle, busy, drained_early = [], [], 0
        for r in range(args.rounds):
            os.mkdir(f"{mnt}/probe")
            os.mkdir(f"{src}/tree{r}")
            make_tree(f"{src}/tree{r}", 50, 200, size=0)
            subprocess.run(["sync"])
            idle += creates(f"{mnt}/probe", "idle", args.creates)
            os.setxattr(f"{mnt}/tree{r}", "user.vanish.delete", b"", os.XATTR_CREATE | os.XATTR_REPLACE)
            busy += creates(f"{mnt}/probe", "busy", args.creates)
            status = subprocess.run([binary, "status", "--json", mnt], capture_output=True, text=True).stdout
            drained_early += '"pending_entries":0,' in status
            subprocess.run([binary, "status", "--wait", mnt], stdout=subprocess.DEVNULL, check=True)
            shutil.rmtree(f"{mnt}/probe")
        print(f"vanish -o {args.options or '(defaults)'} on {args.dir}: {args.rounds} rounds, "
              f"{len(idle)} creates per phase; the reaper finished before the probe in {drained_early} rounds")
        print("| creates | idle | while reaping | ratio |")
        print("|---|---|---|---|")
        for q in (50, 90, 99, 99.9):
            a, b = percentile(idle, q), percentile(busy, q)
            print(f"| p{q} | {a:.0f} µs | {b:.0f} µs | {b / a:.2f}× |")
    finally:
        stop_foreground_vanish(daemon, mnt)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
