"""One rank of the DeepSpeed-checkpoint tests, launched by zsrun: the GPT
example (small, random weights) trained by DeepSpeed itself, saved with
engine.save_checkpoint, and resumed by zeroshard.torch at another world size.

    zsrun -n N -- python ds_ckpt_worker.py deepspeed DIR STAGE DTYPE
        (DS_ACCELERATOR=cpu) 3 steps, save DIR, then 2 more steps; rank 0
        writes DIR/continuation.json (the 2 steps' losses, averaged over
        ranks) and DIR/fp32.safetensors (DeepSpeed's own zero_to_fp32
        consolidation of the saved masters)
    zsrun -n M -- python ds_ckpt_worker.py zeroshard DIR DTYPE
        zt.load_checkpoint(DIR) into a ZeroShardOptimizer and zeroshard.hf's
        WarmupLR; checks every rank's fp32 master shards against
        fp32.safetensors; then the same 2 steps; rank 0 prints one JSON line

A global batch of 6 rows per step, split evenly across ranks: the mean of
the ranks' losses is the global batch's loss at any world size.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "python"))
import train_gpt  # noqa: E402
from launch_env import exit_without_teardown

VOCAB, DIM, HEADS, LAYERS, CTX, ROWS = 65, 32, 4, 2, 16, 6
SCHED = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, VOCAB, (ROWS, CTX), generator=g)
    per = ROWS // world
    x = rows[rank * per:(rank + 1) * per]
    return x, x.roll(1, 1)


def mean_loss(loss):
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def precision(dtype):
    return {"bf16": {"bf16": {"enabled": True}}, "fp32": {}}[dtype]


def deepspeed_side(path, stage, dtype):
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": ROWS // world, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": SCHED},
              "zero_optimization": {"stage": stage}, **precision(dtype)}
    torch.manual_seed(0)
    model = train_gpt.GPT(VOCAB, DIM, HEADS, LAYERS, CTX)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(3):
        x, y = batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(path, client_state={"epoch": 7})
    losses = []
    for step in range(3, 5):
        x, y = batch(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(mean_loss(loss))
    dist.barrier()
    if rank == 0:
        full = get_fp32_state_dict_from_zero_checkpoint(path)
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(path) / "fp32.safetensors"))
        (Path(path) / "continuation.json").write_text(json.dumps({"losses": losses}))
    dist.barrier()


def zeroshard_side(path, dtype):
    from safetensors.torch import load_file

    import zeroshard.torch as zt
    from zeroshard.hf import WarmupLR
    from zeroshard.torch._params import optimizer_state_view

    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": ROWS // world,
              **precision(dtype)}
    zt.init_context(config=config, device="cpu")
    with zt.Init(config=config, device="cpu"):
        model = train_gpt.GPT(VOCAB, DIM, HEADS, LAYERS, CTX)
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=5.0, weight_decay=0.5)  # the load sets both
    sched = WarmupLR(opt, **SCHED)
    client = zt.load_checkpoint(path, model, opt)
    sched.load_state_dict(client["deepspeed"]["lr_scheduler"])
    # The masters each rank loaded, against DeepSpeed's own consolidation.
    ref = load_file(str(Path(path) / "fp32.safetensors"))
    worst = 0.0
    for name, p in model.named_parameters():
        z = p.zs.zparam
        mine = optimizer_state_view(opt._engine, z, 0)[:z.shard_valid]
        theirs = ref[name].reshape(-1)[z.shard_offset:z.shard_offset + z.shard_valid]
        worst = max(worst, (mine - theirs).abs().max().item() if mine.numel() else 0.0)
    t = torch.tensor(worst)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    losses = []
    for step in range(3, 5):
        x, y = batch(step, rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(mean_loss(loss))
    if rank == 0:
        print(json.dumps({"path": path, "losses": losses, "master_max_diff": t.item(), "steps": opt._engine.steps,
                          "client": {k: v for k, v in client.items() if k != "deepspeed"},
                          "global_steps": client["deepspeed"]["global_steps"],
                          "zero_stage": client["deepspeed"]["zero_stage"],
                          "dp_world_size": client["deepspeed"]["dp_world_size"]}), flush=True)
    del model, opt
    zt.shutdown()


def main():
    """deepspeed PATH STAGE DTYPE [PATH STAGE DTYPE ...] or zeroshard PATH
    DTYPE [PATH DTYPE ...]: each checkpoint in turn in this launched world."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    args = sys.argv[2:]
    if sys.argv[1] == "deepspeed":
        for i in range(0, len(args), 3):
            deepspeed_side(args[i], int(args[i + 1]), args[i + 2])
    else:
        for i in range(0, len(args), 2):
            zeroshard_side(args[i], args[i + 1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
