"""Hugging Face's Trainer on the zeroshard engine: a script written for
`transformers.Trainer` with a DeepSpeed JSON trains unchanged but for one
import.

    from zeroshard.hf import Trainer          # was: from transformers import Trainer
    args = TrainingArguments(output_dir="out", deepspeed="ds_zero3.json", ...)
    trainer = Trainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()

Why a subclass: Hugging Face routes `TrainingArguments(deepspeed=...)` to
DeepSpeed through Accelerate, with no hook for another engine; a subclass
of `transformers.Trainer` is how Hugging Face itself and the libraries on it
(TRL's trainers, Seq2SeqTrainer) change what the training loop runs on. The
JSON is read, its "auto" values resolved from the TrainingArguments as
Hugging Face's DeepSpeed integration resolves them (resolve_config), and
the run's DeepSpeed wiring removed from the arguments the base class sees:
the engine acts on the config instead.

What the engine does in the loop: the model is partitioned (zeroshard.torch),
never wrapped in DDP; the optimizer is the engine's (the JSON's "optimizer"
section, else the TrainingArguments'); the JSON's "scheduler" section runs
DeepSpeed's WarmupLR / WarmupDecayLR, else the Trainer's own scheduler; the
backward scales the loss under fp16 (ZeroShardOptimizer.backward); clipping
is the config's gradient_clipping (max_grad_norm); float inputs are cast to
the model's 16-bit dtype under bf16/fp16. Checkpoints (save_strategy) hold
the engine's sharded, crash-safe checkpoint in <checkpoint>/zeroshard and
resume at any world size; save_model writes model.safetensors and the
config, which from_pretrained reads unsharded.

For a Trainer subclass of another library (TRL's SFTTrainer):
`zeroshard.hf.trainer_class(SFTTrainer)`.
"""
import copy
import json
import math
import os

import torch
import transformers

from . import torch as zt
from .torch._context import working_dtype

__all__ = ["Trainer", "Seq2SeqTrainer", "trainer_class", "resolve_config", "HfZeroShardConfig", "WarmupLR",
           "WarmupDecayLR"]

CHECKPOINT_DIR = "zeroshard"  # the engine's checkpoint inside a Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"


# -- the config ---------------------------------------------------------------
def _load(config):
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    text = os.fspath(config)
    if text.lstrip().startswith("{"):
        return json.loads(text)
    with open(text, encoding="utf-8") as f:
        return json.load(f)


class _Resolver:
    """Hugging Face's "auto" resolution of a DeepSpeed JSON
    (HfTrainerDeepSpeedConfig.trainer_config_process and _finalize): an
    "auto" takes the TrainingArguments' value; a value that is not "auto"
    and disagrees with them is collected and reported."""

    def __init__(self, config):
        self.config = config
        self.mismatches = []

    def _node(self, key):
        *path, leaf = key.split(".")
        node = self.config
        for part in path:
            node = node.get(part)
            if not isinstance(node, dict):
                return None, leaf
        return node, leaf

    def fill(self, key, value, hf_key=None, must_match=True):
        node, leaf = self._node(key)
        if node is None or leaf not in node:
            return
        if node[leaf] == "auto":
            node[leaf] = value
        elif must_match and node[leaf] != value:
            self.mismatches.append(f"- ds {key}={node[leaf]} vs hf {hf_key}={value}")

    def is_auto(self, key):
        node, leaf = self._node(key)
        return node is not None and node.get(leaf) == "auto"


