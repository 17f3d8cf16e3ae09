"""GPU step benchmark: one training step of the GPT example
(examples/python/train_gpt.py) on one GPU through zeroshard (a world of one,
params, gradients and optimizer state in the engine's GPU memory) next to
plain PyTorch on the same model (torch.optim.AdamW, fused when available,
else foreach) and FSDP2 in a world of one over NCCL, measured in the same
run, with each one's peak GPU memory; and the engine's AdamW step next to
torch's fused AdamW on one big fp32 param.

    /usr/bin/python3 bench/bench_gpu_step.py [--steps 30] [--warmup 5] [--dim 512 ...]

Each step is timed from its start to torch.cuda.synchronize() (which waits
for the engine's stream too); the figure is the median. Prints a table; the
last line is one JSON object. Without a usable CUDA device it says why and
prints {"skipped": "no CUDA device"} (exit status 0). Never fails on time.
"""
import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def skipped(why):
    print(f"bench_gpu_step: skipped: {why}", flush=True)
    print(json.dumps({"skipped": "no CUDA device"}), flush=True)
    return 0


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "python" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(args, device, n):
    """n (x, y) batches as the example draws them (generator seed 1234)."""
    import torch
    text = Path(args.corpus).read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.ctx] for s in starts]).to(device)
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in starts]).to(device)
        out.append((x, y))
    return len(chars), out


def time_steps(step, data, warmup):
    """Run step(x, y) over data; the first `warmup` untimed. Returns the
    losses of every step and the times of the timed ones (seconds)."""
    import torch
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(x, y)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def training_step(model, opt):
    """step(x, y): forward, backward and a torch optimizer's step."""
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def torch_adamw(params, lr, weight_decay):
    import torch
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True), "fused"
    except (TypeError, RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True), "foreach"


def bench_models(args, device, gpt_module):
    import torch
    import zeroshard.torch as zt

    vocab, data = batches(args, device, args.warmup + args.steps)
    make = lambda: gpt_module.GPT(vocab, args.dim, args.heads, args.layers, args.ctx)  # noqa: E731

    # Plain PyTorch: the same weights (drawn on the host from seed 0).
    torch.manual_seed(0)
    model = make().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt, opt_kind = torch_adamw(model.parameters(), args.lr, 0.01)

    torch.cuda.reset_peak_memory_stats()
    torch_losses, torch_times = time_steps(training_step(model, opt), data, args.warmup)
    torch_peak = torch.cuda.max_memory_allocated()
    model = opt = None  # free the GPU memory before the next run
    gc.collect()
    torch.cuda.empty_cache()

    fsdp = bench_fsdp2(args, device, make, data) if args.fsdp2 else None

    # zeroshard: a world of one on this GPU.
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": args.batch}
    ctx = zt.init_context(config=config, rank=0, world_size=1, device=str(device), backend=args.backend)
    torch.manual_seed(0)
    with zt.Init(config=config, device=str(device)):
        zmodel = make()
    zt.partition_module(zmodel)
    zopt = zt.ZeroShardOptimizer(zmodel.parameters(), lr=args.lr, weight_decay=0.01)

    def zs_step(x, y):
        loss = zmodel(x, y)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        return loss

    torch.cuda.reset_peak_memory_stats()
    ctx.reset_memory_peaks()
    zs_losses, zs_times = time_steps(zs_step, data, args.warmup)
    # torch's allocator holds activations and gradients; the engine's pool
    # holds shards, masters, moments and gathered params.
    by_phase = {phase: ctx.memory_by_kind(phase) for phase in ("forward", "backward", "step")}
    peak_phase = max(by_phase, key=lambda phase: by_phase[phase]["total"])
    info = {"backend": ctx.backend, "memory": ctx.memory(), "coord": ctx.coord_stats(),
            "zs_torch_peak_bytes": torch.cuda.max_memory_allocated(),
            "zs_engine_peak_bytes": by_phase[peak_phase]["total"],
            "zs_engine_peak_phase": peak_phase,
            "zs_engine_peak_kinds": {k: v for k, v in by_phase[peak_phase].items() if v and k != "total"}}
    info["zs_peak_bytes"] = info["zs_torch_peak_bytes"] + info["zs_engine_peak_bytes"]
    zmodel = zopt = None
    zt.shutdown()
    gc.collect()
    torch.cuda.empty_cache()
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(zs_losses, torch_losses)]
    return {"params": n_params, "torch_optimizer": opt_kind,
            "torch_step_s": statistics.median(torch_times), "zs_step_s": statistics.median(zs_times),
            "torch_losses": torch_losses, "zs_losses": zs_losses, "loss_max_rel_diff": max(diffs),
            "torch_peak_bytes": torch_peak, "fsdp2": fsdp, **info}


