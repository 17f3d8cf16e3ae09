"""A DeepSpeed JSON as Hugging Face's integration reads it: "auto" values
resolved from TrainingArguments (and from the model's hidden size), the
16-bit section Accelerate adds for bf16/fp16 arguments, and the part of it
the engine's context is made with."""
import copy
import json
import os


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
    if model is not None and any(r.is_auto(k) for k in _SIZED):
        hidden = _hidden_size(getattr(model, "config", None))
        if hidden is None:
            raise ValueError("zeroshard.hf: the model's config has neither hidden_size nor hidden_sizes, so "
                             f"the config's 'auto' values of {[k for k in _SIZED if r.is_auto(k)]} cannot be "
                             "resolved: give them numbers")
        _fill_sized(r, hidden)
    if num_training_steps is not None:
        r.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        r.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
               "warmup_steps")
    if r.mismatches:
        raise ValueError("zeroshard.hf: these DeepSpeed config values disagree with the TrainingArguments:\n"
                         + "\n".join(r.mismatches) + "\nSet them to 'auto' (or make them agree).")
    return r.config


# Keys whose "auto" Hugging Face sizes by the model's hidden size.
_SIZED = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
          "zero_optimization.stage3_param_persistence_threshold")


def _fill_sized(r, hidden):
    r.fill(_SIZED[0], hidden * hidden, must_match=False)
    r.fill(_SIZED[1], int(0.9 * hidden * hidden), must_match=False)
    r.fill(_SIZED[2], 10 * hidden, must_match=False)


def _hidden_size(config):
    """A model config's hidden size (the largest of hidden_sizes; its text
    config's for a multimodal one), or None."""
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


def resolve_sized_autos(config_json, hf_config):
    """The JSON with its hidden-size based "auto"s resolved from a model
    config, as the Trainer resolves them (other "auto"s take the engine's
    defaults until the Trainer resolves them)."""
    r = _Resolver(copy.deepcopy(config_json))
    hidden = _hidden_size(hf_config)
    if hidden is not None:
        _fill_sized(r, hidden)
    return r.config


# DeepSpeed's reporting and its own activation checkpointing: what each asks
# for, when the value asks for anything.
_NOT_ACTED = {
    "wall_clock_breakdown": "the engine's step timings are in optimizer.step_stats(), not DeepSpeed's breakdown",
    "tensorboard": "DeepSpeed's monitors are not run: use TrainingArguments(report_to=...)",
    "wandb": "DeepSpeed's monitors are not run: use TrainingArguments(report_to=...)",
    "csv_monitor": "DeepSpeed's monitors are not run: use TrainingArguments(report_to=...)",
    "comet": "DeepSpeed's monitors are not run: use TrainingArguments(report_to=...)",
    "flops_profiler": "DeepSpeed's flops profiler is not run",
    "comms_logger": "the engine's collectives are in optimizer.wire_stats(), not DeepSpeed's comms logger",
    "activation_checkpointing": "DeepSpeed's activation checkpointing serves models that call "
                                "deepspeed.checkpointing; use gradient_checkpointing=True",
    "data_types": "gradients are accumulated in fp32 shards",
}


def _asks(key, value):
    if isinstance(value, dict):
        if key == "data_types":
            return value.get("grad_accum_dtype") not in (None, "fp32", "float32")
        return bool(value.get("enabled", bool(value))) if key != "activation_checkpointing" else bool(value)
    return bool(value)


def not_acted_on(config):
    """(key, value, reason) for each top-level key of a DeepSpeed JSON that
    neither the engine nor the Hugging Face side acts on and whose value
    asks for something (a monitor enabled, DeepSpeed's wall-clock
    breakdown, its activation checkpointing, a 16-bit accumulation dtype).
    Keys unknown here but to DeepSpeed are the engine's to name."""
    return [(k, v, _NOT_ACTED[k]) for k, v in config.items() if k in _NOT_ACTED and _asks(k, v)]


def warn_not_acted_on(config, rank):
    """One ZeroShardConfigWarning (on rank 0) naming not_acted_on(config)."""
    found = not_acted_on(config)
    if found and rank == 0:
        import warnings

        from ..errors import ZeroShardConfigWarning
        keys = [{"key": k, "value": v, "reason": why} for k, v, why in found]
        warnings.warn(ZeroShardConfigWarning("\n".join(
            f"zeroshard: config key {k} = {json.dumps(v)} is accepted but not acted on under the Hugging Face "
            f"Trainer or Accelerate: {why}" for k, v, why in found), keys), stacklevel=3)
