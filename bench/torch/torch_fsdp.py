#!/usr/bin/env python3
"""PyTorch FSDP2 (`fully_shard` per layer, gloo, CPU) on the step fsdp-bench measures: a deep
MLP of `layers` Linear(width, width) + tanh layers, each its own unit, `batch` synthetic samples
per rank, the mean of the squared outputs as loss, SGD with momentum, one torch thread per rank.
Run with PyPI's torch (2.x: torch.distributed.fsdp.fully_shard):
    ~/.cache/ddp/torch-venv/bin/python bench/torch/torch_fsdp.py --ranks N [--width W]
        [--layers L] [--batch B] [--steps S] [--warmup K]
Prints "ms/step X" (the slowest rank's median over the timed steps) and "peak MiB Y" (the
largest VmHWM of the ranks)."""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def worker(rank, args, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1)
    model = nn.Sequential(*[Layer(args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    ms = torch.tensor([statistics.median(times[args.warmup:]) * 1e3, peak_mib()])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ms/step {ms[0].item():.3f}")
        print(f"peak MiB {ms[1].item():.1f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args, port), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
