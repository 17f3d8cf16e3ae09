"""The largest GPT each engine trains on this machine: 2 ranks, GPT-2's
vocabulary (50257, head untied), batch 2 x ctx 128 per rank, fp32, AdamW,
--steps optimizer steps each try (default 2: the second step is training's
steady state, AdamW's moments held through forward and backward; an engine
that makes them lazily at its first step shows a lower first-step peak).

    .venv/bin/python bench/bench_largest_model.py [--budget-gib G]
        [--variants zeroshard zeroshard_cpu zeroshard_nvme fsdp2 fsdp2_offload deepspeed deepspeed_offload]
        [--start-params 1.5e8] [--max-params 6e9] [--grid 1.25] [--steps 2] [--nvme-dir DIR]
        [--try-timeout 2400]

Variants (each try is one zsrun launch of bench_torch_memory.py's worker,
its own processes):

  zeroshard          zeroshard.torch, the engine's defaults, model built under zt.Init
  zeroshard_cpu      the same with offload_param and offload_optimizer "cpu" (on a
                     CPU-only machine the shards are in host memory already: the
                     engine keeps them where they are, so this is zeroshard's figure)
  zeroshard_nvme     offload_param and offload_optimizer "nvme" under --nvme-dir
                     (parameter shards, AdamW state and gradient shards in swap
                     files; ZS_NVME_GRADS from the caller's environment; max_in_cpu 0,
                     sub_group_size 2e7, 3 buffers)
  fsdp2              fully_shard on every block, then the model; AdamW over its shards
  fsdp2_offload      the same with CPUOffloadPolicy()
  deepspeed          DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu, gloo), model under zero.Init
  deepspeed_offload  the same with offload_param and offload_optimizer "cpu"

The memory budget is the machine's: MemAvailable at the start less 1 GiB
unless --budget-gib says less (a smaller budget stands for a smaller
machine, and the search ends sooner). A watchdog sums the resident memory
of every process of a try (the launcher and its ranks) every 50 ms and
kills the try the moment the sum passes the budget: a try either trains
its step within the budget or is refused, and the machine never swaps or
meets the kernel's OOM killer. NVMe tries also watch the free space under
--nvme-dir and stop 2 GiB before it runs out; a size whose swap files
cannot fit (16 bytes a param: shards 4, AdamW moments 8, gradients 4)
is not tried.

The search walks a grid of model sizes (each --grid times the last; the
width grows with the size, 64-wide heads, the depth makes up the count):
from --start-params upward, doubling its stride while tries pass, then
bisecting between the last pass and the first failure. Prints each try
(params, shape, result, peak summed RSS, seconds), a table of the largest
model per variant with its ratio to FSDP2's, and one JSON line.
Takes long at the full budget: a try of a 3B model is minutes on 2 cores.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
MIB = 2 ** 20
VOCAB, CTX, BATCH = 50257, 128, 2
# Parameter shards 4 + AdamW moments 8 + gradient shards 4 (in memory
# under ZS_NVME_GRADS=0), over all ranks.
NVME_BYTES_PER_PARAM = 12 if os.environ.get("ZS_NVME_GRADS") == "0" else 16


def nvme_section(path):
    """NVMe offload as docs/offload.md sets it up for a model larger than
    memory: no parameter shards cached in memory, the optimizer stepped in
    sub-groups of 2e7 elements through 3 buffers (160 MB each: read ahead
    and write behind both overlap)."""
    return {"sub_group_size": 20_000_000,
            "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 3,
                                  "pipeline_read": True, "pipeline_write": True}}


CPU_OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def variant(name, nvme_dir):
    """(worker engine, zero_optimization keys, extra environment)."""
    return {
        "zeroshard": ("zeroshard", {}, {}),
        "zeroshard_cpu": ("zeroshard", CPU_OFFLOAD, {}),
        "zeroshard_nvme": ("zeroshard", nvme_section(nvme_dir), {"ZS_HOST_CACHE_MB": "0"}),
        "fsdp2": ("fsdp2", {}, {}),
        "fsdp2_offload": ("fsdp2_offload", {}, {}),
        "deepspeed": ("deepspeed", {}, {"DS_ACCELERATOR": "cpu"}),
        "deepspeed_offload": ("deepspeed", CPU_OFFLOAD, {"DS_ACCELERATOR": "cpu"}),
    }[name]


def count_params(dim, layers):
    """train_gpt.GPT's parameter count (untied head)."""
    per_block = 12 * dim * dim + 13 * dim  # qkv, proj, 4x MLP, two LayerNorms, biases
    return layers * per_block + 2 * VOCAB * dim + CTX * dim + 2 * dim