def resolve_config(config, args, model=None, num_training_steps=None):
    """The DeepSpeed JSON `config` (dict, JSON text or path) with its
    "auto" values resolved from TrainingArguments `args`, as Hugging
    Face's DeepSpeed integration resolves them: batch sizes, gradient
    accumulation, clipping, optimizer and scheduler params, bf16/fp16; with
    `model`, the hidden-size based bucket and threshold sizes; with
    `num_training_steps`, the scheduler's step counts. A value set in the
    JSON that disagrees with the arguments raises ValueError naming both."""
    r = _Resolver(_load(config))
    world = args.world_size
    r.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
    r.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    r.fill("train_batch_size", world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
           "train_batch_size (calculated)")
    r.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    r.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    r.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    r.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    r.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    r.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    r.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    r.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    r.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    # TrainingArguments(bf16=True) with no bf16 section: Accelerate's
    # DeepSpeedPlugin adds one (fp16 likewise), so DeepSpeed trains in bf16.
    for flag, section in ((args.bf16, "bf16"), (args.fp16, "fp16")):
        if flag and "bf16" not in r.config and "fp16" not in r.config:
            r.config[section] = {"enabled": True}
    sized = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
             "zero_optimization.stage3_param_persistence_threshold"]
    if model is not None and any(r.is_auto(k) for k in sized):
        hidden = _hidden_size(model)
        if hidden is None:
            raise ValueError("zeroshard.hf: the model's config has neither hidden_size nor hidden_sizes, so "
                             f"the config's 'auto' values of {[k for k in sized if r.is_auto(k)]} cannot be "
                             "resolved: give them numbers")
        r.fill(sized[0], hidden * hidden, must_match=False)
        r.fill(sized[1], int(0.9 * hidden * hidden), must_match=False)
        r.fill(sized[2], 10 * hidden, must_match=False)
    if num_training_steps is not None:
        r.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        r.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
               "warmup_steps")
    if r.mismatches:
        raise ValueError("zeroshard.hf: these DeepSpeed config values disagree with the TrainingArguments:\n"
                         + "\n".join(r.mismatches) + "\nSet them to 'auto' (or make them agree).")
    return r.config


def _hidden_size(model):
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def _engine_config(config):
    """What the engine's context is made with: the resolved JSON less the
    sections the Trainer side acts on (the optimizer and the scheduler
    are built here; batch sizes stay: the engine lists them as trainer
    keys)."""
    return {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}


# -- DeepSpeed's schedulers ---------------------------------------------------
class WarmupLR:
    """DeepSpeed's WarmupLR on a torch optimizer, step for step: from
    warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear),
    then warmup_max_lr. The first optimizer step runs at warmup_min_lr, as
    under DeepSpeed."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"zeroshard.hf: scheduler.params.warmup_num_steps must be a positive integer, "
                             f"got {warmup_num_steps!r}")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"zeroshard.hf: scheduler.params.warmup_type {warmup_type!r}: expected 'log' or "
                             "'linear'")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lrs = self._per_group(warmup_min_lr, len(groups))
        self.max_lrs = self._per_group(warmup_max_lr, len(groups))
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply()

    @staticmethod
    def _per_group(value, n):
        return list(value) if isinstance(value, (list, tuple)) else [value] * n

    def _gamma(self):
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _apply(self):
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration=None):
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = self._apply()

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply()


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then linear decay to 0 at
    total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


_SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
# TrainingArguments.optim values the engine's AdamW stands for: each is
# AdamW with decoupled weight decay, differing only in torch's kernels.
_ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused"}


# -- the accelerator ----------------------------------------------------------
def _accelerator_class(base):
    """Accelerate's Accelerator as the Trainer uses it, with the model left
    unwrapped (the engine reduces gradients: a DDP wrapper would reduce
    them again), the backward through the engine's loss scaling, and
    clipping left to the engine (the config's gradient_clipping)."""

    class ZeroShardAccelerator(base):
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            if any(zt.is_partitioned(p) for p in model.parameters()):
                return model
            return super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=evaluation_mode)

        def prepare_optimizer(self, optimizer, device_placement=None):
            # Placing the optimizer would round-trip every shard through
            # state_dict(): the engine's state is on its device already.
            if isinstance(optimizer, zt.ZeroShardOptimizer):
                device_placement = False
            return super().prepare_optimizer(optimizer, device_placement=device_placement)

        def backward(self, loss, **kwargs):
            opt = _engine_optimizer(self._optimizers)
            if opt is None:
                return super().backward(loss, **kwargs)
            kwargs.pop("scale_wrt_gas", None)
            opt.backward(loss, **kwargs)

        def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
            if _engine_optimizer(self._optimizers) is None:
                return super().clip_grad_norm_(parameters, max_norm, norm_type)
            return None  # the engine clips at its step, and reports the norm there

        @property
        def optimizer_step_was_skipped(self):
            opt = _engine_optimizer(self._optimizers)
            if opt is None:
                return super().optimizer_step_was_skipped
            return opt.step_was_skipped

    ZeroShardAccelerator.__name__ = ZeroShardAccelerator.__qualname__ = f"ZeroShard{base.__name__}"
    return ZeroShardAccelerator


