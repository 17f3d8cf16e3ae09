"""Healing benchmark (issue 60, docs/healing.md sections 6 and 7): GPT-2 124M
trained by a plain zeroshard.torch loop under `zeroshard.torch.healing_loop`
on 3 CPU ranks of the real `zsrun --restarts`, loopback.

    .venv/bin/python bench/bench_heal.py [--steps 46] [--kills 10] [--seq 64]
        [--batch 1] [--seed 0] [--small] [--pairs 1] [--ckpt-every 10] [--spare] [--warm-start]
        [--regrow-after 5] [--skip steady kills shrink checkpoint torchft]
        [--loop healing_loop|accelerate]

Scenarios, each its own zsrun launch of 3 ranks (GPT-2 124M, n_positions
256, built under zt.Init from torch.manual_seed(0): random weights, dropout
0.1 as GPT-2's config has it; AdamW lr 1e-4, weight decay 0.01, a linear LR
schedule handed to replacements as `shared`; step i's batch from a generator
seeded with 1000 + i, rank r its rows r*batch:(r+1)*batch, labels = inputs):

- **steady**: --steps steps with the peer copies on (`enable_healing()`)
  and off (ZS_HEAL=0), alternating --pairs times: the median step (from one
  committed step to the next on rank 0, the first 3 left out), the copies'
  overhead as on/off - 1, `peer_copies` of the memory report and peak RSS per
  rank, and, with the copies on, each rank's median share of its step that
  zs_step_stats gives the copy on the step's path and the replay on the
  copy's own thread (read per step, not from the noisy on/off difference).
  The first "on" run is also the reference of the kill run: the same steps
  uninterrupted.
- **kills**: one launch of --steps steps, `zsrun --restarts --kills+1`
  with zsstore serving the store (so rank 0 is replaced like any rank);
  with --spare, `zsrun --spare` too: a warm process replaces the lost rank
  (its "replacement started" is then before the kill: negative); with
  --warm-start, every launch under `zsrun --warm-start`: each rank and
  replacement is forked from one interpreter that imported the worker's
  modules (docs/launching.md), so a replacement starts with its imports done.
  After 3 committed steps the driver SIGKILLs a random rank (rank 0
  included) at a random time within a step (`random.Random(--seed)`), waits
  until the run is whole again, lets it commit two more steps, and kills
  again, --kills times. Per kill: the kill's offset into the victim's step;
  kill to the survivors' loss (their `recover()` entered: the heartbeat's
  limit), to the replacement's process start (zsrun's notice and exec), its
  model built (Python, torch and transformers imports, the model), its join
  (the heal's agreement and transfer) and kill to the next committed step:
  the first step the replacement trains, committed on every rank (a step
  whose update the kill hit was already committed; the replacement then
  trains the one after). Median and max over the kills (goal < 10 s).
  Correctness: each rank's optimizer state (masters and moments) and step
  count, and the consolidated params, bitwise against the reference.
- **shrink**: `zsrun --restarts 1 --min-nproc 2 --shrink --regrow-after
  S` (--regrow-after, 5): rank 1 SIGKILLed at a random point of a step
  after 3 committed steps; ranks 0 and 2 shrink in memory and go on (each
  its own share of the data: rank 1's is left out) until zsrun's new rank
  1 is taken back at a step. Kill to the loss seen, to the shrink done, to
  the next committed step; the step on 3 ranks, on 2, and after the
  regrow; the step the regrow came in and the engine's regrow time; the
  returning process's start to its model built, its join and its first
  committed step. The launch runs more than --steps steps where the run
  would otherwise end before the returning rank is back (the steady
  scenario's step time, about 30 s for the comeback). (Bit for bit against the checkpoint route:
  `test_healing_shrink.py`, on a small model.)
- **checkpoint**: today's route: `zsrun --restarts 1 --no-heal`, the loop
  saving a zeroshard checkpoint every --ckpt-every steps (zt.save_checkpoint,
  one tag overwritten) and resuming from it at start; rank 1 SIGKILLed
  mid-step 5 steps after a save. Kill to the killed step committed again,
  steps lost, each save's time. Skipped, saying so, with < 8 GB free.
- **--loop accelerate**: the steady and kills scenarios with the same
  model, data and schedule trained by a plain Accelerate script on
  `zeroshard.hf.Accelerator` (a prepared DataLoader, no wrapper): a loss
  makes the survivors run the rest of the step hollow, heal at its
  optimizer step and take its batch again.
- **torchft**: torchft healing a DDP replica group (3 replica groups of one
  process) of the same model, through `heal_torchft.measure` beside this file,
  if torchft is installed in the venv (else the line says it is not, and how
  to install it).

On this 2-core machine 3 ranks share 2 cores (OMP_NUM_THREADS=1 each:
cores / ranks, unless set):
read the ratios and the parts of a heal, not absolute step times. The last
line is one JSON object with everything.
"""
import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()  # the process's start, before the imports below (the replacement's start-up)

