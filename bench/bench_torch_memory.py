"""Where a rank's memory goes: the GPT example (or the wide Linear stack of
bench_torch_step.py) through zeroshard or torch DDP, with each rank's RSS
sampled every few milliseconds by a background thread and attributed to the
phase it was in (build, forward, backward, step), next to the engine's own
counters (shards, gathered params, host cache) and glibc's heap (bytes in
use, bytes free but kept).

    .venv/bin/python bench/bench_torch_memory.py [--ranks 2] [--steps 3]
        [--dim 768 --layers 8 --heads 12 --batch 4] [--variants default host_cache_0 ...]
        [--model wide --wide-width 4096 --wide-depth 7 --batch 16]

Each variant is one zsrun launch (its own processes, so peaks do not mix):

  ddp            torch DDP (gloo), AdamW(foreach=False), as train_gpt --ddp
  fsdp2          torch FSDP2: fully_shard on every block, then the model;
                 AdamW(foreach=False) over its DTensor shards
  default        zeroshard as train_gpt runs it (the engine's defaults)
  host_cache_0   ZS_HOST_CACHE_MB=0: no idle host blocks kept
  bucket_2e7     zero_optimization.reduce_bucket_size = 2e7 elements
  cache0_bucket  both of the above
  VAR=VALUE,...  (ad hoc) environment and/or config: e.g.
                 "ZS_HOST_CACHE_MB=256,reduce_bucket_size=5e7,prefetch_bucket_size=1e7"
  ddp:VAR=VALUE  DDP with that environment, e.g. "ddp:MALLOC_MMAP_THRESHOLD_=1048576"

Prints, per variant, the per-rank peak RSS and what it consists of, the
ratio to DDP's and FSDP2's peaks, per phase the highest RSS seen, and for
zeroshard its memory report (zt.memory_report(): the engine's bytes by
kind, now and the peak of each phase) beside the RSS. With --vocab 50257,
--dim 768 --layers 12 is GPT-2 small's shape (163M params: the head is not
tied to the embedding here, 124M when it is: --tie-head), --dim 1024
--layers 24 --heads 16 GPT-2 medium's (406M; 355M tied). The last line is one
JSON object. Memory figures from a machine others share are still each
process's own (RSS); the median step time (steps after the first) is
printed too, but on a shared machine it is only indicative.
"""
import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
PRESETS = {
    "ddp": ({}, {}),
    "fsdp2": ({}, {}),
    "default": ({}, {}),
    "host_cache_0": ({"ZS_HOST_CACHE_MB": "0"}, {}),
    "bucket_2e7": ({}, {"reduce_bucket_size": 20000000}),
    "cache0_bucket": ({"ZS_HOST_CACHE_MB": "0"}, {"reduce_bucket_size": 20000000}),
}


def parse_variant(v):
    if v in PRESETS:
        return PRESETS[v]
    if v.startswith("ddp:"):
        v = v[4:]
    env, cfg = {}, {}
    for item in v.split(","):
        k, _, val = item.partition("=")
        if k.isupper():
            env[k] = val
        else:
            cfg[k] = json.loads(val) if val[:1] in "[{\"tf" else int(float(val))
    return env, cfg


# ---------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------

