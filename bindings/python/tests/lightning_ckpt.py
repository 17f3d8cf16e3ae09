"""Lightning checkpoints through ZeroShardStrategy on 2 CPU processes: a fit
of 2 epochs without a stop, and one stopped after epoch 1 (saved by
ModelCheckpoint into the engine's format) and resumed with
ckpt_path into a fresh model and trainer. Rank 0 prints the losses.

    python lightning_ckpt.py DIR
"""
import json
import os
import sys

import torch
import torch.nn as nn

import lightning.pytorch as pl

import zeroshard.lightning  # noqa: F401  registers strategy="zeroshard"
from launch_env import exit_without_teardown

SAMPLES, BATCH, RANKS = 192, 16, 2  # 6 steps per rank and epoch


class Regression(pl.LightningModule):
    def __init__(self, init_seed=None):
        super().__init__()
        self.net = None
        self.losses = []
        self.init_seed = init_seed

    def configure_model(self):
        if self.net is None:
            if self.init_seed is not None:
                torch.manual_seed(self.init_seed)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        return opt


def fit(epochs, init_seed=None, ckpt_path=None, save_to=None):
    pl.seed_everything(0, verbose=False)  # also the sampler's shuffling seed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model = Regression(init_seed)
    callbacks = []
    if save_to is not None:  # the engine's context lives as long as the fit: save within it
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=save_to, filename="epoch1", save_top_k=-1,
                                                      save_on_train_epoch_end=True))
    strategy = "zeroshard"
    if save_to is not None and os.environ.get("ZS_TEST_ASYNC_CHECKPOINT") == "1":
        from zeroshard.lightning import ZeroShardStrategy
        strategy = ZeroShardStrategy(async_checkpoint=True)  # written in the background, waited at the fit's end
    trainer = pl.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_epochs=epochs,
                         enable_progress_bar=False, enable_checkpointing=save_to is not None, logger=False,
                         enable_model_summary=False, use_distributed_sampler=True, callbacks=callbacks)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model


def main():
    d = sys.argv[1]
    trainer, whole = fit(2)
    trainer, first = fit(1, save_to=d)
    path = os.path.join(d, "epoch1.ckpt")
    trainer, resumed = fit(2, init_seed=1, ckpt_path=path)  # other initial weights: the load replaces them
    if trainer.global_rank == 0:
        files = sorted(os.listdir(os.path.join(path, "checkpoint")))
        print(json.dumps({"whole": whole.losses, "first": first.losses, "resumed": resumed.losses,
                          "epoch": trainer.current_epoch, "files": files,
                          "lr": trainer.optimizers[0].param_groups[0]["lr"]}), flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown()
