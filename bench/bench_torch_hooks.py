"""Per-module cost of zeroshard.torch's hooks, on one rank.

    build/bin/zsrun -n 1 -- .venv/bin/python bench/bench_torch_hooks.py [--modules 200] [--steps 50]

A model of N `nn.Linear(8, 8)` (the fine-grained case: compute is tiny, so
what is measured is the bookkeeping): forward + backward + optimizer step
through zeroshard against the same model in plain torch (torch AdamW,
foreach=False) and the same model with no-op hooks of the same kinds, in the
same run. The difference divided by N is the cost per module per step
(target <= 10 us), split into torch's hook machinery and zeroshard's own
work. CPU time of the process, so other load on the machine counts less.
Prints the figures, then one JSON line.
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
    plain_ms = median_step_ms(plain, torch.optim.AdamW(plain.parameters(), foreach=False), x, args.steps)
    hooked = with_noop_hooks(make(args.modules))
    hooked_ms = median_step_ms(hooked, torch.optim.AdamW(hooked.parameters(), foreach=False), x, args.steps)
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = make(args.modules)
    zt.partition_module(model)
    zs_ms = median_step_ms(model, zt.ZeroShardOptimizer(model.parameters()), x, args.steps)
    per_module_us = (zs_ms - plain_ms) * 1e3 / args.modules
    machinery_us = (hooked_ms - plain_ms) * 1e3 / args.modules
    print(f"{args.modules} x nn.Linear(8, 8), one rank, CPU time per step: torch {plain_ms:.2f} ms, "
          f"torch with no-op hooks {hooked_ms:.2f} ms, zeroshard {zs_ms:.2f} ms ({zs_ms / plain_ms:.2f}x torch)")
    print(f"per module per step: {per_module_us:.1f} us in all (target <= 10), of which torch's hook "
          f"machinery {machinery_us:.1f} us and zeroshard's own work {per_module_us - machinery_us:.1f} us")
    print(json.dumps({"modules": args.modules, "torch_ms": round(plain_ms, 3), "noop_hooks_ms": round(hooked_ms, 3),
                      "zeroshard_ms": round(zs_ms, 3), "ratio": round(zs_ms / plain_ms, 3),
                      "us_per_module": round(per_module_us, 2), "torch_hooks_us_per_module": round(machinery_us, 2),
                      "zeroshard_us_per_module": round(per_module_us - machinery_us, 2)}))
    zt.shutdown()


if __name__ == "__main__":
    main()
