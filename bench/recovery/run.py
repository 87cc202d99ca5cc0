#!/usr/bin/env python3
"""Recovery time: a rank of 4 killed mid-run, from the kill to the first training step completed
afterwards, ddp against the path a PyTorch user has. Alternating rounds; the median of the
per-round ratios.

  ddp:   ddprun --on-failure shrink examples/fashion_mnist_elastic --kill 1:0:K --timing
         (the survivors shrink, restore the last commit and go on: no step lost)
  torch: torchrun --max-restarts 1 bench/recovery/torch_restart.py --kill-step K
         (every worker restarted, the last checkpoint loaded: the steps since it are lost)
  --stall: ddp alone, the rank stopped with SIGSTOP instead of killed (noticed through the
         heartbeat): from the stop to the others' next step

  bench/recovery/run.py --ddprun build/default/tools/ddprun \
      --example build/default/examples/fashion_mnist_elastic \
      --torchrun ~/.cache/ddp/torch-venv/bin/torchrun --cache build/default/fashion-mnist-cache
  bench/recovery/run.py --stall --ddprun ... --example ... --torchrun - --cache ...
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def timing(text):
    killed = re.search(r"timing: killed at (\d+)", text)
    first = re.search(r"timing: first step on the new membership done at (\d+)", text)
    if not killed or not first:
        sys.exit("FAIL: no timing lines in:\n" + text[-3000:])
    return (int(first.group(1)) - int(killed.group(1))) / 1e9


def run_ddp(a):
    r = subprocess.run([a.ddprun, "--standalone", "--nproc-per-node", "4", "--on-failure",
                        "shrink", a.example, "--cache", a.cache, "--epochs", "1", "--limit",
                        "12800", "--kill", f"1:0:{a.kill_step}", "--timing"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit("FAIL: ddprun: " + r.stderr[-3000:])
    commit = int(re.search(r"go on from commit (\d+)", r.stdout).group(1))
    return timing(r.stdout + r.stderr), a.kill_step - commit


def run_stall(a):
    """A rank stopped with SIGSTOP (not killed) at step K, the heartbeat at its default: from
    the stop to the first step the others complete without it. Once they have finished, the
    stopped one is continued: it must find itself fenced (it exits with an error)."""
    import signal
    p = subprocess.Popen([a.ddprun, "--standalone", "--nproc-per-node", "4", "--on-failure",
                          "shrink", a.example, "--cache", a.cache, "--epochs", "1", "--limit",
                          "12800", "--stop", f"1:0:{a.kill_step}", "--timing"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, pid = "", None
    for line in p.stdout:
        text += line
        m = re.search(r"stops itself \(SIGSTOP\) at epoch \d+ step \d+, pid (\d+)", line)
        if m:
            pid = int(m.group(1))
        if re.search(r"\[r0\] epoch 1/1: ", line) and pid:
            os.kill(pid, signal.SIGCONT)  # the others are done: wake it, to be fenced
    p.wait(timeout=600)
    if "this process sent no sign of life" not in text:
        sys.exit("FAIL: the stopped rank was not fenced when it woke:\n" + text[-3000:])
    stopped = re.search(r"timing: stopped at (\d+)", text)
    first = re.search(r"timing: first step on the new membership done at (\d+)", text)
    if not stopped or not first:
        sys.exit("FAIL: no timing lines in:\n" + text[-3000:])
    return (int(first.group(1)) - int(stopped.group(1))) / 1e9


def run_torch(a):
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([a.torchrun, "--standalone", "--nproc-per-node", "4", "--max-restarts",
                            "1", "--monitor-interval", "0.1", os.path.join(HERE, "torch_restart.py"),
                            "--cache", a.cache, "--kill-rank", "1", "--kill-step",
                            str(a.kill_step), "--ckpt-every", str(a.ckpt_every), "--steps",
                            str(a.kill_step + 5), "--checkpoint", os.path.join(d, "ck.pt")],
                           capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit("FAIL: torchrun: " + r.stderr[-3000:])
    resumed = int(re.search(r"resumed from (\d+)", r.stdout).group(1))
    return timing(r.stdout + r.stderr), a.kill_step - resumed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ddprun", required=True)
    p.add_argument("--example", required=True)
    p.add_argument("--torchrun", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--stall", action="store_true",
                   help="a rank stopped (SIGSTOP) instead of killed, ddp alone: stop -> next step")
    a = p.parse_args()
    if a.stall:
        times = []
        for i in range(a.rounds):
            times.append(run_stall(a))
            print(f"round {i + 1}: stop -> the others' next step {times[-1] * 1000:.0f} ms",
                  flush=True)
        print(f"median {statistics.median(times) * 1000:.0f} ms (heartbeat: "
              f"{os.environ.get('DDP_HEARTBEAT', '5')} s)")
        return
    ratios, ddp_s, torch_s = [], [], []
    for i in range(a.rounds):
        d, d_lost = run_ddp(a)
        t, t_lost = run_torch(a)
        ratios.append(t / d)
        ddp_s.append(d)
        torch_s.append(t)
        print(f"round {i + 1}: ddp {d * 1000:.0f} ms ({d_lost} steps lost), torchrun restart "
              f"{t * 1000:.0f} ms ({t_lost} steps lost), ratio {t / d:.1f}", flush=True)
    print(f"median: ddp {statistics.median(ddp_s) * 1000:.0f} ms, torchrun restart "
          f"{statistics.median(torch_s) * 1000:.0f} ms; median of the per-round ratios "
          f"{statistics.median(ratios):.1f}")


if __name__ == "__main__":
    main()
