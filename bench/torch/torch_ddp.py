#!/usr/bin/python3
"""PyTorch's own DistributedDataParallel (gloo) on the step torch-bench measures: the same model,
batch (64 synthetic samples per rank), optimizer and thread settings. Run with Debian's
interpreter (python3-torch):
    /usr/bin/python3 bench/torch/torch_ddp.py --model mlp|cnn --ranks N [--steps S] [--warmup W]
        [--hook fp32|powersgd] [--psgd-rank R] [--hidden H]
Prints "ms/step X" (the slowest rank's mean over the timed steps)."""
import argparse
import os
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD


class Mlp(nn.Module):
    def __init__(self, hidden=2048):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, hidden), nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.view(x.size(0), 784))))))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
        self.fc1, self.fc2 = nn.Linear(64 * 5 * 5, 128), nn.Linear(128, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def worker(rank, args, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1)
    # torch's PowerSGD hook on gloo issues collectives from its futures' callbacks: with several
    # buckets in flight they reach the ranks in different orders (a size mismatch in gloo, or a
    # hang); with one bucket they cannot.
    one_bucket = {"bucket_cap_mb": 4096} if args.hook == "powersgd" else {}
    net = nn.parallel.DistributedDataParallel(Mlp(args.hidden) if args.model == "mlp" else Cnn(),
                                              **one_bucket)
    state = None
    if args.hook == "powersgd":  # compressed once the warm-up steps are over
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=args.psgd_rank,
                                       start_powerSGD_iter=args.warmup)
        net.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / args.steps], dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{args.model} torch-ddp {args.ranks} ranks: ms/step {ms.item():.3f}", flush=True)
        if state is not None:
            rate, before, after = state.compression_stats()
            print(f"wire: powerSGD 1/{rate:.1f} ({after} of {before} elements)", flush=True)
    dist.destroy_process_group()


def store_port():
    """A free port below the kernel's ephemeral range. A port from bind(0) lies inside it, and a
    rank that connects before rank 0's TCPStore listens can then be given that very port as its
    own source port: the socket connects to itself (TCP simultaneous open), and the rank hangs at
    100% CPU talking to itself (an intermittent hang)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hook", choices=["fp32", "powersgd"], default="fp32")
    p.add_argument("--psgd-rank", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048, help="the MLP's width")
    args = p.parse_args()
    port = store_port()
    mp.spawn(worker, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
