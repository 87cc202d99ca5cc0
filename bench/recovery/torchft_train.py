"""The same MLP as examples/fashion_mnist_elastic (784-256-10, SGD, global batch 64) trained with
torchft (PyPI's `torchft`): one replica group per process, a lighthouse that forms a quorum per
step, the gradients averaged over the replicas that take part (manager.allreduce on gloo), each
step committed only when every participant finished it (should_commit), and a replica that comes
back healed from a live peer (the manager's state_dict transfer). As torchft's own examples do,
with the DistributedDataParallel wrapper left out (it crashed on a kill inside a step).

  torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 100 --bind [::]:P
  TORCHFT_LIGHTHOUSE=http://127.0.0.1:P REPLICA_GROUP_ID=i MASTER_ADDR=127.0.0.1 \\
      MASTER_PORT=Q RANK=0 WORLD_SIZE=1 python3 torchft_train.py --cache DIR --replicas 3 ...

Prints "timing: killed at NS" (the killed replica), "timing: first step on the new membership
done at NS" (replica 0, the first step committed with fewer participants), "timing: started at
NS" and "timing: newcomer's first step done at NS" (a replica started with --newcomer).
"""
import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torchft import Manager, ProcessGroupGloo


def load(cache):
    with open(os.path.join(cache, "train-images-idx3-ubyte"), "rb") as f:
        images = torch.frombuffer(bytearray(f.read()[16:]), dtype=torch.uint8)
    with open(os.path.join(cache, "train-labels-idx1-ubyte"), "rb") as f:
        labels = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8)
    return images.reshape(-1, 784).float() / 255.0, labels.long()


def main():
    started = time.time_ns()
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--newcomer", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    x, y = load(a.cache)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    # The replica group's store (torchrun's agent would host it; here one process per group).
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"mlp_{replica}",
                      timeout=timedelta(seconds=10))
    if a.newcomer:
        print(f"timing: started at {started}", flush=True)
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(len(y), generator=g)
    participants = None
    first_after_loss = False
    while manager.current_step() < a.steps:
        step = manager.current_step()
        if not a.newcomer and replica == 1 and step == a.kill_step:
            print(f"timing: killed at {time.time_ns()}", flush=True)
            os._exit(9)
        manager.start_quorum()
        n = manager.num_participants()
        if participants is not None and n < participants:
            first_after_loss = True  # the next committed step is the first without the lost one
        participants = n
        local = 64 // max(n, 1)
        rank = manager.participating_rank() or 0
        idx = order[(step * 64 + rank * local) % len(y):][:local]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        for prm in model.parameters():
            manager.allreduce(prm.grad).wait()
        if manager.should_commit():
            opt.step()
            if first_after_loss and replica == 0:
                print(f"timing: first step on the new membership done at {time.time_ns()}",
                      flush=True)
                first_after_loss = False
            if a.newcomer:
                print(f"timing: newcomer's first step done at {time.time_ns()} (step {step})",
                      flush=True)
                a.newcomer = False
    manager.shutdown()
    del store


if __name__ == "__main__":
    main()
