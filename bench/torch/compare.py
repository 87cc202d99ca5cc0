#!/usr/bin/env python3
"""Runs the libtorch step several ways in alternating rounds and prints medians:
  hooks        torch-bench --mode hooks     libtorch + ddp, buckets started from autograd hooks
  average      torch-bench --mode average   libtorch + ddp, average() after backward
  torch-ddp    torch_ddp.py                 PyTorch's DistributedDataParallel with gloo
  one process  torch-bench --mode none      one process, no communication
and, to say where the exposed communication goes:
  local        torch-bench --mode local     N ranks training alone (the cost of sharing the cores)
  barrier      torch-bench --mode barrier   local + a barrier per step (+ waiting for the slowest)
  comm         torch-bench --mode comm      average() alone: this model's all_reduce (the floor)
Each round runs every one once (the machine's speed drifts between minutes, so ratios are taken
within a round and their median reported). Exposed communication = step - one-process step;
scaling efficiency = one-process step / step. --model device-mlp (an accelerator-style MLP, see
torch_bench.cpp) has no PyTorch side.
    bench/torch/compare.py --bench build/default/bench/torch-bench [--model mlp] [--ranks 2]
        [--rounds 5] [--steps 30]"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_output(cmd, env, tries=3, timeout=180, wanted=r"ms/step ([0-9.]+)"):
    """One run's stdout, which must match `wanted`. A run that hangs (PyTorch's gloo rendezvous
    does, now and then, on this VM) is killed with its whole process group after `timeout` s and
    retried."""
    for attempt in range(tries):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            print(f"  (timed out, retrying: {' '.join(cmd)})", file=sys.stderr, flush=True)
            continue
        if p.returncode != 0 or not re.search(wanted, out):
            sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{out}\n{err[-3000:]}")
        return out
    sys.exit(f"{' '.join(cmd)} timed out {tries} times")


def ms_per_step(cmd, env, tries=3, timeout=180):
    """One run's ms/step (see run_output)."""
    out = run_output(cmd, env, tries, timeout)
    return float(re.search(r"ms/step ([0-9.]+)", out).group(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="the torch-bench program")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "device-mlp"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--python", default="/usr/bin/python3", help="an interpreter with torch")
    a = p.parse_args()
    # One BLAS thread per process on both sides; gloo on the loopback interface.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    common = ["--model", a.model, "--steps", str(a.steps)]
    ranks = ["--ranks", str(a.ranks)]
    runs = {
        "hooks": [a.bench, "--mode", "hooks"] + ranks + common,
        "average": [a.bench, "--mode", "average"] + ranks + common,
        "torch-ddp": [a.python, os.path.join(HERE, "torch_ddp.py")] + ranks + common,
        "one process": [a.bench, "--mode", "none"] + common,
        "local": [a.bench, "--mode", "local"] + ranks + common,
        "barrier": [a.bench, "--mode", "barrier"] + ranks + common,
        "comm": [a.bench, "--mode", "comm"] + ranks + common,
    }
    if a.model == "device-mlp":
        del runs["torch-ddp"]
    t = {k: [] for k in runs}
    for r in range(a.rounds):
        for k, cmd in runs.items():
            t[k].append(ms_per_step(cmd, env))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in t.items()), flush=True)
    med = {k: statistics.median(v) for k, v in t.items()}
    one = t["one process"]

    def paired(f):
        return statistics.median(f(i) for i in range(a.rounds))

    print(f"\n{a.model}, {a.ranks} ranks, batch 64 per rank, medians of {a.rounds} rounds (ms/step):")
    print("| run | ms/step | exposed communication (ms) | scaling efficiency |")
    print("|---|---:|---:|---:|")
    for k in runs:
        if k == "comm":
            continue
        exp = paired(lambda i: t[k][i] - one[i])
        eff = paired(lambda i: one[i] / t[k][i])
        print(f"| {k} | {med[k]:.2f} | {exp:.2f} | {100 * eff:.1f}% |")
    print(f"| comm: average() alone | {med['comm']:.2f} | | |")
    if "torch-ddp" in runs:
        for k in ("hooks", "average"):
            speed = paired(lambda i: t["torch-ddp"][i] / t[k][i])
            exposed = paired(lambda i: (t[k][i] - one[i]) / max(t["torch-ddp"][i] - one[i], 1e-9))
            print(f"ddp ({k}) vs PyTorch DDP: {speed:.2f}x the steps per second, "
                  f"{exposed:.2f}x the exposed communication (paired per round)")
    hooks_vs_avg = paired(lambda i: (t["hooks"][i] - one[i]) / max(t["average"][i] - one[i], 1e-9))
    print(f"hooks vs average(): {hooks_vs_avg:.2f}x the exposed communication (paired per round)")
    floor = paired(lambda i: one[i] / (one[i] + t["comm"][i]))
    floor_barrier = paired(lambda i: one[i] / (t["barrier"][i] + t["comm"][i]))
    print(f"efficiency if the all_reduce were the only cost (one / (one + comm)): {100 * floor:.1f}%; "
          f"with the cost of sharing the cores and waiting for the slowest rank "
          f"(one / (barrier + comm)): {100 * floor_barrier:.1f}%")

if __name__ == "__main__":
    main()