def bench_fsdp2(args, device, make, data):
    """FSDP2 in a world of one over NCCL on the same GPU: fully_shard per
    block, then the root, fused AdamW, the same weights and batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    torch.manual_seed(0)
    model = make().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt, _ = torch_adamw(model.parameters(), args.lr, 0.01)

    torch.cuda.reset_peak_memory_stats()
    losses, times = time_steps(training_step(model, opt), data, args.warmup)
    peak = torch.cuda.max_memory_allocated()
    model = opt = None
    dist.destroy_process_group()
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "losses": losses, "peak_bytes": peak}


def bench_adamw(args, device):
    """The engine's AdamW step (gradient sync, global norm and the update of
    one big fp32 param) next to torch's fused AdamW step on the same size."""
    import torch
    import zeroshard

    n = args.adamw_numel
    reps = args.warmup + args.steps
    grad = torch.randn(n, device=device) * 1e-3

    p = torch.nn.Parameter(torch.randn(n, device=device) * 0.02)
    p.grad = grad.clone()
    opt, kind = torch_adamw([p], 1e-3, 0.01)
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    torch_s = statistics.median(times)
    del p, opt
    gc.collect()
    torch.cuda.empty_cache()

    with zeroshard.Context(rank=0, world_size=1, device=str(device), backend=args.backend) as ctx:
        big = ctx.register("bench.big", "fp32", (n,), init="normal", seed=7, b=0.02)
        eopt = ctx.optimizer("adamw")
        eopt.add_group([big], lr=1e-3, weight_decay=0.01)
        times, push_times = [], []
        for i in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            big.push_grad(grad, "fp32")  # device pointer, no host copy
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            eopt.step()
            torch.cuda.synchronize()
            if i >= args.warmup:
                push_times.append(t1 - t0)
                times.append(time.perf_counter() - t1)
        eopt.close()
        big.close()
    return {"adamw_numel": n, "torch_adamw_kind": kind, "torch_adamw_s": torch_s,
            "zs_adamw_step_s": statistics.median(times), "zs_grad_push_s": statistics.median(push_times)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    ap.add_argument("--adamw-numel", type=int, default=64 * 2**20,
                    help="elements of the big param of the AdamW comparison (0: skip it)")
    ap.add_argument("--no-fsdp2", dest="fsdp2", action="store_false",
                    help="skip FSDP2 (a world of one over NCCL)")
    ap.add_argument("--corpus", default=str(REPO / "examples" / "python" / "data" / "corpus.txt"))
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        return skipped("torch is not installed")
    if not torch.cuda.is_available():
        return skipped("torch.cuda.is_available() is False")
    sys.path.insert(0, str(REPO / "bindings" / "python"))
    os.environ.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    import zeroshard
    count, why = zeroshard.cuda_device_count()
    if count == 0:
        return skipped(f"the engine sees no CUDA device: {why}")

    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    gpt = load_example()
    m = bench_models(args, device, gpt)
    a = bench_adamw(args, device) if args.adamw_numel > 0 else None

    ms = lambda s: s * 1e3  # noqa: E731
    rows = [("GPT step, zeroshard", ms(m["zs_step_s"])),
            (f"GPT step, torch (AdamW {m['torch_optimizer']})", ms(m["torch_step_s"]))]
    f = m["fsdp2"]
    if f:
        rows.append(("GPT step, FSDP2 (world of one, NCCL)", ms(f["step_s"])))
    if a:
        rows += [("AdamW, zeroshard step (sync + norm + update)", ms(a["zs_adamw_step_s"])),
                 (f"AdamW, torch {a['torch_adamw_kind']} step", ms(a["torch_adamw_s"])),
                 ("grad push, zeroshard (device pointer)", ms(a["zs_grad_push_s"]))]
    print(f"device {name}, backend {m['backend']}; GPT {m['params'] / 1e6:.1f}M params, batch {args.batch} x "
          f"{args.ctx} tokens; median of {args.steps} steps after {args.warmup} warmup")
    for label, value in rows:
        print(f"  {label:<48s} {value:9.3f} ms")
    ratio = m["zs_step_s"] / m["torch_step_s"]
    print(f"  zeroshard / torch step: x{ratio:.2f}; losses agree to {m['loss_max_rel_diff']:.1e} (relative)")
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"  peak GPU memory: zeroshard {mib(m['zs_peak_bytes']):.0f} MiB (torch allocator + engine), "
          f"torch {mib(m['torch_peak_bytes']):.0f} MiB"
          + (f", FSDP2 {mib(f['peak_bytes']):.0f} MiB" if f else ""))
    print(f"    zeroshard: torch allocator {mib(m['zs_torch_peak_bytes']):.0f} MiB + engine "
          f"{mib(m['zs_engine_peak_bytes']):.0f} MiB at its {m['zs_engine_peak_phase']} peak: "
          + ", ".join(f"{k} {mib(v):.0f}" for k, v in m["zs_engine_peak_kinds"].items()))
    if f:
        fdiff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(f["losses"], m["torch_losses"]))
        print(f"  zeroshard / FSDP2 step: x{m['zs_step_s'] / f['step_s']:.2f}; "
              f"FSDP2 losses agree with torch to {fdiff:.1e}")
    result = {"bench": "gpu_step", "device": name, "backend": m["backend"], "params": m["params"],
              "batch": args.batch, "ctx": args.ctx, "steps": args.steps, "warmup": args.warmup,
              "gpt_step_ms": ms(m["zs_step_s"]), "torch_step_ms": ms(m["torch_step_s"]),
              "ratio_to_torch": ratio, "torch_optimizer": m["torch_optimizer"],
              "loss_max_rel_diff": m["loss_max_rel_diff"],
              "device_system_allocs": m["memory"]["device_system_allocs"],
              "device_reuses": m["memory"]["device_reuses"],
              "zs_peak_mib": mib(m["zs_peak_bytes"]), "torch_peak_mib": mib(m["torch_peak_bytes"]),
              "zs_torch_allocator_peak_mib": mib(m["zs_torch_peak_bytes"]),
              "zs_engine_peak_mib": mib(m["zs_engine_peak_bytes"]),
              "zs_engine_peak_kinds_mib": {k: round(mib(v), 1) for k, v in m["zs_engine_peak_kinds"].items()}}
    if f:
        result.update({"fsdp2_step_ms": ms(f["step_s"]), "ratio_to_fsdp2": m["zs_step_s"] / f["step_s"],
                       "fsdp2_peak_mib": mib(f["peak_bytes"])})
    if a:
        result.update({"adamw_numel": a["adamw_numel"], "zs_adamw_ms": ms(a["zs_adamw_step_s"]),
                       "torch_adamw_ms": ms(a["torch_adamw_s"]), "torch_adamw_kind": a["torch_adamw_kind"],
                       "adamw_ratio_to_torch": a["zs_adamw_step_s"] / a["torch_adamw_s"],
                       "zs_grad_push_ms": ms(a["zs_grad_push_s"])})
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
