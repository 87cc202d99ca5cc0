#!/usr/bin/env python3
"""PowerSGD against fp32 all_reduce, ddp's and PyTorch's, on the libtorch MLP step, in
alternating rounds. Every round runs, in a rotating order:
  ddp fp32       torch-bench --mode hooks --hook fp32       (ddp's GradientAverager, all_reduce)
  ddp powersgd   torch-bench --mode hooks --hook powersgd   (ddp::PowerSGDHook, rank R)
  torch fp32     torch_ddp.py                               (PyTorch DDP, gloo)
  torch powersgd torch_ddp.py --hook powersgd               (torch's powerSGD_hook, rank R)
and the script reports the median ms/step of each, the median of the per-round ratios, and the
bytes each rank all_reduces per step. ddp's transport comes from DDP_HOST_TRANSPORT (shm or
tcp); gloo always uses TCP on the loopback interface.
    bench/torch/powersgd.py --bench build/default/bench/torch-bench --ranks 2 \\
        --transport shm [--hidden 2048] [--rank 4] [--rounds 5] [--steps 20]"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import ms_per_step  # noqa: E402


def wire(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600).stdout
    m = re.search(r"wire: .*", out)
    return m.group(0) if m else "?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="the torch-bench program")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--python", default="/usr/bin/python3", help="an interpreter with torch")
    p.add_argument("--without-torch-powersgd", action="store_true",
                   help="torch's powerSGD_hook on gloo fails on this MLP from a width of 512 "
                        "(a size mismatch in gloo, a hang on torch 2.x): leave it out")
    a = p.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               DDP_HOST_TRANSPORT=a.transport)
    common = ["--model", "mlp", "--ranks", str(a.ranks), "--steps", str(a.steps),
              "--hidden", str(a.hidden)]
    psgd = ["--hook", "powersgd", "--psgd-rank", str(a.rank)]
    runs = {
        "ddp fp32": [a.bench, "--mode", "hooks", *common, "--hook", "fp32"],
        "ddp powersgd": [a.bench, "--mode", "hooks", *common, *psgd],
        "torch fp32": [a.python, os.path.join(HERE, "torch_ddp.py"), *common],
        "torch powersgd": [a.python, os.path.join(HERE, "torch_ddp.py"), *common, *psgd],
    }
    if a.without_torch_powersgd:
        del runs["torch powersgd"]
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(ms_per_step(runs[n], env, tries=5, timeout=90))
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.1f}" for n in names), flush=True)
    print(f"\nMLP 784-{a.hidden}-{a.hidden}-10, {a.ranks} ranks, ddp over {a.transport}, "
          f"PowerSGD rank {a.rank}, {a.rounds} rounds of {a.steps} steps")
    for n in names:
        print(f"  {n:15s} {statistics.median(times[n]):8.1f} ms/step")
    ratio = lambda x, y: statistics.median(t / u for t, u in zip(times[x], times[y]))  # noqa: E731
    print(f"  ddp powersgd / ddp fp32:       {ratio('ddp powersgd', 'ddp fp32'):.2f}")
    if "torch powersgd" in runs:
        print(f"  torch powersgd / torch fp32:   {ratio('torch powersgd', 'torch fp32'):.2f}")
        print(f"  ddp powersgd / torch powersgd: {ratio('ddp powersgd', 'torch powersgd'):.2f}")
    print(f"  ddp fp32 / torch fp32:         {ratio('ddp fp32', 'torch fp32'):.2f}")
    print("  " + wire(runs["ddp powersgd"], env))
    if "torch powersgd" in runs:
        print("  torch: " + wire(runs["torch powersgd"], env))


if __name__ == "__main__":
    main()
