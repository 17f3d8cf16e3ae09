"""Accelerate on the engine: the Accelerator the Trainer uses, adapted
(_accelerator_class), and `zeroshard.hf.Accelerator` for scripts written
against Accelerate, with DeepSpeedPlugin's knobs (or `accelerate launch
--use_deepspeed ...`) mapped onto the engine's config."""
import logging
import math
import os
import sys

import accelerate
import accelerate.data_loader
import accelerate.optimizer
import torch

from .. import torch as zt
from ..torch import heal, shard_optim
from ..torch.optim import scheduler_follows
from . import accelerate_heal
from .config import _engine_config, warn_not_acted_on
from .pretrained import HfZeroShardConfig

_log = logging.getLogger("zeroshard")


def _compiled(accelerator, model):
    """TrainingArguments(torch_compile=True) (Accelerate's dynamo plugin):
    the partitioned model compiled as Accelerate compiles any model, whole
    or per region (its use_regional_compilation). The engine's hooks are
    graph breaks at unit boundaries (zeroshard.torch.gather_unit)."""
    from accelerate.utils import DynamoBackend, compile_regions, is_compiled_module
    plugin = accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO or is_compiled_module(model):
        return model
    if plugin.use_regional_compilation:
        return compile_regions(model, **plugin.to_kwargs())
    return torch.compile(model, **plugin.to_kwargs())


def _accelerator_class(base):
    """Accelerate's Accelerator as the Trainer uses it, with the model left
    unwrapped (the engine reduces gradients: a DDP wrapper would reduce
    them again), the backward through the engine's loss scaling, and
    clipping left to the engine (the config's gradient_clipping)."""

    class ZeroShardAccelerator(base):
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            if any(zt.is_partitioned(p) for p in model.parameters()):
                if all(m is not model for m in self._models):
                    self._models.append(model)
                return _compiled(self, model)
            return super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=evaluation_mode)

        def prepare_optimizer(self, optimizer, device_placement=None):
            # Placing the optimizer would round-trip every shard through
            # state_dict(): the engine's state is on its device already.
            if isinstance(optimizer, zt.ZeroShardOptimizer) or _shard_stepped(optimizer):
                device_placement = False
            return super().prepare_optimizer(optimizer, device_placement=device_placement)

        def backward(self, loss, **kwargs):
            opt = _engine_optimizer(self._optimizers)
            if opt is None:
                return super().backward(loss, **kwargs)
            kwargs.pop("scale_wrt_gas", None)
            kwargs.pop("learning_rate", None)
            # Accelerate's own division for its gradient accumulation (1
            # under the Trainer, which divides itself).
            opt.backward(loss / self.gradient_accumulation_steps, **kwargs)

        def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
            opt = _engine_optimizer(self._optimizers)
            if opt is None and _stock_optimizer(self._optimizers) is not None:
                # A torch optimizer on the shards: torch's clip, by the
                # global norm of the engine's gradient shards.
                return zt.clip_grad_norm_(parameters, max_norm, norm_type)
            if opt is None:
                return super().clip_grad_norm_(parameters, max_norm, norm_type)
            # As under DeepSpeed, the config's gradient_clipping clips (at
            # the engine's step, which takes the norm); said once if the
            # call asks for another value.
            configured = float(zt.get_context().config.get("gradient_clipping") or 0.0)
            if (not getattr(self, "_zs_clip_noted", False) and math.isfinite(max_norm)
                    and float(max_norm) != configured):
                self._zs_clip_noted = True
                if self.is_main_process:
                    _log.warning("zeroshard: gradients are clipped by the config's gradient_clipping = %g (at "
                                 "the engine's step, as under DeepSpeed), not by clip_grad_norm_'s max_norm "
                                 "= %g: set gradient_clipping to change it", configured, max_norm)
            return None

        @property
        def optimizer_step_was_skipped(self):
            opt = _engine_optimizer(self._optimizers)
            if opt is not None:
                return opt.step_was_skipped
            stock = _stock_optimizer(self._optimizers)
            if stock is None:
                return super().optimizer_step_was_skipped
            result = shard_optim.stepper(stock).last_result  # None before the first step
            return bool(result and result["skipped"])

    ZeroShardAccelerator.__name__ = ZeroShardAccelerator.__qualname__ = f"ZeroShard{base.__name__}"
    return ZeroShardAccelerator


