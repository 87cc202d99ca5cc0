#!/usr/bin/env python3
"""The fault-tolerant main job: examples/fashion_mnist_elastic under ddprun --on-failure rejoin
--max-restarts 1, 4 ranks, 3 epochs. Run once without losses and once with two kills and one
rejoin: rank 1 is killed in epoch 1, restarted by ddprun, rejoins the running job (receiving the
live state from the others), and is killed again in epoch 2 (no restart left). The second run
must finish with 3 ranks, train on every image of every epoch exactly once (each process records
the images of its committed steps), and end within 0.3 points of the first run's test accuracy.

    elastic_mnist.py DDPRUN FASHION_MNIST_ELASTIC CACHE_DIR
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

EPOCHS = 3


def run(ddprun, example, cache, *extra):
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "4", "--on-failure", "rejoin",
                        "--max-restarts", "1", example, "--cache", cache, "--epochs", str(EPOCHS), *extra],
                       capture_output=True, text=True, timeout=800)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        sys.exit(f"FAIL: ddprun exited with {r.returncode}")
    found = re.findall(rf"epoch {EPOCHS}/{EPOCHS}: train loss [0-9.]+, test accuracy ([0-9.]+)% "
                       r"\((\d) ranks\)", r.stdout)
    if not found:
        sys.exit("FAIL: no final epoch line")
    return float(found[-1][0]), int(found[-1][1]), r


def main():
    ddprun, example, cache = sys.argv[1:4]
    whole, ranks, _ = run(ddprun, example, cache)
    if ranks != 4:
        sys.exit(f"FAIL: the run without losses ended with {ranks} ranks")
    with tempfile.TemporaryDirectory() as rec:
        lost, ranks, r = run(ddprun, example, cache, "--kill", "1:0:300", "--kill", "1:1:500:1",
                             "--record", rec)
        if ranks != 3:
            sys.exit(f"FAIL: the run with two kills and one rejoin ended with {ranks} ranks")
        if "restarting it alone to rejoin the job" not in r.stderr:
            sys.exit("FAIL: ddprun did not restart rank 1 to rejoin")
        if not re.search(r"world rank 1 rejoined the job as rank 3 of 4", r.stdout):
            sys.exit("FAIL: rank 1 did not rejoin")
        if "lost during the run: rank 1" not in r.stderr:
            sys.exit("FAIL: ddprun did not report rank 1 lost at last")
        seen = collections.Counter()
        for name in os.listdir(rec):
            with open(os.path.join(rec, name)) as f:
                seen.update(tuple(line.split()) for line in f)
        per_epoch = collections.Counter(epoch for epoch, _ in seen)
        twice = [k for k, n in seen.items() if n != 1]
        print(f"images per epoch: {dict(sorted(per_epoch.items()))}; seen more than once: {len(twice)}")
        if twice or sorted(per_epoch.values()) != [60000] * EPOCHS:
            sys.exit("FAIL: the images of an epoch were not each trained on exactly once")
    print(f"test accuracy: {whole:.2f}% without losses, {lost:.2f}% with two kills and a rejoin "
          f"(difference {lost - whole:+.2f} points)")
    if abs(lost - whole) > 0.3:
        sys.exit("FAIL: more than 0.3 points apart")
    print("PASS")


if __name__ == "__main__":
    main()
