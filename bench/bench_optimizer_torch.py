"""Optimizer benchmark from Python: the engine's AdamW step through the
Python binding (a world of one) against torch.optim.AdamW (fused=True and
foreach=True) and DeepSpeed's DeepSpeedCPUAdam, on the same fp32 params, in
one run. Also runs build/bin/bench_optimizer (the C++ kernel alone) on the
same size for reference.

    .venv/bin/python bench/bench_optimizer_torch.py [--params 64M] [--iters 9] [--warmup 2]
        [--threads N] [--no-deepspeed] [--no-kernel]

Every optimizer gets the same initial params, the same gradient every step
and the same hyper-parameters, on --threads threads (default: every core),
and runs warm-up + iters steps. The timed figure is the median step; params/s
= params / median. The engine's figures are split into:

  push  zeroshard.Param.push_grad: the full gradient handed to the engine,
        widened into a reduce bucket (a copy of the gradient);
  sync  zeroshard.Context.grad_sync: the bucket's reduce-scatter (a world of
        one: a copy into a receive buffer) written into the fp32 gradient
        shard (the first write after a step overwrites it), its sum of
        squares taken in the same loop;
  step  zeroshard.Optimizer.step after that sync: global norm and inf/NaN
        check from the sums the sync took (no read of the gradient), the
        AdamW update of the master, exp_avg, exp_avg_sq; the gradient shard
        is not zeroed (the next sync overwrites it).

torch and DeepSpeed read the gradient where it is (param.grad), compute no
norm and zero nothing, so "step" is the figure to compare with theirs; the
kernel's own figure (bench_optimizer) shows what the step adds to the bare
AdamW update. After the run the params of every optimizer are compared
(max abs difference to torch's fused AdamW). The last line is one JSON object.
Targets (not asserted): engine step >= 3x torch fused AdamW and >= DeepSpeed
CPU Adam, in params/s.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_count(s):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(float(s[:-1] if mul != 1 else s) * mul)


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def summary(times):
    return {"median_s": statistics.median(times), "best_s": min(times), "times_s": times}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="64M")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-kernel", action="store_true", help="skip build/bin/bench_optimizer")
    args = ap.parse_args()
    n = parse_count(args.params)
    os.environ["OMP_NUM_THREADS"] = os.environ["ZS_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(REPO / "bindings" / "python"))
    os.environ.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    import torch
    import zeroshard

    torch.set_num_threads(args.threads)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen) * 0.02
    grad = torch.randn(n, generator=gen)
    steps = args.warmup + args.iters
    print(f"bench_optimizer_torch: AdamW on {n / 2 ** 20:.0f}M fp32 params ({n * 16 / 2 ** 30:.2f} GiB of "
          f"param + grad + moments), {args.threads} threads, {args.warmup} warm-up + {args.iters} timed steps; "
          f"torch {torch.__version__}; the machine may be shared, figures are medians", flush=True)
    results, finals, notes = {}, {}, {}

    # -- the engine, through the binding -----------------------------------
    with zeroshard.Context(rank=0, world_size=1, config={"zero_optimization": {"stage": 3}},
                           device="cpu") as ctx:
        param = ctx.register("w", "float32", (n,), init="from_all", data=p0)
        opt = ctx.optimizer("adamw")
        opt.add_group([param], **hp)
        push_t, sync_t, step_t = [], [], []
        for i in range(steps):
            t0 = time.perf_counter()
            param.push_grad(grad, "float32")
            t1 = time.perf_counter()
            ctx.grad_sync()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= args.warmup:
                push_t.append(t1 - t0)
                sync_t.append(t2 - t1)
                step_t.append(t3 - t2)
        results["zeroshard_step"] = summary(step_t)
        results["zeroshard_push"] = summary(push_t)
        results["zeroshard_sync"] = summary(sync_t)
        results["zeroshard_push_and_step"] = summary([a + b + c for a, b, c in zip(push_t, sync_t, step_t)])
        finals["zeroshard"] = torch.from_dlpack(param.shard_dlpack())[:n].clone()
        mem = ctx.memory()
        notes["zeroshard_memory"] = {k: mem[k] for k in ("shard_bytes", "grad_bytes", "optimizer_bytes")}
        del opt, param
    gc.collect()

    # -- torch --------------------------------------------------------------
    def torch_run(name, **kw):
        p = p0.clone().requires_grad_(True)
        p.grad = grad.clone()
        opt = torch.optim.AdamW([p], **hp, **kw)
        results[name] = summary(timed(opt.step, args.warmup, args.iters))
        finals[name] = p.detach().clone()
        del opt, p
        gc.collect()

    torch_run("torch_fused", fused=True)
    torch_run("torch_foreach", foreach=True)

    # -- DeepSpeed ------------------------------------------------------------
    if args.no_deepspeed:
        notes["deepspeed_skipped"] = "--no-deepspeed"
    else:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            p = p0.clone().requires_grad_(True)
            p.grad = grad.clone()
            opt = DeepSpeedCPUAdam([p], adamw_mode=True, **hp)
            results["deepspeed_cpu_adam"] = summary(timed(opt.step, args.warmup, args.iters))
            finals["deepspeed_cpu_adam"] = p.detach().clone()
            del opt, p
            gc.collect()
        except Exception as e:  # noqa: BLE001 (the JIT build can fail many ways)
            notes["deepspeed_skipped"] = f"{type(e).__name__}: {e}"[:400]
            print(f"DeepSpeedCPUAdam skipped: {notes['deepspeed_skipped']}", flush=True)

    # -- the C++ kernel alone ---------------------------------------------------
    kernel = None
    if not args.no_kernel:
        exe = REPO / "build" / "bin" / "bench_optimizer"
        out = subprocess.run([str(exe), "--params", str(n), "--iters", str(args.iters), "--threads",
                              str(args.threads)], capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode == 0 and lines:
            kernel = json.loads(lines[-1])
            results["kernel_adamw"] = {"median_s": kernel["adamw_ms_per_iter"] / 1e3,
                                       "best_s": kernel["adamw_best_ms"] / 1e3, "times_s": []}
        else:
            notes["kernel_skipped"] = f"{exe} exited {out.returncode}: {out.stderr.strip()[-300:]}"

    # -- report ----------------------------------------------------------------
    ref = finals["torch_fused"]
    agree = {k: float((v - ref).abs().max()) for k, v in finals.items()}
    labels = {"zeroshard_step": "zeroshard Optimizer.step", "zeroshard_push": "zeroshard Param.push_grad",
              "zeroshard_sync": "zeroshard Context.grad_sync",
              "zeroshard_push_and_step": "zeroshard push + sync + step",
              "torch_fused": "torch AdamW(fused=True)", "torch_foreach": "torch AdamW(foreach=True)",
              "deepspeed_cpu_adam": "DeepSpeedCPUAdam(adamw_mode)",
              "kernel_adamw": "engine kernel alone (bench_optimizer)"}
    for k, r in results.items():
        r["params_per_s"] = n / r["median_s"]
        gbps = n * 28 / r["median_s"] / 1e9
        print(f"  {labels[k]:38s} {r['median_s'] * 1e3:8.1f} ms (best {r['best_s'] * 1e3:7.1f})  "
              f"{r['params_per_s'] / 1e9:6.3f} G params/s  {gbps:6.1f} GB/s at 28 B/param", flush=True)
    ratios = {}
    eng = results["zeroshard_step"]["median_s"]
    for k in ("torch_fused", "torch_foreach", "deepspeed_cpu_adam"):
        if k in results:
            ratios[f"zeroshard_step_over_{k}"] = results[k]["median_s"] / eng
            ratios[f"zeroshard_push_and_step_over_{k}"] = (results[k]["median_s"]
                                                           / results["zeroshard_push_and_step"]["median_s"])
    if "kernel_adamw" in results:
        ratios["zeroshard_step_time_over_kernel_time"] = eng / results["kernel_adamw"]["median_s"]
    for k, v in ratios.items():
        print(f"  {k:50s} x{v:.2f}", flush=True)
    print("  params after the run, max |difference| to torch fused: "
          + ", ".join(f"{k} {v:.2e}" for k, v in agree.items()), flush=True)
    print("  targets (not asserted): zeroshard step >= 3x torch fused AdamW and >= DeepSpeedCPUAdam", flush=True)
    print(json.dumps({"bench": "optimizer_torch", "params": n, "threads": args.threads, "iters": args.iters,
                      "warmup": args.warmup, "results": results, "ratios": ratios,
                      "max_abs_diff_to_torch_fused": agree, "notes": notes,
                      "targets": {"step_over_torch_fused": 3.0, "step_over_deepspeed_cpu_adam": 1.0}}))


if __name__ == "__main__":
    main()