REPO = Path(__file__).resolve().parent.parent
RANKS = 3
# Heartbeat period and limit: the limit the Python healing test uses on this
# 2-core machine (0.6 s starved a live rank's heartbeat thread there).
HEAL_ENV = dict(ZS_HEARTBEAT_MS="100", ZS_HEARTBEAT_TIMEOUT_MS="1500")
CONFIG = {"zero_optimization": {"stage": 3}}


# -- worker: one rank (launched by zsrun) --

def worker(args):
    import torch
    from transformers import GPT2LMHeadModel

    import zeroshard.torch as zt
    from zeroshard.torch import heal as zheal

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rss import peak_rss

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    replacement = zheal.is_replacement()
    log = open(f"{args.out}.{rank}", "a")

    def note(event, **kv):
        log.write(json.dumps({"event": event, "rank": rank, "pid": os.getpid(), "t": time.time(),
                              "replacement": replacement, **kv}) + "\n")
        log.flush()

    note("start", t=T_START)
    # The survivors' side of a heal, timed: recover() is entered when the
    # loss surfaces, and returns once the replacement joined.
    recover, join = zheal.recover, zheal.join_as_replacement

    def timed_recover(*a, **k):
        note("lost")
        committed = recover(*a, **k)
        note("recovered", committed=committed)
        return committed

    def timed_join(*a, **k):
        committed = join(*a, **k)
        note("joined", committed=committed)
        return committed

    zheal.recover, zheal.join_as_replacement = timed_recover, timed_join
    if args.loop == "accelerate":
        return accelerate_worker(args, note, rank, world)
    if args.heal:
        zt.enable_healing()
    config = gpt2_config(args)
    with zt.Init(config=CONFIG):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    zt.partition_module(model)
    model.train()
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in data parallelism
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / (args.steps + 1)))
    note("built", rss=peak_rss())

    start = 0
    if args.ckpt_dir and os.path.exists(os.path.join(args.ckpt_dir, "latest")):
        client = zt.load_checkpoint(args.ckpt_dir, model, opt)
        start = client["position"]
        sched.load_state_dict(client["sched"])
        note("resumed", position=start)

    def batches():
        for i in range(start, args.steps):
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randint(0, config.vocab_size, (world * args.batch, args.seq), generator=g)
            yield i, x[rank * args.batch:(rank + 1) * args.batch]

    def train_step(batch):
        i, x = batch
        note("begin", step=i)
        loss = model(input_ids=x, labels=x).loss
        note("forward", step=i)
        loss.backward()
        note("backward", step=i)
        opt.step()
        opt.zero_grad()
        note("trained", step=i)
        return loss.item()

    def after_step(i, loss):
        i += start
        st = opt.step_stats()  # the peer copy's share of the step (0 with the copies off)
        note("step", step=i, loss=loss, lr=opt.param_groups[0]["lr"], step_s=st["step_seconds"],
             copy_s=st["peer_copy_seconds"], replay_s=st["replay_seconds"])
        sched.step()
        if args.ckpt_dir and (i + 1) % args.ckpt_every == 0:
            t0 = time.time()
            zt.save_checkpoint(args.ckpt_dir, model, opt, client_state={"position": i + 1,
                                                                         "sched": sched.state_dict()},
                               tag="state", overwrite=True)
            note("saved", step=i, seconds=time.time() - t0)

    zt.healing_loop(batches(), train_step, after_step, shared={"sched": sched})
    note_end(note, opt, model)


def note_end(note, opt, model):
    import zeroshard.torch as zt
    from rss import peak_rss

    report = zt.memory_report()
    peak = peak_rss()  # the training's: rank 0's consolidation below holds the whole model
    digest, steps, params = zt.training_digest(opt, model)
    note("end", digest=digest, steps=steps, params=params, peak_rss=peak,
         peer_copies=report["engine"].get("peer_copies", 0), engine_total=report["engine"]["total"])
    zt.shutdown()


