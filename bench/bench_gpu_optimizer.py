"""GPU optimizer-step benchmark: the engine's AdamW step on one GPU (a world
of one, fp32 params, masters and moments in the engine's GPU memory; the
update runs as one multi-tensor launch per working dtype) next to torch's
AdamW(fused=True) on the same params, for one big param and for the same
elements cut into many small ones.

    python bench/bench_gpu_optimizer.py [--layouts 1x64M,1024x64K,4096x4K] [--steps 20] [--warmup 5]

A layout COUNTxSIZE is COUNT params of SIZE elements (K and M suffixes:
2^10, 2^20). For each, medians over the timed steps of: torch's fused
opt.step(); the engine's zs_optimizer_step (gradient sync, global norm and
update) and, from zs_context_step_stats, the update alone (the multi-tensor
kernels and the stream synchronisation). Each step is timed to
torch.cuda.synchronize(), which waits for the engine's stream too; the
gradients are pushed from device memory before the timer starts. Prints a
table with the ratios to torch; the last line is one JSON object. Without
torch, a CUDA device or one the engine sees, it says why and prints
{"skipped": "..."} (exit status 0). Never fails on time.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def skipped(why):
    print(f"bench_gpu_optimizer: skipped: {why}", flush=True)
    print(json.dumps({"bench": "gpu_optimizer", "skipped": why}), flush=True)
    return 0


def parse_count(s):
    mul = {"K": 2**10, "M": 2**20}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mul > 1 else s) * mul


def parse_layouts(text):
    out = []
    for part in text.split(","):
        count, _, size = part.strip().lower().partition("x")
        if not size:
            raise argparse.ArgumentTypeError(f"{part!r}: expected COUNTxSIZE, e.g. 1024x64K")
        out.append((parse_count(count), parse_count(size)))
    return out


def median_ms(times):
    return statistics.median(times) * 1e3


def bench_torch(count, size, steps, warmup, device):
    import torch
    params = [torch.nn.Parameter(torch.randn(size, device=device) * 0.02) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(size, device=device) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del params, opt
    gc.collect()
    torch.cuda.empty_cache()
    return median_ms(times)


def bench_engine(count, size, steps, warmup, device, backend):
    import torch
    import zeroshard
    grads = [torch.randn(size, device=device) * 1e-3 for _ in range(count)]
    step_times, update_times, push_times = [], [], []
    with zeroshard.Context(rank=0, world_size=1, device=str(device), backend=backend) as ctx:
        params = [ctx.register(f"p{i}", "fp32", (size,), init="normal", seed=i + 1, b=0.02) for i in range(count)]
        opt = ctx.optimizer("adamw")
        opt.add_group(params, lr=1e-3, weight_decay=0.01)
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for p, g in zip(params, grads):
                p.push_grad(g, "fp32")  # device pointer, no host copy
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            if i >= warmup:
                push_times.append(t1 - t0)
                step_times.append(time.perf_counter() - t1)
                update_times.append(ctx.step_stats()["optimizer_seconds"])
        opt.close()
        for p in params:
            p.close()
    del grads
    gc.collect()
    torch.cuda.empty_cache()
    return median_ms(step_times), median_ms(update_times), median_ms(push_times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=parse_layouts, default=parse_layouts("1x64M,1024x64K,4096x4K"),
                    help="comma-separated COUNTxSIZE (default 1x64M,1024x64K,4096x4K)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        return skipped("torch is not installed")
    if not torch.cuda.is_available():
        return skipped("no CUDA device: torch.cuda.is_available() is False")
    sys.path.insert(0, str(REPO / "bindings" / "python"))
    os.environ.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    import zeroshard
    n, why = zeroshard.cuda_device_count()
    if n == 0:
        return skipped(f"no CUDA device the engine sees: {why}")

    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    print(f"device {name}; AdamW on fp32 params, median of {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'layout':<16s} {'torch fused':>12s} {'zs step':>10s} {'zs update':>10s} {'step/torch':>11s} "
          f"{'update/torch':>13s} {'zs push':>9s}")
    cases = []
    for count, size in args.layouts:
        torch_ms = bench_torch(count, size, args.steps, args.warmup, device)
        step_ms, update_ms, push_ms = bench_engine(count, size, args.steps, args.warmup, device, args.backend)
        case = {"count": count, "size": size, "numel": count * size, "torch_fused_ms": torch_ms,
                "zs_step_ms": step_ms, "zs_update_ms": update_ms, "zs_push_ms": push_ms,
                "step_ratio_to_torch": step_ms / torch_ms, "update_ratio_to_torch": update_ms / torch_ms}
        cases.append(case)
        print(f"  {f'{count} x {size}':<16s} {torch_ms:9.3f} ms {step_ms:7.3f} ms {update_ms:7.3f} ms "
              f"{case['step_ratio_to_torch']:10.2f}x {case['update_ratio_to_torch']:12.2f}x {push_ms:6.2f} ms")
    print(json.dumps({"bench": "gpu_optimizer", "device": name, "steps": args.steps, "warmup": args.warmup,
                      "cases": cases}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
