#!/usr/bin/env python3
"""Where a created file's time goes: each step of `create, write, close`
timed on its own, for many files in one directory, in each directory given
(a native one and one through a mount), interleaved, medians of the runs.

    benchmarks/create_steps.py [--files N] [--runs R] NATIVE_DIR MOUNTED_DIR

Steps, in µs per file: a lookup of a name that does not exist (stat), the
open(O_CREAT | O_EXCL) that makes the file (with its own lookup), the first
write (through a FUSE mount the kernel asks for security.capability then),
and the close (a release the caller does not wait for). Needs a soft limit
of open files above N.
"""

import argparse
import os
import shutil
import statistics
import time


def steps(work, files):
    """Times the steps in the new directory `work`, which the caller removes
    after every run (removed through a mount between runs, it would leave
    the reaper freeing it during the next)."""
    os.mkdir(work)
    t0 = time.perf_counter()
    for i in range(files):
        try:
            os.stat(f"{work}/absent{i}")
        except FileNotFoundError:
            pass
    t1 = time.perf_counter()
    fds = [os.open(f"{work}/f{i}", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644) for i in range(files)]
    t2 = time.perf_counter()
    for fd in fds:
        os.write(fd, b"x")
    t3 = time.perf_counter()
    for fd in fds:
        os.close(fd)
    t4 = time.perf_counter()
    per = lambda a, b: (b - a) * 1e6 / files
    return {"lookup of an absent name": per(t0, t1), "create (lookup and open)": per(t1, t2),
            "first write": per(t2, t3), "close": per(t3, t4)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("dirs", nargs="+")
    a = p.parse_args()
    results = {d: [] for d in a.dirs}
    try:
        for run in range(a.runs):
            for d in a.dirs:
                results[d].append(steps(os.path.join(d, f"create-steps-{run}"), a.files))
    finally:
        for d in a.dirs:
            for run in range(a.runs):
                shutil.rmtree(os.path.join(d, f"create-steps-{run}"), ignore_errors=True)
    names = list(results[a.dirs[0]][0])
    print("| step, µs per file | " + " | ".join(a.dirs) + " |")
    print("|---" * (len(a.dirs) + 1) + "|")
    for n in names:
        cells = []
        for d in a.dirs:
            m = statistics.median(r[n] for r in results[d])
            base = statistics.median(r[n] for r in results[a.dirs[0]])
            cells.append(f"{m:.1f}" + ("" if d == a.dirs[0] else f" (+{m - base:.1f})"))
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
