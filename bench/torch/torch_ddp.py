#!/usr/bin/python3
"""PyTorch's own DistributedDataParallel (gloo) on the step torch-bench measures: the same model,
batch (64 synthetic samples per rank), optimizer and thread settings. Run with Debian's
interpreter (python3-torch):
    /usr/bin/python3 bench/torch/torch_ddp.py --model mlp|cnn --ranks N [--steps S] [--warmup W]
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


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 10)

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
    net = nn.parallel.DistributedDataParallel(Mlp() if args.model == "mlp" else Cnn())
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
    args = p.parse_args()
    port = store_port()
    mp.spawn(worker, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
