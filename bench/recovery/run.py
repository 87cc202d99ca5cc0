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
  --etcd: ddp alone, its own store against a 3-member etcd cluster (DDP_STORE), rank 1 killed,
         and rank 0 with etcd
  --torchft: 3 ranks; ddp under ddprun --on-failure rejoin (the killed rank restarted, rejoining
         the running job) against torchft (bench/recovery/torchft_train.py: a lighthouse, one
         replica group per process, the killed one started again and healed from a peer), with
         the lighthouse's join timeout at 10 s (torchft's README) and at 100 ms: kill -> the
         others' next step, and the restarted process's start -> its first step

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


def run_ddp(a, store=None, victim=1):
    r = subprocess.run([a.ddprun, "--standalone", "--nproc-per-node", "4", "--on-failure",
                        "shrink", a.example, "--cache", a.cache, "--epochs", "1", "--limit",
                        "12800", "--kill", f"{victim}:0:{a.kill_step}", "--timing"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, **({"DDP_STORE": store} if store else {})})
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


def run_ddp_rejoin(a):
    """ddp's side against torchft: 3 ranks, rank 1 killed at step K and restarted by ddprun to
    rejoin. (kill -> the others' next step, the restarted process's start -> its first step)."""
    r = subprocess.run([a.ddprun, "--standalone", "--nproc-per-node", "3", "--on-failure",
                        "rejoin", "--max-restarts", "1", a.example, "--cache", a.cache, "--epochs",
                        "1", "--limit", "19200", "--batch", "66", "--kill", f"1:0:{a.kill_step}",
                        "--timing"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit("FAIL: ddprun: " + r.stderr[-3000:])
    text = r.stdout + r.stderr
    started = re.search(r"timing: started at (\d+)", text)
    joined = re.search(r"timing: newcomer's first step done at (\d+)", text)
    if not started or not joined:
        sys.exit("FAIL: no newcomer timing in:\n" + text[-3000:])
    return timing(text), (int(joined.group(1)) - int(started.group(1))) / 1e9


def run_torchft(a, join_timeout_ms):
    """torchft (PyPI): a lighthouse, 3 replica groups of one process, replica 1 killed at step K,
    then started again (it heals from a live peer)."""
    import socket
    import time

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    bindir = os.path.dirname(a.torchrun)
    python = os.path.join(bindir, "python")
    lp = port()
    lighthouse = subprocess.Popen([os.path.join(bindir, "torchft_lighthouse"), "--min_replicas",
                                   "1", "--quorum_tick_ms", "100", "--join_timeout_ms",
                                   str(join_timeout_ms), "--bind", f"[::]:{lp}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as d:
        def replica(i, name, *extra):
            out = open(os.path.join(d, name), "w")
            return subprocess.Popen(
                [python, os.path.join(HERE, "torchft_train.py"), "--cache", a.cache,
                 "--kill-step", str(a.kill_step), "--steps", str(a.kill_step + 100), *extra],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "REPLICA_GROUP_ID": str(i),
                     "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lp}", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port()), "RANK": "0", "WORLD_SIZE": "1"})

        def read(name):
            with open(os.path.join(d, name)) as f:
                return f.read()

        procs = [replica(i, f"r{i}") for i in range(3)]
        until = time.monotonic() + 300
        while "timing: killed at" not in read("r1") and time.monotonic() < until:
            time.sleep(0.01)
        procs.append(replica(1, "new", "--newcomer"))  # restarted at once, as ddprun does
        for p in procs:
            p.wait(timeout=300)
        lighthouse.kill()
        lighthouse.wait()
        text = "".join(read(n) for n in ("r0", "r1", "r2", "new"))
    started = re.search(r"timing: started at (\d+)", text)
    joined = re.search(r"timing: newcomer's first step done at (\d+)", text)
    if not started or not joined:
        sys.exit("FAIL: no torchft timing in:\n" + text[-3000:])
    return timing(text), (int(joined.group(1)) - int(started.group(1))) / 1e9


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
    p.add_argument("--etcd", action="store_true",
                   help="ddp with its own store against ddp with the store in a 3-member etcd "
                        "cluster on loopback (etcd-server), rank 1 and rank 0 killed")
    p.add_argument("--torchft", action="store_true",
                   help="ddp (3 ranks, ddprun --on-failure rejoin) against torchft (its lighthouse "
                        "and Manager; --torchrun names the venv's torchrun, beside torchft's)")
    p.add_argument("--stall", action="store_true",
                   help="a rank stopped (SIGSTOP) instead of killed, ddp alone: stop -> next step")
    a = p.parse_args()
    if a.etcd:
        sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "launch"))
        import etcd_cluster
        rows = []
        with etcd_cluster.EtcdCluster(3) as etcd:
            for i in range(a.rounds):
                own = run_ddp(a)[0]
                e1 = run_ddp(a, etcd.url(f"bench{os.getpid()}r{i}a"))[0]
                e0 = run_ddp(a, etcd.url(f"bench{os.getpid()}r{i}b"), victim=0)[0]
                rows.append((own, e1, e0))
                print(f"round {i + 1}: kill -> next step: ddp's own store {own * 1000:.0f} ms, "
                      f"etcd {e1 * 1000:.0f} ms (rank 1 killed), {e0 * 1000:.0f} ms (rank 0)",
                      flush=True)
        print(f"median: own {statistics.median(r[0] for r in rows) * 1000:.0f} ms, etcd "
              f"{statistics.median(r[1] for r in rows) * 1000:.0f} ms / "
              f"{statistics.median(r[2] for r in rows) * 1000:.0f} ms; median of the per-round "
              f"ratios etcd/own {statistics.median(r[1] / r[0] for r in rows):.2f}")
        return
    if a.torchft:
        rows = []
        for i in range(a.rounds):
            d = run_ddp_rejoin(a)
            t = run_torchft(a, 10000)
            tt = run_torchft(a, 100)
            rows.append((d, t, tt))
            print(f"round {i + 1}: kill -> next step: ddp {d[0] * 1000:.0f} ms, torchft "
                  f"{t[0] * 1000:.0f} ms (join timeout 10 s), {tt[0] * 1000:.0f} ms (100 ms); "
                  f"newcomer start -> its first step: ddp {d[1] * 1000:.0f} ms, torchft "
                  f"{t[1] * 1000:.0f} / {tt[1] * 1000:.0f} ms", flush=True)
        med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
        print(f"median of the per-round ratios, kill -> next step: torchft/ddp "
              f"{med(lambda r: r[1][0] / r[0][0]):.1f} (join timeout 10 s), "
              f"{med(lambda r: r[2][0] / r[0][0]):.1f} (100 ms); newcomer -> first step: "
              f"{med(lambda r: r[1][1] / r[0][1]):.1f}, {med(lambda r: r[2][1] / r[0][1]):.1f}")
        return
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