def gpt2_config(args):
    from transformers import GPT2Config

    return GPT2Config(n_embd=128 if args.small else 768, n_layer=2 if args.small else 12,
                      n_head=4 if args.small else 12, vocab_size=50257, n_positions=256)


def accelerate_worker(args, note, rank, world):
    """--loop accelerate: the same model, data and schedule as a plain
    Accelerate script (zeroshard.hf.Accelerator, a prepared DataLoader:
    rank r's i-th batch is step i's rows r*batch:(r+1)*batch, as above),
    which heals with no wrapper (docs/healing.md, "Accelerate scripts")."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2LMHeadModel

    import zeroshard.torch as zt
    from zeroshard.hf import Accelerator
    from rss import peak_rss

    # Before the context: under zsrun --restarts (ZS_HEAL=auto) it keeps the
    # peer copies on; the "off" launches set ZS_HEAL=0.
    accelerator = Accelerator(zeroshard_config=CONFIG, cpu=True)
    config = gpt2_config(args)
    with zt.Init(config=CONFIG):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    data = torch.cat([torch.randint(0, config.vocab_size, (world * args.batch, args.seq),
                                    generator=torch.Generator().manual_seed(1000 + i)) for i in range(args.steps)])
    loader = DataLoader(TensorDataset(data), batch_size=args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    # Accelerate steps a prepared scheduler once per process a step.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / (world * (args.steps + 1))))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in data parallelism
    engine = opt.optimizer._engine
    note("built", rss=peak_rss())
    for (x,) in loader:
        i = engine.steps
        note("begin", step=i)
        loss = model(input_ids=x, labels=x).loss
        note("forward", step=i)
        accelerator.backward(loss)
        note("backward", step=i)
        opt.step()
        sched.step()
        opt.zero_grad()
        if not opt.step_was_skipped:  # a heal's skipped step comes again with the same batch
            note("trained", step=i)
            st = opt.optimizer.step_stats()
            note("step", step=i, loss=loss.item(), lr=opt.param_groups[0]["lr"], step_s=st["step_seconds"],
                 copy_s=st["peer_copy_seconds"], replay_s=st["replay_seconds"])
    note_end(note, opt.optimizer, model)


# -- driver --

def launch_env(extra):
    """The HF Trainer bench's fresh-job environment (the in-tree package and
    library, cores / ranks kernel threads per rank: one on this 2-core
    machine), without an enclosing job's healing variables, with this
    bench's heartbeat."""
    from bench_hf_trainer import launch_env as fresh_env

    env = fresh_env(RANKS, "zeroshard", warnings="ignore")
    for k in ("ZS_HEAL", "ZS_HEAL_REPLACEMENT"):
        env.pop(k, None)
    env.update(HEAL_ENV)
    env.update(extra)
    return env


class Run:
    """One zsrun launch of the worker, its per-rank logs read as they grow."""

    def __init__(self, args, d, name, zsrun_flags, worker_flags=(), env=None):
        self.out = os.path.join(d, name)
        warm = ["--warm-start"] if args.warm_start else []
        cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(RANKS), *warm, *zsrun_flags, "--", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--out", self.out, "--steps", str(args.steps),
               "--seq", str(args.seq), "--batch", str(args.batch), "--loop", args.loop, *worker_flags] + \
            (["--small"] if args.small else [])
        self.stderr = open(self.out + ".zsrun", "w")
        self.proc = subprocess.Popen(cmd, env=launch_env(env or {}), stdout=self.stderr, stderr=subprocess.STDOUT,
                                     cwd=d, start_new_session=True)
        self.deadline = time.time() + args.launch_timeout

    def events(self, rank=None):
        out = []
        for r in range(RANKS) if rank is None else (rank,):
            try:
                with open(f"{self.out}.{r}") as f:
                    out += [json.loads(line) for line in f if line.endswith("\n")]
            except FileNotFoundError:
                pass
        return out

    def wait_for(self, what, poll=0.05):
        """Polls the logs until what(events) is truthy; None if the launch
        ended or ran out of time first."""
        while time.time() < self.deadline:
            found = what(self.events())
            if found:
                return found
            if self.proc.poll() is not None:
                return what(self.events()) or None
            time.sleep(poll)
        return None

    def finish(self):
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
        self.stderr.close()
        return self.proc.returncode

    def kill(self):
        """Ends the launch, if it still runs (a bench that failed midway)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output_tail(self, lines=15):
        with open(self.out + ".zsrun") as f:
            return "".join(f.readlines()[-lines:])


def ends(events):
    """rank -> its last process's "end" event."""
    return {e["rank"]: e for e in events if e["event"] == "end"}


