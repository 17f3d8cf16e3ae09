"""One rank of the shrink-and-regrow test: heal_worker.py's plain
zeroshard.torch loop (dropout, a scheduler, healing_loop), run either in
place under `zsrun --restarts R --min-nproc M --shrink --regrow-after S`,
or as one leg of the checkpoint route it is compared with.

    python3 shrink_worker.py OUT heal KILL
    python3 shrink_worker.py OUT leg FIRST LAST DIR DATA_IDS

heal: KILL is RANK:STEP:backward (heal_worker.py). The survivors shrink
in memory, pause 100 ms a step until the rank left out comes back, and run
until three steps after it did (at least 6 steps in all); with
$ZS_TEST_END_AT=N, they run steps 0..N-1 and no more, without a pause. Each step's
JSON line has the live ranks after it.

With $ZS_TEST_JOIN_DELAY_S, a process started to grow the job back
(ZS_HEAL_JOIN=grow) waits that long before it makes its context.

leg: a plain loop over steps FIRST..LAST, loading DIR/ckpt (with each rank's
RNG and the scheduler) when FIRST > 0 and saving it after LAST: the
checkpoint route, each leg on as many ranks as the healed run had live.
DATA_IDS (comma-separated) is the world rank of the healed run whose data
each rank takes, as the survivors kept theirs (RANK's own, empty).

Both end with heal_worker.py's digests: this rank's optimizer state, its
step count, and on rank 0 the consolidated params. With
$ZS_TEST_TWO_OPTIMIZERS set, the output layer steps under an SGD of its
own after the body's AdamW (the loop's optimizer; its digest too).
"""
import hashlib
import os
import sys
import time

import torch

import zeroshard.torch as zt
from heal_worker import BATCH, CONFIG, DIM, Net, kills_and_notes, note_end
from launch_env import exit_without_teardown

WORLD = 3  # the healed run's world, whose shares of each global batch the ranks take
MIN_STEPS, AFTER_REGROW, MAX_STEPS = 6, 3, 300


def batch(step, data_rank):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, DIM, generator=g)
    per = BATCH // WORLD
    return x[data_rank * per:(data_rank + 1) * per]


def shards(model):
    """A hash of this rank's shards as a program sees them (DeepSpeed's
    `param.ds_tensor`, its offset and valid elements): laid out for the
    live ranks after a shrink or a regrow."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        z = p.zs.zparam
        h.update(f"{z.shard_offset}:{z.shard_valid}:".encode())
        h.update(p.ds_tensor.detach().numpy().tobytes())
    return h.hexdigest()


def main():
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    heal = mode == "heal"
    replacement = os.environ.get("ZS_HEAL_REPLACEMENT", "") not in ("", "0")
    if heal:
        mine, note = kills_and_notes(out, rank, sys.argv[3:])
        first, last, data_rank = 0, MAX_STEPS - 1, rank
        zt.enable_healing()
    else:
        first, last, ckpt = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        ids = [int(i) for i in sys.argv[6].split(",")] if sys.argv[6] else list(range(WORLD))
        data_rank = ids[rank]
        mine, note = kills_and_notes(out, data_rank, [])
    if heal and os.environ.get("ZS_HEAL_JOIN") == "grow":
        time.sleep(float(os.environ.get("ZS_TEST_JOIN_DELAY_S", "0")))
    with zt.Init(config=CONFIG):
        torch.manual_seed(0)
        model = Net()
    zt.partition_module(model)
    torch.manual_seed(100 + data_rank)  # dropout differs per rank
    # $ZS_TEST_TWO_OPTIMIZERS: the output layer under an SGD of its own,
    # stepped after the body's AdamW (a GAN's shape): the loop's optimizer.
    head = list(model.out.parameters()) if os.environ.get("ZS_TEST_TWO_OPTIMIZERS") else []
    opt = zt.ZeroShardOptimizer([p for p in model.parameters() if all(p is not q for q in head)], lr=1e-2,
                                weight_decay=0.01)
    opt_head = zt.ZeroShardOptimizer(head, kind="sgd", lr=5e-2, momentum=0.9, weight_decay=0.0) if head else None
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ctx = zt.get_context()
    if first > 0:
        if opt_head is not None:
            zt.load_checkpoint(f"{ckpt}/head", model.out, opt_head)
        client = zt.load_checkpoint(f"{ckpt}/ckpt", model, opt)
        sched.load_state_dict(client["sched"])
        if os.path.exists(f"{ckpt}/rng.{data_rank}.pt"):  # else as it starts (a rank that came back)
            torch.set_rng_state(torch.load(f"{ckpt}/rng.{data_rank}.pt"))
        note(event="loaded", step=first - 1, shards=shards(model))
    current, grown = [None], [None]

    def on_hidden(grad):
        if (current[0], "backward") in mine:
            note(event="kill", step=current[0], t=time.time())
            os.kill(os.getpid(), 9)
        return grad

    model.on_hidden = on_hidden

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if opt_head is not None:
            opt_head.step()
            opt_head.zero_grad()
        return loss.item()

    def after_step(i, loss):
        i += first  # the loop counts from its first batch
        live = ctx.live_ranks
        note(event="step", step=i, loss=loss, live=live, lr=opt.param_groups[0]["lr"], shards=shards(model),
             t=time.time())
        sched.step()
        # The first step on the grown world: after one on fewer ranks, or
        # (the rank that came back) the step before its first.
        if heal and grown[0] is None and len(live) == WORLD and (any(len(l) < WORLD for l in seen) or
                                                                  (not seen and replacement)):
            grown[0] = i + 1
        seen.append(live)
        if heal and len(live) < WORLD and not end_at:
            time.sleep(0.1)  # time for the rank left out to come back

    seen = []
    end_at = int(os.environ.get("ZS_TEST_END_AT", "0"))

    class Steps:
        def __iter__(self):
            i = first
            while i <= last and not (heal and i >= max(MIN_STEPS, (grown[0] or MAX_STEPS) + AFTER_REGROW)) and \
                    not (end_at and i >= end_at):
                current[0] = i
                yield batch(i, data_rank)
                i += 1

    ran = zt.healing_loop(Steps(), train_step, after_step, shared={"sched": sched}, optimizer=opt_head or opt)
    if not heal:
        zt.save_checkpoint(ckpt, model, opt, client_state={"sched": sched.state_dict()}, tag="ckpt", overwrite=True)
        if opt_head is not None:
            zt.save_checkpoint(ckpt, model.out, opt_head, tag="head", overwrite=True)
        torch.save(torch.get_rng_state(), f"{ckpt}/rng.{data_rank}.pt")
    kv = {"head": zt.training_digest(opt_head, model)[:2]} if opt_head is not None else {}
    note_end(note, rank, opt, model, ran=ran, **kv)
    zt.shutdown()


if __name__ == "__main__":
    main()
    exit_without_teardown()