def _engine_optimizer(optimizers):
    for o in optimizers or ():
        inner = getattr(o, "optimizer", o)
        if isinstance(inner, zt.ZeroShardOptimizer):
            return inner
    return None


def _shard_stepped(optimizer):
    """Whether a torch optimizer (not the engine's) steps partitioned params."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return (not isinstance(inner, zt.ZeroShardOptimizer)
            and any(zt.is_partitioned(p) for g in inner.param_groups for p in g["params"]))


def _stock_optimizer(optimizers):
    """The first torch optimizer stepping partitioned params on the shards."""
    for o in optimizers or ():
        if _shard_stepped(o):
            return getattr(o, "optimizer", o)
    return None


def checkpoint_optimizer(optimizers):
    """The optimizer a checkpoint holds: the engine's, else a torch one
    stepping the shards."""
    return _engine_optimizer(optimizers) or _stock_optimizer(optimizers)


def config_from_plugin(plugin, mixed_precision="no"):
    """The engine's config from Accelerate's DeepSpeedPlugin: the JSON it
    holds or the one its knobs made (gradient_accumulation_steps,
    gradient_clipping, zero_stage, offload devices and NVMe paths,
    zero3_save_16bit_model), with the "auto"s Accelerate fills from the
    run (clipping 1.0, as Accelerate's DeepSpeed preparation) and the
    Accelerator's mixed precision as the bf16 / fp16 section."""
    config = _json_safe(plugin.deepspeed_config)
    if plugin.enable_msamp:
        raise ValueError("zeroshard.hf.Accelerator: DeepSpeedPlugin(enable_msamp=True): MS-AMP is not supported")
    if plugin.transformer_moe_cls_names:
        raise ValueError("zeroshard.hf.Accelerator: DeepSpeedPlugin(transformer_moe_cls_names=...): name the MoE "
                         "blocks with zeroshard.torch.set_leaf_modules(model, classes) instead")
    # Stages 1 and 2 keep params whole on every rank, 3 partitions them
    # (docs/config.md); "auto" is 3.
    if config.get("zero_optimization", {}).get("stage") == "auto":
        config["zero_optimization"]["stage"] = 3
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = 1.0
    if mixed_precision in ("bf16", "fp16") and "bf16" not in config and "fp16" not in config:
        config[mixed_precision] = {"enabled": True}
    for section in ("bf16", "fp16"):
        if (config.get(section) or {}).get("enabled") == "auto":
            config[section]["enabled"] = mixed_precision == section
    return config


def fsdp_settings(plugin, mixed_precision="no"):
    """What fully_shard takes from Accelerate's FullyShardedDataParallelPlugin
    (fsdp_version=2): the plugin, its reshard_after_forward, offload policy
    and mixed precision policy (from the Accelerator's mixed_precision when
    it sets none, as Accelerate does). What FSDP2 under Accelerate would do
    and the engine cannot is refused by name."""
    if plugin.fsdp_version != 2:
        raise ValueError(f"zeroshard.hf.Accelerator: FullyShardedDataParallelPlugin(fsdp_version="
                         f"{plugin.fsdp_version}): zeroshard serves FSDP2's API; set fsdp_version=2 "
                         "(accelerate launch --fsdp_version 2)")
    if plugin.activation_checkpointing:
        raise NotImplementedError("zeroshard.hf.Accelerator: the FSDP plugin's activation_checkpointing is not "
                                  "applied; enable it on the model (model.gradient_checkpointing_enable())")
    if plugin.cpu_ram_efficient_loading:
        raise NotImplementedError("zeroshard.hf.Accelerator: the FSDP plugin's cpu_ram_efficient_loading is not "
                                  "applied; load partitioned instead (zeroshard.hf from_pretrained under a "
                                  "zeroshard config: no rank holds more than one module whole)")
    if plugin.mixed_precision_policy is None and mixed_precision in ("bf16", "fp16"):
        plugin.set_mixed_precision(mixed_precision)
    return plugin


def fully_shard_by_plugin(model, plugin):
    """fully_shard each module the plugin's auto-wrap policy picks (deepest
    first, as Accelerate's fsdp2_prepare_model), then the model."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    ignored = {p for m in plugin.ignored_modules or () for p in m.parameters()}
    kwargs = dict(reshard_after_forward=plugin.reshard_after_forward,
                  offload_policy=plugin.cpu_offload if plugin.cpu_offload is not None else zt.OffloadPolicy(),
                  mp_policy=plugin.mixed_precision_policy or zt.MixedPrecisionPolicy(),
                  ignored_params=ignored or None)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module):
                zt.fully_shard(module, **kwargs)
    zt.fully_shard(model, **kwargs)
    return model


def accelerate_state_kind(folder, with_optimizer=True):
    """(kind, where) of a save_state folder: "zeroshard" (this
    Accelerator's: folder/zeroshard), "deepspeed" (Accelerate under
    DeepSpeed: folder/pytorch_model in DeepSpeed's layout; where: that tag
    folder), "fsdp_sharded" (Accelerate under FSDP with sharded state
    dicts; where: (pytorch_model_fsdp_0, optimizer_0 or None)) or
    "fsdp_full" (with full state dicts: pytorch_model_fsdp.bin and
    optimizer.bin; where: the folder). Anything else raises, naming what
    the folder holds."""
    from ..torch import dcp_checkpoint, deepspeed_checkpoint
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"zeroshard.hf.Accelerator.load_state: {folder!r} is not a directory")
    names = sorted(f + ("/" if os.path.isdir(os.path.join(folder, f)) else "") for f in os.listdir(folder))
    listing = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "") or "nothing"
    if os.path.isdir(os.path.join(folder, "zeroshard")):
        return "zeroshard", os.path.join(folder, "zeroshard")
    tagdir = deepspeed_checkpoint.find(folder, "pytorch_model")
    if tagdir is not None:
        return "deepspeed", str(tagdir)
    model_dir = os.path.join(folder, "pytorch_model_fsdp_0")
    if dcp_checkpoint.find(model_dir):
        optim_dir = os.path.join(folder, "optimizer_0")
        if not dcp_checkpoint.find(optim_dir):
            if with_optimizer:
                raise ValueError(f"zeroshard.hf.Accelerator.load_state: {folder} holds the FSDP model's shards "
                                 f"(pytorch_model_fsdp_0/) but no optimizer_0/ with its state (a torch DCP folder): "
                                 f"it holds {listing}; nothing was loaded")
            optim_dir = None
        return "fsdp_sharded", (model_dir, optim_dir)
    from ..torch.trainer_checkpoint import FSDP_FULL_OPTIMIZER, FSDP_FULL_WEIGHTS
    if FSDP_FULL_WEIGHTS in names:
        if with_optimizer and FSDP_FULL_OPTIMIZER not in names:
            raise ValueError(f"zeroshard.hf.Accelerator.load_state: {folder} holds FSDP's full model state dict "
                             f"({FSDP_FULL_WEIGHTS}) but not its optimizer's ({FSDP_FULL_OPTIMIZER}): it holds "
                             f"{listing}; nothing was loaded")
        return "fsdp_full", folder
    more = ""
    if any(n.startswith("pytorch_model_fsdp") and n.endswith(".bin") for n in names):
        more = " (pytorch_model_fsdp_*.bin: FSDP's per-rank local state dicts, which are not read: save with " \
               "state_dict_type='SHARDED_STATE_DICT' or 'FULL_STATE_DICT')"
    raise ValueError(f"zeroshard.hf.Accelerator.load_state: {folder} is not a folder save_state wrote under zeroshard "
                     f"(zeroshard/), DeepSpeed (latest + pytorch_model/zero_pp_rank_*_mp_rank_00_*_states.pt) or "
                     f"FSDP with sharded state dicts (pytorch_model_fsdp_0/ + optimizer_0/, torch DCP) or full "
                     f"ones ({FSDP_FULL_WEIGHTS} + {FSDP_FULL_OPTIMIZER}): it holds {listing}{more}; nothing was "
                     f"loaded")


def _json_safe(value):
    """The plugin's config without what JSON cannot hold or the engine
    reads as a value (Accelerate's steps_per_print = inf; nvme_path None
    for a device that is not NVMe)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()
                if v is not None and not (isinstance(v, float) and not math.isfinite(v))}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class _EngineAcceleratedOptimizer(accelerate.optimizer.AcceleratedOptimizer):
    """Accelerate's wrapper of the engine's optimizer: its step_was_skipped
    is the engine's (Accelerate's reads a GradScaler's only, so its
    scheduler stepped on a skipped fp16 step), and, while the script heals
    in place, its step at a window's end heals a loss (accelerate_heal)."""

    _zs_healing = None
    zs_healed_skip = False  # the last step was skipped by a heal: its window runs again

    def step(self, closure=None):
        healing = self._zs_healing
        if healing is None or not self.gradient_state.sync_gradients:
            return super().step(closure)
        healing.step(lambda: super(_EngineAcceleratedOptimizer, self).step(closure))

    @property
    def step_was_skipped(self):
        return self.zs_healed_skip or self.optimizer.step_was_skipped


