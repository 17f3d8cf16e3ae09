"""zeroshard as a Lightning strategy.

    import zeroshard.lightning  # registers "zeroshard" in Lightning's strategy registry
    trainer = Trainer(strategy="zeroshard", accelerator="cpu", devices=2)
    trainer = Trainer(strategy=zeroshard.lightning.ZeroShardStrategy(reduce_bucket_size=5e7), ...)

The knobs are those of Lightning's DeepSpeedStrategy. Those the engine acts
on go into its DeepSpeed config as DeepSpeedStrategy puts them there
(overlap_comm, reduce_bucket_size; offload_parameters and offload_optimizer
with their devices, nvme_path, max_in_cpu, optimizer_buffer_count, and
sub_group_size and the aio knobs under NVMe offload; the Trainer's
gradient_clip_val becomes gradient_clipping); every other knob set away from
its default (pin_memory, the parameter buffer pool, remote_device,
activation checkpointing, an NVMe or aio knob without
NVMe offload, ...) is an error naming the knob and its value, never
silently ignored. `config` (a dict or a path to
DeepSpeed JSON) replaces the knobs, as in DeepSpeedStrategy; keys of it the
engine does not act on are warned about (zeroshard.ZeroShardConfigWarning).

The model is partitioned as it is built: modules created in the
LightningModule's `configure_model` hook run under zeroshard.torch.Init, so
no rank ever holds the whole model; the rest is partitioned at setup. The
optimizer from `configure_optimizers` is replaced by its engine-backed
twin with the same groups and hyper-parameters when it is a torch AdamW,
Adam or SGD; any other torch optimizer steps the shards as it is
(zeroshard.torch.shard_optim), clipped by gradient_clip_val (the config's
gradient_clipping) at its step.

Importing this module imports Lightning when it is installed (to register
the strategy); without Lightning it imports all the same, and
ZeroShardStrategy raises ImportError when used.
"""
import copy
import importlib
import json
import logging
import os

__all__ = ["ZeroShardStrategy", "UnsupportedKnobError", "config_from_knobs", "knob_errors"]

_strategy_class = None
# (context, config) of the last context a ZeroShardStrategy set up.
_strategy_context = None

_PIN = "offloaded state is not pinned (a CPU context has no device to pin it for)"
_NVME_ONLY = "read only by NVMe offload ({})"
_AIO = ("asynchronous I/O serves NVMe offload, which these knobs do not ask for "
        "(offload_params_device or offload_optimizer_device 'nvme')")
_PARAM_BUFFERS = ("offloaded parameter shards are read into buffers of their own size; the memory they "
                  "take is bounded by max_in_cpu")
_ACTIVATIONS = "the engine does not checkpoint or partition activations"

# DeepSpeedStrategy's knobs the engine does not act on: the value that
# changes nothing (DeepSpeedStrategy's default, except stage) and what
# happens instead.
_INERT_KNOBS = {
    "zero_optimization": (True, "zeroshard always shards parameters, gradients and optimizer "
                                "state; use DDPStrategy for unsharded training"),
    "remote_device": (None, "zeroshard.torch.Init places shards by the offload knobs "
                            "(offload_parameters, offload_params_device), not by remote_device"),
    "pin_memory": (False, _PIN),
    "params_buffer_count": (5, _PARAM_BUFFERS),
    "params_buffer_size": (100_000_000, _PARAM_BUFFERS),
    "contiguous_gradients": (True, "gradients always go through contiguous reduce buckets"),
    "allgather_partitions": (True, "parameters are always gathered with all-gather"),
    "reduce_scatter": (True, "gradients are always reduce-scattered into each rank's shard"),
    "allgather_bucket_size": (200_000_000, "parameter gathers are sized by prefetch_bucket_size"),
    "logging_batch_size_per_gpu": ("auto", "the engine has no throughput logging"),
    "logging_level": (logging.WARN, "the engine has no DeepSpeed logger"),
    "partition_activations": (False, _ACTIVATIONS),
    "cpu_checkpointing": (False, _ACTIVATIONS),
    "contiguous_memory_optimization": (False, _ACTIVATIONS),
    "synchronize_checkpoint_boundary": (False, _ACTIVATIONS),
    "exclude_frozen_parameters": (False, "checkpoints hold every parameter, frozen ones included"),
}
# DeepSpeedStrategy's fp16 loss-scaling knobs: the config's fp16 section
# under precision "16-mixed" / "16-true" (trainer_config), refused at any
# other precision when set away from their defaults.
_FP16_KNOBS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
               "min_loss_scale": 1}
