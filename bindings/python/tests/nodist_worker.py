"""A rank that trains through zeroshard.torch without torch.distributed:
the engine's context comes from the launcher's environment alone."""
import json
import sys

import torch
import torch.nn as nn

import zeroshard.torch as zt


def main():
    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": {"stage": 3}}, dtype=torch.bfloat16 if sys.argv[1:] == ["bf16"] else None):
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    ctx = zt.get_context()
    losses = []
    for step in range(10):
        g = torch.Generator().manual_seed(step * 100 + ctx.rank)
        x = torch.randn(8, 6, generator=g)
        dtype = next(iter(model.parameters())).zs.dtype
        loss = (model(x.to(dtype)).float() - x.sum(1, keepdim=True).sin()).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if ctx.rank == 0:
        print(json.dumps({"losses": losses, "world": ctx.world_size,
                          "dtype": str(next(iter(model.parameters())).zs.dtype)}), flush=True)
    zt.shutdown()


if __name__ == "__main__":
    main()
