"""Hugging Face Trainer benchmark: one Trainer script trained through
zeroshard (zeroshard.hf.Trainer with TrainingArguments(deepspeed=<JSON>)),
DDP (transformers.Trainer, no deepspeed=) and DeepSpeed ZeRO-3
(transformers.Trainer with the same TrainingArguments(deepspeed=<JSON>),
DS_ACCELERATOR=cpu), in one run, each engine in its own zsrun launch of
--ranks ranks so that peak RSS figures do not mix.

    .venv/bin/python bench/bench_hf_trainer.py [--model-size base|small] [--ranks 2]
        [--steps 6] [--warmup 2] [--seq 128] [--batch 2] [--grad-accum 1]
        [--engines zeroshard ddp deepspeed] [--optimizer-section] [--zero-config JSON]

The script is the user's: a GPT-2 (GPT2LMHeadModel) built from a config
with random weights (torch.manual_seed(0): the same weights for every
engine; dropout 0), base: n_embd 768, 12 layers, 12 heads, vocab 50257,
n_positions 256 (123.8M params); small: n_embd 256, 2 layers, 4 heads
(14.5M, a quick check). Random token data (--seq tokens, labels = inputs),
per-device batch --batch, gradient accumulation --grad-accum, fp32,
max_steps = --steps, logging_steps=1, save_strategy "no", report_to [],
use_cpu=True, dataloader_drop_last=True, ddp_backend "gloo", AdamW (lr
1e-4, weight decay 0.01, clipping 1.0, linear schedule). The model is built
plainly (`GPT2LMHeadModel(config)`: a full copy on every rank) before the
Trainer, as in the Trainer tests; zeroshard partitions it when the Trainer
is made, DeepSpeed when train() initialises it. The DeepSpeed JSON is one
file, given to zeroshard and DeepSpeed alike: zero_optimization stage 3
with "auto"s for batch sizes, accumulation, clipping, bucket sizes and
bf16/fp16, the way users write it, and no "optimizer" section, so every
engine runs the TrainingArguments' optimizer (optim "adamw_torch_fused"):
DDP torch.optim.AdamW(fused=True); DeepSpeed the same AdamW as the Trainer's
client optimizer, inside DeepSpeedZeroOptimizer_Stage3 (it needs neither
"zero_allow_untested_optimizer" nor "zero_force_ds_cpu_optimizer": those
matter only with an optimizer ZeRO does not list, or with offload_optimizer);
zeroshard its engine's AdamW (ZeroShardOptimizer(kind="adamw")).
--optimizer-section adds {"optimizer": {"type": "AdamW", "params": "auto"s}}:
DeepSpeed then JIT-builds and runs its FusedAdam (CPU op). The first
DeepSpeed launch on a machine JIT-builds its CPU communication op
(deepspeed_shm_comm, about 40 s on 2 cores; cached in
~/.cache/torch_extensions), which counts in its start-up. Each engine runs
on cores / ranks kernel threads per rank (OMP_NUM_THREADS = ZS_NUM_THREADS,
unless set).

Per engine: samples/s over the steps after --warmup (a TrainerCallback
takes the time at each on_step_end; samples = timed steps x batch x ranks x
accumulation; the slowest rank's span); where each timed step's time went
(medians: from the previous step's end to on_step_begin: the batch and the
Trainer's logging; on_step_begin to on_pre_optimizer_step: forwards,
backwards and clipping, under DeepSpeed also its optimizer step, which runs
in the backward; on_pre_optimizer_step to on_optimizer_step:
optimizer.step(); then to on_step_end: scheduler and zero_grad); the CPU
seconds per timed step of each rank (all its threads) and the cores the
rest of the machine used meanwhile (/proc/stat less the ranks' own CPU):
on a shared machine wall time follows the others' load, CPU time much
less; start-up (process start to the first step's begin: imports, model
build, Trainer set-up); peak RSS per rank (ru_maxrss at the end) and the
max, with the RSS after the model build and after the Trainer's set-up;
every step's logged loss (the Trainer's mean over ranks) and the final one;
the optimizer each engine ran (its wrappers down to the one that steps).
Then ratios zeroshard/DDP and zeroshard/DeepSpeed (samples/s, peak RSS, CPU
per step, start-up) and how closely zeroshard's losses track DDP's and
DeepSpeed's (max relative difference; zeroshard.hf is tested equal to DDP
within 1e-5 in fp32). The last line is one JSON object with everything,
the settings and the commit. Nothing is asserted on time. An engine that
cannot run is reported (its exception and the first lines of its
traceback) and the others go on; the exit status is non-zero only when
zeroshard or DDP failed.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rss import peak_rss, rss_now


T_START = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
# fsdp2: transformers.Trainer with TrainingArguments(fsdp="full_shard auto_wrap",
# fsdp_config={"version": 2, ...}): Accelerate's FSDP2 plugin, fully_shard per
# GPT2Block (on this CPU machine through fsdp2_trainer_class: Accelerate alone
# would run it as DDP; the run fails if no param ends up a DTensor); fully_shard: the same arguments to zeroshard.hf.Trainer, which
# fully_shards with zeroshard.torch.fully_shard.
ENGINES = ("zeroshard", "ddp", "fsdp2", "fully_shard", "deepspeed")
FSDP2_ARGS = dict(fsdp="full_shard auto_wrap",
                  fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                               "reshard_after_forward": True})


def fsdp2_trainer_class(transformers):
    """transformers.Trainer under Accelerate's FSDP2 code on a CPU world.
    Accelerate takes FSDP on accelerators only: on CPUs it runs the world as
    MULTI_CPU with the plugin ignored, i.e. as DDP (what this bench's
    "fsdp2" measured before 2026-11-27). The distributed type and plugin are
    set as AcceleratorState sets them on a GPU; from there prepare
    (fully_shard per GPT2Block, then the root) is Accelerate's own."""
    import accelerate
    from accelerate.utils import DistributedType

    class FSDP2Trainer(transformers.Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            self.accelerator.state.distributed_type = DistributedType.FSDP
            accelerate.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = accelerate.FullyShardedDataParallelPlugin(
                **self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True
    return FSDP2Trainer


MODELS = {
    "base": dict(n_embd=768, n_layer=12, n_head=12),
    "small": dict(n_embd=256, n_layer=2, n_head=4),
}
VOCAB, POSITIONS = 50257, 256


def ds_config(optimizer_section):
    """The DeepSpeed JSON, as a user writes it for the Trainer."""
    config = {
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "steps_per_print": 1000000,
    }
    if optimizer_section:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
    return config


# ---------------------------------------------------------------------------
# worker: one engine, one rank (launched by zsrun)
# ---------------------------------------------------------------------------

def describe_optimizer(opt):
    """The chain of optimizer wrappers down to the one that steps, e.g.
    DeepSpeedOptimizerWrapper > DeepSpeedZeroOptimizer_Stage3 > AdamW(fused=True)
    (flags on the last one only: the wrappers share its param_groups)."""
    chain, seen = [], set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        chain.append(opt)
        opt = getattr(opt, "optimizer", None)
    names = [type(o).__name__ for o in chain]
    last = chain[-1] if chain else None
    groups = getattr(last, "param_groups", None)
    flags = [f"kind={last.kind!r}"] if getattr(last, "kind", None) else []
    if groups and isinstance(groups[0], dict):
        flags += [f"{k}={groups[0][k]}" for k in ("fused", "foreach") if groups[0].get(k) is not None]
    if flags:
        names[-1] += "(" + ", ".join(flags) + ")"
    return " > ".join(names)


def thread_sched_s():
    """(seconds on a core, seconds runnable but waiting for one) of the
    calling thread, from /proc/thread-self/schedstat; zeros where absent."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def machine_busy_s():
    """CPU seconds the whole machine has been busy (all processes, all
    cores) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def engine_optimizer(opt):
    """zeroshard's ZeroShardOptimizer under the Accelerate wrapper."""
    seen = set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if hasattr(opt, "step_stats"):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def worker(args):
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    import torch.distributed as dist
    import transformers
    if args.engine in ("zeroshard", "fully_shard"):
        import zeroshard.hf
        import zeroshard.torch as zt
        Trainer = zeroshard.hf.Trainer  # the one line that differs
    elif args.engine == "fsdp2":
        Trainer = fsdp2_trainer_class(transformers)
    else:
        Trainer = transformers.Trainer
    marks = {"imports": time.perf_counter() - T_START}
    rss = {"after_imports": rss_now()}

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seq, seed=0):
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Clock(transformers.TrainerCallback):
        """perf_counter at each step's begin, pre-optimizer, optimizer and end."""

        def __init__(self):
            self.t = {"begin": [], "pre_opt": [], "opt": [], "end": [], "cpu_end": [], "machine_end": [],
                      "main_sched_end": []}

        def on_step_begin(self, *a, **k):
            self.t["begin"].append(time.perf_counter())

        def on_pre_optimizer_step(self, *a, **k):
            self.t["pre_opt"].append(time.perf_counter())

        def on_optimizer_step(self, *a, **k):
            self.t["opt"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            self.t["end"].append(time.perf_counter())
            self.t["cpu_end"].append(time.process_time())  # every thread of this process
            self.t["machine_end"].append(machine_busy_s())
            self.t["main_sched_end"].append(thread_sched_s())  # the training loop's thread

    world = int(os.environ["WORLD_SIZE"])
    out_dir = os.path.join(args.out_dir, args.engine)
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, weight_decay=0.01, max_grad_norm=1.0, max_steps=args.steps,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
        use_cpu=True, dataloader_drop_last=True, disable_tqdm=True, ddp_backend="gloo",
        deepspeed=args.ds_config if args.engine in ("zeroshard", "deepspeed") else None,
        **(FSDP2_ARGS if args.engine in ("fsdp2", "fully_shard") else {}))
    marks["arguments"] = time.perf_counter() - T_START

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **MODELS[args.model_size]))
    nparams = sum(p.numel() for p in model.parameters())
    rss["after_model"] = rss_now()
    marks["model"] = time.perf_counter() - T_START

    clock = Clock()
    data = Tokens(args.steps * args.batch * world * args.grad_accum, args.seq)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[clock])
    rss["after_trainer"] = rss_now()
    marks["trainer"] = time.perf_counter() - T_START
    t0 = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - t0
    rss["after_train"] = rss_now()
    rank, world = dist.get_rank(), dist.get_world_size()

    t = clock.t
    n = len(t["end"])
    ends = t["end"]
    timed = ends[-1] - ends[args.warmup - 1] if n > args.warmup else float("nan")
    cpu = t["cpu_end"][-1] - t["cpu_end"][args.warmup - 1] if n > args.warmup else float("nan")
    busy = t["machine_end"][-1] - t["machine_end"][args.warmup - 1] if n > args.warmup else float("nan")
    # The training loop's thread over the timed steps: on a core, runnable
    # but waiting for a core (others' load), and the rest: blocked (on the
    # other rank's collectives, on the engine's own threads).
    main = None
    if n > args.warmup:
        (r1, w1), (r0, w0) = t["main_sched_end"][-1], t["main_sched_end"][args.warmup - 1]
        main = {"running_s": r1 - r0, "waiting_for_core_s": w1 - w0, "blocked_s": timed - (r1 - r0) - (w1 - w0)}
    phases = {"data_and_logging": [t["begin"][i] - ends[i - 1] for i in range(args.warmup, n)],
              "forward_backward": [t["pre_opt"][i] - t["begin"][i] for i in range(args.warmup, n)],
              "optimizer_step": [t["opt"][i] - t["pre_opt"][i] for i in range(args.warmup, n)],
              "scheduler_zero_grad": [ends[i] - t["opt"][i] for i in range(args.warmup, n)]}
    mine = {"rank": rank, "peak_rss_bytes": peak_rss(), "rss_bytes": rss, "timed_s": timed, "timed_cpu_s": cpu,
            "timed_machine_busy_s": busy, "timed_main_thread": main,
            "step_s": [ends[i] - (ends[i - 1] if i else t["begin"][0]) for i in range(n)],
            "phases_median_s": {k: statistics.median(v) if v else None for k, v in phases.items()},
            "startup_s": t["begin"][0] - T_START if t["begin"] else None,
            "marks_s": marks, "train_s": train_s, "train_runtime_s": result.metrics.get("train_runtime")}
    notes = {"optimizer": describe_optimizer(trainer.optimizer), "optim_arg": str(getattr(targs.optim, "value",
                                                                                          targs.optim))}
    if args.engine == "fsdp2":  # sharded by FSDP2, not run as DDP (fsdp2_trainer_class)
        params = list(trainer.model_wrapped.parameters())
        notes["fsdp2_sharded_params"] = sum(type(p).__name__ == "DTensor" for p in params)
        notes["params"] = len(params)
        if notes["fsdp2_sharded_params"] == 0:
            raise RuntimeError("fsdp2: no param is a DTensor: the Trainer did not run FSDP2")
    if args.engine in ("zeroshard", "fully_shard"):
        eo = engine_optimizer(trainer.optimizer)
        if eo is not None:
            st = eo.step_stats()
            notes["engine_last_step"] = {k: round(v, 4) for k, v in st.items() if isinstance(v, float)}
        m = zt.get_context().memory()
        notes["engine_memory_bytes"] = {k: v for k, v in m.items() if isinstance(v, int)}
    elif args.engine == "deepspeed":
        engine = getattr(trainer, "model_wrapped", None)
        notes["deepspeed_engine"] = type(engine).__name__
        notes["zero_stage"] = getattr(engine, "zero_optimization_stage", lambda: None)()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(json.dumps({"engine": args.engine, "params": nparams, "ranks": world, "steps_run": n,
                          "losses": losses, "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history
                                                           if "loss" in h],
                          "notes": notes, "per_rank": everyone}), flush=True)
    dist.barrier()
    if args.engine in ("zeroshard", "fully_shard"):
        zt.shutdown()
    # torch's Gloo worker thread can abort a finalising interpreter, and
    # DeepSpeed's CPU engine its teardown, once all is measured.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def first_error_lines(text, n=14):
    """The error in a failed launch's output: its last exception line, then
    the first lines of the first traceback (one rank's, the "[rankN]: "
    prefixes that torch adds taken off)."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in text.splitlines()]
    exc = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if start is None:
        block = lines[-n:]
    else:
        block = [lines[start]]
        for line in lines[start + 1:start + n]:
            if line.startswith("Traceback"):
                break
            block.append(line)
    head = exc[-1] if exc else (lines[-1] if lines else "no output")
    return head + "\n" + "\n".join(block)


def launch_env(ranks, engine, warnings="ignore::FutureWarning"):
    """The environment of one engine's zsrun launch of `ranks` ranks: a
    fresh job's (no enclosing launch's variables), the in-tree package and
    library, cores / ranks kernel threads per rank unless set, DeepSpeed on
    its CPU accelerator."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
              "ZS_LAUNCHER", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.setdefault("PYTHONWARNINGS", warnings)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("ZS_NUM_THREADS", env["OMP_NUM_THREADS"])
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def launch(args, engine, config_path, out_dir):
    env = launch_env(args.ranks, engine)
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix", "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine,
           "--model-size", args.model_size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seq", str(args.seq), "--batch", str(args.batch), "--grad-accum", str(args.grad_accum),
           "--lr", str(args.lr), "--ds-config", config_path, "--out-dir", out_dir]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             check=False, timeout=args.launch_timeout)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, f"no result within --launch-timeout {args.launch_timeout} s; output ended:\n" + \
            "\n".join(text.splitlines()[-10:])
    wall = time.perf_counter() - t0
    found = [line for line in out.stdout.splitlines() if line.startswith('{"engine"')]
    if not found:
        return None, f"exit status {out.returncode}: {first_error_lines(out.stdout + out.stderr)}"
    r = json.loads(found[-1])
    r["launch_wall_s"] = wall
    r["load_average_at_launch"] = load
    r["exit_status"] = out.returncode
    if out.returncode != 0:
        print(f"{engine} exited {out.returncode} after reporting; its output ended:\n"
              + "\n".join(out.stderr.splitlines()[-3:]), flush=True)
    return r, None


