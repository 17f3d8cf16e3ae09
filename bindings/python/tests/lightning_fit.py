"""Fit a small model with Lightning on 2 CPU processes, with zeroshard's
strategy or Lightning's own DDP; rank 0 prints the per-step losses as JSON.

    python3 lightning_fit.py zeroshard|ddp
"""
import json
import sys

import torch
import torch.nn as nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses = []

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def main():
    which = sys.argv[1]
    pl.seed_everything(0)
    x = torch.randn(256, 8)
    y = (x.sum(1, keepdim=True)).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    if which == "zeroshard":
        from zeroshard.lightning import ZeroShardStrategy
        strategy = ZeroShardStrategy(stage=3)
    else:
        strategy = "ddp"
    model = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                         enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         use_distributed_sampler=True)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        print(json.dumps({"losses": model.losses}), flush=True)


if __name__ == "__main__":
    main()
