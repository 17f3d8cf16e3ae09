"""One rank of the Accelerate healing test: a plain Accelerate script (its
only change the import of zeroshard.hf's Accelerator), launched by `zsrun
--restarts R`, which a rank may leave by SIGKILL in the middle of a step.

    ACCUMULATION=A python3 accelerate_heal_worker.py OUT EPOCHS [KILL ...]

KILL is RANK:STEP:WHERE: that rank SIGKILLs itself in optimizer step STEP
(counted from 0 over the run), WHERE "forward" (in its last micro-batch's
forward, from a forward pre-hook), "backward" (in its last micro-batch's
backward, from a gradient hook) or "update" (in the engine's optimizer
update: ZS_FAULT_POINT=update:RANK:STEP+1). Only a rank's first process
kills itself.

The loop counts its steps itself under `accelerator.sync_gradients`, and
with one micro-batch a step runs without `accelerator.accumulate`. The
loader shuffles (Accelerate synchronises its sampler's generator at each
epoch's start), the model has dropout and the scheduler steps every
step: a healed window must come back with the same batches, RNG and
learning rate. After each epoch an evaluation gathers a held-out loss (a
replacement runs those of the epochs it skips hollow). Each process
appends JSON lines to OUT.<rank>: per step taken (not skipped) its loss,
per epoch the evaluation's value; at the end its optimizer state's hash with its step
count and lr, rank 0 the consolidated params' hash. Each step's note also
holds its batch's sum, the live ranks and Accelerate's process index and
count (which follow a shrink and a regrow). $ZS_TEST_GROW_MARK, a path:
a process started to grow the world back (ZS_HEAL_JOIN=grow) creates it
before its Accelerator; a survivor of a shrink, after the step before its
epoch's last, waits for it and 3 s more (the joiner's request posted), so
that the world grows back in the epoch's last step and the rank that
comes back takes part in the evaluation after it. $ZS_TEST_STREAM=1: the
same samples in order as an IterableDataset (no shuffle) under
DataLoaderConfiguration(dispatch_batches=False), each rank reading the
stream for its own slice.
"""
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import DataLoaderConfiguration
from accelerate.utils import set_seed
from zeroshard.hf import Accelerator
import zeroshard.torch as zt

from heal_worker import DIM, Net, kills_and_notes, note_end  # the healing_loop test's model
from launch_env import exit_without_teardown

CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2000,
                                "stage3_param_persistence_threshold": 0}}
SAMPLES, BATCH = 60, 4  # 60 samples over 3 ranks: 5 batches a rank an epoch


def main():
    out, epochs = sys.argv[1], int(sys.argv[2])
    accumulation = int(os.environ.get("ACCUMULATION", "1"))
    rank = int(os.environ["RANK"])
    mine, note = kills_and_notes(out, rank, sys.argv[3:])
    mark = os.environ.get("ZS_TEST_GROW_MARK")
    if mark and os.environ.get("ZS_HEAL_JOIN") == "grow":
        open(mark, "w").close()

    stream = os.environ.get("ZS_TEST_STREAM") == "1"
    # Accelerate would dispatch a stream's batches from rank 0 (no heal).
    extra = {"dataloader_config": DataLoaderConfiguration(dispatch_batches=False)} if stream else {}
    accelerator = Accelerator(zeroshard_config=CONFIG, gradient_accumulation_steps=accumulation, cpu=True, **extra)
    set_seed(0)
    model = Net()
    data = TensorDataset(torch.randn(SAMPLES, DIM, generator=torch.Generator().manual_seed(7)))
    if stream:
        rows = data

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (rows[i] for i in range(len(rows)))

        loader = DataLoader(Stream(), batch_size=BATCH)
    else:
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    held_out = DataLoader(TensorDataset(torch.randn(12, DIM, generator=torch.Generator().manual_seed(8))),
                          batch_size=BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    model, opt, loader, held_out, sched = accelerator.prepare(model, opt, loader, held_out, sched)
    accelerator.wait_for_everyone()
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in data parallelism

    engine = opt.optimizer._engine
    ctx = zt.get_context()
    micro = [0]  # micro-batches since the last step taken (for the "begin" notes)

    def at(where):
        # The last micro-batch of the step a kill names (the one that syncs).
        return (engine.steps, where) in mine and accelerator.sync_gradients

    def on_hidden(grad):
        if at("backward"):
            note(event="kill", step=engine.steps, t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    def before_hidden(module, inputs):
        if module.training and at("forward"):
            note(event="kill", step=engine.steps, t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    model.on_hidden = on_hidden
    model.hidden.register_forward_pre_hook(before_hidden)

    completed = 0  # the script's own count, as Accelerate's examples keep it

    def train(x):
        step = engine.steps
        if micro[0] == 0:
            note(event="begin", step=step, t=time.time())
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        return step, loss

    for epoch in range(epochs):
        model.train()
        for (x,) in loader:
            if accumulation == 1:  # as scripts without accumulation write it
                step, loss = train(x)
            else:
                with accelerator.accumulate(model):
                    step, loss = train(x)
            micro[0] += 1
            if accelerator.sync_gradients:  # a step taken (a heal's skipped one reads as none)
                micro[0] = 0
                completed += 1
                live = list(ctx.live_ranks)
                note(event="step", step=step, loss=loss.item(), lr=sched.get_last_lr()[0], epoch=epoch,
                     completed=completed, batch=x.sum().item(), live=live,
                     processes=[accelerator.process_index, accelerator.num_processes],
                     norm_batches=int(accelerator.unwrap_model(model).norm.num_batches_tracked), t=time.time())
                if mark and len(live) < ctx.world_size and step % len(loader) == len(loader) - 2:
                    until = time.time() + 60
                    while not os.path.exists(mark) and time.time() < until:
                        time.sleep(0.05)
                    time.sleep(3)
        model.eval()
        total = 0.0
        with torch.no_grad():
            for (x,) in held_out:
                total += accelerator.gather(model(x).pow(2).mean().reshape(1)).sum().item()
        note(event="eval", epoch=epoch, value=total)
    note_end(note, rank, opt.optimizer, model, ran=engine.steps, completed=completed)
    zt.shutdown()


if __name__ == "__main__":
    main()
    exit_without_teardown()