def _engine_optimizer(optimizers):
    for o in optimizers or ():
        inner = getattr(o, "optimizer", o)
        if isinstance(inner, zt.ZeroShardOptimizer):
            return inner
    return None


# -- the Trainer --------------------------------------------------------------
# TrainingArguments the engine cannot honour with a sharded model, and what
# to use instead.
def _refused(args):
    out = []
    if args.torch_compile:
        out.append("torch_compile=True: the engine's gather hooks run around each module's forward, which "
                   "torch.compile does not keep; leave it False")
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size=True: a retry with a smaller batch would rebuild the partitioned model "
                   "(as under DeepSpeed ZeRO-3); set per_device_train_batch_size")
    if args.fsdp:
        out.append(f"fsdp={args.fsdp!r}: zeroshard shards the model itself; leave fsdp unset")
    if str(getattr(args.optim, "value", args.optim)) not in _ADAMW_OPTIMS | {"sgd"}:
        out.append(f"optim={getattr(args.optim, 'value', args.optim)!r}: the engine steps AdamW, Adam and SGD on "
                   "its shards; use optim='adamw_torch' (or an \"optimizer\" section in the config)")
    return out


class ZeroShardTrainerMixin:
    """The zeroshard engine under a transformers.Trainer (or a subclass):
    see the module docstring. `zeroshard_config` is the DeepSpeed config
    when the TrainingArguments carry none (`deepspeed=`)."""

    def __init__(self, model=None, args=None, *rest, zeroshard_config=None, **kwargs):
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        source = zeroshard_config if zeroshard_config is not None else args.deepspeed
        if zeroshard_config is not None and args.deepspeed:
            raise ValueError("zeroshard.hf.Trainer: give the config once, as TrainingArguments(deepspeed=...) or "
                             "zeroshard_config=, not both")
        if kwargs.get("model_init") is not None:
            raise ValueError("zeroshard.hf.Trainer: model_init (a model rebuilt per run or trial) is not "
                             "supported: pass the model, built under zeroshard.torch.Init or plainly")
        args = _detach_deepspeed(args)
        refused = _refused(args)
        if refused:
            raise ValueError("zeroshard.hf.Trainer: these TrainingArguments cannot work with a sharded model:\n- "
                             + "\n- ".join(refused))
        config = resolve_config(source if source is not None else {"zero_optimization": {"stage": 3}},
                                args, model=model)
        stage = config.get("zero_optimization", {}).get("stage", 3)
        if stage not in (3, "auto"):
            raise ValueError(f"zeroshard.hf.Trainer: zero_optimization.stage {stage!r}: zeroshard always "
                             "partitions parameters, gradients and optimizer state (ZeRO stage 3); set 3")
        self.zs_config = config
        if model is not None:
            zt.partition_module(model, config=_engine_config(config))
        self._zs_dtype = working_dtype() if model is not None else None
        super().__init__(model, args, *rest, **kwargs)

    # -- setup --
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = _accelerator_class(type(self.accelerator))

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        section = self.zs_config.get("optimizer")
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if section is not None:
            kind, hp = _optimizer_from_section(section)
        else:
            kind = "sgd" if str(getattr(self.args.optim, "value", self.args.optim)) == "sgd" else "adamw"
            hp = dict(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                      eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay)
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": hp.get("weight_decay", 0.0)},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.optimizer = zt.ZeroShardOptimizer(groups, kind=kind, **hp)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        section = self.zs_config.get("scheduler")
        if self.lr_scheduler is not None or section is None:
            return super().create_scheduler(num_training_steps, optimizer)
        config = resolve_config({"scheduler": section}, self.args, num_training_steps=num_training_steps)
        kind, params = config["scheduler"].get("type"), dict(config["scheduler"].get("params", {}))
        if kind not in _SCHEDULERS:
            raise ValueError(f"zeroshard.hf: scheduler.type {kind!r} is not supported: zeroshard runs DeepSpeed's "
                             f"{', '.join(_SCHEDULERS)}, or the Trainer's own scheduler (lr_scheduler_type) when "
                             "the config has no scheduler section")
        self.lr_scheduler = _SCHEDULERS[kind](optimizer or self.optimizer, **params)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _prepare_input(self, data):
        data = super()._prepare_input(data)
        if self._zs_dtype is not None and torch.is_tensor(data) and torch.is_floating_point(data):
            return data.to(self._zs_dtype)  # as the Trainer casts them for DeepSpeed
        return data

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # The engine takes the global norm at its step, before clipping.
        if grad_norm is None and self.optimizer is not None:
            result = getattr(_engine_optimizer([self.optimizer]), "last_result", None)
            if result is not None:
                grad_norm = result["grad_norm"]
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- saving --
    def _save(self, output_dir=None, state_dict=None):
        # torch's state_dict() of a partitioned model gathers it a module at
        # a time, on every rank (collective); the main process writes it.
        if state_dict is None:
            state_dict = self.model.state_dict()
        if self.args.should_save:
            super()._save(output_dir, state_dict=state_dict)

    def save_model(self, output_dir=None, _internal_call=False):
        # A checkpoint holds the engine's shards: full weights too only when
        # the config asks (DeepSpeed's stage3_gather_16bit_weights_on_model_save).
        zero = self.zs_config.get("zero_optimization", {})
        gather = zero.get("stage3_gather_16bit_weights_on_model_save", zero.get("gather_16bit_weights_on_model_save"))
        if _internal_call and not gather:
            return
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir):
        zt.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model,
                           _engine_optimizer([self.optimizer]), tag="state", overwrite=True)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The weights come with the optimizer's state (_load_optimizer_and_scheduler).
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            raise ValueError(f"zeroshard.hf: {resume_from_checkpoint} holds no zeroshard checkpoint "
                             f"({CHECKPOINT_DIR}/): resume from a checkpoint this Trainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        zt.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR), self.model,
                           _engine_optimizer([self.optimizer]), tag="state")
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        zt.load_checkpoint(os.path.join(best, CHECKPOINT_DIR), self.model, None, tag="state")


