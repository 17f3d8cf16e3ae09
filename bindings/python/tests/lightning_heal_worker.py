"""One rank of the Lightning healing test: a plain Lightning fit with
ZeroShardStrategy, launched by `zsrun --restarts R`, which a rank may leave
by SIGKILL in the middle of a step. $ZS_TEST_SHRUNK_PAUSE_S: after each
batch taken on fewer ranks than were started (zsrun --shrink), sleep that
long.

    python3 lightning_heal_worker.py OUT STEPS [KILL ...]

KILL is RANK:STEP:WHERE as in heal_worker.py: "backward" (from a gradient
hook in the middle of the backward), "update" (the engine's fault point
in its optimizer update), "val" (in the validation after STEP steps) or
"save" (in its STEP-th checkpoint save: ModelCheckpoint's, at a
validation's end, with ZS_TEST_CHECKPOINTS=1).
Only a rank's first process kills itself. ZS_TEST_ACCUMULATE=K: K
micro-batches a step, "backward1" killing in the first one's backward
(outside the optimizer step), "backward" in the last. ZS_TEST_MANUAL=1:
manual optimization, the training_step stepping the optimizer and the
scheduler itself (the same numbers as automatic optimization's;
ZS_TEST_MANUAL=2: the output layer under an SGD of its own, stepped
after the body's AdamW in the same training_step, "update_first_of_two"
killing in the AdamW's update); with
ZS_TEST_ACCUMULATE=K as well, it steps them every K-th batch (gradients
accumulated by hand: Lightning's own accumulation is 1).

The fit runs 2 epochs of STEPS / 2 optimizer steps from a shuffled
DataLoader (Lightning gives it a DistributedSampler), the model of
heal_worker.py (dropout: a redone step must restore the RNG), AdamW with a
StepLR stepped every step, the loss logged on every batch and as the
epoch's mean, and a validation (its mean synced over the ranks) every 4
steps, after a sanity check. No checkpoint, no logger unless
ZS_TEST_CHECKPOINTS=1 (ZS_TEST_PERSISTENT=1: every param persistent).
Each process appends JSON lines to OUT.<rank>: each batch's start
(Lightning's batch progress totals) and end (its loss, the lr), each
validation's and epoch's logged mean, and at the end a hash of its
optimizer state with its step count, rank 0 the hash of the consolidated
params.
"""
import os
import signal
import sys
import time

import torch

import lightning.pytorch as pl

import zeroshard.lightning
import zeroshard.torch as zt
from heal_worker import BATCH, CONFIG, DIM, Net, buffers_digest, kills_and_notes
from launch_env import exit_without_teardown

ACCUMULATE = int(os.environ.get("ZS_TEST_ACCUMULATE", "1"))  # Trainer(accumulate_grad_batches)
MANUAL = os.environ.get("ZS_TEST_MANUAL") in ("1", "2")
TWO = os.environ.get("ZS_TEST_MANUAL") == "2"  # the output layer under an SGD of its own, stepped second


