#!/usr/bin/python3
"""PyTorch's DistributedDataParallel (gloo) training the MLP 784-H-H-10 on Fashion-MNIST, the
way examples/torch/fashion_mnist_torch.cpp trains it with ddp: global batch 64, SGD with
momentum 0.9, lr 0.05 decayed by 0.7 per epoch, shuffled shards, every test image once; with
torch's own PowerSGD hook (--hook powersgd) or none. Run with Debian's interpreter:
    /usr/bin/python3 bench/torch/fashion_mnist_ddp.py --data DIR --ranks 2 --hidden 512
        --epochs 2 [--hook powersgd --psgd-rank 4 --psgd-start 100]
DIR holds the four idx files (train-images-idx3-ubyte, ..., or their .gz). Prints each epoch's test accuracy
and, with PowerSGD, the elements sent per step."""
import argparse
import gzip
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp import Mlp, store_port  # noqa: E402  the same model as the step benchmark


def idx(path):
    """An idx file, or its .gz (as the dataset is distributed)."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rb") as f:
            data = f.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def worker(rank, args, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    x = torch.from_numpy(idx(os.path.join(args.data, "train-images-idx3-ubyte")).astype(np.float32) / 255)
    y = torch.from_numpy(idx(os.path.join(args.data, "train-labels-idx1-ubyte")).astype(np.int64))
    tx = torch.from_numpy(idx(os.path.join(args.data, "t10k-images-idx3-ubyte")).astype(np.float32) / 255)
    ty = torch.from_numpy(idx(os.path.join(args.data, "t10k-labels-idx1-ubyte")).astype(np.int64))
    if args.limit:
        x, y = x[:args.limit], y[:args.limit]
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(Mlp(args.hidden))
    state = None
    if args.hook == "powersgd":
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=args.psgd_rank,
                                       start_powerSGD_iter=max(2, args.psgd_start))
        net.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sampler = torch.utils.data.DistributedSampler(range(len(x)), num_replicas=args.ranks, rank=rank,
                                                  shuffle=True, seed=7)
    local = args.batch // args.ranks
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for g in opt.param_groups:
            g["lr"] = args.lr * 0.7 ** epoch
        mine = torch.tensor(list(sampler))
        net.train()
        for first in range(0, len(mine), local):
            b = mine[first:first + local]
            opt.zero_grad()
            F.cross_entropy(net(x[b].view(-1, 1, 28, 28)), y[b]).backward()
            opt.step()
        net.eval()
        part = torch.arange(rank, len(tx), args.ranks)
        with torch.no_grad():
            correct = torch.tensor([(net(tx[part].view(-1, 1, 28, 28)).argmax(1) == ty[part]).sum().item()])
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: test accuracy {100 * correct.item() / len(tx):.2f}%",
                  flush=True)
    if rank == 0 and state is not None:
        rate, before, after = state.compression_stats()
        print(f"PowerSGD: 1/{rate:.1f} of the elements of the compressed tensors", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--hook", choices=["fp32", "powersgd"], default="fp32")
    p.add_argument("--psgd-rank", type=int, default=4)
    p.add_argument("--psgd-start", type=int, default=100)
    args = p.parse_args()
    mp.spawn(worker, args=(args, store_port()), nprocs=args.ranks)


if __name__ == "__main__":
    main()