def shape_for(target):
    """A GPT shape near `target` params: GPT-2's widths as the size grows."""
    for limit, dim in ((2.5e8, 768), (6e8, 1024), (1.2e9, 1280), (2.2e9, 1600), (3.6e9, 2048)):
        if target <= limit:
            break
    else:
        dim = 2560
    per_block = 12 * dim * dim + 13 * dim
    layers = max(1, round((target - count_params(dim, 0)) / per_block))
    return dim, layers, dim // 64


def grid(start, stop, ratio):
    out, seen, n = [], set(), start
    while n <= stop:
        s = shape_for(n)
        if s not in seen:
            seen.add(s)
            out.append(s)
        n *= ratio
    return out


def session_pids(sid):
    """The pids of every process in session `sid`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) == sid:
                    yield int(pid)
        except (OSError, ValueError, IndexError):
            continue


def session_rss(sid, page):
    """Resident bytes of every process in session `sid`."""
    total = 0
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def try_one(args, name, shape, budget):
    """Runs one step of `shape` under `name`; returns a dict with 'result'
    (pass, over_memory, over_disk, timeout, error), peak summed RSS, time."""
    dim, layers, heads = shape
    params = count_params(dim, layers)
    engine, zero_cfg, env_add = variant(name, args.nvme_dir)
    row = {"variant": name, "params": params, "dim": dim, "layers": layers, "heads": heads}
    disk_floor = 2 * GIB
    if name == "zeroshard_nvme":
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        os.makedirs(args.nvme_dir, exist_ok=True)
        free = shutil.disk_usage(args.nvme_dir).free
        if params * NVME_BYTES_PER_PARAM > free - disk_floor:
            return {**row, "result": "over_disk", "peak_rss": 0, "seconds": 0.0,
                    "detail": f"swap files need {params * NVME_BYTES_PER_PARAM / GIB:.1f} GiB, "
                              f"{free / GIB:.1f} GiB free under {args.nvme_dir}"}
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.update({"OMP_NUM_THREADS": "1", "ZS_NUM_THREADS": "1", "ZS_TIMEOUT_MS": str(args.try_timeout * 1000)})
    env.update(env_add)
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", "2", "--no-prefix", "--", sys.executable,
           str(REPO / "bench" / "bench_torch_memory.py"), "--worker", "--engine", engine,
           "--zero-config", json.dumps(zero_cfg), "--steps", str(args.steps), "--dim", str(dim), "--layers", str(layers),
           "--heads", str(heads), "--batch", str(BATCH), "--ctx", str(CTX), "--vocab", str(VOCAB)]
    page = os.sysconf("SC_PAGE_SIZE")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    # The output is read by a thread: a full pipe must not stall the ranks.
    out = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    peak, result, detail = 0, None, ""
    while proc.poll() is None:
        rss = session_rss(proc.pid, page)
        peak = max(peak, rss)
        if rss > budget:
            result, detail = "over_memory", f"{rss / GIB:.2f} GiB summed RSS > budget {budget / GIB:.2f} GiB"
        elif name == "zeroshard_nvme" and shutil.disk_usage(args.nvme_dir).free < disk_floor:
            result, detail = "over_disk", f"less than {disk_floor / GIB:.0f} GiB left under {args.nvme_dir}"
        elif time.monotonic() - t0 > args.try_timeout:
            result, detail = "timeout", f"over {args.try_timeout} s"
        if result:
            kill_session(proc.pid)
            break
        time.sleep(0.05)
    proc.wait()
    reader.join(timeout=10)
    seconds = time.monotonic() - t0
    text = "".join(out)
    report = None
    for line in text.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
    if result is None:
        if proc.returncode == 0 and report:
            result = "pass"
        else:
            result, detail = "error", f"exit {proc.returncode}: " + " | ".join(text.strip().splitlines()[-4:])[-600:]
    if name == "zeroshard_nvme":
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
    row.update({"result": result, "peak_rss": peak, "seconds": round(seconds, 1), "detail": detail})
    if report:
        row["rank_peak_rss"] = [p["peak_rss"] for p in report["per_rank"]]
        row["step_s"] = max(p["steps"][-1]["step_s"] for p in report["per_rank"])  # the last step's
    return row


def kill_session(sid):
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def search(args, name, shapes, budget, log):
    """Largest passing index: gallop up from 0 while tries pass, then bisect."""
    tried = {}

    def attempt(i):
        if i not in tried:
            row = try_one(args, name, shapes[i], budget)
            tried[i] = row
            log(row)
        return tried[i]["result"] == "pass"

    good, bad, stride, i = -1, len(shapes), 1, 0
    while i < len(shapes):
        if attempt(i):
            good, i, stride = i, i + stride, stride * 2
        else:
            bad = i
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if attempt(mid):
            good = mid
        else:
            bad = mid
    return good, bad, tried


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["fsdp2", "fsdp2_offload", "deepspeed", "deepspeed_offload",
                                                      "zeroshard", "zeroshard_cpu", "zeroshard_nvme"])
    ap.add_argument("--budget-gib", type=float, default=None, help="summed RSS of a try (default: MemAvailable - 1)")
    ap.add_argument("--start-params", type=float, default=1.5e8)
    ap.add_argument("--max-params", type=float, default=6e9)
    ap.add_argument("--grid", type=float, default=1.25, help="each size this many times the last")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps a try must complete")
    ap.add_argument("--nvme-dir", default=str(REPO / "build" / "largest_model_nvme"))
    ap.add_argument("--try-timeout", type=int, default=2400, help="seconds a try may take")
    args = ap.parse_args()
    if args.grid <= 1.0:
        sys.exit(f"bench_largest_model: --grid {args.grid} must be above 1")
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    budget = int(args.budget_gib * GIB) if args.budget_gib else avail - GIB
    if budget > avail:
        sys.exit(f"bench_largest_model: --budget-gib {args.budget_gib} is above the {avail / GIB:.1f} GiB available")
    shapes = grid(args.start_params, args.max_params, args.grid)
    print(f"bench_largest_model: 2 ranks, batch {BATCH} x ctx {CTX}, vocab {VOCAB}, {args.steps} steps; budget {budget / GIB:.1f} GiB "
          f"summed RSS ({avail / GIB:.1f} GiB available); {len(shapes)} sizes from "
          f"{count_params(*shapes[0][:2]) / 1e6:.0f}M to {count_params(*shapes[-1][:2]) / 1e6:.0f}M; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    def log(row):
        print(f"  {row['variant']:<18} {row['params'] / 1e6:7.0f}M ({row['dim']} x {row['layers']}): "
              f"{row['result']:<11} peak {row['peak_rss'] / GIB:5.2f} GiB, {row['seconds']:6.1f} s"
              + (f" (step {row['step_s']:.1f} s)" if "step_s" in row else "")
              + (f"  {row['detail']}" if row["detail"] else ""), flush=True)

    largest = {}
    for name in args.variants:
        variant(name, args.nvme_dir)  # an unknown name fails before any try
    for name in args.variants:
        good, bad, tried = search(args, name, shapes, budget, log)
        largest[name] = {"params": count_params(*shapes[good][:2]) if good >= 0 else 0,
                         "shape": list(shapes[good]) if good >= 0 else None,
                         "first_failure": tried.get(bad), "tries": [tried[k] for k in sorted(tried)]}
    base = largest.get("fsdp2", {}).get("params")
    print(f"\nlargest model that trains {args.steps} steps:", flush=True)
    for name, r in largest.items():
        fail = r["first_failure"]
        print(f"  {name:<18} {r['params'] / 1e6:7.0f}M" + (f" = {r['params'] / base:.2f}x FSDP2's" if base else "")
              + (f"; next size {fail['params'] / 1e6:.0f}M: {fail['result']}" if fail else "; the grid's top"),
              flush=True)
    print(json.dumps({"bench": "largest_model", "budget_bytes": budget, "grid": args.grid, "steps": args.steps,
                      "batch": BATCH, "ctx": CTX, "vocab": VOCAB,
                      "largest": {k: {"params": v["params"], "shape": v["shape"]} for k, v in largest.items()},
                      "ratio_to_fsdp2": {k: v["params"] / base for k, v in largest.items()} if base else None,
                      "tries": [t for v in largest.values() for t in v["tries"]]}))


if __name__ == "__main__":
    sys.exit(main())
