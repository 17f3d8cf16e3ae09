"""One rank of the mixed-precision tests, launched by zsrun.

    zsrun -n N -- python3 precision_worker.py MODE

MODE: bf16 (params, masters, buffers, wire bytes, state_dict, a checkpoint
round trip), fp16 (the dynamic loss scaler: a forced overflow skipped and
logged, an unscaled backward refused), autocast (torch.autocast over a
zeroshard model against DDP under the same autocast). Rank 0 writes what
the test checks as JSON to the file $ZS_TEST_RESULT names; checkpoints go
under $ZS_TEST_DIR.
"""
import logging
import os

import torch
import torch.nn as nn

import zeroshard.torch as zt
from zeroshard.torch._params import optimizer_state_view
from torch_worker import TinyGPT, batch, mean_over_ranks, run_mode
from launch_env import exit_without_teardown

ZERO = {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
FP32 = {"zero_optimization": ZERO}
BF16 = {"zero_optimization": ZERO, "bf16": {"enabled": True}}
LR = 3e-3


def build(config):
    with zt.Init(config=config):
        torch.manual_seed(0)
        model = TinyGPT()
        model.register_buffer("scale", torch.ones(()))  # a float buffer keeps its dtype
    zt.partition_module(model)
    return model, zt.ZeroShardOptimizer(model.parameters(), lr=LR, weight_decay=0.01)


def step(model, opt, s, rank, backward=None):
    x, y = batch(s, rank)
    loss = model(x, y) * model.scale
    (backward or opt.backward)(loss)
    opt.step()
    opt.zero_grad()
    return mean_over_ranks(loss.item())


def wire(opt, since=None):
    w = opt.wire_stats()
    now = {k: w[k] for k in ("gather_bytes_sent", "reduce_scatter_bytes_sent")}
    return now if since is None else {k: now[k] - since[k] for k in now}


def masters(model, opt):
    return [optimizer_state_view(opt._engine, p.zs.zparam, 0).clone() for p in model.parameters()]


def run(config, steps, rank):
    """Losses and wire bytes per step (after the first) of a fresh model."""
    zt.shutdown()
    model, opt = build(config)
    losses = [step(model, opt, 0, rank)]
    before = wire(opt)
    losses += [step(model, opt, s, rank) for s in range(1, steps)]
    per_step = {k: v / (steps - 1) for k, v in wire(opt, before).items()}
    return model, opt, losses, per_step


def mode_bf16(rank, world):
    _, _, fp32_losses, fp32_wire = run(FP32, 10, rank)
    _, _, fp32_comm_losses, fp32_comm_wire = run(
        {**BF16, "communication_data_type": "fp32"}, 10, rank)
    model, opt, bf16_losses, bf16_wire = run(BF16, 10, rank)

    params = list(model.parameters())
    kept = masters(model, opt)
    master_dtypes = sorted({str(m.dtype) for m in kept})
    master_sizes = all(m.numel() == p.zs.zparam.shard_numel for m, p in zip(kept, params))
    # The masters carry more than bf16 holds: fp32 state, not a widened copy.
    finer = any(not torch.equal(m, m.bfloat16().float()) for m in kept if m.numel())
    sd = model.state_dict()  # full values, as torch's state_dict of an unpartitioned model

    # Checkpoint round trip: the fp32 masters saved, the bf16 working copy
    # restored from them, the same losses after the load.
    directory = os.path.join(os.environ["ZS_TEST_DIR"], "bf16")
    zt.save_checkpoint(directory, model, opt, tag="bf16")
    saved_masters = masters(model, opt)
    saved_sd = {k: v.clone() for k, v in zt.consolidated_state_dict(model).items()}
    after_save = [step(model, opt, s, rank) for s in range(10, 14)]
    model2, opt2 = build(BF16)
    zt.load_checkpoint(directory, model2, opt2, tag="bf16")
    loaded_masters = masters(model2, opt2)
    loaded_sd = zt.consolidated_state_dict(model2)
    masters_equal = all(torch.equal(a, b) for a, b in zip(saved_masters, loaded_masters))
    working_equal = rank != 0 or all(torch.equal(saved_sd[k], loaded_sd[k]) for k in saved_sd)
    # The working copy is the masters rounded to bf16.
    with zt.GatheredParameters([model2.head.weight]):
        full = model2.head.weight.detach().clone()
    after_load = [step(model2, opt2, s, rank) for s in range(10, 14)]
    return {"fp32": fp32_losses, "bf16": bf16_losses, "fp32_comm": fp32_comm_losses,
            "wire": {"fp32": fp32_wire, "bf16": bf16_wire, "bf16_fp32_comm": fp32_comm_wire},
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "buffer_dtype": str(model.scale.dtype), "master_dtypes": master_dtypes,
            "master_sizes": master_sizes, "masters_finer_than_bf16": finer,
            "state_dict_dtypes": sorted({str(v.dtype) for v in sd.values()}),
            "state_dict_full": all(v.numel() > 0 for v in sd.values()),
            "gathered_dtype": str(full.dtype),
            "masters_equal": masters_equal, "working_equal": working_equal,
            "after_save": after_save, "after_load": after_load}


class Overflows(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def mode_fp16(rank, world):
    config = {"zero_optimization": ZERO,
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
                       "hysteresis": 1, "min_loss_scale": 1}}
    _, _, fp32_losses, _ = run(FP32, 8, rank)
    zt.shutdown()
    handler = Overflows()
    logging.getLogger("zeroshard").addHandler(handler)
    model, opt = build(config)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    losses, scales, skipped, unchanged = [], [], [], None
    for s in range(8):
        if s == 3:
            # Only rank 0's gradients overflow: every rank skips the step.
            before = {k: v.clone() for k, v in zt.consolidated_state_dict(model).items()}
            x, y = batch(s, rank)
            loss = model(x, y)
            opt.backward(loss * (float("inf") if rank == 0 else 1.0))
            opt.step()
            opt.zero_grad()
            after = zt.consolidated_state_dict(model)
            unchanged = rank != 0 or all(torch.equal(before[k], after[k]) for k in before)
            losses.append(None)
        else:
            losses.append(step(model, opt, s, rank))
        scales.append(opt.loss_scale)
        skipped.append(opt.step_was_skipped)
    # A plain loss.backward() under a loss scale of 256 is refused, naming the fix.
    x, y = batch(0, rank)
    error = None
    try:
        model(x, y).backward()
    except RuntimeError as e:
        error = str(e)
    opt.zero_grad()
    logging.getLogger("zeroshard").removeHandler(handler)
    return {"fp32": fp32_losses, "fp16": losses, "scales": scales, "skipped": skipped,
            "skipped_steps": opt.skipped_steps, "unchanged": unchanged, "param_dtypes": dtypes,
            "logged": handler.messages, "error": error}


def mode_autocast(rank, world):
    """torch.autocast over fp32 params: the same losses as DDP under it."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyGPT())
    ref = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    model, opt = build(FP32)
    ddp_losses, zs_losses = [], []
    for s in range(8):
        x, y = batch(s, rank)
        for m, o, out in ((ddp, ref, ddp_losses), (model, opt, zs_losses)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(mean_over_ranks(loss.item()))
    return {"ddp": ddp_losses, "zeroshard": zs_losses, "param_dtypes": sorted({str(p.dtype) for p in
                                                                                model.parameters()})}


def main():
    run_mode({"bf16": mode_bf16, "fp16": mode_fp16, "autocast": mode_autocast})


if __name__ == "__main__":
    main()
    exit_without_teardown()
