#!/usr/bin/env python3
"""ddp's GradientAverager against libtorch's own C++ DDP engine (c10d::Reducer over
ProcessGroupGloo, bench/torch/reducer_bench.cpp) on the same libtorch training step, in
alternating rounds, quiet or beside other load:
  hooks     torch-bench --mode hooks     ddp, buckets started from autograd hooks
  average   torch-bench --mode average   ddp, average() after backward
  reducer   reducer-bench                c10d::Reducer + ProcessGroupGloo
  local     torch-bench --mode local     the ranks training alone (the step's floor here)
--load: none; cpu (N processes spinning, default 4); mem (2 processes copying 64 MiB arrays:
memory bandwidth); mixed (both). The load runs for the whole round. Reports the median ms/step
and the median of the per-round ratios reducer / ddp (above 1: ddp is faster), and reducer /
local: the ratio an engine that averaged for free would reach.
    bench/torch/reducer_compare.py --bench build/default/bench/torch-bench \\
        --reducer build/default/bench/reducer-bench --model cnn --ranks 2 --load none
        [--rounds 5] [--steps 30] [--hogs 4]"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import ms_per_step  # noqa: E402

SPIN = "while True: pass"
COPY = ("import numpy as np\na = np.ones(16 << 20, np.float32); b = np.empty_like(a)\n"
        "while True: np.copyto(b, a)")


def start_load(kind, hogs):
    code = {"cpu": [SPIN] * hogs, "mem": [COPY] * 2, "mixed": [SPIN] * hogs + [COPY] * 2,
            "none": []}[kind]
    return [subprocess.Popen(["/usr/bin/python3", "-c", c]) for c in code]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="the torch-bench program")
    p.add_argument("--reducer", required=True, help="the reducer-bench program")
    p.add_argument("--model", default="cnn", choices=["cnn", "mnist-net", "mlp"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--load", default="none", choices=["none", "cpu", "mem", "mixed"])
    p.add_argument("--hogs", type=int, default=4, help="spinning processes of --load cpu/mixed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    common = ["--model", a.model, "--ranks", str(a.ranks), "--steps", str(a.steps)]
    runs = {
        "hooks": [a.bench, "--mode", "hooks", *common],
        "average": [a.bench, "--mode", "average", *common],
        "reducer": [a.reducer, *common],
        "local": [a.bench, "--mode", "local", *common],
    }
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(a.rounds):
        load = start_load(a.load, a.hogs)
        try:
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                times[n].append(ms_per_step(runs[n], env, tries=5, timeout=90))
        finally:
            for h in load:
                h.kill()
                h.wait()
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}" for n in names), flush=True)
    print(f"\n{a.model}, {a.ranks} ranks, load {a.load}"
          f"{f' ({a.hogs} spinning)' if a.load in ('cpu', 'mixed') else ''}, "
          f"{a.rounds} rounds of {a.steps} steps")
    for n in names:
        print(f"  {n:8s} {statistics.median(times[n]):8.2f} ms/step")
    for n in ("hooks", "average", "local"):
        ratio = statistics.median(t / u for t, u in zip(times["reducer"], times[n]))
        lo = min(t / u for t, u in zip(times["reducer"], times[n]))
        hi = max(t / u for t, u in zip(times["reducer"], times[n]))
        what = "the bound: training alone" if n == "local" else f"ddp {n}"
        print(f"  reducer / {what}: {ratio:.2f} (rounds {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    main()
