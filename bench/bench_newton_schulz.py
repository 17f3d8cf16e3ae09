"""Muon's Newton-Schulz iteration, one matrix at a time: torch.optim.Muon's
(bf16), DeepSpeed 0.19's two methods (eager: "gram" and "standard"), and
zeroshard.torch.Muon's (the same two methods and dtypes as DeepSpeed's:
bit for bit equal, see test_torch_optimizers.py), on the shapes of a GPT's
hidden matrices, in one run, on the device given.

    .venv/bin/python bench/bench_newton_schulz.py [--dim 768] [--steps 5] [--iters 3]
        [--threads 1] [--device cpu|cuda] [--no-deepspeed]

Prints the median seconds per matrix and each one's ratio to torch's; the
last line is one JSON object. Never a pass or a fail: figures only.
"""
import argparse
import json
import os
import statistics
import time

import torch

from zeroshard.torch.muon import NS_COEFFICIENTS, orthogonalize


def timed(fn, iters):
    fn()  # warm-up (and DeepSpeed's first call)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
    impls = {"torch.optim.Muon": lambda g: torch_ns(g, NS_COEFFICIENTS, args.steps, 1e-7),
             "zeroshard gram": lambda g: orthogonalize(g, args.steps, "gram"),
             "zeroshard standard": lambda g: orthogonalize(g, args.steps, "standard")}
    if not args.no_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.device == "cpu" else "cuda")
        from deepspeed.runtime.zero.muon import original_muon as ds
        torch.compiler.set_stance("force_eager")  # DeepSpeed compiles these per shape; timed eager
        impls["deepspeed gram"] = lambda g: ds.zeropower_via_gram_newtonschulz(g, args.steps)
        impls["deepspeed standard"] = lambda g: ds.zeropower_via_newtonschulz5(g, args.steps)
    d = args.dim
    shapes = [(d, d), (3 * d, d), (4 * d, d), (d, 4 * d)]  # attention out, qkv, MLP in, MLP out
    g = torch.Generator().manual_seed(0)
    results = {}
    print(f"Newton-Schulz, {args.steps} steps, {args.threads} thread(s), {args.device}: median seconds per matrix")
    print(f"{'shape':>12} " + " ".join(f"{k:>20}" for k in impls))
    for shape in shapes:
        m = torch.randn(*shape, generator=g).to(args.device)
        row = {k: timed(lambda f=f: f(m), args.iters) for k, f in impls.items()}
        results["x".join(map(str, shape))] = row
        print(f"{'x'.join(map(str, shape)):>12} " + " ".join(f"{v:>20.4f}" for v in row.values()))
    base = "torch.optim.Muon"
    ratios = {s: {k: v / row[base] for k, v in row.items() if k != base} for s, row in results.items()}
    for s, r in ratios.items():
        print(f"{s:>12} vs torch's: " + ", ".join(f"{k} {v:.3f}x" for k, v in r.items()))
    print(json.dumps({"bench": "newton_schulz", "device": args.device, "threads": args.threads, "steps": args.steps,
                      "seconds": results, "ratio_to_torch": ratios}))


if __name__ == "__main__":
    main()
