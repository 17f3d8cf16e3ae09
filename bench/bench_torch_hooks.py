"""Per-module cost of zeroshard.torch's hooks, on one rank.

    build/bin/zsrun -n 1 -- .venv/bin/python bench/bench_torch_hooks.py [--modules 200] [--steps 50]

A model of N `nn.Linear(8, 8)` (the fine-grained case: compute is tiny, so
what is measured is the bookkeeping), in the same run: plain torch, the same
model with no-op hooks of the kinds zeroshard used to install on every
module (forward pre/post, a gradient hook on each output and each param),
and zeroshard, taking turns step by step. The hooks' cost is measured on forward + backward, where they
run: zeroshard's minus plain torch's, divided by N, is the cost per module
per step (target <= 10 us); the no-op hooks show what torch's hook machinery
alone costs. The whole step (with the optimizer: torch's AdamW(fused=True),
the engine's AdamW) is printed beside it. CPU time of the process, so other
load on the machine counts less. Prints the figures, then one JSON line.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

# This checkout's package and library, as the other benches give their ranks.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bindings" / "python"))
os.environ.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
import zeroshard.torch as zt  # noqa: E402


def make(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def median_ms(runs, x, steps, warmup=5):
    """CPU time of this process (all its threads) per step, median, for
    each (model, optimizer) in `runs`: of the forward + backward, and of the
    whole step. The runs take turns step by step, so that the machine's
    other load falls on each alike. What the hooks and the engine cost,
    whatever else the machine runs."""
    fwd_bwd = [[] for _ in runs]
    whole = [[] for _ in runs]
    for s in range(warmup + steps):
        for i, (model, opt) in enumerate(runs):
            t0 = time.thread_time()
            model(x).pow(2).mean().backward()
            t1 = time.thread_time()
            opt.step()
            opt.zero_grad()
            if s >= warmup:
                fwd_bwd[i].append(t1 - t0)
                whole[i].append(time.thread_time() - t0)
    return [(statistics.median(f) * 1e3, statistics.median(w) * 1e3) for f, w in zip(fwd_bwd, whole)]


def with_noop_hooks(model):
    """The same hooks zeroshard installs (forward pre/post per module, a
    gradient hook on each output and each param), doing nothing: what
    torch's hook machinery itself costs."""
    def post(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: None)

    for m in model.modules():
        m.register_forward_pre_hook(lambda module, inputs: None)
        m.register_forward_hook(post)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: None)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4, 8)
    plain = make(args.modules)
    hooked = with_noop_hooks(make(args.modules))
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = make(args.modules)
    zt.partition_module(model)
    (plain_fb, plain_ms), (hooked_fb, hooked_ms), (zs_fb, zs_ms) = median_ms(
        [(plain, torch.optim.AdamW(plain.parameters(), fused=True)),
         (hooked, torch.optim.AdamW(hooked.parameters(), fused=True)),
         (model, zt.ZeroShardOptimizer(model.parameters()))], x, args.steps)
    per_module_us = (zs_fb - plain_fb) * 1e3 / args.modules
    machinery_us = (hooked_fb - plain_fb) * 1e3 / args.modules
    print(f"{args.modules} x nn.Linear(8, 8), one rank, CPU time of forward + backward: torch {plain_fb:.2f} ms, "
          f"torch with no-op hooks {hooked_fb:.2f} ms, zeroshard {zs_fb:.2f} ms ({zs_fb / plain_fb:.2f}x torch)")
    print(f"hooks per module per step: zeroshard {per_module_us:.1f} us (target <= 10), "
          f"torch's no-op hooks {machinery_us:.1f} us")
    print(f"whole step with the optimizer: torch (AdamW fused) {plain_ms:.2f} ms, zeroshard {zs_ms:.2f} ms "
          f"({zs_ms / plain_ms:.2f}x torch)")
    print(json.dumps({"modules": args.modules, "torch_fwd_bwd_ms": round(plain_fb, 3),
                      "noop_hooks_fwd_bwd_ms": round(hooked_fb, 3), "zeroshard_fwd_bwd_ms": round(zs_fb, 3),
                      "us_per_module": round(per_module_us, 2), "noop_hooks_us_per_module": round(machinery_us, 2),
                      "torch_step_ms": round(plain_ms, 3), "zeroshard_step_ms": round(zs_ms, 3),
                      "step_ratio": round(zs_ms / plain_ms, 3)}))
    zt.shutdown()


if __name__ == "__main__":
    main()
