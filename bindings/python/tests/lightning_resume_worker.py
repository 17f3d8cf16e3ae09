"""One rank of test_lightning_resume.py, launched by zsrun (Lightning sees a
torchelastic world): checkpoints written by Lightning's own DeepSpeedStrategy
(ZeRO-3) and FSDPStrategy (full and sharded state dicts) resumed with
trainer.fit(ckpt_path=...) under ZeroShardStrategy.

    zsrun -n 2 -- python lightning_resume_worker.py sources   ($ZS_TEST_DIR)
        per source strategy: a 2-epoch fit saving after each epoch (its
        uninterrupted continuation), its own resume of epoch=0.ckpt, and
        zeroshard's resume of it
    zsrun -n 3 -- python lightning_resume_worker.py resume
        zeroshard's resume of each at 3 ranks, then the bad folders the test
        made (bad/<case>): each fit's error message

Lightning refuses both strategies on a CPU-only machine by checks alone;
the CPU* subclasses below step past exactly those checks, so the files are
written by Lightning's and DeepSpeed's / torch FSDP's own save code:
- DeepSpeedStrategy.setup_environment raises unless the accelerator is
  CUDAAccelerator, setup_distributed checks device indices against local
  ranks, and DeepSpeed's engine needs root_device.index (None on a CPU):
  CPUDeepSpeed skips the two checks and gives cpu:<local rank>
  (DS_ACCELERATOR=cpu, gloo).
- The Trainer refuses type(strategy) is FSDPStrategy without a GPU, and
  FSDPStrategy wraps with device_id=root_device.index (None: FSDP then asks
  for an accelerator): CPUFSDP wraps with device_id=cpu. Lightning's full
  state-dict context asks FSDP for offload_to_cpu=True, and torch's FSDP
  then segfaults in its state-dict hook when the params are already on the
  CPU (torch 2.11): the context is the same with offload_to_cpu=False.
$ZS_TEST_LIGHTNING_WIDTH=W adds a W x W layer (load-time figures on a
larger model). A global batch of 12 rows a step at any world size (batch 12 // world, the
DistributedSampler's contiguous global blocks), so losses averaged over
ranks are the same curve at 2 and 3 ranks.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

import zeroshard.lightning  # noqa: F401  registers strategy="zeroshard"
from launch_env import exit_without_teardown, write_rank0_result

SAMPLES, GLOBAL_BATCH = 96, 12  # 8 steps an epoch
SOURCES = ("deepspeed", "fsdp_full", "fsdp_sharded")


class CPUDeepSpeed(DeepSpeedStrategy):
    @property
    def root_device(self):
        return torch.device("cpu", self.local_rank)

    def setup_environment(self):
        DDPStrategy.setup_environment(self)  # without the CUDAAccelerator check

    def setup_distributed(self):
        from lightning.fabric.utilities.seed import reset_seed
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()  # without _validate_device_index_selection


class CPUFSDP(FSDPStrategy):
    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self.kwargs)


def _full_state_dict_context_on_cpu(module, world_size, rank0_only=True):
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    return FSDP.state_dict_type(module=module, state_dict_type=StateDictType.FULL_STATE_DICT,
                                state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
                                optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False,
                                                                                 rank0_only=rank0_only))


import lightning.pytorch.strategies.fsdp as _lightning_fsdp  # noqa: E402
_lightning_fsdp._get_full_state_dict_context = _full_state_dict_context_on_cpu


def strategy(name):
    if name == "deepspeed":
        return CPUDeepSpeed(stage=3, process_group_backend="gloo")
    if name == "fsdp_full":
        return CPUFSDP(process_group_backend="gloo", state_dict_type="full")
    if name == "fsdp_sharded":
        return CPUFSDP(process_group_backend="gloo", state_dict_type="sharded")
    return "zeroshard"


class Regression(pl.LightningModule):
    def __init__(self, init_seed=0):
        super().__init__()
        self.save_hyperparameters()  # plain values: in every checkpoint's hyper_parameters
        self.net = None
        self.register_buffer("seen", torch.zeros(()))  # batches trained on: a buffer to restore
        self.losses = []

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(self.hparams.init_seed)
            width = int(os.environ.get("ZS_TEST_LIGHTNING_WIDTH", "0"))  # figures: a width x width layer more
            hidden = [nn.Linear(width, width), nn.Tanh()] if width else []
            width = width or 32
            self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), *hidden, nn.Linear(width, 1))

    def training_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        with torch.no_grad():
            self.seen += 1
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}}


class Resumed(pl.Callback):
    """What the load restored, seen as the first resumed batch starts."""

    def __init__(self):
        self.state = None

    def on_train_batch_start(self, trainer, module, batch, idx):
        if self.state is None:
            opt = trainer.optimizers[0]
            engine = getattr(opt, "_engine", None)
            self.state = {"epoch": trainer.current_epoch, "global_step": trainer.global_step, "batch_idx": idx,
                          "lr": opt.param_groups[0]["lr"], "seen": float(module.seen),
                          "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
                          "optimizer_step": None if engine is None else int(engine.steps)}


def fit(name, epochs, init_seed=0, ckpt_path=None, save_to=None):
    world = int(os.environ["WORLD_SIZE"])
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH // world)
    model = Regression(init_seed)
    resumed = Resumed()
    callbacks = [resumed]
    if save_to is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=save_to, filename="{epoch}", save_top_k=-1,
                                                      save_on_train_epoch_end=True))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy(name), max_epochs=epochs,
                         enable_progress_bar=False, enable_checkpointing=save_to is not None, logger=False,
                         enable_model_summary=False, callbacks=callbacks)
    load = trainer.strategy.load_checkpoint
    timed = {}

    def timed_load(*args, **kwargs):
        start = time.perf_counter()
        out = load(*args, **kwargs)
        timed["load_s"] = time.perf_counter() - start
        return out

    trainer.strategy.load_checkpoint = timed_load
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {"losses": model.losses, "state": resumed.state, "load_s": timed.get("load_s"),
            "strategy": type(trainer.strategy).__name__, "end_step": trainer.global_step,
            "end_seen": float(model.seen), "end_lr": trainer.optimizers[0].param_groups[0]["lr"]}


def checkpoint_of(root, name):
    return str(Path(root) / name / "epoch=0.ckpt")


def main():
    mode, root = sys.argv[1], os.environ["ZS_TEST_DIR"]
    rank = int(os.environ["RANK"])
    out = {}
    if mode == "sources":
        for name in SOURCES:
            whole = fit(name, 2, save_to=str(Path(root) / name))
            own = fit(name, 2, init_seed=1, ckpt_path=checkpoint_of(root, name))
            ours = fit("zeroshard", 2, init_seed=1, ckpt_path=checkpoint_of(root, name))
            out[name] = {"whole": whole, "own": own, "zeroshard": ours}
    else:
        for name in SOURCES:
            out[name] = {"zeroshard": fit("zeroshard", 2, init_seed=1, ckpt_path=checkpoint_of(root, name))}
        errors = {}
        for case in sorted(os.listdir(Path(root) / "bad")) + ["absent"]:
            try:
                fit("zeroshard", 2, init_seed=1, ckpt_path=str(Path(root) / "bad" / case))
                errors[case] = None
            except Exception as e:  # noqa: BLE001  the message is the result
                errors[case] = f"{type(e).__name__}: {e}"
        out["errors"] = errors
    write_rank0_result(rank, out)
    sys.stdout.flush()
    os._exit(0)  # past torch's and DeepSpeed's teardown, as the other workers leave


if __name__ == "__main__":
    main()
    exit_without_teardown()