# Knobs that go into the engine's config.
# stage: 1 and 2 keep params whole on every rank (docs/config.md); 3 unless
# given, where DeepSpeedStrategy's default is 2.
_CONFIG_KNOBS = {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 200_000_000,
                 "zero_allow_untested_optimizer": True}
# Offload knobs with DeepSpeedStrategy's defaults: mapped by _offload_config.
_OFFLOAD_KNOBS = {"offload_parameters": False, "offload_optimizer": False, "offload_params_device": "cpu",
                  "offload_optimizer_device": "cpu", "nvme_path": "/local_nvme", "max_in_cpu": 1_000_000_000,
                  "optimizer_buffer_count": 4, "sub_group_size": 1_000_000_000_000}
_AIO_KNOBS = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
              "thread_count": 1}
_OFFLOAD_AND_AIO_KNOBS = {**_OFFLOAD_KNOBS, **_AIO_KNOBS}
# Trainer precisions and the config section each turns on, as
# DeepSpeedStrategy maps them: "-mixed" and "-true" alike give 16-bit params
# with fp32 masters in the optimizer (no autocast, inputs cast).
_PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16",
               "16-true": "fp16"}


class UnsupportedKnobError(NotImplementedError, ValueError):
    """A DeepSpeedStrategy knob (or Trainer setting) the zeroshard engine
    does not act on yet, set away from its default."""


def knob_errors(knobs):
    """The knobs among `knobs` that the engine does not act on and that are
    set away from their default, as "name=value: what happens instead"."""
    errors = []
    for name, value in knobs.items():
        if name not in _INERT_KNOBS:
            continue
        default, reason = _INERT_KNOBS[name]
        if value != default:
            errors.append(f"{name}={value!r}: {reason}")
    return errors


def _offload_config(knobs):
    """The config's offload sections from the offload and aio knobs, as
    DeepSpeedStrategy writes them: (zero_optimization entries, aio section or
    None, errors for knobs that would change nothing)."""
    v = dict(_OFFLOAD_AND_AIO_KNOBS)
    v.update({k: x for k, x in knobs.items() if k in v})
    changed = [k for k in v if v[k] != _OFFLOAD_AND_AIO_KNOBS[k]]
    errors, zero = [], {}
    for on, device, section in (("offload_parameters", "offload_params_device", "offload_param"),
                                ("offload_optimizer", "offload_optimizer_device", "offload_optimizer")):
        if v[device] not in ("cpu", "nvme"):
            errors.append(f"{device}={v[device]!r}: expected 'cpu' or 'nvme'")
        elif device in changed and not v[on]:
            errors.append(f"{device}={v[device]!r}: has no effect without {on}=True")
        if v[on]:
            zero[section] = {"device": v[device]}
            if v[device] == "nvme":
                zero[section]["nvme_path"] = v["nvme_path"]
    params_nvme = "offload_param" in zero and zero["offload_param"]["device"] == "nvme"
    optimizer_nvme = "offload_optimizer" in zero and zero["offload_optimizer"]["device"] == "nvme"
    if params_nvme:
        zero["offload_param"]["max_in_cpu"] = v["max_in_cpu"]
    if optimizer_nvme:
        zero["offload_optimizer"]["buffer_count"] = v["optimizer_buffer_count"]
        if "sub_group_size" in changed:
            zero["sub_group_size"] = v["sub_group_size"]
    params_needs = "offload_parameters=True with offload_params_device='nvme'"
    optimizer_needs = "offload_optimizer=True with offload_optimizer_device='nvme'"
    for knob, acts, needs in (("nvme_path", params_nvme or optimizer_nvme, f"{params_needs}, or {optimizer_needs}"),
                              ("max_in_cpu", params_nvme, params_needs),
                              ("optimizer_buffer_count", optimizer_nvme, optimizer_needs),
                              ("sub_group_size", optimizer_nvme, optimizer_needs)):
        if knob in changed and not acts:
            errors.append(f"{knob}={v[knob]!r}: " + _NVME_ONLY.format(needs))
    aio = None
    if params_nvme or optimizer_nvme:
        aio = {("intra_op_parallelism" if k == "thread_count" else k): v[k] for k in _AIO_KNOBS}
    else:
        errors += [f"{k}={v[k]!r}: {_AIO}" for k in _AIO_KNOBS if k in changed]
    return zero, aio, errors


