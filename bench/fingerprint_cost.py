#!/usr/bin/env python3
# ddp — header-only C++20 distributed data-parallel toolkit
# SPDX-License-Identifier: MIT
"""What the collective fingerprint check costs on backend::Host: the latency of a 4-byte
all_reduce with DDP_VERIFY_COLLECTIVES=1 (the default) and =0, in interleaved runs (this machine's
speed drifts), reported as medians.

    python3 bench/fingerprint_cost.py [--bench build/release/tools/ddp-bench] [--rounds 9]
"""

import argparse
import os
import statistics
import subprocess
import tempfile
from csv import DictReader


def latency_us(bench, transport, nproc, verify, seconds):
    env = dict(os.environ, DDP_VERIFY_COLLECTIVES="1" if verify else "0")
    with tempfile.NamedTemporaryFile(suffix=".csv") as csv:
        subprocess.run([bench, "-o", "all_reduce", "-n", str(nproc), "-b", "4", "-e", "4",
                        "-t", transport, "--seconds", str(seconds), "-w", "1000",
                        "--csv", csv.name], env=env, check=True, capture_output=True)
        rows = list(DictReader(open(csv.name)))
    return float(rows[-1]["time_us"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="build/release/tools/ddp-bench")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--transport", nargs="+", default=["shm", "tcp"])
    a = ap.parse_args()
    print("| transport | ranks | verify on (us) | verify off (us) | cost |")
    print("|---|---|---|---|---|")
    for t in a.transport:
        for n in a.nproc:
            on, off = [], []
            for k in range(a.rounds):  # alternating which goes first
                for verify in ((True, False) if k % 2 == 0 else (False, True)):
                    (on if verify else off).append(latency_us(a.bench, t, n, verify, a.seconds))
            m_on, m_off = statistics.median(on), statistics.median(off)
            print(f"| {t} | {n} | {m_on:.3f} | {m_off:.3f} | {100 * (m_on / m_off - 1):+.1f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