class Module(pl.LightningModule):
    def __init__(self, kills, note):
        super().__init__()
        self.net, self.kills, self.note = None, kills, note
        self.automatic_optimization = not MANUAL

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = Net()

    def training_step(self, batch, idx):
        step = self.global_step
        # With gradient accumulation, "backward" is the step's last
        # micro-batch (inside the optimizer step), "backward1" its first.
        where = "backward1" if ACCUMULATE > 1 and idx % ACCUMULATE == 0 else "backward"

        def on_hidden(grad):
            if (step, where) in self.kills:
                self.note(event="kill", step=step, t=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        self.net.on_hidden = on_hidden
        if MANUAL:
            opts = self.optimizers() if TWO else [self.optimizers()]
            if idx % ACCUMULATE == 0:
                for opt in opts:
                    opt.zero_grad()
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss, on_step=True, on_epoch=True)
        if MANUAL:
            self.manual_backward(loss)
            if idx % ACCUMULATE == ACCUMULATE - 1:
                for opt in opts:
                    opt.step()
                self.lr_schedulers().step()
        return loss

    def validation_step(self, batch, idx):
        if (self.global_step, "val") in self.kills and not self.trainer.sanity_checking:
            self.note(event="kill", step=self.global_step, t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        loss = self.net(batch[0]).pow(2).mean()
        self.log("val", loss, sync_dist=True)
        self.log("val_local", loss)  # this rank's own mean, for the test to redo the sync

    def on_fit_start(self):
        torch.manual_seed(100 + self.global_rank)  # dropout differs per rank, as in data parallelism

    def configure_optimizers(self):
        head = list(self.net.out.parameters()) if TWO else []
        opt = torch.optim.AdamW([p for p in self.parameters() if all(p is not q for q in head)], lr=1e-2,
                                weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        if TWO:
            return [opt, torch.optim.SGD(head, lr=5e-2, momentum=0.9)], [{"scheduler": sched, "interval": "step"}]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Notes(pl.Callback):
    def __init__(self, note):
        self.note = note

    def on_train_batch_start(self, trainer, module, batch, idx):
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        val = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
        self.note(event="begin", step=trainer.global_step, t=time.time(),
                  progress=[progress.ready, progress.started, progress.processed, progress.completed,
                            val.ready, val.started, val.processed, val.completed])

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else None  # {} after a hollow step
        live = zt.get_context().live_ranks
        self.note(event="step", step=trainer.global_step - 1, epoch=trainer.current_epoch, batch=idx,
                  loss=None if loss is None else loss.item(), lr=trainer.optimizers[0].param_groups[0]["lr"],
                  live=live, norm_batches=int(module.net.norm.num_batches_tracked), t=time.time())
        if len(live) < int(os.environ["WORLD_SIZE"]):
            time.sleep(float(os.environ.get("ZS_TEST_SHRUNK_PAUSE_S", "0")))  # for a rank left out to come back

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.note(event="val", step=trainer.global_step, loss=trainer.callback_metrics["val"].item(),
                      local=trainer.callback_metrics["val_local"].item(), live=zt.get_context().live_ranks,
                      t=time.time())

    def on_train_epoch_end(self, trainer, module):
        self.note(event="epoch", epoch=trainer.current_epoch, loss=trainer.callback_metrics["loss_epoch"].item(),
                  t=time.time())


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kills, note = kills_and_notes(out, rank, sys.argv[3:])

    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(steps // 2 * BATCH * ACCUMULATE, DIM, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH // world, shuffle=True)
    module = Module(set(kills), note)
    config = CONFIG
    if os.environ.get("ZS_TEST_PERSISTENT"):
        # Every param persistent: each optimizer step ends in their gather,
        # where a survivor learns of a rank lost after the step committed.
        config = {"zero_optimization": dict(CONFIG["zero_optimization"],
                                            stage3_param_persistence_threshold=100000)}
    strategy = zeroshard.lightning.ZeroShardStrategy(config=config)
    # ZS_TEST_CHECKPOINTS=1: Lightning's default logger (CSV here) and
    # ModelCheckpoint, under the job's folder.
    checkpoints = os.environ.get("ZS_TEST_CHECKPOINTS") == "1"
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, logger=checkpoints,
                         enable_checkpointing=checkpoints, default_root_dir=os.path.dirname(out),
                         enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=4 * ACCUMULATE, accumulate_grad_batches=1 if MANUAL else ACCUMULATE,
                         callbacks=[Notes(note)])
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2 * BATCH, DIM, generator=g)),
                                      batch_size=BATCH // world)
    trainer.fit(module, loader, val)
    opt = trainer.optimizers[0]
    digest, taken, params = zt.training_digest(opt, module)
    if rank == 0:
        note(event="params", sha256=params)
    extra = {"head_digest": zt.training_digest(trainer.optimizers[1], module)[:2]} if TWO else {}
    note(event="end", ran=trainer.global_step, digest=digest, steps=taken, lr=opt.param_groups[0]["lr"],
         buffers=buffers_digest(module), **extra)
    sys.stdout.flush()
    os._exit(0)  # past torch.distributed's teardown, as the other Lightning workers leave


if __name__ == "__main__":
    main()
    exit_without_teardown()