def _optimizer_from_section(section):
    """(kind, hyper-parameters) of the config's "optimizer" section."""
    kind = str(section.get("type", "")).lower()
    params = dict(section.get("params", {}))
    if kind not in _OPTIMIZERS:
        raise ValueError(f"zeroshard.hf: optimizer.type {section.get('type')!r} is not supported: the engine steps "
                         "AdamW, Adam and SGD on its shards")
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
    if kind == "adam" and params.pop("adam_w_mode", True):
        kind = "adamw"
    params.pop("torch_adam", None)
    hp = {}
    for key in ("lr", "eps", "weight_decay", "momentum", "dampening", "nesterov", "bias_correction"):
        if key in params:
            hp[key] = params.pop(key)
    if "betas" in params:
        hp["betas"] = tuple(params.pop("betas"))
    if params:
        raise ValueError(f"zeroshard.hf: optimizer.params {sorted(params)} are not acted on by the engine's "
                         f"{kind}; remove them")
    return _OPTIMIZERS[kind], hp


def _detach_deepspeed(args):
    """Take the DeepSpeed wiring out of `args`, in place (the Trainer and
    the user's code share the object): no DeepSpeed plugin, no Accelerate
    mixed precision (the engine's config carries bf16/fp16: Accelerate
    would add autocast over 16-bit params), and the process state set up
    again without DeepSpeed. `args.deepspeed` keeps the user's value, and
    its HfTrainerDeepSpeedConfig lives on with `args` (HfZeroShardConfig's
    role: later from_pretrained calls load partitioned)."""
    given = args.deepspeed
    args.deepspeed = None
    args.deepspeed_plugin = None
    args.mixed_precision = "no"
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    args.__dict__.pop("_setup_devices", None)  # a cached_property: set up again without DeepSpeed
    args.device  # noqa: B018 (the set-up is the point)
    args.deepspeed = given
    _take_over_deepspeed_registration()  # from_pretrained: the engine's path, not DeepSpeed's
    return args


