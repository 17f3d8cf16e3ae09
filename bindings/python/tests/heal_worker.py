"""One rank of the healing tests: a plain zeroshard.torch loop under
healing_loop, launched by `zsrun --restarts R`, which a rank may leave by
SIGKILL in the middle of a step.

    python3 heal_worker.py OUT STEPS [KILL ...]

KILL is RANK:STEP:WHERE: that rank SIGKILLs itself in step STEP, WHERE
"backward" (in the middle of the backward, from a gradient hook) or
"update" (in the engine's optimizer update, through the engine's fault
point ZS_FAULT_POINT=update:RANK:STEP+1); for workers that save,
"save": in its STEP-th checkpoint save, its shards written, before rank 0
hears of them (ZS_FAULT_POINT=save:RANK:STEP). Only the first process of a rank
kills itself: its replacement (ZS_HEAL_REPLACEMENT set) runs on, and so does
a job zsrun restarted whole.

Each step draws its batch from a generator seeded with the step, and the
model has dropout, so a redone step must restore the RNG to match; and a
BatchNorm, whose running statistics each rank keeps (unsharded, its own
batches'), so a redone step must start from them as they were and a
replacement must take its predecessor's. No
checkpoint directory. Each process appends JSON lines to OUT.<rank>: per
committed step its loss, pid and times; at the end a hash of its
optimizer state (masters and moments of its shards) with its step count,
a hash of its module buffers, and rank 0 the hash of the consolidated params.
"""
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import zeroshard.torch as zt
from zeroshard.torch.state import _raw_bytes
from launch_env import exit_without_teardown

CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2000,
                                "stage3_param_persistence_threshold": 0}}
DIM, BATCH = 16, 24


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, 48)
        self.drop = nn.Dropout(0.25)
        self.hidden = nn.Linear(48, 48)
        self.norm = nn.BatchNorm1d(48)
        self.out = nn.Linear(48, DIM)
        # The parent initialises its children's params, as Hugging Face's
        # post_init does: under Init these reads gather, except in a
        # replacement, whose survivors wait in the join (its values come
        # from there).
        with torch.no_grad():
            for layer in (self.inp, self.hidden, self.out):
                layer.weight.normal_(0.0, 0.2)
                layer.bias.zero_()

    def forward(self, x):
        h = self.drop(torch.relu(self.inp(x)))
        h = torch.relu(self.norm(self.hidden(h)))
        if self.training and self.on_hidden is not None:
            h.register_hook(self.on_hidden)
        return self.out(h)

    on_hidden = None


class Batches:
    """Step i's share of a global batch seeded with i: no global RNG."""

    def __init__(self, steps, rank, world):
        self.steps, self.rank, self.world = steps, rank, world

    def __iter__(self):
        per = BATCH // self.world
        for i in range(self.steps):
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(BATCH, DIM, generator=g)
            yield x[self.rank * per:(self.rank + 1) * per]


def kills_and_notes(out, rank, kills):
    """This process's kills among `kills` (RANK:STEP:WHERE) as a list of
    (STEP, WHERE), its "update" ones armed as the engine's fault point, and
    note(**kv), which appends a JSON line to OUT.<rank>."""
    replacement = os.environ.get("ZS_HEAL_REPLACEMENT", "") not in ("", "0")
    # A kill is one failure: not in a replacement, nor in a job zsrun
    # restarted whole (whose ZS_FAULT_POINT is not armed either).
    first = not replacement and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    mine = [(int(s), where) for r, s, where in (k.split(":") for k in kills) if int(r) == rank] if first else []
    for s, where in mine:
        if where == "update":
            os.environ["ZS_FAULT_POINT"] = f"update:{rank}:{s + 1}"
        if where == "update_first_of_two":  # two optimizers a step: the first's update in step s
            os.environ["ZS_FAULT_POINT"] = f"update:{rank}:{2 * s + 1}"
        if where == "save":  # STEP counts the process's checkpoint saves here
            os.environ["ZS_FAULT_POINT"] = f"save:{rank}:{s}"
    log = open(f"{out}.{rank}", "a")

    def note(**kv):
        log.write(json.dumps({"rank": rank, "pid": os.getpid(), **kv}) + "\n")
        log.flush()

    return mine, note


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    replacement = os.environ.get("ZS_HEAL_REPLACEMENT", "") not in ("", "0")
    mine, note = kills_and_notes(out, rank, sys.argv[3:])

    zt.enable_healing()
    with zt.Init(config=CONFIG):
        torch.manual_seed(0)
        model = Net()
    zt.partition_module(model)
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in data parallelism
    # ZS_TEST_TWO_OPTIMIZERS: the output layer under an SGD of its own,
    # stepped after the body's AdamW; "last" gives the loop that one,
    # "first" the body's.
    two = os.environ.get("ZS_TEST_TWO_OPTIMIZERS")
    head = list(model.out.parameters()) if two else []
    opt = zt.ZeroShardOptimizer([p for p in model.parameters() if all(p is not q for q in head)], lr=1e-2,
                                weight_decay=0.01)
    opt_head = zt.ZeroShardOptimizer(head, kind="sgd", lr=5e-2, momentum=0.9, weight_decay=0.0) if two else None
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    current = [None]

    def on_hidden(grad):
        if (current[0], "backward") in mine:
            note(event="kill", step=current[0], t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model.on_hidden = on_hidden

    def train_step(x):
        note(event="begin", step=current[0], t=time.time())
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if opt_head is not None:
            opt_head.step()
            opt_head.zero_grad()
        return loss.item()

    def after_step(i, loss):
        note(event="step", step=i, loss=loss, lr=opt.param_groups[0]["lr"], t=time.time())
        sched.step()
        if i + 1 < steps:
            current[0] = i + 1

    batches = Batches(steps, rank, world)
    current[0] = 0
    if replacement:  # it resumes where the survivors are: the loop tells after joining
        current[0] = None

    class Tracking:
        """The step a batch belongs to, for the kill hooks (the loop's own
        position is internal)."""

        def __iter__(self):
            for i, x in enumerate(batches):
                current[0] = i
                yield x

    ran = zt.healing_loop(Tracking(), train_step, after_step, shared={"sched": sched},
                          optimizer=opt_head if two == "last" else None)
    extra = {"head_digest": zt.training_digest(opt_head, model)[:2]} if two else {}
    note_end(note, rank, opt, model, ran=ran, **extra)
    zt.shutdown()


def note_end(note, rank, opt, model, **kv):
    """The end of a run: this rank's optimizer state hashed with its step
    count and lr, its buffers' hash, and on rank 0 the consolidated params'
    hash (collective)."""
    digest, taken, params = zt.training_digest(opt, model)
    if rank == 0:
        note(event="params", sha256=params)
    note(event="end", digest=digest, steps=taken, lr=opt.param_groups[0]["lr"], buffers=buffers_digest(model), **kv)


def buffers_digest(model):
    """sha256 of this rank's module buffers (BatchNorm's statistics: each
    rank's own, which no consolidation shows)."""
    h = hashlib.sha256()
    for name, b in model.named_buffers():
        h.update(name.encode())
        h.update(_raw_bytes(b))
    return h.hexdigest()


if __name__ == "__main__":
    main()
    exit_without_teardown()