def _raise_for(knobs):
    errors = knob_errors(knobs) + _offload_config(knobs)[2]
    if errors:
        raise UnsupportedKnobError(
            "ZeroShardStrategy: not acted on by the zeroshard engine yet, so refused rather than "
            "ignored (leave them at their defaults): " + "; ".join(errors))


def config_from_knobs(**knobs):
    """The engine's DeepSpeed config from DeepSpeedStrategy's keyword
    arguments: the knobs the engine acts on, mapped; any other knob away
    from its default raises UnsupportedKnobError naming it; an unknown name
    raises TypeError."""
    unknown = sorted(set(knobs) - set(_INERT_KNOBS) - set(_CONFIG_KNOBS) - set(_OFFLOAD_AND_AIO_KNOBS)
                     - set(_FP16_KNOBS))
    if unknown:
        raise TypeError(f"ZeroShardStrategy: unknown knob(s) {', '.join(unknown)} (the knobs are those of "
                        "Lightning's DeepSpeedStrategy)")
    _raise_for(knobs)
    values = dict(_CONFIG_KNOBS, **{k: v for k, v in knobs.items() if k in _CONFIG_KNOBS})
    zero_offload, aio, _ = _offload_config(knobs)
    config = {"zero_allow_untested_optimizer": values["zero_allow_untested_optimizer"],
              "zero_optimization": {"stage": values["stage"], "overlap_comm": values["overlap_comm"],
                                    "reduce_bucket_size": values["reduce_bucket_size"], **zero_offload}}
    if aio is not None:
        config["aio"] = aio
    return config


def _load_config(config):
    if config is None or isinstance(config, dict):
        return None if config is None else dict(config)
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ZeroShardStrategy: config {path!r} is not a file")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fp16_knobs(knobs):
    """DeepSpeedStrategy's loss-scaling knobs among `knobs`, defaults filled in."""
    return {k: knobs.get(k, default) for k, default in _FP16_KNOBS.items()}


def trainer_config(config, precision, gradient_clip_val=None, gradient_clip_algorithm=None, loss_scaling=None):
    """`config` completed with what the Trainer asks for: its precision as
    the bf16 or fp16 section (DeepSpeedStrategy's mapping; `loss_scaling`:
    the strategy's fp16 knobs, fp16_knobs()), its gradient clipping (by
    norm) as gradient_clipping. Precisions, knobs and clipping the engine
    cannot honour, or that contradict the config, raise
    UnsupportedKnobError."""
    config = dict(config)
    precision = str(precision)
    if precision not in _PRECISIONS:
        raise UnsupportedKnobError(
            f"ZeroShardStrategy: Trainer(precision={precision!r}) is not supported: the strategy runs "
            f"{', '.join(repr(p) for p in _PRECISIONS)} (16-bit params on fp32 masters for the 16-bit ones)")
    want = _PRECISIONS[precision]
    loss_scaling = loss_scaling or fp16_knobs({})
    changed = [f"{k}={v!r}" for k, v in loss_scaling.items() if v != _FP16_KNOBS[k]]
    enabled = {section: bool((config.get(section) or {}).get("enabled")) for section in ("bf16", "fp16")}
    if want is not None:
        other = "fp16" if want == "bf16" else "bf16"
        if enabled[other] or (want in config and not enabled[want]):
            raise UnsupportedKnobError(
                f"ZeroShardStrategy: Trainer(precision={precision!r}) asks for {want}, but the config's "
                f"{other if enabled[other] else want}.enabled is {str(enabled[other]).lower()}: make them agree")
        if want not in config:
            config[want] = {"enabled": True, **(loss_scaling if want == "fp16" else {})}
        elif want == "fp16" and changed:
            raise UnsupportedKnobError(
                f"ZeroShardStrategy: the config's fp16 section replaces the loss-scaling knobs, so "
                f"{', '.join(changed)} would be ignored: put them in the config")
    if want != "fp16" and changed:
        raise UnsupportedKnobError(
            f"ZeroShardStrategy: {', '.join(changed)}: fp16 loss scaling acts only under "
            f"Trainer(precision='16-mixed' or '16-true'), not {precision!r}")
    if gradient_clip_val:
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
        if algorithm != "norm":
            raise UnsupportedKnobError(
                f"ZeroShardStrategy: Trainer(gradient_clip_algorithm={algorithm!r}) is not supported: the "
                "engine clips gradients by their global norm only ('norm')")
        have = config.get("gradient_clipping")
        if have not in (None, "auto", 0, 0.0) and float(have) != float(gradient_clip_val):
            raise UnsupportedKnobError(
                f"ZeroShardStrategy: Trainer(gradient_clip_val={gradient_clip_val!r}) and the config's "
                f"gradient_clipping={have!r} disagree: give one of them")
        config["gradient_clipping"] = float(gradient_clip_val)
    return config


