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
from torch.multiprocessing.reductions import StorageWeakRef

import lightning.pytorch as pl

import zeroshard
import zeroshard.lightning  # registers strategy="zeroshard"
import zeroshard.torch as zt
from launch_env import exit_without_teardown

SAMPLES, BATCH, RANKS = 384, 16, 2  # 12 steps per rank


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None
        self.losses = []
        self.partitioned_at_construction = None
        self.grads_after_backward = []  # params whose gradient is still in .grad after each backward
        self.hooked = None

    def configure_model(self):
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        # Under ZeroShardStrategy, zeroshard.torch.Init partitioned every
        # layer as it was built, before the strategy's setup.
        self.partitioned_at_construction = all(zt.is_partitioned(p) for p in self.net.parameters())

    def training_step(self, batch, idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, idx):
        # Here, not in training_step: compiled, dynamo would trace the
        # all_gather (torch.compile of a LightningModule compiles its steps).
        self.losses.append(float(self.all_gather(outputs["loss"].detach()).mean()))

    def on_after_backward(self):
        if self.partitioned_at_construction:
            self.grads_after_backward.append(sorted(n for n, p in self.named_parameters() if p.grad is not None))

    def on_train_end(self):
        self.param_dtypes = sorted({str(p.dtype) for p in self.net.parameters()})
        opt = self.trainer.strategy.optimizers[0]
        self.loss_scale = getattr(getattr(opt, "_optimizer", opt), "loss_scale", None)
        # Every param is persistent (under the default threshold): every
        # unit is kept, and runs without the engine's forward hooks.
        if self.partitioned_at_construction:
            from zeroshard.torch import gather_unit
            self.hooked = [n for n, m in self.net.named_modules()
                           if gather_unit._unit_pre_forward in m._forward_pre_hooks.values()]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)


class RmsRegression(Regression):
    """configure_optimizers returns a torch optimizer the engine has no twin
    of: under zeroshard it steps the shards as it is."""

    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=3e-3, momentum=0.5)

    def on_train_end(self):
        super().on_train_end()
        opt = self.trainer.strategy.optimizers[0]
        self.optimizer_class = type(getattr(opt, "_optimizer", opt)).__name__


class Wide(pl.LightningModule):
    """Several 256x256 layers, reached from training_step and
    validation_step through self.net, not through the LightningModule's own
    forward (as most LightningModules do). Under zeroshard it records, after
    each training forward (before Lightning's backward), the bytes of the
    params' gathered buffers still alive (what autograd's saved tensors
    keep: the engine released them, and its gathered counters count them
    no more), and the engine's memory counters before the strategy's
    teardown drops the context."""

    def __init__(self):
        super().__init__()
        self.net = None
        self.losses, self.val_losses, self.test_losses = [], [], []
        self.memory = None
        self.buffers = []  # (weak reference to a gathered buffer, its bytes) in this forward
        self.alive_after_forward = []

    def on_train_start(self):
        if not zt.is_partitioned(next(self.net.parameters())):
            return

        def watch(module, inputs):  # after the engine's pre-hook: the params are gathered
            self.buffers += [(StorageWeakRef(p.untyped_storage()), p.numel() * p.element_size())
                             for p in module._parameters.values() if p is not None and p.numel()]

        for m in self.net.modules():
            m.register_forward_pre_hook(watch)

    def configure_model(self):
        if self.net is not None:
            return
        layers = [nn.Linear(8, WIDTH), nn.Tanh()]
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))

    def training_step(self, batch, idx):
        x, y = batch
        self.buffers.clear()
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.buffers:
            self.alive_after_forward.append(sum(n for ref, n in self.buffers if not ref.expired()))
            self.buffers.clear()
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.val_losses.append(float(self.all_gather(loss).mean()))

    def test_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.test_losses.append(float(self.all_gather(loss).mean()))

    def predict_step(self, batch, idx):
        return self.net(batch[0]).sum()

    def on_train_end(self):
        if zt.is_partitioned(next(self.net.parameters())):
            memory = zt.get_context().memory()
            self.memory = {k: memory[k] for k in ("peak_gathered_bytes", "gathered_bytes", "unsharded_bytes")}

    def configure_optimizers(self):
        # A scheduler made on the torch optimizer, which the strategy
        # replaces with the engine's twin.
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}}


WIDTH, DEPTH = 256, 6
# Nothing persists, nothing is kept gathered across the turn from forward to
# backward, and the prefetch window is one unit: what stays gathered is what
# autograd's saved tensors hold.
WIDE_CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1}}


