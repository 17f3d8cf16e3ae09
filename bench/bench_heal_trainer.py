"""Healing a Hugging Face Trainer script (issue 60's own scenario,
docs/healing.md section 3, step 5): a plain `zeroshard.hf.Trainer` script
on 3 CPU ranks of the real `zsrun`, loopback, a rank SIGKILLed after step
--kill-after of --steps, against today's restart.

    .venv/bin/python bench/bench_heal_trainer.py [--model-size small|base] [--steps 80]
        [--kill-after 60] [--seq 64] [--batch 1] [--grad-accum 2] [--save-steps 10]
        [--spare] [--pairs 1] [--skip steady heal restart checkpoint]

The script: GPT-2 from a config (bench_hf_trainer's sizes: base 124M,
small 14.5M; random weights from torch.manual_seed(0), dropout 0.1 as
GPT-2's config has it), random tokens (labels = inputs), per-device batch
--batch, --grad-accum micro-batches a step, AdamW (the engine's) lr 1e-4
with a linear schedule, logging every 10 steps, fp32. Scenarios, each its
own zsrun launch:

- **steady**: the run uninterrupted under `zsrun --restarts 1` (healing on:
  peer copies, torch.distributed over the engine) and `--no-heal` (neither:
  Gloo), alternating --pairs times: median step (rank 0's step ends, the
  first 3 left out), the overhead of healing on/off - 1, wall time. The
  first "on" run is the reference of the others.
- **heal**: rank 1 SIGKILLed once its step --kill-after ended (before its
  logging), `zsrun --restarts 1` (--spare: a warm spare takes its place):
  wall time lost against the reference, kill to the survivors' next step
  end, steps lost (none), and every rank's optimizer state and the
  consolidated params bitwise against the reference.
- **restart**: today's route with no checkpoint (the issue's "Measured"):
  `--no-heal`, every rank started again and the job from step 0: time
  lost, steps lost.
- **checkpoint**: `--no-heal` with `save_steps` --save-steps and the
  script resuming from its last checkpoint (get_last_checkpoint): time
  lost, steps lost, each save's time. Skipped with < 8 GB free.

On this 2-core machine 3 ranks share 2 cores (one kernel thread each):
read the differences and ratios. Nothing is asserted on time; the last line
is one JSON object with everything.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()
REPO = Path(__file__).resolve().parent.parent
RANKS = 3
LOG_EVERY = 10


# -- worker: one rank, the user's script plus what the bench reads --

def worker(args):
    import torch
    import transformers
    from transformers.trainer_utils import get_last_checkpoint

    import zeroshard.hf
    import zeroshard.torch as zt
    from bench_hf_trainer import MODELS, POSITIONS, VOCAB
    from bench_heal import state_digests

    rank = int(os.environ["RANK"])
    first = os.environ.get("ZS_HEAL_REPLACEMENT", "") in ("", "0") and \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    log = open(f"{args.out}.{rank}", "a")

    def note(event, **kv):
        log.write(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(), "event": event, **kv}) + "\n")
        log.flush()

    note("start", started=T_START)
    n = args.steps * args.batch * args.grad_accum * RANKS
    ids = torch.randint(0, VOCAB, (n, args.seq), generator=torch.Generator().manual_seed(0))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    out_dir = os.path.join(os.path.dirname(args.out), "out")
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0, max_steps=args.steps, lr_scheduler_type="linear",
        logging_steps=LOG_EVERY, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=[], seed=0, data_seed=0, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True,
        deepspeed={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, **MODELS[args.model_size]))

    class Notes(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            note("step", step=state.global_step)
            if first and rank == 1 and state.global_step == args.kill_after and args.kill:
                note("kill", step=state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_save(self, a, state, control, **kw):
            note("saved", step=state.global_step)

    trainer = zeroshard.hf.Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[Notes()])
    resume = get_last_checkpoint(out_dir) if args.save_steps and os.path.isdir(out_dir) else None
    note("train", resume=resume)
    trainer.train(resume_from_checkpoint=resume)
    digest, steps, params = state_digests(trainer.optimizer, trainer.model, rank)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    note("end", digest=digest, params=params, losses=losses, steps=steps)
    zt.shutdown()


# -- driver --

def launch(args, d, name, zsrun_flags, kill=False, save_steps=0, env=None):
    """One zsrun launch, waited for: (return code, wall seconds, events)."""
    from bench_heal import launch_env

    out = os.path.join(d, name, "log")
    os.makedirs(os.path.dirname(out))
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(RANKS), *zsrun_flags, "--", sys.executable,
           str(Path(__file__).resolve()), "--worker", "--out", out, "--steps", str(args.steps), "--seq",
           str(args.seq), "--batch", str(args.batch), "--grad-accum", str(args.grad_accum), "--model-size",
           args.model_size, "--kill-after", str(args.kill_after), "--save-steps", str(save_steps)]
    cmd += ["--kill"] if kill else []
    t0 = time.time()
    with open(out + ".zsrun", "w") as f:
        code = subprocess.run(cmd, env=launch_env(env or {}), stdout=f, stderr=subprocess.STDOUT, cwd=d,
                              timeout=args.launch_timeout).returncode
    wall = time.time() - t0
    events = []
    for r in range(RANKS):
        with open(f"{out}.{r}") as f:
            events += [json.loads(line) for line in f]
    if code != 0:
        with open(out + ".zsrun") as f:
            print(f"{name}: zsrun exited with {code}:\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
    return code, wall, events


def ends(events):
    return {e["rank"]: e for e in events if e["event"] == "end"}


def median_step(events, skip=3):
    t = [e["t"] for e in events if e["event"] == "step" and e["rank"] == 0]
    return statistics.median(b - a for a, b in zip(t[skip:], t[skip + 1:]))


def same_state(a, b):
    """Every rank's optimizer state and step count, the params and the
    logged losses equal."""
    ea, eb = ends(a), ends(b)
    return all((ea[r]["digest"], ea[r]["steps"]) == (eb[r]["digest"], eb[r]["steps"]) for r in range(RANKS)) and \
        ea[0]["params"] == eb[0]["params"] and ea[0]["losses"] == eb[0]["losses"]


def after_kill(events, args):
    """Kill to the survivors' next step end, and steps trained twice."""
    killed = min(e["t"] for e in events if e["event"] == "kill")
    nxt = [e["t"] for e in events if e["event"] == "step" and e["rank"] != 1 and e["step"] == args.kill_after + 1
           and e["t"] > killed]
    steps = [e["step"] for e in events if e["event"] == "step" and e["rank"] == 0]
    return (max(nxt) - killed if nxt else None), len(steps) - len(set(steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-size", choices=("small", "base"), default="small")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-after", type=int, default=60)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--spare", action="store_true", help="zsrun --spare for the heal")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], choices=("steady", "heal", "restart", "checkpoint"))
    ap.add_argument("--launch-timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        return worker(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    env = {"OMP_NUM_THREADS": "1", "ZS_NUM_THREADS": "1"}
    result = {"model_size": args.model_size, "steps": args.steps, "kill_after": args.kill_after, "ranks": RANKS,
              "seq": args.seq, "batch": args.batch, "grad_accum": args.grad_accum,
              "load_at_start": os.getloadavg()[0]}
    print(f"zeroshard.hf.Trainer, GPT-2 {args.model_size}, {RANKS} ranks, {args.steps} steps "
          f"({args.grad_accum} x {args.batch} x {args.seq} tokens a rank), load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="zs_bench_heal_trainer_") as d:
        code, wall, ref = launch(args, d, "reference", ["--restarts", "1"], env=env)
        if code != 0:
            sys.exit("the reference run failed")
        result["reference"] = {"wall_s": wall, "step_s": median_step(ref)}
        print(f"uninterrupted, healing on: {wall:.1f} s, median step {median_step(ref):.3f} s")
        if "steady" not in args.skip:
            on, off = [median_step(ref)], []
            for i in range(args.pairs):
                code, wall_off, ev = launch(args, d, f"off{i}", ["--restarts", "1", "--no-heal"], env=env)
                off.append(median_step(ev))
                if i + 1 < args.pairs:
                    on.append(median_step(launch(args, d, f"on{i}", ["--restarts", "1"], env=env)[2]))
            overhead = [a / b - 1 for a, b in zip(on, off)]
            result["steady"] = {"on_step_s": on, "off_step_s": off, "overhead": overhead, "off_wall_s": wall_off}
            print(f"steady step, healing on / off: " + ", ".join(
                f"{a:.3f} / {b:.3f} s ({o:+.1%})" for a, b, o in zip(on, off, overhead)))
        if "heal" not in args.skip:
            flags = ["--restarts", "1"] + (["--spare"] if args.spare else [])
            code, wall, ev = launch(args, d, "heal", flags, kill=True, env=env)
            gap, twice = after_kill(ev, args)
            result["heal"] = {"ok": code == 0, "wall_s": wall, "lost_s": wall - result["reference"]["wall_s"],
                              "kill_to_next_step_s": gap, "steps_lost": twice, "spare": args.spare,
                              "bitwise": code == 0 and same_state(ev, ref)}
            print(f"healed in place{' (warm spare)' if args.spare else ''}: {wall:.1f} s, "
                  f"+{result['heal']['lost_s']:.1f} s on the uninterrupted run; kill to the next step end "
                  f"{gap:.2f} s; steps lost {twice}; bitwise equal: {result['heal']['bitwise']}")
        if "restart" not in args.skip:
            code, wall, ev = launch(args, d, "restart", ["--restarts", "1", "--no-heal"], kill=True, env=env)
            gap, twice = after_kill(ev, args)
            result["restart"] = {"ok": code == 0, "wall_s": wall, "lost_s": wall - result["reference"]["wall_s"],
                                 "steps_lost": twice}
            print(f"restart, no checkpoint (today): {wall:.1f} s, +{wall - result['reference']['wall_s']:.1f} s; "
                  f"steps trained again {twice}")
        if "checkpoint" not in args.skip:
            free = shutil.disk_usage(d).free
            if free < 8 * 2 ** 30:
                print(f"checkpoint: skipped, {free / 2 ** 30:.1f} GB free under {d} (< 8 GB)")
            else:
                code, wall, ev = launch(args, d, "checkpoint", ["--restarts", "1", "--no-heal"], kill=True,
                                        save_steps=args.save_steps, env=env)
                gap, twice = after_kill(ev, args)
                result["checkpoint"] = {"ok": code == 0, "wall_s": wall, "save_steps": args.save_steps,
                                        "lost_s": wall - result["reference"]["wall_s"], "steps_lost": twice}
                print(f"restart from a checkpoint every {args.save_steps} steps: {wall:.1f} s, "
                      f"+{wall - result['reference']['wall_s']:.1f} s; steps trained again {twice}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
