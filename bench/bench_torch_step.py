"""PyTorch step benchmark: the GPT example (examples/python/train_gpt.py) on
2 and 4 ranks, through zeroshard and through torch DDP (gloo), in the same
run. Prints step times and per-rank memory; the last line is one JSON object.

    /usr/bin/python3 bench/bench_torch_step.py [--steps 30] [--ranks 2 4]

Targets: step time <= 1.25 x DDP; params + grads + optimizer state per rank
<= DDP's / N + the largest layer.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(ranks, engine, steps, extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(ranks), "--no-prefix", "--", sys.executable,
           str(REPO / "examples" / "python" / "train_gpt.py"), "--steps", str(steps)] + extra
    if engine == "ddp":
        cmd.append("--ddp")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"bench_torch_step: {engine} on {ranks} ranks failed:\n{out.stdout}\n{out.stderr}")
    return json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_gpt.py options")
    args = ap.parse_args()
    results = []
    for n in args.ranks:
        zs, ddp = run(n, "zeroshard", args.steps, args.extra), run(n, "ddp", args.steps, args.extra)
        state = lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]  # noqa: E731
        zs_state = max(state(r) for r in zs["per_rank"])
        ddp_state = max(state(r) for r in ddp["per_rank"])
        bound = ddp_state / n + zs["largest_param_bytes"]
        row = {"ranks": n,
               "zeroshard_step_s": zs["median_step_s"], "ddp_step_s": ddp["median_step_s"],
               "step_time_ratio": zs["median_step_s"] / ddp["median_step_s"],
               "zeroshard_state_bytes": zs_state, "ddp_state_bytes": ddp_state,
               "state_bound_bytes": bound, "state_ratio_to_bound": zs_state / bound,
               "zeroshard_peak_rss": max(r["peak_rss_bytes"] for r in zs["per_rank"]),
               "ddp_peak_rss": max(r["peak_rss_bytes"] for r in ddp["per_rank"]),
               "zeroshard_final_loss": zs["final_loss"], "ddp_final_loss": ddp["final_loss"]}
        results.append(row)
        print(f"{n} ranks: step {row['zeroshard_step_s'] * 1e3:.1f} ms vs DDP {row['ddp_step_s'] * 1e3:.1f} ms "
              f"(x{row['step_time_ratio']:.2f}, target <= 1.25); state/rank {zs_state / 2**20:.2f} MiB vs DDP "
              f"{ddp_state / 2**20:.2f} MiB (bound {bound / 2**20:.2f} MiB, x{row['state_ratio_to_bound']:.2f}); "
              f"peak RSS {row['zeroshard_peak_rss'] / 2**20:.0f} vs {row['ddp_peak_rss'] / 2**20:.0f} MiB; "
              f"final loss {zs['final_loss']:.4f} vs {ddp['final_loss']:.4f}", flush=True)
    print(json.dumps({"bench": "torch_step", "steps": args.steps, "target_step_ratio": 1.25, "results": results}))


if __name__ == "__main__":
    main()
