"""What a checkpoint costs the training loop: zeroshard.torch's synchronous
save against its asynchronous one (the time the call blocks, and until the
background write is done), side by side with torch DCP's dcp.save and
dcp.async_save of the same model under FSDP2, on the same disk, 2 ranks.

    .venv/bin/python bench/bench_checkpoint_async.py [--dim 768 --layers 12] [--repeats 3]
        [--dir build/bench_checkpoint_async]

The GPT example (vocab 50257, untied head) after one AdamW step: params and
both moments, fp32 (16 bytes a param over the ranks; 162M params: 2.4 GiB).
Each engine is its own launch; each figure is the median of --repeats saves
into fresh tags (the directory is emptied between engines). Blocked: from
the call until it returns (zeroshard: shards staged in host memory; DCP:
its staging to CPU and planning). Done: until the write is durable
(zt.wait_checkpoint / the future's result). Prints figures and ratios and
ends with one JSON line. Disk figures on a shared VM move from run to run.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.path.insert(0, str(REPO / "examples" / "python"))
    import train_gpt

    make = lambda: train_gpt.GPT(50257, args.dim, args.dim // 64, args.layers, 128)  # noqa: E731
    x = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(rank))
    y = x.roll(1, 1)
    out = {"sync": [], "blocked": [], "done": []}
    if args.engine == "zeroshard":
        import zeroshard.torch as zt
        config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
        zt.init_context(config=config, device="cpu")
        with zt.Init(config=config, device="cpu"):
            model = make()
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-4)
        model(x, y).backward()
        opt.step()
        nbytes = sum(p.numel() for p in model.parameters()) * 16  # params are counted whole
        for i in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            zt.save_checkpoint(args.dir, model, opt, tag=f"sync-{i}")
            out["sync"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            zt.save_checkpoint(args.dir, model, opt, tag=f"async-{i}", async_save=True)
            out["blocked"].append(time.perf_counter() - t0)
            zt.wait_checkpoint()
            out["done"].append(time.perf_counter() - t0)
        del model, opt
        zt.shutdown()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard
        model = make()
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(x, y).backward()
        opt.step()
        nbytes = sum(p.numel() for p in model.parameters()) * 16
        for i in range(args.repeats):
            msd, osd = get_state_dict(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{args.dir}/sync-{i}")
            out["sync"].append(time.perf_counter() - t0)
            msd, osd = get_state_dict(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{args.dir}/async-{i}")
            out["blocked"].append(time.perf_counter() - t0)
            future.result()
            out["done"].append(time.perf_counter() - t0)
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:  # the slowest rank's time of each save
        merged = {k: [max(r[k][i] for r in everyone) for i in range(args.repeats)] for k in out}
        print(json.dumps({"engine": args.engine, "bytes": nbytes, **merged}), flush=True)
    dist.destroy_process_group()


def launch(args, engine):
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", "2", "--no-prefix", "--", sys.executable, __file__,
           "--worker", "--engine", engine, "--dim", str(args.dim), "--layers", str(args.layers),
           "--repeats", str(args.repeats), "--dir", args.dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench_checkpoint_async: {engine} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="zeroshard", help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=str(REPO / "build" / "bench_checkpoint_async"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    free = shutil.disk_usage(Path(args.dir).parent if Path(args.dir).parent.exists() else REPO).free
    print(f"bench_checkpoint_async: GPT dim {args.dim} x {args.layers} layers, 2 ranks, {args.repeats} saves each, "
          f"into {args.dir} ({free / 2**30:.0f} GiB free)", flush=True)
    results = {e: launch(args, e) for e in ("zeroshard", "dcp")}
    figures = {}
    for e, r in results.items():
        f = {k: median(r[k]) for k in ("sync", "blocked", "done")}
        f["gib"] = r["bytes"] / 2**30
        figures[e] = f
        print(f"  {e:<10} {f['gib']:.2f} GiB: synchronous {f['sync']:.2f} s ({f['gib'] / f['sync']:.2f} GiB/s); "
              f"asynchronous blocks {f['blocked']:.3f} s = {f['blocked'] / f['sync']:.1%} of synchronous, "
              f"done after {f['done']:.2f} s", flush=True)
    z, d = figures["zeroshard"], figures["dcp"]
    print(f"  zeroshard / DCP: synchronous {z['sync'] / d['sync']:.2f}x, blocked {z['blocked'] / d['blocked']:.2f}x, "
          f"done {z['done'] / d['done']:.2f}x", flush=True)
    print(json.dumps({"bench": "checkpoint_async", "dim": args.dim, "layers": args.layers, "ranks": 2,
                      "figures": figures, "raw": results}))


if __name__ == "__main__":
    sys.exit(main())
