"""One rank of test_launch_order.py: torch.distributed and the zeroshard
context come up in either order, under any launcher.

    zsrun -n 2 -- python launch_order_worker.py context_first|torch_first
    (or torchrun, or plain processes with Slurm's variables)

Rank 0 prints one JSON line: zeroshard's and DDP's losses over the same
steps, an all_reduce through torch's process group, the ports each side
used, and the config warnings every rank saw.
"""
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
import zeroshard.torch as zt

STEPS, DIM = 4, 16
# sub_group_size away from its default: a key the engine does not act on,
# which rank 0 (and only rank 0) warns about.
CONFIG = {"zero_optimization": {"stage": 3, "sub_group_size": 1e8}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, 1)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).pow(2).mean()


def data(step, rank):
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def init_torch():
    timeout = datetime.timedelta(seconds=60)  # a collision fails, not hangs for 30 minutes
    if os.environ.get("SLURM_PROCID") is not None and "RANK" not in os.environ:
        # Slurm sets no RANK / WORLD_SIZE; torch's env:// takes them as arguments.
        dist.init_process_group("gloo", rank=int(os.environ["SLURM_PROCID"]),
                                world_size=int(os.environ["SLURM_NTASKS"]), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def train(model, opt, rank):
    losses = []
    for s in range(STEPS):
        loss = model(data(s, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def main():
    order = sys.argv[1]
    if order == "torch_first":
        init_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        with zt.Init(config=CONFIG):
            model = Net()
        zt.partition_module(model)  # the fetch hooks
    if order == "context_first":
        init_torch()  # after the engine's store is up: must not collide with it
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = zt.get_context()
    assert ctx.rank == rank and ctx.world_size == world, (ctx.rank, rank, ctx.world_size, world)

    zopt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01)
    zs_losses = train(model, zopt, rank)

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    ddp_losses = train(ddp, opt, rank)

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    config_warnings = [str(w.message) for w in caught
                       if issubclass(w.category, zeroshard.ZeroShardConfigWarning)]
    gathered = [None] * world
    dist.all_gather_object(gathered, config_warnings)
    zt.shutdown()
    if rank == 0:
        print(json.dumps({"order": order, "zeroshard": zs_losses, "ddp": ddp_losses,
                          "all_reduce": total.item(), "world": world,
                          "master_port": os.environ.get("MASTER_PORT"),
                          "zs_store_port": os.environ.get("ZS_STORE_PORT"),
                          "config_warnings": gathered}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
