"""A rank that trains through zeroshard.torch without torch.distributed:
the engine's context comes from the launcher's environment alone. Rank 0
also trains a plain torch copy on every rank's batch, as the reference."""
import copy
import json
import sys

import torch
import torch.nn as nn

import zeroshard.torch as zt


def rank_batch(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def main():
    bf16 = sys.argv[1:] == ["bf16"]
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    with zt.Init(config={"zero_optimization": {"stage": 3}}, dtype=torch.bfloat16 if bf16 else None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    ctx = zt.get_context()
    dtype = next(iter(model.parameters())).zs.dtype
    losses, ref_losses = [], []
    for step in range(10):
        x, y = rank_batch(ctx.rank)
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if ctx.rank == 0:  # the same step, unsharded, on the whole batch
            xs, ys = zip(*(rank_batch(r) for r in range(ctx.world_size)))
            ref_loss = (reference(torch.cat(xs)) - torch.cat(ys)).pow(2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append((reference(x) - y).pow(2).mean().item())
    if ctx.rank == 0:
        # Rank 0's loss after each step, from the reference weights.
        print(json.dumps({"losses": losses, "reference_after": ref_losses, "world": ctx.world_size,
                          "dtype": str(dtype)}), flush=True)
    zt.shutdown()


if __name__ == "__main__":
    main()