class Sampler(threading.Thread):
    """Polls RSS; keeps the highest value per phase."""

    def __init__(self, period_s=0.002):
        super().__init__(daemon=True)
        self.period = period_s
        self.phase = "start"
        self.peaks = {}
        self.stop_flag = False
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)

    def rss(self):
        return int(os.pread(self.fd, 128, 0).split()[1]) * self.page

    def note(self):
        r = self.rss()
        if r > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = r
        return r

    def run(self):
        while not self.stop_flag:
            self.note()
            time.sleep(self.period)


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap():
    """glibc's view: bytes in use (heap + mmapped chunks), and free bytes it
    keeps in its arenas (resident unless trimmed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
        m = libc.mallinfo2()
        return {"in_use": m.uordblks + m.hblkhd, "mmapped": m.hblkhd, "free_kept": m.fordblks}
    except (OSError, AttributeError):
        return {}


def worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sampler = Sampler()
    sampler.start()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sys.path.insert(0, str(REPO / "examples" / "python"))
    import train_gpt

    text = (REPO / "examples" / "python" / "data" / "corpus.txt").read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    rss_before = sampler.note()
    sampler.phase = "build"
    torch.manual_seed(0)
    vocab = max(args.vocab, len(chars))  # token ids are the corpus's characters; a larger vocab sizes the tables
    make = lambda: train_gpt.GPT(vocab, args.dim, args.heads, args.layers, args.ctx,  # noqa: E731
                                 tie_head=args.tie_head)
    if args.model == "wide":
        sys.path.insert(0, str(REPO / "bench"))
        import bench_torch_step
        make = lambda: bench_torch_step.build_model(args)  # noqa: E731
    zt = None
    ds_engine = None
    if args.engine in ("fsdp2", "fsdp2_offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if args.engine == "fsdp2_offload" else {}
        module = make()
        for blk in module.blocks:
            fully_shard(blk, **policy)
        model = fully_shard(module, **policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=False)
        nparams = sum(p.numel() for p in module.parameters())
        largest = max(p.numel() for p in module.parameters())
    elif args.engine == "deepspeed":
        # DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu, gloo): the model built under
        # its zero.Init, its own AdamW; args.zero_config goes into its
        # zero_optimization section (offload_param / offload_optimizer).
        import deepspeed
        ds_config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
                     "zero_optimization": {"stage": 3, **json.loads(args.zero_config)}}
        deepspeed.init_distributed(dist_backend="gloo")
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            module = make()
        ds_engine, opt, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                    config=ds_config)
        model = ds_engine
        nparams = sum(p.ds_numel for p in module.parameters())
        largest = max(p.ds_numel for p in module.parameters())
    elif args.engine == "ddp":
        module = make()
        model = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=False)
        nparams = sum(p.numel() for p in module.parameters())
        largest = max(p.numel() for p in module.parameters())
    else:
        import zeroshard.torch as zt
        config = {"zero_optimization": {"stage": 3, **json.loads(args.zero_config)},
                  "train_micro_batch_size_per_gpu": args.batch}
        zt.init_context(config=config, device="cpu")
        with zt.Init(config=config, device="cpu"):
            model = make()
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-4, weight_decay=0.01)
        nparams = zt.get_context().memory()["unsharded_bytes"] // 4
        import math
        largest = max(math.prod(p.zs.shape) for p in model.parameters())
    gen = torch.Generator().manual_seed(1234)
    steps = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.ctx - 1, (world * args.batch,), generator=gen)
        mine = starts[rank * args.batch:(rank + 1) * args.batch]
        x = torch.stack([data[s:s + args.ctx] for s in mine])
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in mine])
        if args.model == "wide":  # bench_torch_step's wide batches: this rank's rows of a global batch
            x = torch.randn(world * args.batch, args.wide_width, generator=gen)[rank * args.batch:][:args.batch]
            y = torch.randn(world * args.batch, args.wide_width, generator=gen)[rank * args.batch:][:args.batch]
        row = {}
        t0 = time.perf_counter()
        sampler.phase = f"forward {step}"
        loss = model(x, y)
        row["after_forward"] = sampler.note()
        sampler.phase = f"backward {step}"
        if ds_engine is not None:
            ds_engine.backward(loss)
        else:
            loss.backward()
        row["after_backward"] = sampler.note()
        if zt is not None:
            m = zt.get_context().memory()
            row["gathered_after_backward"] = m["gathered_bytes"]
            row["host_cache_after_backward"] = m["host_cache_bytes"]
        sampler.phase = f"step {step}"
        if ds_engine is not None:
            ds_engine.step()
        else:
            opt.step()
            opt.zero_grad()
        row["after_step"] = sampler.note()
        row["step_s"] = time.perf_counter() - t0
        row["heap_after_step"] = heap()
        if zt is not None:
            m = zt.get_context().memory()
            row["engine_after_step"] = {k: m[k] for k in ("shard_bytes", "grad_bytes", "optimizer_bytes",
                                                          "gathered_bytes", "peak_gathered_bytes",
                                                          "host_cache_bytes", "device_system_allocs",
                                                          "device_reuses")}
        steps.append(row)
    sampler.stop_flag = True
    sampler.join()
    unsharded = nparams * 4
    report = None
    if args.engine in ("fsdp2", "fsdp2_offload", "deepspeed"):
        shard = unsharded // world
        state = {"param_bytes": shard, "grad_bytes": shard, "optimizer_bytes": 2 * shard}
    elif zt is None:
        state = {"param_bytes": unsharded, "grad_bytes": unsharded, "optimizer_bytes": 2 * unsharded}
    else:
        m = zt.get_context().memory()
        state = {"param_bytes": m["shard_bytes"], "grad_bytes": m["grad_bytes"],
                 "optimizer_bytes": m["optimizer_bytes"]}
        report = zt.memory_report()
        report["text"] = zt.format_memory_report(report)
    mine = {"rank": rank, "rss_before_model": rss_before, "peak_rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "phase_peaks": sampler.peaks, "steps": steps, **state,
            "memory_report": report}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(json.dumps({"engine": args.engine, "params": nparams, "largest_param": largest,
                          "per_rank": everyone}), flush=True)
    dist.barrier()
    if zt is not None:
        del model, opt
        zt.shutdown()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def launch(args, name):
    env_add, cfg = parse_variant(name)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("ZS_NUM_THREADS", "1")
    env.update(env_add)
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix", "--", sys.executable,
           str(Path(__file__).resolve()), "--worker", "--engine",
           "ddp" if name == "ddp" or name.startswith("ddp:") else "fsdp2" if name == "fsdp2" else "zeroshard",
           "--zero-config", json.dumps(cfg), "--steps", str(args.steps), "--dim", str(args.dim),
           "--layers", str(args.layers), "--heads", str(args.heads), "--batch", str(args.batch),
           "--ctx", str(args.ctx), "--vocab", str(args.vocab), "--model", args.model, "--wide-width", str(args.wide_width),
           "--wide-depth", str(args.wide_depth)] + (["--tie-head"] if args.tie_head else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"bench_torch_memory: {name} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    r = json.loads(lines[-1])
    r["variant"], r["env"], r["zero_config"] = name, env_add, cfg
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="zeroshard", help=argparse.SUPPRESS)
    ap.add_argument("--zero-config", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=0, help="embedding rows (0: the corpus's characters)")
    ap.add_argument("--tie-head", action="store_true",
                    help="the GPT's head is its token embedding, as GPT-2's (--dim 1024 --layers 24: 355M)")
    ap.add_argument("--model", choices=["gpt", "wide"], default="gpt",
                    help="gpt: the GPT example; wide: bench_torch_step.py's Linear stack")
    ap.add_argument("--wide-width", type=int, default=4096)
    ap.add_argument("--wide-depth", type=int, default=7)
    ap.add_argument("--variants", nargs="+", default=["ddp", "default", "host_cache_0", "bucket_2e7",
                                                      "cache0_bucket"])
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.model == "wide":
        print(f"bench_torch_memory: wide model {args.wide_depth} x Linear({args.wide_width}, {args.wide_width}), "
              f"batch {args.batch} rows per rank, {args.ranks} ranks, {args.steps} steps", flush=True)
    else:
        print(f"bench_torch_memory: GPT dim {args.dim}, {args.layers} layers, {args.heads} heads, batch {args.batch} "
          f"x ctx {args.ctx} per rank, {args.ranks} ranks, {args.steps} steps; load average "
          f"{os.getloadavg()[0]:.1f} (a shared machine: RSS is per process, times only indicative)", flush=True)
    results = []
    ddp_peak = fsdp2_peak = None
    for name in args.variants:
        r = launch(args, name)
        results.append(r)
        pr = r["per_rank"]
        peak = max(p["peak_rss"] for p in pr)
        if name == "ddp":
            ddp_peak = peak
        if name == "fsdp2":
            fsdp2_peak = peak
        if name.startswith("ddp:") and "ddp" not in args.variants:
            ddp_peak = ddp_peak or peak
        p0 = max(pr, key=lambda p: p["peak_rss"])
        state = p0["param_bytes"] + p0["grad_bytes"] + p0["optimizer_bytes"]
        last = p0["steps"][-1]
        eng = last.get("engine_after_step", {})
        phase = max(p0["phase_peaks"].items(), key=lambda kv: kv[1])
        times = sorted(max(p["steps"][i]["step_s"] for p in pr) for i in range(1, len(p0["steps"])))
        r["median_step_s"] = times[len(times) // 2] if times else None
        print(f"\n[{name}] {r['params'] / 1e6:.1f}M params; peak RSS/rank "
              + " ".join(f"{p['peak_rss'] / MIB:.0f}" for p in pr) + " MiB"
              + (f" = {peak / ddp_peak:.2f}x DDP's" if ddp_peak and name != "ddp" else "")
              + (f", {peak / fsdp2_peak:.2f}x FSDP2's" if fsdp2_peak and name != "fsdp2" else "")
              + f"; highest in '{phase[0]}'"
              + (f"; median step after the first {r['median_step_s']:.2f} s" if times else ""), flush=True)
        print(f"  before the model {p0['rss_before_model'] / MIB:.0f} MiB; params+grads+AdamW {state / MIB:.0f} MiB "
              f"({p0['param_bytes'] / MIB:.0f} + {p0['grad_bytes'] / MIB:.0f} + {p0['optimizer_bytes'] / MIB:.0f}); "
              f"rest of the peak {(p0['peak_rss'] - p0['rss_before_model'] - state) / MIB:.0f} MiB", flush=True)
        if eng:
            print(f"  engine after the last step: host cache {eng['host_cache_bytes'] / MIB:.0f} MiB, gathered now "
                  f"{eng['gathered_bytes'] / MIB:.0f} MiB, peak gathered {eng['peak_gathered_bytes'] / MIB:.0f} MiB; "
                  f"after backward: gathered {last['gathered_after_backward'] / MIB:.0f} MiB, host cache "
                  f"{last['host_cache_after_backward'] / MIB:.0f} MiB", flush=True)
        h = last.get("heap_after_step", {})
        if h:
            print(f"  glibc heap after the last step: in use {h['in_use'] / MIB:.0f} MiB "
                  f"(mmapped {h['mmapped'] / MIB:.0f}), free but kept {h['free_kept'] / MIB:.0f} MiB", flush=True)
        print("  highest RSS per phase (MiB): " + ", ".join(
            f"{k} {v / MIB:.0f}" for k, v in p0["phase_peaks"].items()), flush=True)
        rep = p0.get("memory_report")
        if rep:
            print("  " + rep["text"].replace("\n", "\n  "), flush=True)
            beyond = rep["engine"]["total"] - state
            print(f"  engine bytes now beyond the state (params+grads+AdamW): {beyond / MIB:.0f} MiB "
                  f"({beyond / max(state, 1):.1%} of the state); peak total over phases "
                  f"{max(p['total'] for p in rep['peaks'].values()) / MIB:.0f} MiB", flush=True)
    print(json.dumps({"bench": "torch_memory", "ranks": args.ranks, "steps": args.steps,
                      "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "batch": args.batch,
                                "ctx": args.ctx}, "results": results}))


if __name__ == "__main__":
    sys.exit(main())