def seeded_data():
    """Lightning's seed reset, then the data every run sees."""
    pl.seed_everything(0, verbose=False)
    x = torch.randn(SAMPLES, 8)
    y = x.sum(1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def fit(strategy, module=Regression, val=False, compiled=False, **trainer_kwargs):
    data = seeded_data()
    model = module()
    fitted = model
    if compiled:
        # Lightning unwraps the compiled module and compiles its forward
        # and steps (lightning.pytorch.utilities.compile.from_compiled).
        fitted = torch.compile(model)
    if val:
        trainer_kwargs.update(limit_val_batches=2, num_sanity_val_steps=1, val_check_interval=4)
        data = {"train_dataloaders": data, "val_dataloaders": data}
    else:
        data = {"train_dataloaders": data}
    trainer = pl.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_epochs=1,
                         enable_progress_bar=False, enable_checkpointing=False, logger=False,
                         enable_model_summary=False, use_distributed_sampler=True, **trainer_kwargs)
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(fitted, **data)
    graphs = counters["stats"]["unique_graphs"] - graphs
    config_warnings = [str(w.message) for w in caught
                       if issubclass(w.category, zeroshard.ZeroShardConfigWarning)]
    # torch's scheduler checks, at its first step, that its optimizer's step
    # ran first: what it says when the optimizer was swapped behind it.
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    if module is Wide:
        extra = {"val_losses": model.val_losses, "memory": model.memory,
                 "alive_after_forward": model.alive_after_forward, "scheduler_warnings": scheduler_warnings,
                 "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    else:
        extra = {"grads_after_backward": model.grads_after_backward, "hooked": model.hooked,
                 "param_dtypes": model.param_dtypes, "loss_scale": model.loss_scale,
                 "optimizer_class": getattr(model, "optimizer_class", None)}
    return trainer, {**extra, "losses": model.losses, "strategy": type(trainer.strategy).__name__,
                     "partitioned_at_construction": getattr(model, "partitioned_at_construction", None),
                     "config_warnings": config_warnings, "graphs_compiled": graphs}


def evaluate(strategy):
    """validate, test and predict on a model never fitted (Lightning sets
    a strategy up without its fit path for them), then fit it and validate
    and test again through the same trainer: what the fit left in the
    model."""
    data = seeded_data()
    model = Wide()
    trainer = pl.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_epochs=1, limit_val_batches=3,
                         limit_test_batches=3, limit_predict_batches=3, enable_progress_bar=False,
                         enable_checkpointing=False, logger=False, enable_model_summary=False)
    out = {}
    trainer.validate(model, data, verbose=False)
    trainer.test(model, data, verbose=False)
    out["before_fit"] = {"val": model.val_losses, "test": model.test_losses,
                         "predict": [float(p) for p in trainer.predict(model, data)]}
    model.val_losses, model.test_losses = [], []
    trainer.fit(model, data)
    trainer.validate(model, data, verbose=False)
    trainer.test(model, data, verbose=False)
    out["after_fit"] = {"val": model.val_losses, "test": model.test_losses, "losses": model.losses}
    return out


def main():
    results = {}
    trainer, results["ddp"] = fit("ddp")
    trainer, results["zeroshard"] = fit("zeroshard")  # by name, from Lightning's registry
    trainer, results["zeroshard_compiled"] = fit("zeroshard", compiled=True)  # trainer.fit(torch.compile(m))
    trainer, results["ddp_clip"] = fit("ddp", gradient_clip_val=0.05)
    # Lightning's own accumulation: backward per batch (the loss divided by
    # 2), the optimizer step every second batch.
    trainer, results["ddp_accumulate"] = fit("ddp", accumulate_grad_batches=2)
    trainer, results["zeroshard_accumulate"] = fit("zeroshard", accumulate_grad_batches=2)
    # configure_optimizers returning RMSprop, clipped by gradient_clip_val.
    trainer, results["ddp_rmsprop"] = fit("ddp", module=RmsRegression, gradient_clip_val=0.05)
    trainer, results["zeroshard_rmsprop"] = fit("zeroshard", module=RmsRegression, gradient_clip_val=0.05)
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
    # A model of several 256x256 layers whose steps call self.net: the root
    # scope (saved for backward by reference) covers Lightning's steps.
    trainer, results["ddp_wide"] = fit("ddp", module=Wide, val=True)
    trainer, results["zeroshard_wide"] = fit(zeroshard.lightning.ZeroShardStrategy(config=WIDE_CONFIG),
                                             module=Wide, val=True)
    # Trainer precisions map to the config's bf16 / fp16 sections, as
    # DeepSpeedStrategy maps them (16-bit params on fp32 masters).
    trainer, results["ddp_bf16_mixed"] = fit("ddp", precision="bf16-mixed")
    for precision in ("bf16-mixed", "bf16-true"):
        trainer, results[f"zeroshard_{precision}"] = fit("zeroshard", precision=precision)
    fp16 = zeroshard.lightning.ZeroShardStrategy(initial_scale_power=8, loss_scale_window=4)
    trainer, results["zeroshard_16-true"] = fit(fp16, precision="16-true")
    results["zeroshard_16-true"]["effective_config"] = fp16.zs_config
    results["ddp_eval"] = evaluate("ddp")
    results["zeroshard_eval"] = evaluate(zeroshard.lightning.ZeroShardStrategy(config=WIDE_CONFIG))
    if trainer.global_rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown()