def step_times(events, skip=3):
    """Rank 0's intervals between committed steps, the first `skip` left out."""
    t = [e["t"] for e in events if e["event"] == "step" and e["rank"] == 0]
    return [b - a for a, b in zip(t[skip:], t[skip + 1:])]


def copy_shares(events, skip=3):
    """Each rank's median of what zs_step_stats says the peer copy took on
    the step's path and its replay on the copy's own thread, as fractions of
    the engine's step time (the first `skip` steps left out)."""
    out = {}
    for k in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["event"] == "step" and e["rank"] == k and "copy_s" in e][skip:]
        if mine:
            out[k] = (statistics.median(e["copy_s"] / e["step_s"] for e in mine),
                      statistics.median(e["replay_s"] / e["step_s"] for e in mine))
    return out


def steady(args, d):
    results = {"on": [], "off": []}
    for pair in range(args.pairs):
        for mode in ("on", "off"):
            flags = ["--heal"] if mode == "on" else []
            run = Run(args, d, f"steady_{mode}_{pair}", ["--restarts", "1"], flags,
                      env=None if mode == "on" else {"ZS_HEAL": "0"})
            code = run.finish()
            ev = run.events()
            e = ends(ev)
            if code != 0 or len(e) != RANKS:
                raise RuntimeError(f"steady ({mode}) launch failed, status {code}:\n{run.output_tail()}")
            steps = step_times(ev)
            r = {"median_step_s": statistics.median(steps), "steps_timed": len(steps),
                 "peak_rss_mib": [round(e[k]["peak_rss"] / 2**20) for k in range(RANKS)],
                 "peer_copies_mib": [round(e[k]["peer_copies"] / 2**20, 1) for k in range(RANKS)],
                 "engine_mib": [round(e[k]["engine_total"] / 2**20, 1) for k in range(RANKS)],
                 "digests": [e[k]["digest"] for k in range(RANKS)], "params": e[0]["params"],
                 "steps": [e[k]["steps"] for k in range(RANKS)]}
            shares = copy_shares(ev)
            r["copy_share"] = [round(shares[k][0], 4) for k in sorted(shares)]
            r["replay_share"] = [round(shares[k][1], 4) for k in sorted(shares)]
            results[mode].append(r)
            print(f"steady {mode:3} (pair {pair}): median step {r['median_step_s']:.3f} s over {len(steps)}, "
                  f"peak RSS {r['peak_rss_mib']} MiB, peer copies {r['peer_copies_mib']} MiB", flush=True)
            if mode == "on" and shares:
                print("  zs_step_stats, each rank's median share of its step: the copy on the step's path "
                      f"{', '.join(f'{x:.1%}' for x in r['copy_share'])}; the replay on the copy's thread "
                      f"{', '.join(f'{x:.1%}' for x in r['replay_share'])}", flush=True)
    ratios = [on["median_step_s"] / off["median_step_s"] for on, off in zip(results["on"], results["off"])]
    results["overhead"] = [round(x - 1, 4) for x in ratios]
    results["overhead_median"] = round(statistics.median(ratios) - 1, 4)
    same = all(on["digests"] == off["digests"] and on["params"] == off["params"]
               for on, off in zip(results["on"], results["off"]))
    results["on_equals_off_bitwise"] = same
    print(f"copies' overhead on the step: {', '.join(f'{x:+.1%}' for x in results['overhead'])} "
          f"(median {results['overhead_median']:+.1%}; goal <= 3%); the runs with and without copies "
          f"{'equal' if same else 'DIFFER'} bit for bit", flush=True)
    return results


