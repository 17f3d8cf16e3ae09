"""TRL benchmark: one GRPO step (generation + training) and one DPO step of
the same TRL script through zeroshard (zeroshard.hf.trainer_class(X) with
TrainingArguments(deepspeed=<JSON>)), DDP (TRL's X as it is, no
deepspeed=) and DeepSpeed ZeRO-3 (TRL's X with the same JSON,
DS_ACCELERATOR=cpu), in one run, each engine and trainer in its own zsrun
launch of --ranks ranks.

    .venv/bin/python bench/bench_trl.py [--ranks 2] [--steps 5] [--trainers grpo dpo]
        [--engines zeroshard ddp deepspeed zeroshard-healing] [--layers 8] [--hidden 512]
        [--completion 64] [--zero-config JSON] [--rounds 1]

zeroshard-healing (only when named): zeroshard under `zsrun --restarts 1`,
where the trainer heals a lost rank in place (peer copies of every shard,
torch.distributed over the engine's groups): its steady-state cost, as a
ratio to zeroshard.

The script is the user's: a Llama (hidden --hidden, --layers layers,
vocabulary 8192, untied; 31.5M params at the defaults) saved once with random weights
(seed 0) and a word-level tokenizer, given to the trainer as a path (TRL
loads it, and its reference model for GRPO's beta 0.04 and for DPO), fp32
(bf16=False), AdamW (lr 1e-5), per-device batch 4, max_steps --steps, the
first step not timed. GRPO: 4 generations per prompt of 16 words, sampled
(temperature 1) up to --completion tokens, a reward counting one word,
ds3_gather_for_generation TRL's default (True). DPO: prompt 16 words, chosen
12, rejected 20, max_length 128.

Per engine and trainer: seconds per timed step (median; a TrainerCallback's
on_step_begin to on_step_end, the slowest rank), the CPU seconds of a step
(each rank's process, all its threads; median over steps and ranks: on a
shared machine wall time follows the others' load, CPU time much less), GRPO's generation
(TrainerMixin._generate_single_turn timed on each rank: for DeepSpeed it
includes its gather of the params for generation) as tokens/s summed over
ranks (tokens: completion tokens up to their end), peak RSS per rank
(ru_maxrss), the reference model's bytes per rank between its forwards
(a partitioned param's shard and any gathered copy kept, a plain one whole), start-up (process start
to the first step), losses. Then the
ratios zeroshard/DDP and zeroshard/DeepSpeed. With --rounds N every engine
runs N times, alternating (zeroshard, DDP, ..., zeroshard, DDP, ...), the
ratios taken within each round and summed up as their min, median and
max: on a shared machine one launch's ratio moves by +-15%. The last line is one JSON
object with everything. Nothing is asserted on time; an engine that cannot
run is reported with its error and the others go on.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_hf_trainer import ds_config, engine_optimizer, first_error_lines, git_commit, launch_env
from rss import peak_rss

T_START = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
ENGINES = ("zeroshard", "ddp", "deepspeed")
# zeroshard under `zsrun --restarts 1`: the trainer heals a lost rank in
# place (peer copies, torch.distributed over the engine), which costs its
# steady state; run only when named.
HEALING = "zeroshard-healing"
TRAINERS = ("grpo", "dpo")
# The trainer methods timed a step (TRL's own: generation and scoring of
# completions, the loss's forwards, the whole of a micro-batch's step with
# its backward), as "phases".
PHASES = {"grpo": ("_generate_single_turn", "_generate_and_score_completions", "compute_loss", "training_step"),
          "dpo": ("compute_loss", "training_step")}
VOCAB = 8192


# ---------------------------------------------------------------------------
# worker: one engine, one trainer, one rank (launched by zsrun)
# ---------------------------------------------------------------------------

def worker(args):
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    import transformers
    from datasets import Dataset
    if args.engine == "zeroshard":
        import zeroshard.hf
    import trl

    rank = int(os.environ.get("RANK", "0"))
    words = [f"w{i}" for i in range(VOCAB - 3)]
    path = os.path.join(args.out_dir, "policy")
    done = os.path.join(path, "done")
    if rank == 0 and not os.path.exists(done):
        from tokenizers import Tokenizer, models, pre_tokenizers
        vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=1,
            tie_word_embeddings=False))
        model.save_pretrained(path)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                             unk_token="<unk>").save_pretrained(path)
        open(done, "w").close()
    while not os.path.exists(done):
        time.sleep(0.1)

    g = torch.Generator().manual_seed(0)

    def sentence(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    common = dict(output_dir=os.path.join(args.out_dir, f"{args.trainer}-{args.engine}"),
                  per_device_train_batch_size=4, learning_rate=1e-5, max_steps=args.steps, logging_steps=1,
                  report_to=[], seed=0, use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False,
                  ddp_backend="gloo")
    if args.engine != "ddp":
        common["deepspeed"] = args.ds_config
    if args.trainer == "grpo":
        data = Dataset.from_list([{"prompt": sentence(16)} for _ in range(64)])

        def reward(completions, **_):
            return [float(c.count("w7")) for c in completions]
        cls = trl.GRPOTrainer
        kwargs = dict(reward_funcs=reward, args=trl.GRPOConfig(**common, num_generations=4, beta=0.04,
                                                                max_completion_length=args.completion))
    else:
        data = Dataset.from_list([{"prompt": sentence(16), "chosen": sentence(12), "rejected": sentence(20)}
                                  for _ in range(64)])
        cls = trl.DPOTrainer
        kwargs = dict(args=trl.DPOConfig(**common, max_length=128))
    if args.engine == "zeroshard":
        cls = zeroshard.hf.trainer_class(cls)
    trainer = cls(model=path, train_dataset=data, **kwargs)

    marks = {"begin": [], "end": [], "cpu_begin": [], "cpu_end": []}

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.perf_counter())
            marks["cpu_begin"].append(time.process_time())  # every thread of this process

        def on_step_end(self, *a, **k):
            marks["end"].append(time.perf_counter())
            marks["cpu_end"].append(time.process_time())

    trainer.add_callback(Clock())
    generation = []
    if args.trainer == "grpo":
        generate = trainer._generate_single_turn

        def timed(*a, **k):
            t = time.perf_counter()
            out = generate(*a, **k)
            generation.append((time.perf_counter() - t, sum(len(c) for c in out[0])))
            return out
        trainer._generate_single_turn = timed
    # Seconds a step in each of the trainer's own methods (nested ones
    # counted in their caller too): where one engine's step differs.
    phases = {}

    def clocked(name):
        inner = getattr(trainer, name)

        def run(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                phases.setdefault(name, {}).setdefault(len(marks["begin"]), 0.0)
                phases[name][len(marks["begin"])] += time.perf_counter() - t
        setattr(trainer, name, run)
    for name in PHASES[args.trainer]:
        clocked(name)
    trainer.train()
    steps = [e - b for b, e in zip(marks["begin"], marks["end"])]
    cpu_steps = [e - b for b, e in zip(marks["cpu_begin"], marks["cpu_end"])]
    ref = getattr(trainer, "ref_model", None)
    ref = getattr(ref, "module", ref)  # DeepSpeed's engine
    # The reference model's bytes this rank holds between its forwards: a
    # partitioned param's shard (zeroshard's and DeepSpeed's ds_tensor) and
    # its gathered copy if one is kept (zeroshard keeps a frozen model's
    # while it fits), a plain one whole: what .data's storage holds.
    ref_bytes = None if ref is None else sum(
        (p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor") else 0)
        + p.data.untyped_storage().nbytes() for p in ref.parameters())
    result = {"engine": args.engine, "trainer": args.trainer, "rank": rank,
              "startup_s": marks["begin"][0] - T_START, "steps_s": steps, "cpu_steps_s": cpu_steps,
              "generation": generation,
              "phases": {n: [v.get(i, 0.0) for i in range(1, len(steps) + 1)] for n, v in phases.items()},
              "peak_rss_bytes": peak_rss(), "ref_model_bytes": ref_bytes,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "params": sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters())}
    if args.engine == "zeroshard":
        # Where the engine's last step went: collectives' time and counts,
        # fetches the coordinator made on demand (counters since the start).
        from zeroshard import torch as zt
        eo = engine_optimizer(trainer.optimizer)
        if eo is not None:
            st = eo.step_stats()
            result["engine_last_step"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in st.items()
                                          if k != "size"}
        c = zt.get_context().coord_stats()
        result["coordinator"] = {k: c[k] for k in ("steps", "fetch_calls", "demand_fetches", "prefetches",
                                                   "blocked_waits", "reuse_hits")}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with open(os.path.join(args.out_dir, f"r-{args.engine}-{args.trainer}-{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0:  # every rank's result, once all have written theirs
        files = [os.path.join(args.out_dir, f"r-{args.engine}-{args.trainer}-{r}.json") for r in range(world)]
        while not all(os.path.exists(f) for f in files):
            time.sleep(0.1)
        time.sleep(0.2)
        print(json.dumps({"engine": args.engine, "ranks": [json.load(open(f)) for f in files]}), flush=True)


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def launch(args, engine, trainer, config_path, out_dir):
    healing = engine == HEALING
    engine = "zeroshard" if healing else engine
    env = launch_env(args.ranks, engine, warnings="ignore")
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix"] + \
        (["--restarts", "1"] if healing else []) + ["--", sys.executable,
           str(Path(__file__).resolve()), "--worker", "--engine", engine, "--trainer", trainer,
           "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--completion", str(args.completion), "--ds-config", config_path, "--out-dir", out_dir]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    except subprocess.TimeoutExpired:
        return None, f"no result within --launch-timeout {args.launch_timeout} s"
    found = [line for line in out.stdout.splitlines() if line.startswith('{"engine"')]
    if not found:
        return None, f"exit status {out.returncode}: {first_error_lines(out.stdout + out.stderr)}"
    return json.loads(found[-1])["ranks"], None


def summarise(ranks):
    timed = [max(r["steps_s"][i] for r in ranks) for i in range(1, min(len(r["steps_s"]) for r in ranks))]
    # CPU seconds a step, each rank's process (all its threads), the median
    # over the timed steps and ranks: on a shared machine wall time follows
    # the others' load, CPU time much less.
    cpu = [r["cpu_steps_s"][i] for r in ranks for i in range(1, len(r["cpu_steps_s"]))]
    out = {"step_s": statistics.median(timed) if timed else None, "steps_s": timed,
           "cpu_step_s": statistics.median(cpu) if cpu else None,
           "startup_s": max(r["startup_s"] for r in ranks),
           "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
           "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
           "losses": ranks[0]["losses"], "params": ranks[0]["params"],
           "ref_model_bytes_per_rank": [r["ref_model_bytes"] for r in ranks]}
    if "engine_last_step" in ranks[0]:
        out["engine_last_step"] = ranks[0]["engine_last_step"]
        out["coordinator"] = ranks[0]["coordinator"]
    # Each timed step's seconds in a trainer method, the slowest rank; the median.
    out["phases"] = {name: statistics.median(max(r["phases"][name][i] for r in ranks)
                                             for i in range(1, len(ranks[0]["phases"][name])))
                     for name in ranks[0].get("phases", {}) if len(ranks[0]["phases"][name]) > 1}
    calls = [r["generation"][1:] for r in ranks]  # the first step's generation not timed
    if any(calls):
        seconds = [sum(t for t, _ in c) for c in calls]
        tokens = sum(n for c in calls for _, n in c)
        out["generation"] = {"tokens": tokens, "seconds_per_rank": seconds, "tokens_per_s": tokens / max(seconds)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--trainer", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--ds-config", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--engines", nargs="+", choices=ENGINES + (HEALING,), default=list(ENGINES))
    ap.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (the first not timed)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--completion", type=int, default=64, help="GRPO's max_completion_length")
    ap.add_argument("--zero-config", default="{}",
                    help="JSON merged into the config's zero_optimization (zeroshard's and DeepSpeed's), e.g. "
                         "'{\"stage3_module_granularity_threshold\": 250000}'")
    ap.add_argument("--launch-timeout", type=float, default=3600)
    ap.add_argument("--rounds", type=int, default=1,
                    help="launch every engine this many times, alternating; ratios' min/median/max over the rounds")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 2:
        ap.error("need --steps >= 2 (the first is not timed)")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: need at least 1")
    commit = git_commit()
    print(f"bench_trl: Llama hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, {args.ranks} ranks, fp32, "
          f"{args.steps} steps (1 warm-up), GRPO completions up to {args.completion} tokens; {os.cpu_count()} "
          f"cores; commit {commit}. Each engine and trainer in its own launch.", flush=True)
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="zs_bench_trl_") as scratch:
        config_path = os.path.join(scratch, "ds_zero3.json")
        config = ds_config(False)
        # TRL's prepare_deepspeed initialises the reference model's engine
        # where DeepSpeed's CPU accelerator counts a world of 1, so a
        # resolved train_batch_size fails its batch assertion ("8 != 4 * 1 *
        # 1"); left out, every engine derives it.
        config.pop("train_batch_size")
        config["zero_optimization"].update(json.loads(args.zero_config))
        with open(config_path, "w") as f:
            json.dump(config, f)
        rounds = [{} for _ in range(args.rounds)]
        for trainer in args.trainers:
            for n, engine in ((n, e) for n in range(args.rounds) for e in args.engines):
                ranks, why = launch(args, engine, trainer, config_path, scratch)
                key = f"{trainer}/{engine}"
                shown = key if args.rounds == 1 else f"{key}#{n + 1}"
                if ranks is None:
                    skipped[key] = why
                    print(f"{shown} could not run: {why}", flush=True)
                    continue
                rounds[n][key] = s = summarise(ranks)
                results.setdefault(key, s)  # the first round's
                gen = s.get("generation")
                print(f"{shown:16s} step {s['step_s']:.3f} s (CPU {s['cpu_step_s']:.2f} s/rank) | "
                      + (f"generation {gen['tokens_per_s']:.1f} tokens/s ({gen['tokens']} tokens) | " if gen else "")
                      + "peak RSS/rank " + "/".join(f"{b / MIB:.0f}" for b in s["peak_rss_bytes_per_rank"])
                      + " MiB | reference model/rank " + "/".join(
                          "-" if b is None else f"{b / MIB:.1f}" for b in s["ref_model_bytes_per_rank"])
                      + f" MiB | startup {s['startup_s']:.1f} s | losses "
                      + " ".join(f"{x:.5f}" for x in s["losses"]) + f" | {s['params'] / 1e6:.1f}M params",
                      flush=True)
                if s["phases"]:
                    print(f"{'':16s} a step's seconds in " + ", ".join(f"{n} {v:.3f}" for n, v in s["phases"].items()),
                          flush=True)
                if "engine_last_step" in s:
                    e, c = s["engine_last_step"], s["coordinator"]
                    print(f"{'':16s} engine's last step, rank 0: {e['gathers']} gathers {e['gather_seconds']:.3f} s, "
                          f"{e['reduce_scatters']} reduce-scatters {e['reduce_scatter_seconds']:.3f} s, "
                          f"wait {e['wait_seconds']:.3f} s, optimizer {e['optimizer_seconds']:.3f} s; since the "
                          f"start: {c['fetch_calls']} fetch calls, {c['demand_fetches']} on demand, "
                          f"{c['prefetches']} prefetches", flush=True)
    ratios = {}
    for trainer in args.trainers:
        for ours, other in (("zeroshard", "ddp"), ("zeroshard", "deepspeed"), (HEALING, "zeroshard")):
            per_round = [q for q in (ratio(r.get(f"{trainer}/{ours}"), r.get(f"{trainer}/{other}"))
                                     for r in rounds) if q is not None]
            if not per_round:
                continue
            # The median of each figure over the rounds (the one round's with --rounds 1).
            q = {k: statistics.median(p[k] for p in per_round) for k in per_round[0]}
            if len(per_round) > 1:
                q["rounds"] = per_round
                for k in ("step_s", "cpu_step_s"):
                    q[f"{k}_min"], q[f"{k}_max"] = min(p[k] for p in per_round), max(p[k] for p in per_round)
            ratios[f"{trainer}/{ours}_over_{other}"] = q
            over = "" if len(per_round) == 1 else f" (median of {len(per_round)} rounds)"
            print(f"{trainer} {ours}/{other}{over}: step time x{q['step_s']:.3f}, CPU a step x{q['cpu_step_s']:.3f}, "
                  f"peak RSS x{q['peak_rss']:.3f}"
                  + (f", generation tokens/s x{q['generation_tokens_per_s']:.3f}" if "generation_tokens_per_s" in q
                     else ""), flush=True)
            if len(per_round) > 1:
                print(f"{'':16s} step time per round: " + ", ".join(f"x{p['step_s']:.3f}" for p in per_round)
                      + f" (min x{q['step_s_min']:.3f}, max x{q['step_s_max']:.3f})", flush=True)
    for key, why in skipped.items():
        print(f"{key}: did not run: {why.splitlines()[0]}")
    print(json.dumps({"bench": "trl", "commit": commit,
                      "settings": {"ranks": args.ranks, "steps": args.steps, "layers": args.layers,
                                   "hidden": args.hidden, "vocab": VOCAB, "completion": args.completion,
                                   "dtype": "fp32"},
                      "cores": os.cpu_count(), "ds_config": config, "results": results, "ratios": ratios,
                      "skipped": skipped, **({"rounds": rounds} if args.rounds > 1 else {})}))
    return 1 if any(k.endswith("/zeroshard") or k.endswith("/ddp") for k in skipped) else 0


def ratio(zs, other):
    """One round's ratios of `zs`'s figures to `other`'s (None when either
    did not run)."""
    if zs is None or other is None:
        return None
    q = {"step_s": zs["step_s"] / other["step_s"], "cpu_step_s": zs["cpu_step_s"] / other["cpu_step_s"],
         "peak_rss": zs["peak_rss_bytes"] / other["peak_rss_bytes"]}
    if "generation" in zs and "generation" in other:
        q["generation_tokens_per_s"] = zs["generation"]["tokens_per_s"] / other["generation"]["tokens_per_s"]
    return q


if __name__ == "__main__":
    sys.exit(main())
