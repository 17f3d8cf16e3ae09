"""torchft healing a DDP replica group: the torchft side of the healing bench
(issue 60, "a lost rank heals from its peers' memory").

    .venv/bin/python bench/heal_torchft.py [--kills 3] [--seq 64] [--batch 1] [--seed 0]
        [--steps N] [--small] [--transport http|pg] [--heartbeat-timeout-ms 5000] [--stock-ddp]

What it measures. GPT-2 124M (transformers GPT2LMHeadModel, n_positions 256,
torch.manual_seed(0), fp32, CPU) trained with AdamW (lr 1e-4, weight_decay
0.01) by 3 replica groups of one process each: plain DDP replicas
(torchft.DistributedDataParallel) over torchft's reconfigurable Gloo process
group, coordinated by a torchft Manager per replica and a LighthouseServer (a
process of its own) with min_replicas 2, so that 2 survivors may go on.
Step k's batch: random token ids from torch.Generator().manual_seed(1000 + k),
shape (3 * batch, seq); replica r takes rows r*batch:(r+1)*batch, labels =
inputs. After a warmup, the steady step time (median interval between
full-quorum commits); then `kills` times: SIGKILL one replica (random victim,
random offset within a step, random.Random(seed)), restart it at once with
the same REPLICA_GROUP_ID, as torchelastic would, and let torchft heal it
from a live replica (the Manager's quorum + checkpoint transport: HTTP by
default, the Manager's own default; --transport pg sends it over the process
group as torchft's train_ddp.py example does). Per kill, seconds from the
kill to:
  to_survivors_next_commit_s     the first step a survivor commits afterwards
                                 (can be the step in flight, when the
                                 victim died after its gradients were reduced);
  to_survivors_reduced_commit_s  the first step committed by a 2-replica
                                 quorum (the survivors going on without it);
  replacement_start_s / _built_s the replacement's interpreter start and its
                                 model + Manager being ready;
  replacement_first_commit_s     its first commit (the step it healed in:
                                 torchft feeds it zero gradients there);
  to_full_quorum_commit_s        its first commit with 3 participants: healed
                                 and training again; the figure comparable to
                                 ours.
Each replica appends JSON lines (start, built, step / uncommitted) to a log
file that the driver follows.

What bounds torchft's figures here: the lighthouse forms no smaller quorum
while the victim's heartbeat is fresh (heartbeat_timeout_ms, 5 s by default),
nor admits the replacement before then (its replica id is new); a survivor
left blocked in the Gloo all-reduce on the other survivor is freed only when
that one's process group is reconfigured, up to the join timeout (10 s) later.
torchft 0.2.0's DistributedDataParallel crashes the survivors when a kill
lands in the all-reduce (see _fixed_ddp; --stock-ddp runs it as shipped).

Nothing is asserted on time; the last line printed standalone is one JSON
object. measure() is what bench/bench_heal.py calls; it returns a status
instead of failing when torchft is missing or does not work, never waits
unboundedly and kills every process it started.
"""
import time

_T0 = time.time()  # the replica's "start": before the heavy imports

import argparse
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

INSTALL = (".venv/bin/python -m pip install --no-deps torchft==0.2.0 "
           "opentelemetry-exporter-otlp-proto-http opentelemetry-sdk opentelemetry-api")
REPLICAS = 3
WARMUP = 3      # full-quorum commits before anything is timed
BETWEEN = 2     # full-quorum commits between kills


def _gpt2_config(small):
    from transformers import GPT2Config
    if small:
        return GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=50257, n_positions=256)
    return GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=256)