def kills(args, d, reference):
    rng = random.Random(args.seed)
    run = Run(args, d, "kills", ["--restarts", str(args.kills + 1)] + (["--spare"] if args.spare else []),
              ["--heal"])
    out = []
    try:
        committed = run.wait_for(lambda ev: [e for e in ev if e["event"] == "step" and e["step"] >= 2])
        if not committed:
            raise RuntimeError(f"the kill run never reached step 2:\n{run.output_tail()}")
        for k in range(args.kills):
            ev = run.events()
            last = max(e["step"] for e in ev if e["event"] == "step")
            if last + 4 >= args.steps:
                print(f"kill {k}: only {args.steps - last - 1} steps left; no more kills (raise --steps)", flush=True)
                break
            victim = rng.randrange(RANKS)
            # The victim's current process, and a random point in a step.
            pid = [e for e in ev if e["event"] == "start" and e["rank"] == victim][-1]["pid"]
            typical = statistics.median(step_times(ev, skip=1) or [2.0])
            begin = run.wait_for(lambda ev: [e for e in ev if e["event"] == "begin" and e["rank"] == victim
                                             and e["step"] > last])
            if not begin:
                raise RuntimeError(f"kill {k}: rank {victim} did not begin step {last + 1}:\n{run.output_tail()}")
            time.sleep(rng.uniform(0, typical))
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            # The step the victim was in: its last begin before the kill.
            began = [e for e in run.events(victim) if e["event"] == "begin" and e["pid"] == pid and e["t"] < t_kill]
            in_flight, offset = began[-1]["step"], t_kill - began[-1]["t"]

            def healed(ev):
                # The replacement's first trained step, committed on every rank.
                mine = [e for e in ev if e["rank"] == victim and e["t"] > t_kill]
                trained = [e["step"] for e in mine if e["event"] == "trained"]
                if not trained:
                    return None
                done = [e for e in ev if e["event"] == "step" and e["step"] == trained[0] and e["t"] > t_kill]
                return done if len({e["rank"] for e in done}) == RANKS else None

            done = run.wait_for(healed)
            if not done:
                raise RuntimeError(f"kill {k} (rank {victim} in step {in_flight}) did not heal:\n"
                                   f"{run.output_tail()}")
            ev = run.events()
            after = [e for e in ev if e["t"] > t_kill]
            lost = [e["t"] for e in after if e["event"] == "lost"]
            recovered = [e["t"] for e in after if e["event"] == "recovered"]
            rep = {e["event"]: e["t"] for e in reversed(after) if e["rank"] == victim}
            r = {"victim": victim, "step": in_flight, "offset_s": round(offset, 3),
                 "offset_of_step": round(offset / typical, 2),
                 "to_loss_seen_s": round(min(lost) - t_kill, 3) if lost else None,
                 "to_replacement_start_s": round(rep["start"] - t_kill, 3),
                 "to_replacement_built_s": round(rep["built"] - t_kill, 3),
                 "to_joined_s": round(max(recovered + [rep["joined"]]) - t_kill, 3),
                 "to_next_committed_s": round(max(e["t"] for e in done) - t_kill, 3),
                 "redone": done[0]["step"] == in_flight}
            out.append(r)
            print(f"kill {k}: rank {victim} {r['offset_s']:.2f} s into step {in_flight} "
                  f"({r['offset_of_step']:.0%} of a step): loss seen {r['to_loss_seen_s']} s, replacement "
                  f"started {r['to_replacement_start_s']} s, built {r['to_replacement_built_s']} s, joined "
                  f"{r['to_joined_s']} s, next committed step ({done[0]['step']}, "
                  f"{'redone' if r['redone'] else 'the one after'}) {r['to_next_committed_s']} s", flush=True)
            settle = done[0]["step"] + 2
            run.wait_for(lambda ev: [e for e in ev if e["event"] == "step" and e["step"] >= settle])
        code = run.finish()
    finally:
        run.kill()
    ev = run.events()
    e = ends(ev)
    totals = [x["to_next_committed_s"] for x in out]
    result = {"kills": out, "exit_status": code, "median_to_next_committed_s": round(statistics.median(totals), 3) if totals
              else None, "max_to_next_committed_s": max(totals) if totals else None,
              "job_restarted": "starting the job again" in open(run.out + ".zsrun").read()}
    if reference is not None and len(e) == RANKS:
        result["bitwise_equal_to_uninterrupted"] = (
            [e[k]["digest"] for k in range(RANKS)] == reference["digests"] and e[0]["params"] == reference["params"]
            and [e[k]["steps"] for k in range(RANKS)] == reference["steps"])
    print(f"{len(out)} kills: kill to next committed step median {result['median_to_next_committed_s']} s, max "
          f"{result['max_to_next_committed_s']} s (goal < 10 s); exit status {code}, job restarted: "
          f"{result['job_restarted']}; bitwise equal to the uninterrupted run: "
          f"{result.get('bitwise_equal_to_uninterrupted', 'not compared')}", flush=True)
    return result


