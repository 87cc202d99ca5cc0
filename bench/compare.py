#!/usr/bin/env python3
"""Markdown table comparing ddp and a peer from ddp-bench/mpi-bench CSV files.

  compare.py A1.csv [A2.csv ...] -- B1.csv [B2.csv ...]

Each side may give several runs (interleaved with the other side's): per size, the median time
of the runs is used, which tames this machine's noise."""
import csv
import statistics
import sys


def load(paths):
    runs = {}
    label = None
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                label = r["label"]
                runs.setdefault(int(r["bytes"]), []).append(r)
    out = {}
    for size, rows in runs.items():
        t = statistics.median(float(r["time_us"]) for r in rows)
        scale = t / float(rows[0]["time_us"])
        out[size] = (t, float(rows[0]["busbw_gbps"]) / scale, len(rows))
    return label, out


args = sys.argv[1:]
split = args.index("--")
la, a = load(args[:split])
lb, b = load(args[split + 1:])
print(f"| size (B) | {la} time (µs) | {lb} time (µs) | {la} busbw (GB/s) | {lb} busbw (GB/s) | {la} / {lb} (busbw) |")
print("|---:|---:|---:|---:|---:|---:|")
for size in sorted(set(a) & set(b)):
    (ta, ba, _), (tb, bb, _) = a[size], b[size]
    print(f"| {size} | {ta:.2f} | {tb:.2f} | {ba:.2f} | {bb:.2f} | {tb / ta:.2f}x |")
