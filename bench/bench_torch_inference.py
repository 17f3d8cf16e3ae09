"""Inference benchmark: a Hugging Face GPT-2 (random weights from a small
config) evaluated and decoding under no_grad through zeroshard, DeepSpeed
ZeRO-3 on the CPU (DS_ACCELERATOR=cpu, gloo; the model built whole, then
partitioned by deepspeed.initialize, so its peak RSS holds one whole model)
and plain torch (the whole
model on every rank, no communication: the floor), in one run, each in its
own zsrun launch so that peak RSS figures do not mix.

    .venv/bin/python bench/bench_torch_inference.py [--ranks 2] [--layers 8] [--width 512]
        [--evals 20] [--new-tokens 32] [--loop 1000] [--package PATH] [--no-deepspeed]

Two phases per engine, both under torch.no_grad():
  eval      --evals forwards with labels (batch --batch x --seq tokens):
            median ms per forward after --warmup;
  generate  generate() with the KV cache, greedy, --new-tokens tokens from a
            --prompt-token prompt: the slowest rank's generate() time over
            the longest rank's tokens (the job's time per token); rank 1
            stops early (eos_token_id set to what it generates half-way),
            so the ranks stop at different lengths. The sharded engines
            are called with synced_gpus=True, as ZeRO-3 users and TRL call
            them; plain torch without (the unsharded floor). zeroshard's
            generate() gathers the model whole for the call when it fits
            (python.md, "Generation and weight sync"): no collective per
            token, each rank stops by itself, synced_gpus or not. "zeroshard, per forward"
            (zs_gather=False) and DeepSpeed gather per forward: a sharded
            rank that stopped keeps running forwards with the others
            (synced_gpus), so its own time over its own tokens would count
            them twice.
  loop      (zeroshard only) --loop forwards of 50 nn.Linear(320, 320)
            under no_grad, each weight over the persistence threshold (1e5
            elements), so gathered every forward, and of 50 nn.Linear(64,
            64), every param kept gathered: ms per forward, and RSS growth
            from the first forward to the last (a step that never ended
            kept every forward's order).
zeroshard also reports its coordinator's counters (gathers on demand and
ahead, steps, the recorded order's length). "zeroshard, reuse 0" runs it
again with stage3_max_reuse_distance 0: nothing stays gathered from one
forward to the next (the default, 5e7 elements, keeps a model of up to
that size gathered across forward-only steps), and generates per forward. --package runs another
checkout's bindings/python against the same library as "zeroshard
(before)": a before/after comparison. Greedy tokens must equal plain
torch's on every engine (printed). The last line is one JSON object.
Nothing is asserted on time.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def worker(args):
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq + args.prompt_tokens + args.new_tokens + 8,
                        n_embd=args.width, n_layer=args.layers, n_head=args.heads)
    ds_config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": 3},
                 "steps_per_print": 10 ** 9}
    if args.max_reuse_distance is not None:
        ds_config["zero_optimization"]["stage3_max_reuse_distance"] = args.max_reuse_distance
    coord = None
    if args.engine == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        # Built whole and partitioned by initialize(): under zero.Init
        # Hugging Face's weight init writes into the empty placeholders and
        # GPT-2's Conv1D weights stay uninitialized memory (its loss is in
        # the hundreds), unless HF's own DeepSpeed integration builds it.
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config)
        engine.eval()
        run, gen = engine, engine.module.generate
    else:
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        if args.engine == "plain":
            model = GPT2LMHeadModel(config)
        else:
            import zeroshard.torch as zt
            with zt.Init(config=ds_config):
                model = GPT2LMHeadModel(config)
            zt.partition_module(model)
            coord = zt.get_context().coord_stats
        model.eval()
        run, gen = model, model.generate
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    out = {"rank": rank}

    times = []
    with torch.no_grad():
        for i in range(args.evals):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            t0 = time.perf_counter()
            loss = run(input_ids=ids, labels=ids).loss
            times.append(time.perf_counter() - t0)
        out["eval_loss"] = float(loss)
    out["eval_ms"] = statistics.median(times[args.warmup:]) * 1e3
    if coord is not None:
        out["coord_after_eval"] = coord()

    prompt = torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
    if world > 1 and args.engine != "plain":
        kw["synced_gpus"] = True  # as ZeRO-3 users, the Seq2Seq Trainer and TRL call it
    if args.engine == "zeroshard" and args.zs_gather == "off":
        kw["zs_gather"] = False  # per forward: each token's forward gathers, ranks paired (synced_gpus)
    with torch.no_grad():
        full = gen(prompt, **kw)  # greedy: the same tokens on every rank
        if rank == 1:  # stops half-way, at a token it is about to produce
            kw["eos_token_id"] = int(full[0, args.prompt_tokens + args.new_tokens // 2])
        t0 = time.perf_counter()
        tokens = gen(prompt, **kw)
        elapsed = time.perf_counter() - t0
    out["generated"] = tokens[0, args.prompt_tokens:].tolist()
    out["full"] = full[0, args.prompt_tokens:].tolist()
    out["generate_s"] = elapsed
    if coord is not None:
        out["coord_end"] = coord()
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["rss_mib"] = _rss_mib()
    if args.engine == "zeroshard" and args.loop > 0:
        import zeroshard.torch as zt
        for kind, width in (("gathered", 320), ("kept", 64)):
            with zt.Init(config=ds_config):
                stack = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(50)])
            zt.partition_module(stack)
            x = torch.randn(4, width)
            with torch.no_grad():
                stack(x)
                rss0, t0 = _rss_mib(), time.perf_counter()
                for _ in range(args.loop - 1):
                    stack(x)
                out[f"loop_{kind}_ms"] = (time.perf_counter() - t0) / max(1, args.loop - 1) * 1e3
            out[f"loop_{kind}_rss_growth_mib"] = _rss_mib() - rss0
            del stack
    with open(os.environ["ZS_BENCH_OUT"] + f".{rank}", "w") as f:
        json.dump(out, f)
    if args.engine == "zeroshard":
        import zeroshard.torch as zt
        zt.shutdown()
    dist.destroy_process_group()


def launch(args, name, engine, package, tmp, extra=()):
    env = dict(os.environ, ZS_BENCH_OUT=os.path.join(tmp, name.replace(" ", "_")))
    env["PYTHONPATH"] = package + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.ranks)))
    env.setdefault("ZS_NUM_THREADS", env["OMP_NUM_THREADS"])
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    passed = [a for a in sys.argv[1:] if a not in ("--no-deepspeed",)]
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix", "--", sys.executable,
           str(Path(__file__).resolve()), *passed, *extra, "--worker", "--engine", engine]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    rows = []
    for r in range(args.ranks):
        try:
            with open(env["ZS_BENCH_OUT"] + f".{r}") as f:
                rows.append(json.load(f))
        except OSError:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            return None, f"exit status {proc.returncode}, rank {r} wrote nothing:\n{tail}"
    return rows, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=["zeroshard", "deepspeed", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--evals", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--loop", type=int, default=1000)
    ap.add_argument("--package", default=None, help="another checkout's bindings/python, run as 'zeroshard (before)'")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--max-reuse-distance", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zs-gather", choices=("auto", "off"), default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.evals <= args.warmup:
        ap.error("--evals must exceed --warmup")

    import tempfile
    ours = str(REPO / "bindings" / "python")
    # (row name, --engine, bindings/python to import, extra worker arguments)
    engines = [("zeroshard", "zeroshard", ours, ()),
               ("zeroshard, per forward", "zeroshard", ours, ("--zs-gather", "off")),
               ("zeroshard, reuse 0", "zeroshard", ours, ("--max-reuse-distance", "0", "--zs-gather", "off"))]
    if args.package:
        engines.append(("zeroshard (before)", "zeroshard", args.package, ()))
    if not args.no_deepspeed:
        engines.append(("deepspeed", "deepspeed", ours, ()))
    engines.append(("plain", "plain", ours, ()))
    print(f"bench_torch_inference: GPT-2 of {args.layers} layers x {args.width}, vocab {args.vocab}, "
          f"{args.ranks} ranks, {os.environ.get('OMP_NUM_THREADS', max(1, (os.cpu_count() or 1) // args.ranks))} "
          f"thread(s) per rank, load average {os.getloadavg()[0]:.1f}", flush=True)
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, engine, package, extra in engines:
            rows, why = launch(args, name, engine, package, tmp, extra)
            if rows is None:
                if name != "deepspeed":
                    sys.exit(f"bench_torch_inference: {name} failed: {why}")
                skipped[name] = why
                print(f"deepspeed skipped: {why}", flush=True)
                continue
            results[name] = rows
    plain = results["plain"][0]
    summary = {}
    for name, rows in results.items():
        r0 = rows[0]
        row = {"eval_ms": max(r["eval_ms"] for r in rows),
               "generate_ms_per_token": max(r["generate_s"] for r in rows) * 1e3
                                        / max(1, max(len(r["generated"]) for r in rows)),
               "peak_rss_mib": [r["peak_rss_mib"] for r in rows],
               "tokens_equal_plain": all(r["full"] == plain["full"] for r in rows),
               "early_stop_lengths": [len(r["generated"]) for r in rows],
               "eval_loss_rank0": r0["eval_loss"]}
        if "coord_end" in r0:
            c, e = r0["coord_end"], r0["coord_after_eval"]
            row["coord"] = {k: c[k] for k in ("steps", "demand_fetches", "prefetches", "trace_length")}
            row["coord_after_eval"] = {k: e[k] for k in ("steps", "demand_fetches", "prefetches", "trace_length")}
        for kind in ("gathered", "kept"):
            if f"loop_{kind}_ms" in r0:
                row[f"loop_{kind}_ms"] = max(r[f"loop_{kind}_ms"] for r in rows)
                row[f"loop_{kind}_rss_growth_mib"] = [r[f"loop_{kind}_rss_growth_mib"] for r in rows]
        summary[name] = row
        coord = row.get("coord_after_eval")
        print(f"{name:22s} eval {row['eval_ms']:8.1f} ms/forward | generate {row['generate_ms_per_token']:7.1f} "
              f"ms/token | peak RSS/rank {' '.join(f'{x:.0f}' for x in row['peak_rss_mib'])} MiB | tokens "
              f"{'equal' if row['tokens_equal_plain'] else 'DIFFER from'} plain torch's, lengths "
              f"{row['early_stop_lengths']}"
              + (f" | after eval: {coord['steps']} steps, {coord['demand_fetches']} gathers on demand, "
                 f"{coord['prefetches']} ahead, order {coord['trace_length']} units" if coord else "")
              + "".join(f" | {args.loop} forwards, {kind}: {row[f'loop_{kind}_ms']:.2f} ms each, RSS "
                        f"{' '.join(f'{x:+.1f}' for x in row[f'loop_{kind}_rss_growth_mib'])} MiB"
                        for kind in ("gathered", "kept") if f"loop_{kind}_ms" in row), flush=True)
    ratios = {}
    for name in summary:
        if name == "zeroshard":
            continue
        ratios[f"zeroshard_over_{name}"] = {
            "eval": summary["zeroshard"]["eval_ms"] / summary[name]["eval_ms"],
            "generate": summary["zeroshard"]["generate_ms_per_token"] / summary[name]["generate_ms_per_token"]}
        print(f"zeroshard / {name}: eval x{ratios[f'zeroshard_over_{name}']['eval']:.2f}, generate "
              f"x{ratios[f'zeroshard_over_{name}']['generate']:.2f}", flush=True)
    print(json.dumps({"bench": "torch_inference", "ranks": args.ranks, "layers": args.layers, "width": args.width,
                      "vocab": args.vocab, "load_average_end": os.getloadavg()[0], "results": summary,
                      "ratios": ratios, "skipped": skipped}))


if __name__ == "__main__":
    sys.exit(main())