# Seconds from zsrun's start of the returning rank to its first step, at
# most, as the shrink scenario plans its length (GPT-2 124M: about 15 s).
COMEBACK_S = 30


def shrink_steps(args, typical):
    """Steps the shrink launch runs: --steps, or more when the run would end
    before the returning rank is taken back (3 steps before the kill, the
    regrow's wait and the comeback at `typical` seconds a step, 5 after);
    a returner that comes after the end is refused (exit 76) and the
    scenario has nothing to measure."""
    return max(args.steps, 3 + math.ceil((args.regrow_after + COMEBACK_S) / typical) + 5)


def shrink_and_regrow(args, d, typical=None):
    """zsrun --restarts 1 --min-nproc 2 --shrink --regrow-after S: rank 1
    SIGKILLed at a random point of a step after 3 committed steps; the two
    others shrink in memory and go on; S seconds later zsrun starts rank 1
    again, which the others take back at a step. `typical`: a step's
    seconds on 3 ranks (the steady scenario's), for the launch's length."""
    rng = random.Random(args.seed)
    steps = shrink_steps(args, typical or 2.0)
    run = Run(argparse.Namespace(**{**vars(args), "steps": steps}), d, "shrink",
              ["--restarts", "1", "--min-nproc", str(RANKS - 1), "--shrink", "--regrow-after",
               str(args.regrow_after)], ["--heal"])
    victim = 1
    try:
        if not run.wait_for(lambda ev: [e for e in ev if e["event"] == "step" and e["step"] >= 2]):
            raise RuntimeError(f"the shrink run never reached step 2:\n{run.output_tail()}")
        ev = run.events()
        last = max(e["step"] for e in ev if e["event"] == "step")
        pid = [e for e in ev if e["event"] == "start" and e["rank"] == victim][-1]["pid"]
        typical = statistics.median(step_times(ev, skip=1) or [2.0])
        if not run.wait_for(lambda ev: [e for e in ev if e["event"] == "begin" and e["rank"] == victim
                                        and e["step"] > last]):
            raise RuntimeError(f"rank {victim} did not begin step {last + 1}:\n{run.output_tail()}")
        time.sleep(rng.uniform(0, typical))
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        began = [e for e in run.events(victim) if e["event"] == "begin" and e["pid"] == pid and e["t"] < t_kill]
        in_flight = began[-1]["step"]

        def back(ev):  # the first step the rank that came back trained, committed on every rank
            trained = [e["step"] for e in ev if e["rank"] == victim and e["event"] == "trained" and e["t"] > t_kill]
            done = [e for e in ev if trained and e["event"] == "step" and e["step"] == trained[0]]
            return done if len({e["rank"] for e in done}) == RANKS else None

        done = run.wait_for(back)
        if not done:
            raise RuntimeError(f"rank {victim} did not come back:\n{run.output_tail()}")
        code = run.finish()
    finally:
        run.kill()
    ev = run.events()
    after = [e for e in ev if e["t"] > t_kill]
    recovered = [e for e in after if e["event"] == "recovered"]
    shrunk_steps = [e for e in after if e["event"] == "step" and e["rank"] == 0 and e["step"] >= in_flight]
    came = {e["event"]: e for e in after if e["rank"] == victim}
    regrow_step = came["joined"]["committed"] - 1  # the survivors' step the regrow came in
    t0 = [e for e in ev if e["event"] == "step" and e["rank"] == 0]
    by_step = {e["step"]: e["t"] for e in t0}

    def intervals(first, last):
        return [by_step[i] - by_step[i - 1] for i in range(first, last + 1) if i in by_step and i - 1 in by_step]

    log = open(run.out + ".zsrun").read()
    grew = [float(x) for x in __import__("re").findall(r"the world grew back to \d+ of \d+ ranks in ([0-9.]+) s", log)]
    r = {"steps": steps, "step_killed": in_flight, "exit_status": code,
         "job_restarted": "starting the job again" in log,
         "to_loss_seen_s": round(min(e["t"] for e in after if e["event"] == "lost") - t_kill, 3),
         "to_shrunk_s": round(max(e["t"] for e in recovered) - t_kill, 3) if recovered else None,
         "to_next_committed_s": round(shrunk_steps[0]["t"] - t_kill, 3) if shrunk_steps else None,
         "step_s_before": round(statistics.median(intervals(2, in_flight - 1) or [0]), 3),
         "step_s_shrunk": round(statistics.median(intervals(in_flight + 2, regrow_step - 1) or [0]), 3),
         "step_s_after": round(statistics.median(intervals(regrow_step + 2, max(by_step)) or [0]), 3),
         "regrow_step": regrow_step,
         "regrow_step_s": round(by_step[regrow_step] - by_step[regrow_step - 1], 3),
         "regrow_in_engine_s": grew[0] if grew else None,
         "comeback_start_to_built_s": round(came["built"]["t"] - came["start"]["t"], 3),
         "comeback_start_to_joined_s": round(came["joined"]["t"] - came["start"]["t"], 3),
         "comeback_start_to_first_committed_s": round(max(e["t"] for e in done) - came["start"]["t"], 3),
         "survivor_pids_kept": all(len({e["pid"] for e in ev if e["rank"] == k}) == 1 for k in range(RANKS)
                                   if k != victim)}
    print(f"shrink: rank {victim} killed in step {in_flight}: loss seen {r['to_loss_seen_s']} s, shrunk in memory "
          f"{r['to_shrunk_s']} s, next committed step (on {RANKS - 1} ranks) {r['to_next_committed_s']} s after the "
          f"kill; step {r['step_s_before']} s on {RANKS} ranks, {r['step_s_shrunk']} s on {RANKS - 1}", flush=True)
    print(f"regrow: rank {victim} started again {args.regrow_after} s after; built {r['comeback_start_to_built_s']} s, "
          f"joined {r['comeback_start_to_joined_s']} s, first step committed "
          f"{r['comeback_start_to_first_committed_s']} s after its start; the survivors' step {regrow_step} (the "
          f"regrow inside it) {r['regrow_step_s']} s, the engine's regrow {r['regrow_in_engine_s']} s; step "
          f"{r['step_s_after']} s after; exit status {code}, job restarted {r['job_restarted']}, survivors' pids kept "
          f"{r['survivor_pids_kept']}", flush=True)
    return r


