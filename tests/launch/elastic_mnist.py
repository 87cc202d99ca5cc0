#!/usr/bin/env python3
"""The fault-tolerant main job: examples/fashion_mnist_elastic under ddprun --on-failure shrink,
4 ranks, 3 epochs. Run once without losses and once with two ranks killed (one in epoch 1, one in
epoch 2); the second run must finish with the two others, train on every image of every epoch
exactly once (the ranks record the images of their committed steps), and end within 0.3 points
of the first run's test accuracy.

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
    r = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "4", "--on-failure", "shrink",
                        example, "--cache", cache, "--epochs", str(EPOCHS), *extra],
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
        lost, ranks, r = run(ddprun, example, cache, "--kill", "1:0:300", "--kill", "3:1:500",
                             "--record", rec)
        if ranks != 2:
            sys.exit(f"FAIL: the run with two losses ended with {ranks} ranks")
        if "lost during the run: ranks 1, 3" not in r.stderr:
            sys.exit("FAIL: ddprun did not report ranks 1 and 3 lost")
        seen = collections.Counter()
        for name in os.listdir(rec):
            with open(os.path.join(rec, name)) as f:
                seen.update(tuple(line.split()) for line in f)
        per_epoch = collections.Counter(epoch for epoch, _ in seen)
        twice = [k for k, n in seen.items() if n != 1]
        print(f"images per epoch: {dict(sorted(per_epoch.items()))}; seen more than once: {len(twice)}")
        if twice or sorted(per_epoch.values()) != [60000] * EPOCHS:
            sys.exit("FAIL: the images of an epoch were not each trained on exactly once")
    print(f"test accuracy: {whole:.2f}% without losses, {lost:.2f}% with two ranks lost "
          f"(difference {lost - whole:+.2f} points)")
    if abs(lost - whole) > 0.3:
        sys.exit("FAIL: more than 0.3 points apart")
    print("PASS")


if __name__ == "__main__":
    main()
