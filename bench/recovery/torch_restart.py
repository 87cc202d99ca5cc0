"""What a PyTorch user has when a rank dies: torchrun restarts every worker (--max-restarts), and
they resume from the last checkpoint. The same MLP as examples/fashion_mnist_elastic
(784-256-10, SGD, global batch 64) on Fashion-MNIST, DistributedDataParallel over gloo; rank 0
saves a checkpoint every --ckpt-every steps (torch.save, written aside then renamed).

  torchrun --standalone --nproc-per-node 4 --max-restarts 1 torch_restart.py \
      --cache DIR --kill-rank 1 --kill-step 100 --ckpt-every 50 --steps 130

Prints "timing: killed at NS" (the killed rank, first attempt only) and, after the restart,
"timing: first step on the new membership done at NS (step S, resumed from R)" (rank 0).
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def load(cache):
    images = np.fromfile(os.path.join(cache, "train-images-idx3-ubyte"), dtype=np.uint8)[16:]
    labels = np.fromfile(os.path.join(cache, "train-labels-idx1-ubyte"), dtype=np.uint8)[8:]
    x = torch.from_numpy(images.reshape(-1, 784).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checkpoint", default="torch_restart.pt")
    a = p.parse_args()
    torch.set_num_threads(1)
    # torchrun's agent store outlives the workers; each attempt's gloo keys go under a prefix of
    # its own (with env:// alone the restarted workers read the dead ones' addresses).
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{restart}", store),
                            rank=rank, world_size=world)
    x, y = load(a.cache)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start = 0
    if os.path.exists(a.checkpoint):
        ck = torch.load(a.checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(len(y), generator=g)
    local = 64 // world
    resumed_from = start
    for step in range(start, a.steps):
        if restart == 0 and rank == a.kill_rank and step == a.kill_step:
            print(f"timing: killed at {time.time_ns()}", flush=True)
            os._exit(9)
        idx = order[(step * 64 + rank * local) % len(y):][:local]
        loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == resumed_from and restart > 0 and rank == 0:
            print(f"timing: first step on the new membership done at {time.time_ns()} "
                  f"(step {step}, resumed from {resumed_from})", flush=True)
        if (step + 1) % a.ckpt_every == 0 and rank == 0:
            tmp = a.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, a.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
