"""from_pretrained partitioned at load time: DeepSpeed's HfDeepSpeedConfig
and is_deepspeed_zero3_enabled for the engine."""
import contextlib
import json
import logging
import os
import sys
import weakref

import torch
import transformers

from .. import torch as zt
from . import trainer_heal
from .config import _engine_config, _load, resolve_sized_autos

_zero3 = [None]  # weakref to the registered config holder (HfZeroShardConfig, or TrainingArguments')


class HfZeroShardConfig:
    """DeepSpeed's HfDeepSpeedConfig for zeroshard: while this object lives,
    `from_pretrained` of any Hugging Face model builds it under
    zeroshard.torch.Init with `config` (a DeepSpeed JSON) and each rank
    reads only its own shards' bytes of the weights: the full model is
    never materialised on one rank. Keep a reference, as with DeepSpeed's.
    `TrainingArguments(deepspeed=...)` made after `import zeroshard.hf`
    does the same, for as long as it lives (its DeepSpeed registration is
    taken over: DeepSpeed's zero.Init would partition the model for
    DeepSpeed)."""

    def __init__(self, config):
        self.config = _load(config)
        _register(self)

    def is_zero3(self):
        return self.config.get("zero_optimization", {}).get("stage") in (3, "auto")


def _register(holder):
    _zero3[0] = weakref.ref(holder)


@contextlib.contextmanager
def loading_partitioned(config):
    """from_pretrained loads partitioned with `config` (a resolved DeepSpeed
    JSON) inside the block; the registration before it is back after."""
    _take_over_deepspeed_registration()
    before = _zero3[0]
    holder = HfZeroShardConfig(config)
    try:
        yield holder
    finally:
        _zero3[0] = before


def _keep_given_config():
    """transformers' HfDeepSpeedConfig objects keep the JSON as given
    (Accelerate's DeepSpeedPlugin later fills DeepSpeed's own defaults into
    their .config, such as steps_per_print = inf, which is not JSON)."""
    from transformers.integrations import deepspeed as hf_deepspeed
    cls = hf_deepspeed.HfDeepSpeedConfig
    if getattr(cls.__init__, "_zs_keeps_given", False):
        return
    original = cls.__init__

    def __init__(self, config_file_or_dict):
        self._zs_given = _load(config_file_or_dict)
        original(self, config_file_or_dict)

    __init__._zs_keeps_given = True
    cls.__init__ = __init__


def _take_over_deepspeed_registration():
    """A HfDeepSpeedConfig that TrainingArguments(deepspeed=...) registered
    with transformers becomes ours: transformers' own checks then see no
    DeepSpeed (its zero.Init path is DeepSpeed's, not the engine's)."""
    from transformers.integrations import deepspeed as hf_deepspeed
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    holder = ref() if ref is not None else None
    if holder is not None and holder.is_zero3():
        _register(holder)
    hf_deepspeed.unset_hf_deepspeed_config()


def zero3_config():
    """The DeepSpeed JSON (dict) registered for loading partitioned, or None."""
    _take_over_deepspeed_registration()
    holder = _zero3[0]() if _zero3[0] is not None else None
    if holder is None or not holder.is_zero3():
        return None
    return getattr(holder, "_zs_given", holder.config)


def _weight_files(path, hub_kwargs):
    """(the path load_safetensors takes, the names in it) for a checkpoint
    directory, file or Hub id (through Hugging Face's cache)."""
    from safetensors import safe_open
    from transformers.utils import cached_file
    if os.path.isfile(path) and path.endswith(".safetensors"):
        files, top = [path], path
    else:
        index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False,
                            **hub_kwargs)
        if index is not None:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            files = [cached_file(path, shard, **hub_kwargs) for shard in shards]
            top = index
        else:
            single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False,
                                 **hub_kwargs)
            if single is None:
                raise ValueError(f"zeroshard.hf: {path} has no model.safetensors(.index.json): the engine loads "
                                 "safetensors weights (convert .bin checkpoints with save_pretrained first)")
            files, top = [single], single
    names = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                names[key] = file
    return top, names


def _file_name(name, in_file, prefix):
    """The checkpoint's key for the model's param `name`: as it is, or
    with/without the base model's prefix (a head model from a base
    checkpoint, or the reverse), as from_pretrained matches them."""
    for candidate in (name, f"{prefix}.{name}" if prefix else None,
                      name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None):
        if candidate is not None and candidate in in_file:
            return candidate
    return None


def _params_missing(cls, config, build, kwargs, in_file, prefix):
    """Whether some param of the model is not in the checkpoint: the names
    of a build on the meta device (which allocates and draws nothing). A
    model whose constructor needs real values (an .item() in custom code)
    is taken as lacking some: it is initialised in full, as before."""
    try:
        with torch.device("meta"), _without_initial_values():
            probe = cls._from_config(config, **build, **kwargs)
    except Exception:  # noqa: BLE001 (any failure of the probe only costs the draws)
        return True
    return any(_file_name(name, in_file, prefix) is None for name, _ in probe.named_parameters())


