"""Per-module cost of zeroshard.torch's hooks, on one rank.

    build/bin/zsrun -n 1 -- .venv/bin/python bench/bench_torch_hooks.py [--modules 200] [--steps 50]

A model of N `nn.Linear(8, 8)` (the fine-grained case: compute is tiny, so
what is measured is the bookkeeping): forward + backward + optimizer step
through zeroshard against the same model in plain torch (torch AdamW,
foreach=False) in the same run. The difference divided by N is the cost per
module per step (target <= 10 us). Prints the figures, then one JSON line.
"""
import argparse
import json
import time

import torch
import torch.nn as nn

import zeroshard.torch as zt


def make(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def median_step_ms(model, opt, x, steps, warmup=5):
    """CPU time of this process per step (all its threads): what the hooks
    and the engine cost, whatever else the machine runs."""
    times = []
    for s in range(warmup + steps):
        t = time.process_time()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if s >= warmup:
            times.append(time.process_time() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4, 8)
    plain = make(args.modules)
    plain_ms = median_step_ms(plain, torch.optim.AdamW(plain.parameters(), foreach=False), x, args.steps)
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = make(args.modules)
    zt.partition_module(model)
    zs_ms = median_step_ms(model, zt.ZeroShardOptimizer(model.parameters()), x, args.steps)
    per_module_us = (zs_ms - plain_ms) * 1e3 / args.modules
    print(f"{args.modules} x nn.Linear(8, 8), one rank: torch {plain_ms:.2f} ms/step, "
          f"zeroshard {zs_ms:.2f} ms/step ({zs_ms / plain_ms:.2f}x); "
          f"hooks and engine: {per_module_us:.1f} us per module per step (target <= 10; CPU time)")
    print(json.dumps({"modules": args.modules, "torch_ms": round(plain_ms, 3), "zeroshard_ms": round(zs_ms, 3),
                      "ratio": round(zs_ms / plain_ms, 3), "us_per_module": round(per_module_us, 2)}))
    zt.shutdown()


if __name__ == "__main__":
    main()