def summarise(args, r):
    pr = r["per_rank"]
    timed = max(p["timed_s"] for p in pr)  # the slowest rank's span
    samples = (args.steps - args.warmup) * args.batch * args.ranks * args.grad_accum
    # CPU the rest of the machine used while rank 0 timed its steps, in cores.
    others = (pr[0]["timed_machine_busy_s"] - sum(p["timed_cpu_s"] for p in pr)) / pr[0]["timed_s"]
    phases = {k: max(p["phases_median_s"][k] for p in pr) for k in pr[0]["phases_median_s"]}
    return {"samples_per_s": samples / timed, "timed_s": timed, "timed_samples": samples,
            "cpu_s_per_step_per_rank": [p["timed_cpu_s"] / (args.steps - args.warmup) for p in pr],
            "other_processes_cores": max(0.0, others),
            "main_thread_s_per_step": {k: max(p["timed_main_thread"][k] for p in pr) / (args.steps - args.warmup)
                                       for k in pr[0]["timed_main_thread"]}, "load_average_at_launch": r["load_average_at_launch"],
            "step_s_rank0": pr[0]["step_s"], "phases_median_s": phases,
            "startup_s": max(p["startup_s"] for p in pr), "launch_wall_s": r["launch_wall_s"],
            "marks_s_rank0": pr[0]["marks_s"], "train_s": max(p["train_s"] for p in pr),
            "peak_rss_bytes_per_rank": [p["peak_rss_bytes"] for p in pr],
            "peak_rss_bytes": max(p["peak_rss_bytes"] for p in pr),
            "rss_bytes_rank0": pr[0]["rss_bytes"],
            "rss_after_model_bytes": max(p["rss_bytes"]["after_model"] for p in pr),
            "rss_after_trainer_bytes": max(p["rss_bytes"]["after_trainer"] for p in pr),
            "losses": r["losses"], "final_loss": r["losses"][-1] if r["losses"] else None,
            "grad_norms": r["grad_norms"], "optimizer": r["notes"]["optimizer"], "notes": r["notes"],
            "params": r["params"], "steps_run": r["steps_run"], "exit_status": r["exit_status"]}