@contextlib.contextmanager
def _without_initial_values():
    """Modules built inside draw no initial values: torch's init functions
    do nothing (as transformers' no_init_weights makes them), nor does
    PreTrainedModel.initialize_weights; ties are still made (no_init_weights
    would skip them, with the rest of init_weights)."""
    from transformers import initialization

    def skip(*args, **kwargs):
        pass

    saved = [(transformers.PreTrainedModel, "initialize_weights", transformers.PreTrainedModel.initialize_weights)]
    for name in initialization.TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(name)
        for fn in initialization.TORCH_INIT_FUNCTIONS if module is not None else ():
            if hasattr(module, fn):
                saved.append((module, fn, getattr(module, fn)))
    try:
        for owner, fn, _ in saved:
            setattr(owner, fn, skip)
        yield
    finally:
        for owner, fn, original in reversed(saved):
            setattr(owner, fn, original)


_HUB_KEYS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
# from_pretrained options that ask for another way of placing or reading
# the weights, and the ones that change nothing here.
_REFUSED_LOADING = ("device_map", "quantization_config", "tp_plan", "load_in_8bit", "load_in_4bit", "state_dict",
                    "gguf_file", "from_tf", "from_flax", "variant", "output_loading_info", "offload_folder",
                    "key_mapping", "ignore_mismatched_sizes")
_IGNORED_LOADING = ("low_cpu_mem_usage", "trust_remote_code", "adapter_kwargs", "adapter_name", "_from_auto",
                    "_from_pipeline", "_commit_hash", "use_safetensors", "weights_only", "resume_download",
                    "offload_state_dict", "offload_buffers", "use_kernels")


def _from_pretrained_partitioned(cls, path, config_json, *model_args, **kwargs):
    from safetensors import safe_open
    refused = [k for k in _REFUSED_LOADING if kwargs.get(k) not in (None, False)]
    if refused or model_args:
        raise ValueError(f"zeroshard.hf: from_pretrained({', '.join(refused) or 'positional model args'}) with a "
                         "zeroshard config registered: the engine places, partitions and reads the model's "
                         "safetensors weights itself; leave them unset")
    hub = {k: kwargs.pop(k) for k in _HUB_KEYS if k in kwargs}
    for k in _REFUSED_LOADING + _IGNORED_LOADING:  # the refused ones unset (None, False): as if not given
        kwargs.pop(k, None)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config, kwargs = cls.config_class.from_pretrained(config or path, return_unused_kwargs=True, **hub,
                                                          **kwargs)
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    if dtype == "auto":
        dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    engine = resolve_sized_autos(config_json, config)
    trainer_heal.before_loading()
    top, in_file = _weight_files(os.fspath(path), hub)
    prefix = getattr(cls, "base_model_prefix", "")
    build = {"dtype": dtype} if dtype is not None else {}
    # Every param read from the checkpoint right after: none needs initial
    # values, which every rank drew in full before (a 35M Llama: 40M normal
    # draws a rank); DeepSpeed's ZeRO-3 loading skips them too.
    drawing = contextlib.nullcontext() if _params_missing(cls, config, build, kwargs, in_file, prefix) \
        else _without_initial_values()
    with drawing, zt.Init(config=_engine_config(engine)):
        model = cls._from_config(config, **build, **kwargs)
    params, names, missing = [], [], []
    for name, p in model.named_parameters():
        key = _file_name(name, in_file, prefix)
        if key is None:
            missing.append(name)
        else:
            params.append(p)
            names.append(key)
    # Each rank reads its own shards' bytes.
    zt.get_context().load_safetensors(top, [p.zs.zparam for p in params], names=names, strict=True)
    for name, buffer in model.named_buffers():
        key = _file_name(name, in_file, prefix)
        if key is not None:
            with safe_open(in_file[key], "pt") as f, torch.no_grad():
                buffer.copy_(f.get_tensor(key))
    if missing and zt.get_context().rank == 0:
        logging.getLogger("zeroshard").warning(
            "zeroshard.hf: %s: these params are not in the checkpoint and keep their fresh initialisation: %s",
            cls.__name__, ", ".join(missing))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(path, **hub)
        except OSError:
            pass
    model.config.name_or_path = os.fspath(path)  # as from_pretrained records it (TRL loads its reference model by it)
    model.eval()
    return model


_original_from_pretrained = transformers.PreTrainedModel.from_pretrained.__func__


@classmethod
def _from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    config_json = zero3_config()
    if config_json is None or pretrained_model_name_or_path is None:
        return _original_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)
    return _from_pretrained_partitioned(cls, pretrained_model_name_or_path, config_json, *model_args, **kwargs)


transformers.PreTrainedModel.from_pretrained = _from_pretrained
_keep_given_config()