class Accelerator(_accelerator_class(accelerate.Accelerator)):
    """Accelerate's Accelerator on the zeroshard engine, for scripts written
    against Accelerate:

        from zeroshard.hf import Accelerator      # was: from accelerate import Accelerator
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="ds.json", zero_stage=3))
        model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

    The config comes from `zeroshard_config` (a DeepSpeed JSON), a
    DeepSpeedPlugin, or `accelerate launch --use_deepspeed --zero_stage 3
    [--deepspeed_config_file ...]` (which Accelerate passes as
    environment variables); with none, ZeRO-3 defaults. prepare()
    partitions each model (no DDP wrapper: the engine reduces gradients),
    turns each torch AdamW / Adam / SGD into the engine's optimizer with the
    same groups (schedulers follow), and leaves dataloaders to Accelerate.
    backward() scales the loss under fp16; clipping is the config's
    gradient_clipping; save_state / load_state keep the engine's sharded
    checkpoint (any world size) beside Accelerate's own files. With
    zero3_init_flag (DeepSpeed's default under ZeRO-3), from_pretrained
    loads partitioned."""

    def __init__(self, *args, zeroshard_config=None, deepspeed_plugin=None, fsdp_plugin=None, **kwargs):
        if isinstance(deepspeed_plugin, dict):
            raise ValueError("zeroshard.hf.Accelerator: several DeepSpeed plugins (a dict) are not supported")
        from_env = os.environ.pop("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        fsdp_from_env = os.environ.pop("ACCELERATE_USE_FSDP", "false").lower() == "true"
        given = [name for name, on in (("zeroshard_config=", zeroshard_config is not None),
                                       ("a DeepSpeedPlugin (or accelerate launch --use_deepspeed)",
                                        deepspeed_plugin is not None or from_env),
                                       ("an FSDP plugin (or accelerate launch --use_fsdp)",
                                        fsdp_plugin is not None or fsdp_from_env)) if on]
        if len(given) > 1:
            raise ValueError(f"zeroshard.hf.Accelerator: give the config once: {' and '.join(given)} were both "
                             "given")
        mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed = str(getattr(mixed, "value", mixed))
        if deepspeed_plugin is None and from_env:
            deepspeed_plugin = accelerate.DeepSpeedPlugin()  # from accelerate launch's variables
        if fsdp_plugin is None and fsdp_from_env:
            fsdp_plugin = accelerate.FullyShardedDataParallelPlugin()  # likewise
        self._zs_fsdp = None
        if fsdp_plugin is not None:
            self._zs_fsdp = fsdp_settings(fsdp_plugin, mixed)
            self.zs_config = {"zero_optimization": {"stage": 3}}  # fully_shard makes the context
            zero3_init = False
        elif deepspeed_plugin is not None:
            self.zs_config = config_from_plugin(deepspeed_plugin, mixed)
            kwargs.setdefault("gradient_accumulation_steps",
                              int(deepspeed_plugin.deepspeed_config.get("gradient_accumulation_steps") or 1))
            zero3_init = deepspeed_plugin.zero3_init_flag
        else:
            from .config import _load
            self.zs_config = _load(zeroshard_config) or {"zero_optimization": {"stage": 3}}
            zero3_init = True
        # The engine carries the precision (16-bit params on fp32 masters):
        # Accelerate's autocast would run over them a second time.
        kwargs["mixed_precision"] = "no"
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        # Under zsrun --restarts: peer copies on, before any context exists.
        accelerate_heal.before_context(self.zs_config, self._zs_fsdp)
        self._zs_healing = None
        super().__init__(*args, **kwargs)
        warn_not_acted_on(self.zs_config, self.process_index)
        # DeepSpeed's zero3_init_flag: from_pretrained loads partitioned
        # while this Accelerator lives.
        self._zs_pretrained = HfZeroShardConfig(self.zs_config) if zero3_init else None

    def prepare(self, *args, device_placement=None):
        if self._zs_fsdp is not None:
            # FSDP2's route: fully_shard as Accelerate's plugin would wrap,
            # the torch optimizer kept, stepping the shards (shard_optim).
            for obj in args:
                if isinstance(obj, torch.nn.Module) and not any(zt.is_partitioned(p) for p in obj.parameters()):
                    fully_shard_by_plugin(obj, self._zs_fsdp)
            return super().prepare(*args, device_placement=device_placement)
        engine_config = _engine_config(self.zs_config)
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                zt.partition_module(obj, config=engine_config)
        converted = {}
        out = []
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, zt.ZeroShardOptimizer):
                twin = zt.ZeroShardOptimizer.twin_of(obj)  # else it steps the shards as it is
                if twin is not None:
                    converted[id(obj)] = obj = twin
            out.append(obj)
        for obj in out:
            inner = getattr(obj, "scheduler", obj)
            if id(getattr(inner, "optimizer", None)) in converted:
                scheduler_follows(inner, converted[id(inner.optimizer)])
        result = super().prepare(*out, device_placement=device_placement)
        return self._heal_prepared(result)

    def _heal_prepared(self, result):
        """The prepared engine optimizer reports the engine's skipped steps
        (fp16 overflow, a heal) to Accelerate's scheduler; and where the
        context keeps peer copies, once an engine optimizer and a DataLoader
        are prepared, a lost rank heals in place (accelerate_heal.py)."""
        single = not isinstance(result, tuple)
        items = [result] if single else list(result)
        for o in items:
            engine_inside = isinstance(getattr(o, "optimizer", None), zt.ZeroShardOptimizer)
            if type(o) is accelerate.optimizer.AcceleratedOptimizer and engine_inside:
                o.__class__ = _EngineAcceleratedOptimizer
        healing = self._zs_healing
        ctx = zt.current_context()
        # Once both the optimizer and the training DataLoader are prepared.
        if healing is None and ctx is not None and heal.heals(ctx) and self._optimizers and self._dataloaders:
            opt = self._optimizers[0]
            why = None
            if not isinstance(opt, _EngineAcceleratedOptimizer):
                why = "its optimizer is not the engine's AdamW, Adam or SGD"
            elif len(self._optimizers) > 1:
                why = "it prepared several optimizers"
            elif type(self._dataloaders[0]) is not accelerate.data_loader.DataLoaderShard:
                why = f"its first DataLoader is an Accelerate {type(self._dataloaders[0]).__name__}, not a " \
                      "DataLoaderShard (dispatch_batches, an IterableDataset's default: with " \
                      "dataloader_config=DataLoaderConfiguration(dispatch_batches=False) each rank reads the " \
                      "stream for its own slice, and the script heals)"
            if why is None:
                healing = self._zs_healing = accelerate_heal.Healing(self, opt)
                opt._zs_healing = healing
            elif not getattr(self, "_zs_said_no_heal", False):
                self._zs_said_no_heal = True
                if ctx.rank == 0:
                    print(f"zeroshard.hf.Accelerator: the context keeps peer copies, but this script does not heal "
                          f"a lost rank in place ({why}): a loss restarts the job from its last save_state",
                          file=sys.stderr, flush=True)
        if healing is not None:
            healing.adopt_schedulers()
            # The first DataLoader records the windows; the others' iterators
            # are made without drawing from the global RNG.
            for i, loader in enumerate(self._dataloaders):
                twin = healing.wrap(loader, training=i == 0)
                if twin is not loader:
                    self._dataloaders[i] = twin
                    items = [twin if o is loader else o for o in items]
        return items[0] if single else tuple(items)

    def save_state(self, output_dir=None, **kwargs):
        """Accelerate's state (schedulers, samplers, RNG, registered objects)
        and the engine's checkpoint of the prepared model and optimizer
        (crash-safe, sharded) in output_dir/zeroshard."""
        model, optimizer = self._engine_pair("save_state")
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            path = super().save_state(output_dir, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        zt.save_checkpoint(os.path.join(path, "zeroshard"), model, optimizer, tag="state", overwrite=True)
        return path

    def load_state(self, input_dir=None, **kwargs):
        """save_state's directory back, at any world size; or a folder
        accelerate.Accelerator.save_state wrote under DeepSpeed ZeRO
        (pytorch_model/ in DeepSpeed's layout, latest) or under FSDP with
        sharded state dicts (pytorch_model_fsdp_0/ and optimizer_0/, torch
        DCP) or full ones (pytorch_model_fsdp.bin and optimizer.bin): the weights, Adam moments, step and hyper-parameters into the
        engine, then Accelerate's own files (schedulers, samplers, RNG,
        registered objects) as Accelerate loads them. Any other folder is a
        ValueError naming what it holds; nothing is loaded then."""
        model, optimizer = self._engine_pair("load_state")
        if input_dir is None:  # Accelerate's own choice: its latest automatic checkpoint
            input_dir = self._latest_state_dir()
        kind, found = accelerate_state_kind(input_dir, with_optimizer=optimizer is not None)
        # The engine's part first: a folder whose shards fail to load
        # leaves Accelerate's state (schedulers, RNG) untouched.
        if kind == "zeroshard":
            zt.load_checkpoint(found, model, optimizer, tag="state")
        elif kind == "deepspeed":
            zt.load_checkpoint(found, model, optimizer)
        elif kind == "fsdp_full":
            from ..torch.trainer_checkpoint import load_fsdp_full
            load_fsdp_full(found, model, optimizer)
        else:
            from ..torch.checkpoint import load_dcp_checkpoint
            load_dcp_checkpoint(found[0], model, optimizer, optim_path=found[1])
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            super().load_state(input_dir, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers

    def _latest_state_dir(self):
        folder = os.path.join(self.project_dir, "checkpoints")
        return os.path.join(folder, sorted(os.listdir(folder), key=lambda f: int(f.split("_")[-1]))[-1])

    def _engine_pair(self, what):
        models = [m for m in self._models if any(zt.is_partitioned(p) for p in m.parameters())]
        opt = checkpoint_optimizer(self._optimizers)
        if len(models) != 1 or len(self._optimizers) > 1:
            raise NotImplementedError(f"zeroshard.hf.Accelerator.{what}: one prepared model and at most one "
                                      f"optimizer are supported, not {len(models)} and {len(self._optimizers)}")
        return models[0], opt
