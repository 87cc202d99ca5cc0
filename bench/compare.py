#!/usr/bin/env python3
"""Markdown table comparing ddp and a peer from ddp-bench/mpi-bench CSV files, paired by round.

  compare.py A1.csv [A2.csv ...] -- B1.csv [B2.csv ...]

A_i and B_i are one round: they ran one right after the other, on the same machine in the same
minute. This machine's speed drifts by up to 3x between minutes, so the figure that counts is the
median, over the rounds, of each round's ratio B time / A time (how many times faster A is), with
the lowest and highest round beside it. The time columns are medians over the rounds."""
import csv
import statistics
import sys


def load(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return rows[0]["label"] if rows else path, {int(r["bytes"]): float(r["time_us"]) for r in rows}


def human(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main(argv):
    if "--" not in argv:
        sys.exit(__doc__)
    split = argv.index("--")
    a_paths, b_paths = argv[:split], argv[split + 1:]
    if len(a_paths) != len(b_paths) or not a_paths:
        sys.exit("compare.py: give as many runs on each side (one per round)")
    a = [load(p) for p in a_paths]
    b = [load(p) for p in b_paths]
    la, lb = a[0][0], b[0][0]
    sizes = sorted(set.intersection(*(set(t) for _, t in a + b)))
    print(f"| size | {la} (µs) | {lb} (µs) | {la} ÷ {lb} speed, median of {len(a)} rounds "
          f"| lowest–highest round |")
    print("|---:|---:|---:|---:|---:|")
    for s in sizes:
        ta = [t[s] for _, t in a]
        tb = [t[s] for _, t in b]
        ratios = [y / x for x, y in zip(ta, tb)]
        print(f"| {human(s)} | {statistics.median(ta):.2f} | {statistics.median(tb):.2f} "
              f"| {statistics.median(ratios):.2f}× | {min(ratios):.2f}–{max(ratios):.2f}× |")


if __name__ == "__main__":
    main(sys.argv[1:])