def _lightning():
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
        return pl, DDPStrategy, StrategyRegistry
    except ImportError:
        try:
            import pytorch_lightning as pl
            from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
            return pl, DDPStrategy, StrategyRegistry
        except ImportError as e:
            raise ImportError("zeroshard.lightning.ZeroShardStrategy needs Lightning "
                              "(`lightning` or `pytorch_lightning`), which is not installed") from e


def _convert_optimizer(opt):
    """The engine-backed twin of a torch AdamW, Adam or SGD (same groups and
    values); any other torch optimizer as it is: it steps the shards
    (zeroshard.torch.shard_optim)."""
    from .torch import ZeroShardOptimizer
    return ZeroShardOptimizer.twin_of(opt) or opt


def _to_json(value, where):
    """Lightning's checkpoint dict as JSON: tensors become {"__tensor__":
    base64 of their bytes, "dtype", "shape"}, inf/nan {"__float__": text},
    tuples lists; anything else JSON cannot hold is a TypeError naming where
    it is (no pickle)."""
    import base64
    import math

    import torch
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": base64.b64encode(raw).decode("ascii"), "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape)}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"ZeroShardStrategy checkpoint: key {k!r} in {where} is not a JSON key")
            out[str(k)] = _to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"ZeroShardStrategy checkpoint: {where} is a {type(value).__name__}, which JSON cannot "
                    "hold (checkpoints take no pickle)")


