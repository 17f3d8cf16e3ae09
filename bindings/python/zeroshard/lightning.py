"""zeroshard as a Lightning strategy.

    from zeroshard.lightning import ZeroShardStrategy
    trainer = Trainer(strategy=ZeroShardStrategy(stage=3), ...)

Lightning is imported only when ZeroShardStrategy is first used, so this
module imports (and the rest of zeroshard works) without it. The knobs are
those of Lightning's DeepSpeedStrategy where they apply; `config` (a dict or
a path to DeepSpeed JSON) overrides them.
"""
import json
import os

__all__ = ["ZeroShardStrategy"]

_strategy_class = None


def _lightning():
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy
        return pl, DDPStrategy
    except ImportError:
        try:
            import pytorch_lightning as pl
            from pytorch_lightning.strategies import DDPStrategy
            return pl, DDPStrategy
        except ImportError as e:
            raise ImportError("zeroshard.lightning.ZeroShardStrategy needs Lightning "
                              "(`lightning` or `pytorch_lightning`), which is not installed") from e


def config_from_knobs(zero_optimization=True, stage=3, offload_optimizer=False, offload_parameters=False,
                      remote_device=None, offload_params_device="cpu", offload_optimizer_device="cpu",
                      nvme_path="/local_nvme", params_buffer_count=5, params_buffer_size=100_000_000,
                      max_in_cpu=1_000_000_000, pin_memory=False, sub_group_size=1_000_000_000_000,
                      contiguous_gradients=True, overlap_comm=True, allgather_partitions=True,
                      reduce_scatter=True, allgather_bucket_size=200_000_000, reduce_bucket_size=200_000_000,
                      zero_allow_untested_optimizer=True, loss_scale=0, initial_scale_power=16,
                      loss_scale_window=1000, hysteresis=2, min_loss_scale=1, block_size=1048576,
                      queue_depth=8, single_submit=False, overlap_events=True, thread_count=1,
                      precision=None, gradient_clipping=None):
    """The DeepSpeed config Lightning's DeepSpeedStrategy would build from
    the same keyword arguments."""
    zero = {"stage": stage, "contiguous_gradients": contiguous_gradients, "overlap_comm": overlap_comm,
            "allgather_partitions": allgather_partitions, "reduce_scatter": reduce_scatter,
            "allgather_bucket_size": allgather_bucket_size, "reduce_bucket_size": reduce_bucket_size,
            "sub_group_size": sub_group_size}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer_device, "nvme_path": nvme_path,
                                     "buffer_count": 4, "pin_memory": pin_memory}
    if offload_parameters or remote_device:
        zero["offload_param"] = {"device": remote_device or offload_params_device, "nvme_path": nvme_path,
                                 "buffer_count": params_buffer_count, "buffer_size": params_buffer_size,
                                 "max_in_cpu": max_in_cpu, "pin_memory": pin_memory}
    config = {"zero_allow_untested_optimizer": zero_allow_untested_optimizer,
              "aio": {"block_size": block_size, "queue_depth": queue_depth, "single_submit": single_submit,
                      "overlap_events": overlap_events, "thread_count": thread_count}}
    if zero_optimization:
        config["zero_optimization"] = zero
    if precision in ("16", "16-mixed", 16):
        config["fp16"] = {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
                          "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                          "min_loss_scale": min_loss_scale}
    elif precision in ("bf16", "bf16-mixed"):
        config["bf16"] = {"enabled": True}
    if gradient_clipping:
        config["gradient_clipping"] = gradient_clipping
    return config


def _load_config(config):
    if config is None or isinstance(config, dict):
        return config
    with open(os.fspath(config)) as f:
        return json.load(f)


def _optimizer_kind(opt):
    import torch
    if isinstance(opt, torch.optim.AdamW):
        return "adamw"
    if isinstance(opt, torch.optim.Adam):
        return "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd"
    raise TypeError(f"ZeroShardStrategy: {type(opt).__name__} has no sharded counterpart "
                    "(use AdamW, Adam or SGD)")


def _convert_optimizer(opt):
    """The engine-backed twin of a torch optimizer, same groups and values."""
    from .torch import ZeroShardOptimizer
    kind = _optimizer_kind(opt)
    groups = []
    for g in opt.param_groups:
        groups.append({"params": g["params"], "lr": g["lr"], "weight_decay": g.get("weight_decay", 0.0),
                       "betas": g.get("betas", (0.9, 0.999)), "eps": g.get("eps", 1e-8),
                       "momentum": g.get("momentum", 0.0), "dampening": g.get("dampening", 0.0),
                       "nesterov": g.get("nesterov", False)})
    return ZeroShardOptimizer(groups, kind=kind)


def _make_strategy_class():
    pl, DDPStrategy = _lightning()
    import contextlib

    from . import torch as zt

    class ZeroShardStrategy(DDPStrategy):
        strategy_name = "zeroshard"

        def __init__(self, config=None, load_full_weights=False, **knobs):
            accelerator = knobs.pop("accelerator", None)
            parallel_devices = knobs.pop("parallel_devices", None)
            cluster_environment = knobs.pop("cluster_environment", None)
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=cluster_environment, process_group_backend="gloo")
            self.zs_config = _load_config(config) or config_from_knobs(**knobs)
            self.load_full_weights = load_full_weights

        def setup_environment(self):
            super().setup_environment()
            # The context goes where Lightning puts this rank's model
            # (unless the config or ZS_DEVICE names a device).
            try:
                root = self.root_device
            except Exception:
                root = None
            zt.get_context(self.zs_config, like=root)

        @contextlib.contextmanager
        def model_sharded_context(self):
            with zt.Init(config=self.zs_config):
                yield

        def _setup_model(self, model):
            # No DDP wrapper: the engine averages gradients itself.
            zt.partition_module(model, config=self.zs_config)
            return model

        def setup_optimizers(self, trainer):
            super().setup_optimizers(trainer)
            self.optimizers = [_convert_optimizer(o) for o in self.optimizers]
            for config in self.lr_scheduler_configs:
                config.scheduler.optimizer = self.optimizers[0]

        def lightning_module_state_dict(self):
            return zt.consolidated_state_dict(self.lightning_module)

        def load_model_state_dict(self, checkpoint, strict=True):
            state = checkpoint["state_dict"] if self.global_rank == 0 else None
            zt.load_consolidated_state_dict(self.lightning_module, state, strict=strict)

        def optimizer_state(self, optimizer):
            return optimizer.state_dict()

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            # Weights arrive consolidated (lightning_module_state_dict); the
            # optimizer state is sharded, so each rank keeps its own file.
            states = checkpoint.pop("optimizer_states", [])
            if states:
                import torch
                torch.save(states, f"{filepath}.rank{self.global_rank}.optim")
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            self.barrier("zeroshard_save_checkpoint")

        def load_checkpoint(self, checkpoint_path):
            import torch
            checkpoint = self.checkpoint_io.load_checkpoint(checkpoint_path)
            optim = f"{checkpoint_path}.rank{self.global_rank}.optim"
            if not self.load_full_weights and os.path.exists(optim):
                checkpoint["optimizer_states"] = torch.load(optim)
            return checkpoint

        def teardown(self):
            super().teardown()
            zt.shutdown()

    return ZeroShardStrategy


def __getattr__(name):
    global _strategy_class
    if name == "ZeroShardStrategy":
        if _strategy_class is None:
            _strategy_class = _make_strategy_class()
        return _strategy_class
    raise AttributeError(name)