def checkpoint_route(args, d):
    free = shutil.disk_usage(d).free
    if free < 8 * 2**30:
        print(f"checkpoint route skipped: {free / 2**30:.1f} GB free in {d}, it needs 8", flush=True)
        return {"skipped": f"{free / 2**30:.1f} GB free"}
    ckpt = os.path.join(d, "ckpt")
    run = Run(args, d, "ckpt", ["--restarts", "1", "--no-heal"],
              ["--ckpt-dir", ckpt, "--ckpt-every", str(args.ckpt_every)])
    target = args.ckpt_every + 5  # 5 steps after a save: the route loses them
    try:
        begin = run.wait_for(lambda ev: [e for e in ev if e["event"] == "begin" and e["rank"] == 1
                                         and e["step"] == target])
        if not begin:
            raise RuntimeError(f"the checkpoint run never began step {target}:\n{run.output_tail()}")
        ev = run.events()
        typical = statistics.median(step_times(ev, skip=1) or [2.0])
        time.sleep(typical / 2)
        t_kill = time.time()
        os.kill(begin[-1]["pid"], signal.SIGKILL)
        done = run.wait_for(lambda ev: [e for e in ev if e["event"] == "step" and e["step"] == target
                                        and e["t"] > t_kill and e["rank"] == 0])
        code = run.finish()
    finally:
        run.kill()
    ev = run.events()
    saves = [e["seconds"] for e in ev if e["event"] == "saved" and e["rank"] == 0]
    resumed = [e["position"] for e in ev if e["event"] == "resumed" and e["rank"] == 0]
    r = {"exit_status": code, "killed_in_step": target, "resumed_at_step": resumed[0] if resumed else None,
         "steps_lost": target - resumed[0] if resumed else None,
         "to_killed_step_committed_s": round(done[0]["t"] - t_kill, 3) if done else None,
         "save_s": [round(s, 2) for s in saves],
         "restarted": "starting the job again" in open(run.out + ".zsrun").read()}
    print(f"checkpoint route (save every {args.ckpt_every} steps, restart every rank): rank 1 killed in step "
          f"{target}, resumed at {r['resumed_at_step']} ({r['steps_lost']} steps lost), step {target} committed "
          f"again {r['to_killed_step_committed_s']} s after the kill; saves took {r['save_s']} s", flush=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return r


def _s(x):
    return "-" if x is None else f"{x:.2f} s"


def torchft(args):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import heal_torchft
    except ImportError as e:
        return {"status": f"bench/heal_torchft.py cannot be imported: {e}"}
    r = heal_torchft.measure(kills=min(args.kills, args.torchft_kills), seq=args.seq, batch=args.batch,
                             seed=args.seed, small=args.small)
    print(f"torchft: {r.get('status')}; kill to a full quorum's commit median "
          f"{_s(r.get('median_to_full_quorum_s'))}, max {_s(r.get('max_to_full_quorum_s'))} (its steady step "
          f"{_s(r.get('steady_step_s'))})", flush=True)
    return r


class _kept:
    def __init__(self, d):
        self.d = d

    def __enter__(self):
        return self.d

    def __exit__(self, *exc):
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--heal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=46)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="2 layers of 128: a quick check of the bench itself")
    p.add_argument("--pairs", type=int, default=1, help="alternating steady launches with and without copies")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--torchft-kills", type=int, default=3)
    p.add_argument("--spare", action="store_true",
                   help="the kill run under zsrun --spare: a warm process, its imports done, replaces the lost rank")
    p.add_argument("--warm-start", action="store_true",
                   help="every launch under zsrun --warm-start: ranks and replacements forked with imports done")
    p.add_argument("--regrow-after", type=float, default=5.0,
                   help="the shrink scenario: zsrun starts the lost rank again this long after the shrink")
    p.add_argument("--skip", nargs="*", default=[], choices=["steady", "kills", "shrink", "checkpoint", "torchft"])
    p.add_argument("--loop", choices=["healing_loop", "accelerate"], default="healing_loop",
                   help="the training loop: zeroshard.torch.healing_loop, or a plain Accelerate script on "
                        "zeroshard.hf.Accelerator (its steady and kills scenarios)")
    p.add_argument("--launch-timeout", type=float, default=1200)
    p.add_argument("--keep", help="write the launches' logs into this folder (kept) instead of a temporary one")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.loop == "accelerate":
        args.skip = sorted(set(args.skip) | {"shrink", "checkpoint", "torchft"})
        print("--loop accelerate: the steady and kills scenarios (a shrink is not built for Accelerate "
              "scripts; the checkpoint route and torchft do not depend on the loop)", flush=True)
    if "kills" not in args.skip and args.kills * 4 + 6 > args.steps:
        p.error(f"--steps {args.steps} is too few for --kills {args.kills} (a kill takes about 4 steps): "
                f"give at least {args.kills * 4 + 6}")
    print(f"GPT-2 {'small check' if args.small else '124M'}, {RANKS} ranks, {args.steps} steps, batch "
          f"{args.batch} x {args.seq} a rank, load average {os.getloadavg()[0]:.1f}", flush=True)
    result = {"bench": "heal", "model": "gpt2-small-check" if args.small else "gpt2-124M", "ranks": RANKS,
              "spare": args.spare, "warm_start": args.warm_start, "loop": args.loop,
              "steps": args.steps, "seq": args.seq, "batch": args.batch, "seed": args.seed,
              "load_average_at_start": os.getloadavg()[0]}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with (tempfile.TemporaryDirectory(prefix="zs_bench_heal_") if not args.keep else _kept(args.keep)) as d:
        if "steady" not in args.skip:
            result["steady"] = steady(args, d)
        if "kills" not in args.skip:
            reference = result["steady"]["on"][0] if "steady" in result else None
            result["heal"] = kills(args, d, reference)
        if "shrink" not in args.skip:
            typical = result["steady"]["on"][0]["median_step_s"] if "steady" in result else None
            result["shrink_and_regrow"] = shrink_and_regrow(args, d, typical)
        if "checkpoint" not in args.skip:
            result["checkpoint_route"] = checkpoint_route(args, d)
    if "torchft" not in args.skip:
        result["torchft"] = torchft(args)
    result["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