# -- from_pretrained partitioned at load time -----------------------------------
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
    import weakref
    _zero3[0] = weakref.ref(holder)


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
    for k in _IGNORED_LOADING:
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
    with zt.Init(config=_engine_config(engine)):
        model = cls._from_config(config, **({"dtype": dtype} if dtype is not None else {}), **kwargs)
    top, in_file = _weight_files(os.fspath(path), hub)
    prefix = getattr(cls, "base_model_prefix", "")
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
        import logging
        logging.getLogger("zeroshard").warning(
            "zeroshard.hf: %s: these params are not in the checkpoint and keep their fresh initialisation: %s",
            cls.__name__, ", ".join(missing))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(path, **hub)
        except OSError:
            pass
    model.eval()
    return model


def resolve_sized_autos(config_json, hf_config):
    """The JSON with its hidden-size based "auto"s resolved from a model
    config, as the Trainer resolves them (other "auto"s take the engine's
    defaults until the Trainer resolves them)."""
    class _Model:
        config = hf_config
    r = _Resolver(copy.deepcopy(config_json))
    sized = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
             "zero_optimization.stage3_param_persistence_threshold"]
    hidden = _hidden_size(_Model)
    if hidden is not None:
        r.fill(sized[0], hidden * hidden, must_match=False)
        r.fill(sized[1], int(0.9 * hidden * hidden), must_match=False)
        r.fill(sized[2], 10 * hidden, must_match=False)
    return r.config


_original_from_pretrained = transformers.PreTrainedModel.from_pretrained.__func__


@classmethod
def _from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    config_json = zero3_config()
    if config_json is None or pretrained_model_name_or_path is None:
        return _original_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)
    return _from_pretrained_partitioned(cls, pretrained_model_name_or_path, config_json, *model_args, **kwargs)


transformers.PreTrainedModel.from_pretrained = _from_pretrained
_keep_given_config()

_classes = {}


def trainer_class(base):
    """`base` (transformers.Trainer or a subclass: Seq2SeqTrainer, TRL's
    SFTTrainer) running on the zeroshard engine."""
    if base not in _classes:
        attrs = {"__module__": __name__, "__doc__": f"{base.__name__} on the zeroshard engine."}
        if issubclass(base, transformers.Seq2SeqTrainer):
            def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
                # generate() on ranks that stop at different lengths: every
                # rank runs forwards until all have finished, so their
                # gathers pair up (DeepSpeed ZeRO-3's synced_gpus).
                if self.args.world_size > 1:
                    if not gen_kwargs:  # what the base class would take: evaluate()'s or predict()'s
                        gen_kwargs = dict(getattr(self, "_gen_kwargs", None) or {})
                    gen_kwargs.setdefault("synced_gpus", True)
                return base.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys,
                                            **gen_kwargs)
            attrs["prediction_step"] = prediction_step
        _classes[base] = type(base.__name__, (ZeroShardTrainerMixin, base), attrs)
    return _classes[base]


Trainer = trainer_class(transformers.Trainer)
Seq2SeqTrainer = trainer_class(transformers.Seq2SeqTrainer)
