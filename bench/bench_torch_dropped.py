"""Models trained one after another in one process, each dropped before the
next (a notebook, a sweep of fits): what each rank holds after every round,
the engine's own counters (params registered, shard + gradient + optimizer
bytes) and the process's RSS.

    .venv/bin/python bench/bench_torch_dropped.py [--ranks 2] [--rounds 5] [--steps 2]
        [--width 1024] [--depth 8] [--package PATH]

`--package` runs another checkout's bindings/python against the same
library (for a before/after comparison). Prints per round and rank the
figures and their growth over round 1; the last line is one JSON object.
Memory only: nothing here is timed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args):
    import gc
    import resource

    import torch
    import torch.nn as nn

    import zeroshard.torch as zt

    rows = []
    for round_ in range(args.rounds):
        torch.manual_seed(round_)
        with zt.Init(config={"zero_optimization": {"stage": 3}}):
            model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
        zt.partition_module(model)
        rank = zt.get_context().rank
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-3)
        for step in range(args.steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(8, args.width, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        mem = zt.get_context().memory()
        rows.append({"round": round_ + 1, "num_params": mem["num_params"],
                     "state_mib": (mem["shard_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]) / 2**20,
                     "rss_mib": _rss_mib(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        del model, opt
        gc.collect()  # as a notebook's user might; the other ranks' collectors agree at the next step
    with open(os.environ["ZS_BENCH_OUT"] + f".{rank}", "w") as f:
        json.dump(rows, f)
    zt.shutdown()


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--package", default=str(REPO / "bindings" / "python"))
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ZS_BENCH_OUT=os.path.join(tmp, "rows"), PYTHONPATH=args.package,
                   OMP_NUM_THREADS="1")
        env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
        cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--", sys.executable, __file__,
               "--worker"] + [a for a in sys.argv[1:] if a != "--worker"]
        subprocess.run(cmd, env=env, check=True)
        per_rank = []
        for r in range(args.ranks):
            with open(os.path.join(tmp, f"rows.{r}")) as f:
                per_rank.append(json.load(f))
    params = args.width * (args.width + 1) * args.depth
    print(f"{args.rounds} models of {args.depth} x Linear({args.width}, {args.width}) ({params / 1e6:.1f}M params), "
          f"{args.steps} steps each, {args.ranks} ranks, package {args.package}")
    print("round  rank  params registered  state MiB  RSS MiB  (RSS over round 1)")
    for r, rows in enumerate(per_rank):
        for row in rows:
            print(f"{row['round']:5d}  {r:4d}  {row['num_params']:17d}  {row['state_mib']:9.1f}  "
                  f"{row['rss_mib']:7.0f}  (+{row['rss_mib'] - rows[0]['rss_mib']:.0f})")
    growth = [rows[-1]["rss_mib"] - rows[0]["rss_mib"] for rows in per_rank]
    state_growth = [rows[-1]["state_mib"] / rows[0]["state_mib"] for rows in per_rank]
    print(f"RSS growth from round 1 to {args.rounds}: " + ", ".join(f"rank {r} +{g:.0f} MiB" for r, g in enumerate(growth))
          + f"; engine state last/first round: " + ", ".join(f"{x:.2f}x" for x in state_growth))
    print(json.dumps({"bench": "torch_dropped", "ranks": args.ranks, "rounds": args.rounds, "params": params,
                      "package": args.package, "per_rank": per_rank, "rss_growth_mib": growth,
                      "state_growth_ratio": state_growth}))


if __name__ == "__main__":
    main()
