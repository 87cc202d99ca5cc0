#!/usr/bin/env python3
"""ddp's FullyShardedAverager (fsdp-bench, libtorch's kernels) against PyTorch FSDP2
(torch_fsdp.py: fully_shard per layer over gloo) on the same step: a deep MLP of Linear + tanh
layers, one unit per layer, the same width, layers and batch per rank, SGD with momentum, one
torch thread per rank. Each round runs, in turn:
  ddp           fsdp-bench                  the next unit gathered while this one computes
  ddp, no prefetch  fsdp-bench --prefetch off   every gather waited for in turn
  torch FSDP2   torch_fsdp.py
  ddp, communication alone   fsdp-bench --compute off   the same gathers and reduces, no arithmetic
(the machine's speed drifts between minutes, so ratios are taken within a round; the medians of
the per-round ratios are printed, with each side's median ms/step and peak resident memory).
fsdp-bench is built here against the Python's own libtorch (PyPI's torch) when --bench is not
given, into --build.
    bench/torch/fsdp_compare.py [--python ~/.cache/ddp/torch-venv/bin/python] [--ranks 2]
        [--width 1024] [--layers 8] [--batch 32] [--rounds 5] [--steps 20]
        [--bench PATH | --build DIR]"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import run_output  # noqa: E402


def run(cmd, env):
    """One run's (ms/step, peak MiB)."""
    out = run_output(cmd, env, timeout=300, wanted=r"ms/step [0-9.]+\npeak MiB [0-9.]+")
    ms, mib = re.search(r"ms/step ([0-9.]+)\npeak MiB ([0-9.]+)", out).groups()
    return float(ms), float(mib)


def build(python, where):
    """fsdp-bench against `python`'s torch (its libraries, not a system libtorch's)."""
    torch_dir = subprocess.check_output(
        [python, "-c", "import torch, os; print(os.path.dirname(torch.__file__))"],
        text=True, stderr=subprocess.DEVNULL).strip()
    cfg = ["cmake", "-S", os.path.join(HERE, "fsdp"), "-B", where, "-DCMAKE_BUILD_TYPE=Release",
           f"-DCMAKE_PREFIX_PATH={torch_dir}/share/cmake",
           # Debian's libtorch-dev, when installed, has a libc10 that find_library prefers
           f"-Dc10_LIBRARY={torch_dir}/lib/libc10.so"]
    nccl = subprocess.run([python, "-c", "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"],
                          capture_output=True, text=True)
    if nccl.returncode == 0:  # a CUDA build of torch links NCCL from its own wheel
        cfg.append(f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,{nccl.stdout.strip()}/lib")
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", where], check=True, stdout=subprocess.DEVNULL)
    return os.path.join(where, "fsdp-bench")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.cache/ddp/torch-venv/bin/python"))
    ap.add_argument("--bench")
    ap.add_argument("--build", default="build/fsdp-bench")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    bench = a.bench or build(a.python, a.build)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    shape = ["--ranks", str(a.ranks), "--width", str(a.width), "--layers", str(a.layers),
             "--batch", str(a.batch), "--steps", str(a.steps)]
    sides = {
        "ddp": [bench, *shape],
        "ddp, no prefetch": [bench, *shape, "--prefetch", "off"],
        "torch FSDP2": [a.python, os.path.join(HERE, "torch_fsdp.py"), *shape],
        "ddp, comm alone": [bench, *shape, "--compute", "off"],
    }
    got = {k: [] for k in sides}
    for r in range(a.rounds):
        for name, cmd in sides.items():
            got[name].append(run(cmd, env))
        line = ", ".join(f"{k} {v[-1][0]:.1f} ms" for k, v in got.items())
        print(f"round {r + 1}: {line}", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"{a.ranks} ranks, width {a.width}, {a.layers} layers, batch {a.batch} per rank, "
          f"{a.rounds} rounds of {a.steps} steps:")
    for name, v in got.items():
        print(f"  {name:17s} ms/step {med([x[0] for x in v]):8.1f}   "
              f"peak MiB/rank {med([x[1] for x in v]):7.1f}")
    ddp, off, torch, _ = ([x[0] for x in got[k]] for k in sides)
    print(f"  torch FSDP2 / ddp (step time): {med([t / d for t, d in zip(torch, ddp)]):.2f}x")
    print(f"  no prefetch / prefetch (ddp):  {med([o / d for o, d in zip(off, ddp)]):.2f}x")
    mem = med([t[1] / d[1] for t, d in zip(got['torch FSDP2'], got['ddp'])])
    print(f"  torch FSDP2 / ddp (peak memory): {mem:.2f}x")


if __name__ == "__main__":
    main()