def _from_json(value):
    import base64

    import torch
    if isinstance(value, dict):
        if set(value) == {"__tensor__", "dtype", "shape"}:
            raw = bytearray(base64.b64decode(value["__tensor__"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(getattr(torch, value["dtype"])).reshape(value["shape"]).clone()
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


# ---- checkpoints other strategies wrote

_DS_HINT = "a DeepSpeedStrategy checkpoint (latest + <tag>/zero_pp_rank_*_mp_rank_00_{model,optim}_states.pt)"
_OWN_HINT = "a ZeroShardStrategy checkpoint (<tag>/manifest.json)"
_DCP_HINT = "an FSDPStrategy sharded checkpoint (.metadata, *.distcp and meta.pt)"
_FILE_HINT = "a full checkpoint file (FSDPStrategy state_dict_type='full', DDP)"


def lightning_checkpoint_kind(path):
    """(kind, where) of what a Lightning `ckpt_path` holds: "zeroshard"
    (this strategy's own), "deepspeed" (DeepSpeedStrategy's folder; where:
    its tag folder), "fsdp_sharded" (FSDPStrategy's DCP folder; where: its
    meta.pt) or "file" (one torch checkpoint file, as FSDPStrategy's full
    state dict and DDP's). Anything else raises, naming what it found."""
    from pathlib import Path

    from .torch import dcp_checkpoint, deepspeed_checkpoint
    path = Path(path)
    if path.is_file():
        return "file", path
    if not path.is_dir():
        raise FileNotFoundError(f"ZeroShardStrategy: checkpoint {str(path)!r} does not exist")
    tagdir = deepspeed_checkpoint.find(path)
    if tagdir is not None:
        return "deepspeed", tagdir
    if dcp_checkpoint.find(path):
        meta = path / "meta.pt"
        if not meta.is_file():
            raise ValueError(f"ZeroShardStrategy: {path} is a torch DCP checkpoint without Lightning's meta.pt "
                             f"(the epoch, loops, callbacks and schedulers FSDPStrategy writes beside the shards): "
                             f"holds {_listing(path)}")
        return "fsdp_sharded", meta
    latest = path / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    if (path / "manifest.json").is_file() or (path / tag / "manifest.json").is_file():
        return "zeroshard", path
    raise ValueError(f"ZeroShardStrategy: {path} is not a checkpoint this strategy reads: it holds "
                     f"{_listing(path)}; expected {_OWN_HINT}, {_DS_HINT}, {_DCP_HINT}, or {_FILE_HINT}")


def _listing(path, limit=12):
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _safe_torch_load(file, kind):
    import zipfile

    from .torch import deepspeed_checkpoint
    try:
        return deepspeed_checkpoint.safe_load(str(file), kind)
    except (zipfile.BadZipFile, RuntimeError) as e:
        raise ValueError(f"ZeroShardStrategy: {file} is not a torch checkpoint file ({e}); expected {_OWN_HINT}, "
                         f"{_DS_HINT}, {_DCP_HINT}, or {_FILE_HINT}") from None


def _keys(obj):
    return f"keys {sorted(obj)[:8]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"


def _lightning_meta(meta):
    """FSDPStrategy's meta.pt: Lightning's checkpoint less the model and
    optimizers, read without running pickled code."""
    checkpoint = _safe_torch_load(meta, "Lightning checkpoint file")
    if not isinstance(checkpoint, dict) or "loops" not in checkpoint:
        raise ValueError(f"ZeroShardStrategy: {meta} is not Lightning's checkpoint metadata ({_keys(checkpoint)})")
    return dict(checkpoint)


def _load_full_file(file, module, optimizer, strict):
    """A Lightning checkpoint file holding the full state_dict (and, to
    resume a fit, optimizer_states: torch's optimizer state_dict, as
    FSDPStrategy's full state dict and DDP write it) into the partitioned
    module: each rank copies its shards' elements."""
    from .torch import trainer_checkpoint
    checkpoint = _safe_torch_load(file, "Lightning checkpoint file")
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"ZeroShardStrategy: {file} is a torch file but not a Lightning checkpoint with the full "
                         f"weights ({_keys(checkpoint)}, no 'state_dict')")
    states = checkpoint.pop("optimizer_states", None)
    if optimizer is not None:
        if not states:
            raise ValueError(f"ZeroShardStrategy: {file} holds no optimizer_states (keys {sorted(checkpoint)}): "
                             f"saved with save_weights_only=True? Resuming a fit needs the optimizer's state "
                             f"(trainer.validate, test and predict load the weights alone)")
        if len(states) != 1:
            raise ValueError(f"ZeroShardStrategy: {file} holds {len(states)} optimizers' states; the strategy "
                             f"resumes one")
    weights = checkpoint.pop("state_dict")
    trainer_checkpoint.load_state_dict_shards(module, optimizer, weights, f"Lightning checkpoint {file}", strict)
    if optimizer is not None:
        trainer_checkpoint.load_optimizer_state(module, optimizer, states[0], f"{file}'s optimizer_states[0]")
    return checkpoint


def _make_strategy_class():
    pl, DDPStrategy, _ = _lightning()
    TrainerFn = importlib.import_module(pl.__name__ + ".trainer.states").TrainerFn
    import contextlib

    import torch
    from lightning_utilities.core.apply_func import apply_to_collection

    from . import lightning_heal
    from . import torch as zt
    from .torch import heal_dist
    from .torch.init import hide_partitioned_from_ddp

    Precision = importlib.import_module(pl.__name__ + ".plugins.precision").Precision

    class ZeroShardPrecision(Precision):
        """Lightning's precision plugin for the engine: what
        DeepSpeedPrecision does for DeepSpeed. The 16-bit params come from
        the config (bf16.enabled / fp16.enabled, set by trainer_config):
        floating inputs are cast to their dtype, there is no autocast, the
        backward goes through ZeroShardOptimizer's loss scaling (fp16), and
        the engine clips by the config's gradient_clipping (Lightning's
        clipping would see no gradients: they live in the engine)."""

        def __init__(self, precision):
            super().__init__()
            self.precision = precision
            kind = _PRECISIONS.get(precision)
            self._dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind)

        def convert_input(self, data):
            if self._dtype is None:
                return data
            return apply_to_collection(data, torch.Tensor,
                                       lambda t: t.to(self._dtype) if t.is_floating_point() else t)

        def backward(self, tensor, model, optimizer, *args, **kwargs):
            opt = getattr(optimizer, "_optimizer", optimizer)
            if opt is None:  # manual optimization: the strategy's optimizer
                opts = model.trainer.strategy.optimizers
                opt = opts[0] if opts else None
            if not isinstance(opt, zt.ZeroShardOptimizer):
                return super().backward(tensor, model, optimizer, *args, **kwargs)
            with opt.scaled_loss(tensor) as scaled:
                model.backward(scaled, *args, **kwargs)

        def clip_gradients(self, *args, **kwargs):
            pass

    class ZeroShardStrategy(DDPStrategy):
        """Lightning's DDPStrategy with the zeroshard engine in place of the
        DDP wrapper: ZeRO-3 partitioned parameters, gradients and optimizer
        state. Takes DeepSpeedStrategy's keyword arguments (see the module
        docstring for which act)."""

        strategy_name = "zeroshard"
        _zs_heal = None  # a lightning_heal.Healing while a fit heals a lost rank in place

        def __init__(self, accelerator=None, config=None, load_full_weights=False, parallel_devices=None,
                     cluster_environment=None, precision_plugin=None, process_group_backend=None,
                     timeout=None, async_checkpoint=False, **knobs):
            # async_checkpoint: a save returns once the shards are staged in
            # host memory and writes in the background; removing an older
            # checkpoint (ModelCheckpoint's top-k) waits for it, so the
            # newest whole checkpoint is never the one deleted.
            self.async_checkpoint = bool(async_checkpoint)
            ddp_kwargs = {}
            if timeout is not None:
                ddp_kwargs["timeout"] = timeout
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                             process_group_backend=process_group_backend, **ddp_kwargs)
            loaded = _load_config(config)
            if loaded is not None:
                # DeepSpeedStrategy ignores its knobs when given a config; here
                # that would be silent, so the two do not mix.
                config_from_knobs(**knobs)  # unknown names and inert knobs still raise
                mapped = dict(_CONFIG_KNOBS, **_OFFLOAD_AND_AIO_KNOBS, **_FP16_KNOBS)
                given = [f"{k}={v!r}" for k, v in knobs.items() if k in mapped and v != mapped[k]]
                if given:
                    raise UnsupportedKnobError(f"ZeroShardStrategy: config= replaces the knobs, so "
                                               f"{', '.join(given)} would be ignored: put them in the config")
                self.zs_config = loaded
            else:
                self.zs_config = config_from_knobs(**knobs)
            self.loss_scaling = fp16_knobs(knobs)
            self.load_full_weights = load_full_weights

        @classmethod
        def register_strategies(cls, strategy_registry):
            strategy_registry.register("zeroshard", cls, description="zeroshard ZeRO-3 engine", override=True)

        def _trainer(self):
            module = self.lightning_module
            return getattr(module, "_trainer", None) if module is not None else None

        def setup_environment(self):
            trainer = self._trainer()
            # Healing (lightning_heal.py): the peer copies kept on under
            # zsrun --restarts for a fit that can heal; a replacement's
            # process group made without a rendezvous.
            self._zs_heal = None
            lightning_heal.before_context(trainer, self.lightning_module)
            super().setup_environment()  # the process group, whichever launcher started us
            precision = str(self.precision_plugin.precision)
            if trainer is not None:
                self.zs_config = trainer_config(self.zs_config, precision, trainer.gradient_clip_val,
                                                trainer.gradient_clip_algorithm, self.loss_scaling)
            # The engine casts the model and scales the loss; Lightning's
            # plugin for this precision (autocast, GradScaler, module.to)
            # would do it a second time, or to the empty placeholders.
            self.precision_plugin = ZeroShardPrecision(precision)
            # The context goes where Lightning puts this rank's model
            # (unless the config or ZS_DEVICE names a device).
            try:
                root = self.root_device
            except Exception:
                root = None
            # The context outlives the trainer call that made it (teardown),
            # so that a fitted model can be validated, tested or saved by the
            # next. A strategy with another config cannot use it: it goes,
            # and the params partitioned in it with it.
            global _strategy_context
            made = _strategy_context
            if made is not None and made[0] is zt.current_context() and made[1] != self.zs_config:
                zt.shutdown()
            _strategy_context = (zt.get_context(self.zs_config, like=root), copy.deepcopy(self.zs_config))
            self._zs_heal = lightning_heal.after_context(trainer, self.lightning_module)

        @contextlib.contextmanager
        def model_sharded_context(self):
            # configure_model runs here: every module is partitioned as its
            # constructor returns.
            with zt.Init(config=self.zs_config):
                yield

        def _setup_model(self, model):
            # No DDP wrapper: the engine averages gradients itself. Params
            # built outside configure_model are partitioned now.
            zt.partition_module(model, config=self.zs_config)
            return model

        def setup(self, trainer):
            # Outside fit, DDPStrategy broadcasts every param from C++
            # (_sync_module_states): params partitioned in configure_model
            # are skipped there, as DDP skips them when fitting.
            if self.model is not None:
                hide_partitioned_from_ddp(self.model)
            super().setup(trainer)
            # DDPStrategy wraps the model only to fit (validate, test and
            # predict have no gradients to reduce); a model built under Init
            # needs its hooks to run at all, and one built plainly is
            # partitioned as when fitting.
            if trainer.state.fn != TrainerFn.FITTING:
                self.model = self._setup_model(self.model)
            if self._zs_heal is not None:  # a replacement joins here, its optimizer made
                self._zs_heal = self._zs_heal.after_setup(self, trainer)

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            if self._zs_heal is None:
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            return self._zs_heal.optimizer_step(
                self._trainer(), optimizer, closure,
                lambda c: super(ZeroShardStrategy, self).optimizer_step(optimizer, c, model, **kwargs))

        def on_train_batch_start(self, batch, batch_idx):
            super().on_train_batch_start(batch, batch_idx)
            if self._zs_heal is not None:
                self._zs_heal.register(self._trainer())

        def on_exception(self, exception):
            if self._zs_heal is not None:
                self._zs_heal.on_exception(exception)
            super().on_exception(exception)

        def broadcast(self, obj, src=0):
            if self._zs_heal is not None and heal_dist.answers_locally():
                return obj  # a replacement catching up: the survivors broadcast it long ago
            return super().broadcast(obj, src)

        def process_dataloader(self, dataloader):
            dataloader = super().process_dataloader(dataloader)
            if self._zs_heal is not None:
                dataloader = self._zs_heal.loader(self._trainer(), dataloader)
            return dataloader

        # Lightning's steps reach the model through its submodules
        # (self.net(x)), not through the LightningModule's forward, whose
        # hooks begin each forward's scope (zeroshard.torch.forward_scope): each
        # step runs as the root's forward instead, so gathered params saved
        # for backward are held by reference, kept units are re-evaluated
        # after an optimizer step, and the step's output ends the backward
        # with the gradient sweep.

        def training_step(self, *args, **kwargs):
            inner = super().training_step
            if self._zs_heal is not None and not self.lightning_module.automatic_optimization:
                return self._zs_heal.manual_step(
                    self._trainer(), lambda: zt.run_as_forward(self.lightning_module, inner, *args, **kwargs))
            return zt.run_as_forward(self.lightning_module, inner, *args, **kwargs)

        def validation_step(self, *args, **kwargs):
            return zt.run_as_forward(self.lightning_module, super().validation_step, *args, **kwargs)

        def test_step(self, *args, **kwargs):
            return zt.run_as_forward(self.lightning_module, super().test_step, *args, **kwargs)

        def predict_step(self, *args, **kwargs):
            return zt.run_as_forward(self.lightning_module, super().predict_step, *args, **kwargs)

        def setup_optimizers(self, trainer):
            from .torch.optim import scheduler_follows
            super().setup_optimizers(trainer)
            converted = {id(o): _convert_optimizer(o) for o in self.optimizers}
            for config in self.lr_scheduler_configs:
                scheduler_follows(config.scheduler, converted[id(config.scheduler.optimizer)])
            self.optimizers = [converted[id(o)] for o in self.optimizers]

        # Checkpoints: `filepath` names a directory (as in DeepSpeedStrategy)
        # holding the engine's checkpoint (README, "Checkpoints"): every
        # rank writes its own shards, params and optimizer state, and
        # Lightning's other state (loops, callbacks, schedulers, epoch ...)
        # goes into it as JSON. No pickle; loads at any world size, after
        # setup, into the partitioned model and its engine optimizer.

        @property
        def restore_checkpoint_after_setup(self):
            return True

        @property
        def lightning_restore_optimizer(self):
            return False  # the engine restores it with the weights

        def lightning_module_state_dict(self):
            return {}  # the weights go through the engine's checkpoint

        def optimizer_state(self, optimizer):
            return {}

        def _engine_optimizer(self):
            opts = list(self.optimizers or [])
            if len(opts) > 1:
                raise NotImplementedError("ZeroShardStrategy checkpoints hold one optimizer, not "
                                          f"{len(opts)}")
            return opts[0] if opts else None

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            if storage_options is not None:
                raise TypeError("ZeroShardStrategy.save_checkpoint: storage_options are not supported")
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            zt.save_checkpoint(str(filepath), self.lightning_module, self._engine_optimizer(),
                               client_state=_to_json(rest, "checkpoint"), tag="checkpoint", overwrite=True,
                               async_save=self.async_checkpoint)

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            if self._zs_heal is not None and checkpoint_path == lightning_heal.HEAL_CHECKPOINT:
                return self._zs_heal.checkpoint()  # a replacement's: the survivors' state
            if self.load_full_weights:
                # Full weights only (a `zsckpt export` file or a Hugging Face
                # safetensors set): each rank reads its own shards' bytes.
                zt.load_pretrained(self.lightning_module, str(checkpoint_path))
                return {"state_dict": {}, "zeroshard": "full_weights"}
            # What the path holds decides: this strategy's own checkpoint,
            # or one that DeepSpeedStrategy (ZeRO-3) or FSDPStrategy
            # (sharded: DCP + meta.pt; full: one torch file, as DDP's) wrote.
            kind, found = lightning_checkpoint_kind(checkpoint_path)
            module, optimizer = self.lightning_module, self._engine_optimizer()
            strict = bool(getattr(module, "strict_loading", True))
            if kind == "zeroshard":
                state = zt.load_checkpoint(str(checkpoint_path), module, optimizer)
                checkpoint = _from_json(state or {})
            elif kind == "deepspeed":
                checkpoint = dict(zt.load_checkpoint(str(found), module, optimizer, strict=strict) or {})
                checkpoint.pop("deepspeed", None)  # DeepSpeed's own counters, not Lightning's
            elif kind == "fsdp_sharded":
                checkpoint = _lightning_meta(found)
                zt.load_checkpoint(str(checkpoint_path), module, optimizer, strict=strict)
            else:  # a full torch checkpoint file (FSDPStrategy's full state dict, DDP's, ...)
                checkpoint = _load_full_file(found, module, optimizer, strict)
            checkpoint["state_dict"] = {}
            checkpoint["zeroshard"] = kind
            return checkpoint

        def load_model_state_dict(self, checkpoint, strict=True):
            if "zeroshard" in checkpoint:
                return  # loaded by the engine in load_checkpoint
            state = checkpoint["state_dict"] if self.global_rank == 0 else None
            zt.load_consolidated_state_dict(self.lightning_module, state, strict=strict)

        def remove_checkpoint(self, filepath):
            if self.async_checkpoint and zt.current_context() is not None:
                zt.wait_checkpoint()  # the save in flight is durable before an older one goes
            if self.is_global_zero and os.path.isdir(filepath):
                import shutil
                shutil.rmtree(filepath)
            elif not os.path.isdir(filepath):
                super().remove_checkpoint(filepath)

        def teardown(self):
            # The context and the partitioned model stay: trainer.validate,
            # test, predict or save_checkpoint after fit use the trained
            # weights (as after DeepSpeedStrategy's fit). The process's exit,
            # zeroshard.torch.shutdown() or a strategy with another config
            # ends them.
            if self._zs_heal is not None:
                self._zs_heal.teardown()
                self._zs_heal = None
            super().teardown()

    return ZeroShardStrategy


def _register():
    """Put "zeroshard" in Lightning's strategy registry (when Lightning is
    installed), so Trainer(strategy="zeroshard") finds it."""
    global _strategy_class
    try:
        _, _, registry = _lightning()
    except ImportError:
        return
    if _strategy_class is None:
        _strategy_class = _make_strategy_class()
    _strategy_class.register_strategies(registry)


def __getattr__(name):
    global _strategy_class
    if name == "ZeroShardStrategy":
        if _strategy_class is None:
            _strategy_class = _make_strategy_class()
        return _strategy_class
    raise AttributeError(name)


_register()
