"""Fit a small model with Lightning on 2 CPU processes, with Lightning's own
DDP and with zeroshard's strategy, one after the other in the same
processes; rank 0 prints the per-step losses of every fit as JSON.

    python lightning_fit.py

Lightning's subprocess launcher starts rank 1 (it runs this script again
with LOCAL_RANK set); the later fits reuse the ranks and process group. Both
strategies see the same data in the same order (DistributedSampler without
shuffling), the same initial weights (configure_model after Lightning's
seed reset, rank 0's values) and AdamW(foreach=False).
"""
import json
import os
import warnings

import torch
import torch.nn as nn

import lightning.pytorch as pl

import zeroshard
import zeroshard.lightning  # registers strategy="zeroshard"
import zeroshard.torch as zt

SAMPLES, BATCH, RANKS = 384, 16, 2  # 12 steps per rank


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None
        self.losses = []
        self.partitioned_at_construction = None

    def configure_model(self):
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        # Under ZeroShardStrategy, zeroshard.torch.Init partitioned every
        # layer as it was built, before the strategy's setup.
        self.partitioned_at_construction = all(zt.is_partitioned(p) for p in self.net.parameters())

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)


def fit(strategy, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    x = torch.randn(SAMPLES, 8)
    y = x.sum(1, keepdim=True).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_epochs=1,
                         enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False, use_distributed_sampler=True, **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    config_warnings = [str(w.message) for w in caught
                       if issubclass(w.category, zeroshard.ZeroShardConfigWarning)]
    return trainer, {"losses": model.losses, "strategy": type(trainer.strategy).__name__,
                     "partitioned_at_construction": model.partitioned_at_construction,
                     "config_warnings": config_warnings}


def main():
    results = {}
    trainer, results["ddp"] = fit("ddp")
    trainer, results["zeroshard"] = fit("zeroshard")  # by name, from Lightning's registry
    trainer, results["ddp_clip"] = fit("ddp", gradient_clip_val=0.05)
    knobs = zeroshard.lightning.ZeroShardStrategy(reduce_bucket_size=100, overlap_comm=False)
    trainer, results["zeroshard_clip"] = fit(knobs, gradient_clip_val=0.05)
    results["zeroshard_clip"]["effective_config"] = knobs.zs_config
    # Params and optimizer state on NVMe through DeepSpeedStrategy's knobs;
    # max_in_cpu 0: every shard is read back from its file when used.
    nvme = os.environ["ZS_TEST_NVME_DIR"]
    offload = zeroshard.lightning.ZeroShardStrategy(
        offload_parameters=True, offload_params_device="nvme", offload_optimizer=True,
        offload_optimizer_device="nvme", nvme_path=nvme, max_in_cpu=0, sub_group_size=1000)
    trainer, results["zeroshard_nvme"] = fit(offload)
    results["zeroshard_nvme"]["effective_config"] = offload.zs_config
    if trainer.global_rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