def loss_agreement(a, b):
    if not a or len(a) != len(b):
        return None
    return {"max_abs_diff": max(abs(x - y) for x, y in zip(a, b)),
            "max_rel_diff": max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))}


def git_commit():
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--ds-config", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--model-size", choices=sorted(MODELS), default="base")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps (max_steps)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--optimizer-section", action="store_true",
                    help='add an "optimizer" section (AdamW, "auto" params) to the DeepSpeed JSON')
    ap.add_argument("--launch-timeout", type=float, default=3600, help="seconds before a launch is given up")
    ap.add_argument("--zero-config", default="{}",
                    help="JSON merged into the config's zero_optimization (zeroshard's and DeepSpeed's), e.g. "
                         "'{\"stage3_module_granularity_threshold\": 1000000}'")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not 1 <= args.warmup < args.steps:
        ap.error("need 1 <= --warmup < --steps")
    if args.seq > POSITIONS:
        ap.error(f"--seq is at most n_positions = {POSITIONS}")

    commit = git_commit()
    config = ds_config(args.optimizer_section)
    config["zero_optimization"].update(json.loads(args.zero_config))
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.ranks)))
    print(f"bench_hf_trainer: GPT-2 {args.model_size} ({MODELS[args.model_size]}, vocab {VOCAB}), {args.ranks} "
          f"ranks, seq {args.seq}, batch {args.batch}/rank, accumulation {args.grad_accum}, {args.steps} steps "
          f"({args.warmup} warm-up), fp32, {threads} kernel thread(s) per rank, {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f}; commit {commit}. Each engine runs in its own launch.", flush=True)
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="zs_bench_hf_") as scratch:
        config_path = os.path.join(scratch, "ds_zero3.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        for engine in args.engines:
            r, why = launch(args, engine, config_path, scratch)
            if r is None:
                skipped[engine] = why
                print(f"{engine} could not run: {why}", flush=True)
                continue
            results[engine] = s = summarise(args, r)
            ph = s["phases_median_s"]
            per_step = s["timed_s"] / (args.steps - args.warmup)
            print(f"{engine:9s} {s['samples_per_s']:7.3f} samples/s | step {per_step:6.2f} s "
                  f"(fwd+bwd {ph['forward_backward']:.2f}, opt {ph['optimizer_step']:.2f}, data+log "
                  f"{ph['data_and_logging']:.2f}; CPU {max(s['cpu_s_per_step_per_rank']):.2f} s/rank; others "
                  f"{s['other_processes_cores']:.2f} cores) | startup {s['startup_s']:.1f} s | peak RSS/rank "
                  + " ".join(f"{b / MIB:.0f}" for b in s["peak_rss_bytes_per_rank"])
                  + f" MiB | final loss {s['final_loss']:.6f} | {s['optimizer']}", flush=True)

    print()
    names = [e for e in args.engines if e in results]
    if names:
        width = 14
        rows = [("params", lambda s: f"{s['params'] / 1e6:.1f}M"),
                ("samples/s", lambda s: f"{s['samples_per_s']:.3f}"),
                ("s/step (timed)", lambda s: f"{s['timed_s'] / (args.steps - args.warmup):.3f}"),
                ("  fwd+bwd+clip", lambda s: f"{s['phases_median_s']['forward_backward']:.3f}"),
                ("  optimizer", lambda s: f"{s['phases_median_s']['optimizer_step']:.3f}"),
                ("  sched+zero", lambda s: f"{s['phases_median_s']['scheduler_zero_grad']:.3f}"),
                ("  data+log", lambda s: f"{s['phases_median_s']['data_and_logging']:.3f}"),
                ("CPU s/step/rank", lambda s: "/".join(f"{c:.2f}" for c in s["cpu_s_per_step_per_rank"])),
                ("others' cores", lambda s: f"{s['other_processes_cores']:.2f}"),
                ("main thread s/step", lambda s: ""),
                ("  running", lambda s: f"{s['main_thread_s_per_step']['running_s']:.3f}"),
                ("  waiting core", lambda s: f"{s['main_thread_s_per_step']['waiting_for_core_s']:.3f}"),
                ("  blocked", lambda s: f"{s['main_thread_s_per_step']['blocked_s']:.3f}"),
                ("startup s", lambda s: f"{s['startup_s']:.1f}"),
                ("launch wall s", lambda s: f"{s['launch_wall_s']:.1f}"),
                ("RSS model MiB", lambda s: f"{s['rss_after_model_bytes'] / MIB:.0f}"),
                ("RSS trainer MiB", lambda s: f"{s['rss_after_trainer_bytes'] / MIB:.0f}"),
                ("peak RSS MiB", lambda s: "/".join(f"{b / MIB:.0f}" for b in s["peak_rss_bytes_per_rank"])),
                ("final loss", lambda s: f"{s['final_loss']:.6f}")]
        print(f"{'':18s}" + "".join(f"{e:>{width}s}" for e in names))
        for label, fmt in rows:
            print(f"{label:18s}" + "".join(f"{fmt(results[e]):>{width}s}" for e in names))
        steps = max(len(results[e]["losses"]) for e in names)
        for i in range(steps):
            print(f"{'loss step ' + str(i + 1):18s}" + "".join(
                f"{results[e]['losses'][i]:>{width}.6f}" if i < len(results[e]["losses"]) else f"{'-':>{width}s}"
                for e in names))
        for e in names:
            print(f"optimizer {e}: {results[e]['optimizer']}")
    ratios = {}
    zs = results.get("zeroshard")
    pairs = [("zeroshard", zs, other) for other in ("ddp", "fsdp2", "deepspeed")]
    pairs.append(("fully_shard", results.get("fully_shard"), "fsdp2"))
    for name, zs, other in pairs:
        o = results.get(other)
        if zs is None or o is None:
            continue
        ratios[f"{name}_over_{other}"] = q = {
            "samples_per_s": zs["samples_per_s"] / o["samples_per_s"],
            "peak_rss": zs["peak_rss_bytes"] / o["peak_rss_bytes"],
            "forward_backward": zs["phases_median_s"]["forward_backward"] / o["phases_median_s"]["forward_backward"],
            "cpu_s_per_step": max(zs["cpu_s_per_step_per_rank"]) / max(o["cpu_s_per_step_per_rank"]),
            "startup": zs["startup_s"] / o["startup_s"],
            "losses": loss_agreement(zs["losses"], o["losses"])}
        agree = q["losses"]
        print(f"{name}/{other}: samples/s x{q['samples_per_s']:.3f}, peak RSS x{q['peak_rss']:.3f}, "
              f"CPU s/step x{q['cpu_s_per_step']:.3f}, startup x{q['startup']:.2f}; losses "
              + (f"agree to {agree['max_rel_diff']:.2e} rel ({agree['max_abs_diff']:.2e} abs, worst of "
                 f"{len(zs['losses'])} steps)" if agree else "not comparable"), flush=True)
    for e, why in skipped.items():
        print(f"{e}: did not run: {why.splitlines()[0]}")
    print(json.dumps({"bench": "hf_trainer", "commit": commit,
                      "settings": {"model_size": args.model_size, "model": MODELS[args.model_size], "vocab": VOCAB,
                                   "n_positions": POSITIONS, "ranks": args.ranks, "steps": args.steps,
                                   "warmup": args.warmup, "seq": args.seq, "batch": args.batch,
                                   "grad_accum": args.grad_accum, "lr": args.lr, "dtype": "fp32",
                                   "optimizer_section": args.optimizer_section, "engines": args.engines,
                                   "threads_per_rank": int(threads)},
                      "cores": os.cpu_count(), "load_average_end": os.getloadavg()[0], "ds_config": config,
                      "results": results, "ratios": ratios, "skipped": skipped}))
    return 1 if any(e in skipped for e in ("zeroshard", "ddp")) else 0


if __name__ == "__main__":
    sys.exit(main())