def _die_with_parent():
    """SIGKILL this process when the driver goes, even if the driver is
    SIGKILLed (PR_SET_PDEATHSIG = 1); the driver's pid comes in the environment."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    parent = int(os.environ["HEAL_TORCHFT_PARENT"])
    if os.getppid() != parent:
        sys.exit(1)
    return parent


def _lighthouse(a):
    # Its own process: its (Rust) log goes to a file, not the bench's stderr,
    # and nothing in the driver's process is configured by it.
    _die_with_parent()
    from torchft.coordination import LighthouseServer
    # min_replicas 2: two survivors may commit without the victim. join
    # timeout as torchft's README runs its lighthouse; heartbeat timeout:
    # torchft's default unless asked.
    lh = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS - 1, join_timeout_ms=10000,
                          quorum_tick_ms=100, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(lh.address(), flush=True)
    while True:
        time.sleep(3600)


# ----------------------------------------------------------------- replica --

def _fixed_ddp(base):
    """torchft.DistributedDataParallel with its comm hook made to survive a
    peer dying in the all-reduce. torchft 0.2.0's hook asserts `fut._fut`,
    which is None when the Gloo work failed (_ManagedWork.wait caught the
    error and reported it to the Manager): the survivors then crash in
    backward() with an AssertionError (--stock-ddp shows it). Once the Manager
    has errored, the later buckets get a _DummyWork whose plain Future has no
    `_fut` at all. Here a failed bucket comes back unreduced; the Manager knows
    of the error, so the step is not committed."""
    import torch

    class DDP(base):
        @staticmethod
        def _comm_hook(manager, bucket):
            work = manager.allreduce(bucket.buffer())
            ok = work.wait()
            fut = work.get_future()
            fut = getattr(fut, "_fut", fut)   # a _ManagedFuture's torch future, or _DummyWork's
            if ok and fut is not None:
                return fut
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
    return DDP


def _replica(a):
    gid = int(os.environ["REPLICA_GROUP_ID"])
    out = open(a.log, "a", buffering=1)

    def emit(ev, **kw):
        out.write(json.dumps({"ev": ev, "gid": gid, "pid": os.getpid(), **kw}) + "\n")

    emit("start", t=_T0)
    parent = _die_with_parent()

    from datetime import timedelta
    import torch
    from torch.distributed import TCPStore
    from transformers import GPT2LMHeadModel
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    torch.set_num_threads(1)

    cfg = _gpt2_config(a.small)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    # The replica group's store, as torchelastic's agent would host it
    # (MASTER_ADDR/PORT); the Manager only connects to it.
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    # Generous timeouts (the Manager's default is 60 s): a dead peer shows up
    # as a closed Gloo connection, and a survivor left waiting in the
    # all-reduce on the other survivor is freed when that one's process group
    # is reconfigured (within the lighthouse's join timeout); a replica's
    # backward or a heal may also lag by seconds, 3 processes on 2 cores here.
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    transport = None
    if a.transport == "pg":
        from torchft.checkpointing.pg_transport import PGTransport
        transport = PGTransport(pg, timeout=timedelta(seconds=120), device=torch.device("cpu"))
    # Built after the model: a Manager heartbeats from its creation, and a
    # heartbeating replica that has not asked for a quorum yet holds the
    # survivors' next quorum back (the lighthouse waits for stragglers).
    manager = Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=2, replica_id=f"heal_{gid}",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        # every replica starts from manual_seed(0): no step-0 sync needed
        init_sync=False, checkpoint_transport=transport,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60))
    ddp = (DistributedDataParallel if a.stock_ddp else _fixed_ddp(DistributedDataParallel))(manager, model)
    emit("built", t=time.time())

    while os.getppid() == parent:
        k = manager.current_step()
        g = torch.Generator().manual_seed(1000 + k)
        ids = torch.randint(0, cfg.vocab_size, (REPLICAS * a.batch, a.seq), generator=g)
        ids = ids[gid * a.batch:(gid + 1) * a.batch]
        # What torchft.Optimizer's zero_grad/step do, spelled out to see the vote.
        manager.start_quorum()
        opt.zero_grad()
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        committed = manager.should_commit()
        if committed:
            opt.step()
        emit("step" if committed else "uncommitted", step=manager.current_step(),
             loss=loss.item(), t=time.time(), participants=manager.num_participants(),
             participating=manager.is_participating())


# ------------------------------------------------------------------ driver --

class _Run:
    """The replicas, their logs and the records read from them so far."""

    def __init__(self, tmp, argv, deadline):
        self.tmp, self.argv, self.deadline = tmp, argv, deadline
        self.addr = None
        self.procs = {}   # "lighthouse" or gid -> Popen
        self.recs = []    # every record, in reading order
        self._off = {}

    def _spawn(self, name, args, env, stdout=None):
        err = open(os.path.join(self.tmp, f"{name}.err"), "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   HEAL_TORCHFT_PARENT=str(os.getpid()), **env)
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env,
                             stdout=stdout or err, stderr=err, stdin=subprocess.DEVNULL)
        err.close()
        return p

    def start_lighthouse(self, heartbeat_timeout_ms):
        p = self.procs["lighthouse"] = self._spawn(
            "lighthouse", ["--lighthouse", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)], {},
            stdout=subprocess.PIPE)
        ready, _, _ = select.select([p.stdout], [], [], 60)
        self.addr = p.stdout.readline().decode().strip() if ready else ""
        if not self.addr:
            raise RuntimeError(f"the lighthouse did not start: {self.err_tail('lighthouse')}")

    def start(self, gid):
        self.procs[gid] = self._spawn(
            f"replica{gid}", ["--replica", "--log", os.path.join(self.tmp, f"replica{gid}.jsonl"), *self.argv],
            {"REPLICA_GROUP_ID": str(gid), "NUM_REPLICA_GROUPS": str(REPLICAS),
             "TORCHFT_LIGHTHOUSE": self.addr})

    def kill(self, gid):
        p = self.procs[gid]
        t = time.time()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        return t

    def stop_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout:
                p.stdout.close()

    def poll(self):
        for gid, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{gid} exited with rc {p.returncode}: {self.err_tail(gid)}")
            if gid == "lighthouse":
                continue
            path = os.path.join(self.tmp, f"replica{gid}.jsonl")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self._off.get(gid, 0))
                data = f.read()
            whole = data[:data.rfind("\n") + 1]   # a line being written waits
            self._off[gid] = self._off.get(gid, 0) + len(whole.encode())
            self.recs += [json.loads(line) for line in whole.splitlines()]

    def err_tail(self, gid, n=1500):
        name = gid if gid == "lighthouse" else f"replica{gid}"
        try:
            with open(os.path.join(self.tmp, f"{name}.err"), "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        # torchft's Rust side logs every quorum at INFO: not what went wrong
        return "\n".join(line for line in text.splitlines() if "[INFO]" not in line)[-n:].strip()

    def wait(self, what, pred):
        """Poll the logs until pred(recs) gives something; bounded by the deadline."""
        while True:
            self.poll()
            got = pred(self.recs)
            if got is not None:
                return got
            if time.time() > self.deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.02)


def _full(recs, after=0.0, gid=None, pid=None):
    return [r for r in recs if r["ev"] == "step" and r["participants"] == REPLICAS and r["t"] > after
            and (gid is None or r["gid"] == gid) and (pid is None or r["pid"] == pid)]


def _s(x):
    return "never" if x is None else f"{x:.2f} s"


def _first(recs, cond):
    return next((r for r in recs if cond(r)), None)


def measure(kills=3, steps=None, seq=64, batch=1, seed=0, log=print, timeout_s=900,
            small=False, transport="http", heartbeat_timeout_ms=5000, stock_ddp=False):
    """Runs the scenario of the module docstring; returns a JSON-serialisable dict.
    steps: full-quorum commits timed for the steady step time (default 6)."""
    res = {"status": "ok", "torchft_version": None, "replicas": REPLICAS,
           "model": "gpt2-small-test" if small else "gpt2-124M", "seq": seq, "batch": batch,
           "seed": seed, "transport": transport, "heartbeat_timeout_ms": heartbeat_timeout_ms,
           "ddp_comm_hook": "torchft 0.2.0 as shipped" if stock_ddp else "fixed to survive a failed all-reduce",
           "steady_step_s": None, "kills": []}
    res.update({f"{s}_{k}": None for k in ("to_full_quorum_s", "to_survivors_next_commit_s",
                                           "to_survivors_reduced_commit_s") for s in ("median", "max")})
    try:
        import torchft  # noqa: F401  (what the replicas will need, torch included)
    except ImportError as e:
        res["status"] = f"torchft is not installed ({e}): {INSTALL}"
        return res
    from importlib.metadata import version
    res["torchft_version"] = version("torchft")
    steps = steps or 6
    rng = random.Random(seed)
    argv = ["--seq", str(seq), "--batch", str(batch), "--transport", transport] + (["--small"] if small else []) \
        + (["--stock-ddp"] if stock_ddp else [])
    tmp = tempfile.mkdtemp(prefix="heal_torchft_")
    t_begin = time.time()
    run = _Run(tmp, argv, t_begin + timeout_s)
    try:
        run.start_lighthouse(heartbeat_timeout_ms)
        for gid in range(REPLICAS):
            run.start(gid)
        log(f"torchft {res['torchft_version']}: 3 replicas of {res['model']} starting "
            f"(lighthouse {run.addr})")

        # Warmup, then the steady step time from replica 0's full-quorum commits.
        run.wait("warmup", lambda rs: True if len(_full(rs, gid=0)) >= WARMUP else None)
        t_warm = _full(run.recs, gid=0)[WARMUP - 1]["t"]
        ts = run.wait("steady steps",
                      lambda rs: (lambda f: [r["t"] for r in f] if len(f) >= steps + 1 else None)(
                          _full(rs, after=t_warm - 1e-9, gid=0)))
        res["steady_step_s"] = statistics.median(b - a for a, b in zip(ts, ts[1:]))
        log(f"warm after {t_warm - t_begin:.1f} s; steady step {res['steady_step_s']:.3f} s "
            f"(median of {steps} intervals)")

        for k in range(kills):
            victim, frac = rng.randrange(REPLICAS), rng.random()
            # A random time within a step: after a full-quorum commit of the victim.
            n0 = len(_full(run.recs, gid=victim))
            last = run.wait("a step to kill in", lambda rs: (lambda f: f[-1] if len(f) > n0 else None)(
                _full(rs, gid=victim)))
            offset = frac * res["steady_step_s"]
            time.sleep(max(0.0, last["t"] + offset - time.time()))
            old_pid = run.procs[victim].pid
            t_kill = run.kill(victim)
            run.start(victim)   # at once, as torchelastic would
            new_pid = run.procs[victim].pid
            surv = lambda r: r["gid"] != victim and r["t"] > t_kill
            full = run.wait("the replacement in a full quorum", lambda rs: (lambda f: f[0] if f else None)(
                _full(rs, t_kill, victim, new_pid)))
            nxt = run.wait("the survivors' next commit", lambda rs: _first(rs, lambda r: surv(r) and r["ev"] == "step"))
            # None if the survivors never went on without the replacement
            red = _first(run.recs, lambda r: surv(r) and r["ev"] == "step" and r["participants"] == REPLICAS - 1
                         and r["t"] <= full["t"] + 1.0)
            mine = [r for r in run.recs if r["pid"] == new_pid]
            ev = {e: _first(mine, lambda r, e=e: r["ev"] == e) for e in ("start", "built", "step")}
            kill = {
                "victim": victim, "offset_s": round(offset, 4),
                "to_survivors_next_commit_s": round(nxt["t"] - t_kill, 4),
                "to_survivors_reduced_commit_s": round(red["t"] - t_kill, 4) if red else None,
                "to_full_quorum_commit_s": round(full["t"] - t_kill, 4),
                "replacement_start_s": round(ev["start"]["t"] - t_kill, 4),
                "replacement_built_s": round(ev["built"]["t"] - t_kill, 4),
                "replacement_first_commit_s": round(ev["step"]["t"] - t_kill, 4),
                # steps a survivor ran in vain (its all-reduce failed, or too few replicas)
                "survivor_uncommitted_steps": max(sum(1 for r in run.recs if surv(r) and r["gid"] == g
                                                      and r["ev"] == "uncommitted" and r["t"] < full["t"])
                                                  for g in range(REPLICAS) if g != victim),
                "healed_at_step": ev["step"]["step"], "old_pid": old_pid, "new_pid": new_pid,
            }
            res["kills"].append(kill)
            log(f"kill {k + 1}/{kills}: replica {victim} at +{offset:.2f} s in a step; survivors commit "
                f"after {kill['to_survivors_next_commit_s']:.2f} s (without it: "
                f"{_s(kill['to_survivors_reduced_commit_s'])}); replacement started "
                f"{kill['replacement_start_s']:.2f} s, built {kill['replacement_built_s']:.2f} s, healed "
                f"{kill['replacement_first_commit_s']:.2f} s, full quorum "
                f"{kill['to_full_quorum_commit_s']:.2f} s")
            # Full-quorum commits with the replacement in before the next kill.
            run.wait("full-quorum steps after the heal",
                     lambda rs: True if len(_full(rs, t_kill, victim, new_pid)) >= BETWEEN else None)
    except Exception as e:
        res["status"] = f"{type(e).__name__}: {e}"
        if not isinstance(e, RuntimeError):   # what the processes said last
            res["status"] += "".join(f" | {g}: {t}" for g in run.procs if (t := run.err_tail(g, 400)))
    finally:
        run.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    for key, name in (("to_full_quorum_commit_s", "to_full_quorum_s"),
                      ("to_survivors_next_commit_s", "to_survivors_next_commit_s"),
                      ("to_survivors_reduced_commit_s", "to_survivors_reduced_commit_s")):
        vals = [kd[key] for kd in res["kills"] if kd[key] is not None]
        res[f"median_{name}"] = statistics.median(vals) if vals else None
        res[f"max_{name}"] = max(vals) if vals else None
    res["wall_s"] = round(time.time() - t_begin, 1)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="steady-state intervals timed (default 6)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a tiny GPT-2 (2 layers, n_embd 128) to develop with")
    ap.add_argument("--transport", choices=("http", "pg"), default="http")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--stock-ddp", action="store_true",
                    help="torchft.DistributedDataParallel's comm hook as shipped (survivors crash when a kill lands in the all-reduce)")
    ap.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.replica:
        return _replica(a)
    if a.lighthouse:
        return _lighthouse(a)
    r = measure(kills=a.kills, steps=a.steps, seq=a.seq, batch=a.batch, seed=a.seed,
                timeout_s=a.timeout_s, small=a.small, transport=a.transport,
                heartbeat_timeout_ms=a.heartbeat_timeout_ms, stock_ddp=a.stock_ddp)
    if r["status"] != "ok":
        print(f"status: {r['status']}")
    if r["kills"]:
        print(f"steady step {r['steady_step_s']:.3f} s; over {len(r['kills'])} kills, kill -> "
              f"full-quorum commit median {r['median_to_full_quorum_s']:.2f} s, max "
              f"{r['max_to_full_quorum_s']:.2f} s ({r['median_to_full_quorum_s'] / r['steady_step_s']:.1f} "
              f"steady steps); kill -> survivors' next commit median "
              f"{r['median_to_survivors_next_commit_s']:.2f} s, max {r['max_to_survivors_next_commit_s']:.2f} s")
    print(json.dumps({"bench": "heal_torchft", **r}), flush=True)


if __name__ == "__main__":
    main()
