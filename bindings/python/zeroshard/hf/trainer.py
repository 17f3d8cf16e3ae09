"""transformers.Trainer (or a subclass of it) on the engine; see the package
docstring."""
import inspect
import os
import types
import typing

import torch
import transformers

from .. import torch as zt
from ..torch._context import working_dtype
from ..torch._params import freeze_untrainable
from ..torch import shard_optim, trainer_checkpoint
from .accelerator import _accelerator_class, checkpoint_optimizer, fsdp_settings, fully_shard_by_plugin
from .config import _engine_config, resolve_config, warn_not_acted_on
from .pretrained import _take_over_deepspeed_registration, loading_partitioned
from .schedulers import SCHEDULERS
from . import trainer_heal
from .trainer_heal import HealingTrainerMixin

CHECKPOINT_DIR = "zeroshard"  # the engine's checkpoint inside a Trainer checkpoint folder
SCHEDULER_NAME = "scheduler.pt"
# transformers.Trainer under FSDP with SHARDED_STATE_DICT: Accelerate's DCP folders
FSDP_MODEL_DIR, FSDP_OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
# TrainingArguments.optim values the engine's AdamW stands for: each is
# AdamW with decoupled weight decay, differing only in torch's kernels.
_ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused"}


# TrainingArguments the engine cannot honour with a sharded model, and what
# to use instead.
def _refused(args):
    out = []
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size=True: a retry with a smaller batch would rebuild the partitioned model "
                   "(as under DeepSpeed ZeRO-3); set per_device_train_batch_size")
    return out


class ZeroShardTrainerMixin:
    """The zeroshard engine under a transformers.Trainer (or a subclass):
    see the module docstring. `zeroshard_config` is the DeepSpeed config
    when the TrainingArguments carry none (`deepspeed=`)."""

    def __init__(self, *args, zeroshard_config=None, async_checkpoint=False, deepspeed_checkpoint=False,
                 fsdp_checkpoint=False, **kwargs):
        # async_checkpoint: each checkpoint's engine state is written in the
        # background (zt.save_checkpoint(async_save=True)); rotating old
        # checkpoints out (save_total_limit) and the end of train() wait for it.
        self.async_checkpoint = bool(async_checkpoint)
        # deepspeed_checkpoint: each checkpoint-N/ also holds DeepSpeed
        # ZeRO-3's layout (global_stepN/, latest, zero_to_fp32.py), which
        # transformers.Trainer under DeepSpeed resumes: True for this run's
        # world size, an int for another (DeepSpeed loads ZeRO-3 optimizer
        # state only at the world size it was written for).
        if deepspeed_checkpoint is not False and not (deepspeed_checkpoint is True or (
                isinstance(deepspeed_checkpoint, int) and deepspeed_checkpoint >= 1)):
            raise ValueError(f"zeroshard.hf.Trainer: deepspeed_checkpoint={deepspeed_checkpoint!r}: True (this "
                             f"run's world size), a world size >= 1, or False")
        self.deepspeed_checkpoint = deepspeed_checkpoint
        # fsdp_checkpoint: each checkpoint-N/ also holds what
        # transformers.Trainer under FSDP2 with SHARDED_STATE_DICT writes
        # (Accelerate's pytorch_model_fsdp_0/ and optimizer_0/, torch DCP),
        # which that Trainer resumes at any world size.
        if not isinstance(fsdp_checkpoint, bool):
            raise ValueError(f"zeroshard.hf.Trainer: fsdp_checkpoint={fsdp_checkpoint!r}: True or False")
        self.fsdp_checkpoint = fsdp_checkpoint
        # The arguments by the base class's own signature: TRL's trainers
        # put reward_funcs or ref_model second, and take the model as a path.
        mro = type(self).__mro__
        signature = _init_signature(mro[mro.index(ZeroShardTrainerMixin) + 1:])
        call = _bind(signature, type(self).__name__, args, kwargs)
        model = call.arguments.get("model")
        if fsdp_checkpoint and _is_peft(model):
            # Under FSDP2 the Trainer saves and loads a PEFT model's adapters
            # alone, by PEFT's key names: not the full layout written here.
            raise ValueError("zeroshard.hf.Trainer: fsdp_checkpoint=True with a PEFT model is not written yet "
                             "(FSDP2 checkpoints of a PEFT model hold its adapters alone); leave it False")
        targs = call.arguments.get("args")
        if targs is None:
            targs = call.arguments["args"] = _arguments_class(signature)(output_dir="tmp_trainer")
        source = zeroshard_config if zeroshard_config is not None else targs.deepspeed
        if zeroshard_config is not None and targs.deepspeed:
            raise ValueError("zeroshard.hf.Trainer: give the config once, as TrainingArguments(deepspeed=...) or "
                             "zeroshard_config=, not both")
        if call.arguments.get("model_init") is not None:
            raise ValueError("zeroshard.hf.Trainer: model_init (a model rebuilt per run or trial) is not "
                             "supported: pass the model, built under zeroshard.torch.Init or plainly")
        if targs.fsdp and source is not None:
            raise ValueError("zeroshard.hf.Trainer: TrainingArguments(fsdp=...) and a DeepSpeed config "
                             "(deepspeed= or zeroshard_config=): give one")
        targs = _detach_deepspeed(targs)
        refused = _refused(targs)
        if refused:
            raise ValueError("zeroshard.hf.Trainer: these TrainingArguments cannot work with a sharded model:\n- "
                             + "\n- ".join(refused))
        by_path = isinstance(model, (str, os.PathLike))
        # FSDP2's route (fsdp=..., fsdp_config={"version": 2}): fully_shard as
        # Accelerate's plugin would wrap, the Trainer's own torch optimizer.
        self._zs_fsdp = _fsdp_route(targs) if targs.fsdp else None
        if self._zs_fsdp is not None:
            config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save":
                                            "FULL" in str(self._zs_fsdp.state_dict_type)}}
        else:
            config = resolve_config(source if source is not None else {"zero_optimization": {"stage": 3}},
                                    targs, model=_config_holder(model, targs) if by_path else model)
            warn_not_acted_on(config, targs.process_index)
        self.zs_config = config
        engine_config = _engine_config(config)
        base = mro[mro.index(ZeroShardTrainerMixin) + 1]
        on_engine = _steps_on_engine(config, targs)
        # What says whether a TRL trainer can heal, before the base class
        # has stored any of it.
        self._zs_init_arguments = {"args": targs, **{k: call.arguments.get(k) for k in ("environment_factory",
                                                                                         "rollout_func",
                                                                                         "train_dataset")}}
        trainer_heal.before_context(self, base, on_engine)
        if model is not None and not by_path:
            self._partition(model, engine_config)
        given = list(_frozen_models(call.arguments))
        for frozen in given:
            frozen_model(frozen, engine_config)
        # Models the base class loads from a path (the policy, TRL's
        # reference and reward models) load partitioned, each rank reading
        # its own shards.
        with loading_partitioned(config):
            super().__init__(*call.args, **call.kwargs)
        if by_path:  # loaded partitioned by the base class: the engine's hooks now
            self._partition(self.model, engine_config)
        # TRL's DistillationTrainer's JSD loss reads both models' lm_head.weight
        # directly, as TRL's fused head does inside the model's forward.
        reads_head = base.__name__ == "DistillationTrainer" and base.__module__.split(".")[0] == "trl"
        for frozen in _frozen_models(vars(self)):
            if all(frozen is not m for m in given):  # built by the base class from a path
                frozen_model(frozen, engine_config)
            _declare_fused_head(frozen, reads_head)
        _declare_fused_head(self.model, reads_head)
        trainer_heal.after_context(self, base, on_engine)
        # TRL's ds3_gather_for_generation (True by default): generate() in
        # the loop gathers the policy whole when it fits; False: per forward.
        if getattr(targs, "ds3_gather_for_generation", True) is False and self.model is not None:
            zt.set_generation_gather(self.model, False)
        self._zs_dtype = working_dtype() if self.model is not None else None

    # -- setup --
    def _partition(self, model, engine_config):
        if self._zs_fsdp is not None:
            fully_shard_by_plugin(model, self._zs_fsdp)
        else:
            zt.partition_module(model, config=engine_config)

    def _precompute_ref_logps(self, *args, **kwargs):
        """TRL's DPO and KTO with precompute_ref_log_probs: their __init__
        scores the dataset with the model it keeps for it (the reference,
        or the policy when it keeps none) before this mixin hooks the
        models TRL loaded from a path; hooked here first (partition_module
        hooks a module once)."""
        model = getattr(self, "ref_model", None) or self.model
        if self._zs_fsdp is None and model is not None:
            zt.partition_module(model, config=_engine_config(self.zs_config))
        return super()._precompute_ref_logps(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = _accelerator_class(type(self.accelerator))

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        if self._zs_fsdp is not None:  # as under FSDP2: the Trainer's torch optimizer, stepping the shards
            return super().create_optimizer(model)
        model = self.model if model is None else model
        section = self.zs_config.get("optimizer")
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if section is not None:
            kind, hp = _optimizer_from_section(section)
        elif optim in _ADAMW_OPTIMS or optim == "sgd":
            kind = "sgd" if optim == "sgd" else "adamw"
            hp = dict(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                      eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay)
        else:
            kind = None  # the Trainer's own choice of torch optimizer, stepping the shards
            cls, hp = self.get_optimizer_cls_and_kwargs(self.args, model)
        weight_decay = hp.get("weight_decay", self.args.weight_decay if kind is None else 0.0)
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if kind == "muon":
            # DeepSpeed splits each group into its Muon and AdamW halves, by
            # the param's name and shape (zeroshard.torch.muon_param_groups).
            hidden = {id(p) for g in zt.muon_param_groups(model) if g["use_muon"] for p in g["params"]}
            groups = [dict(g, params=[p for p in g["params"] if (id(p) in hidden) is use], use_muon=use)
                      for g in groups for use in (True, False)]
            muon = zt.Muon([g for g in groups if g["params"]], **hp)
            # The engine's Muon (C++, fp32 Newton-Schulz on the BLAS) where it
            # runs the same method; "standard" (bf16) steps as torch code.
            self.optimizer = zt.ZeroShardOptimizer.twin_of(muon) or muon
            return self.optimizer
        if kind is None:
            self.optimizer = cls(groups, **hp)
        else:
            self.optimizer = zt.ZeroShardOptimizer(groups, kind=kind, **hp)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        section = self.zs_config.get("scheduler")
        if self.lr_scheduler is not None or section is None:
            return super().create_scheduler(num_training_steps, optimizer)
        config = resolve_config({"scheduler": section}, self.args, num_training_steps=num_training_steps)
        kind, params = config["scheduler"].get("type"), dict(config["scheduler"].get("params", {}))
        if kind not in SCHEDULERS:
            raise ValueError(f"zeroshard.hf: scheduler.type {kind!r} is not supported: zeroshard runs DeepSpeed's "
                             f"{', '.join(SCHEDULERS)}, or the Trainer's own scheduler (lr_scheduler_type) when "
                             "the config has no scheduler section")
        self.lr_scheduler = SCHEDULERS[kind](optimizer or self.optimizer, **params)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _prepare_input(self, data):
        data = super()._prepare_input(data)
        if self._zs_dtype is not None and torch.is_tensor(data) and torch.is_floating_point(data):
            return data.to(self._zs_dtype)  # as the Trainer casts them for DeepSpeed
        return data

    def _zs_grad_norm(self, grad_norm):
        """The norm to log: the Trainer's, else the engine's, which it takes
        at its step, before clipping (for a step a lost rank cut short once
        it committed: zs_heal_committed_result's)."""
        if grad_norm is None and self.optimizer is not None:
            opt = checkpoint_optimizer([self.optimizer])
            result = getattr(opt if isinstance(opt, zt.ZeroShardOptimizer) else shard_optim.stepper(opt),
                             "last_result", None)
            if result is not None:
                grad_norm = result["grad_norm"]
        return grad_norm

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        return super()._maybe_log_save_evaluate(tr_loss, self._zs_grad_norm(grad_norm), *args, **kwargs)

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

    def _save_checkpoint(self, model, trial):
        if not (self.async_checkpoint and self.args.save_total_limit):
            return super()._save_checkpoint(model, trial)
        # The Trainer deletes the oldest checkpoints right after a save: not
        # before this one is durable, so the newest whole one always stays.
        import transformers.trainer as hf_trainer
        rotate = hf_trainer.rotate_checkpoints

        def rotate_once_written(*args, **kwargs):
            zt.wait_checkpoint()
            return rotate(*args, **kwargs)
        hf_trainer.rotate_checkpoints = rotate_once_written
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            hf_trainer.rotate_checkpoints = rotate

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        if self.async_checkpoint and zt.current_context() is not None:
            zt.wait_checkpoint()  # the last checkpoint is durable when train() returns
        return result

    def _save_optimizer_and_scheduler(self, output_dir):
        # The folder is the weights' save's to make, which writes nothing
        # here unless the config gathers 16-bit weights on save.
        os.makedirs(output_dir, exist_ok=True)
        zt.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model,
                           checkpoint_optimizer([self.optimizer]), tag="state", overwrite=True,
                           async_save=self.async_checkpoint)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        if self.deepspeed_checkpoint is not False:
            self._save_deepspeed_layout(output_dir)
        if self.fsdp_checkpoint:
            self._save_fsdp_layout(output_dir)

    def _save_fsdp_layout(self, output_dir):
        """FSDP2's sharded layout beside the engine's: Accelerate's
        pytorch_model_fsdp_0/ and optimizer_0/ (torch DCP), written from the
        live shards (masters and Adam moments) by every rank."""
        from ..torch import dcp_checkpoint
        from ..torch._params import optimizer_state_view
        opt = checkpoint_optimizer([self.optimizer])
        if isinstance(opt, zt.ZeroShardOptimizer):
            if opt.kind not in ("adamw", "adam"):
                raise ValueError(f"zeroshard.hf.Trainer(fsdp_checkpoint=True): FSDP's layout is written from "
                                 f"AdamW or Adam state, not the engine's {opt.kind}")
            optim = str(getattr(self.args.optim, "value", self.args.optim))
            # as the Trainer under FSDP2 makes its torch AdamW
            extras = [{"fused": True if optim == "adamw_torch_fused" else None}] * len(opt.param_groups)
        else:
            extras = None
        dcp_checkpoint.save_accelerate_fsdp(os.path.join(output_dir, FSDP_MODEL_DIR),
                                            os.path.join(output_dir, FSDP_OPTIMIZER_DIR), self.model, opt,
                                            optimizer_state_view, group_extras=extras)

    def _save_deepspeed_layout(self, output_dir):
        """DeepSpeed ZeRO-3's files beside the engine's, read back from the
        engine's checkpoint just written: each rank writes the DeepSpeed
        ranks r with r % world == its rank; rank 0 commits global_stepN/
        and `latest`, and copies DeepSpeed's zero_to_fp32.py."""
        import torch.distributed as dist

        from ..torch import deepspeed_export
        zt.wait_checkpoint()  # an asynchronous save is read back: durable first
        opt = checkpoint_optimizer([self.optimizer])
        if not isinstance(opt, zt.ZeroShardOptimizer):
            raise ValueError(f"zeroshard.hf.Trainer(deepspeed_checkpoint=...): DeepSpeed's layout is written from "
                             f"the engine's AdamW, not a {type(opt).__name__}")
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        extras = [{**({"initial_lr": g["initial_lr"]} if "initial_lr" in g else {}),
                   "fused": True if optim == "adamw_torch_fused" else None} for g in opt.param_groups]
        world = self.args.world_size if self.deepspeed_checkpoint is True else int(self.deepspeed_checkpoint)
        barrier = dist.barrier if dist.is_available() and dist.is_initialized() else None
        deepspeed_export.export(os.path.join(output_dir, CHECKPOINT_DIR), output_dir, world_size=world,
                                ds_config=self.zs_config, group_extras=extras, rank=self.args.process_index,
                                world=self.args.world_size, barrier=barrier)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The weights come with the optimizer's state (_load_optimizer_and_scheduler).
        _resumable(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        kind = _resumable(checkpoint)
        empty = []  # the saved optimizer's groups that held no param, left out here
        if kind == "zeroshard":
            zt.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR), self.model,
                               checkpoint_optimizer([self.optimizer]), tag="state")
        elif kind == "deepspeed":  # the global_stepN its `latest` names: weights and optimizer state
            strict = not _is_peft(self.model) or not _deepspeed_without_frozen(checkpoint, self.model)
            zt.load_checkpoint(checkpoint, self.model, checkpoint_optimizer([self.optimizer]), strict=strict)
        elif kind == "fsdp_sharded":  # torch DCP folders: the model's, then the optimizer's
            from ..torch.checkpoint import load_dcp_checkpoint
            load_dcp_checkpoint(os.path.join(checkpoint, FSDP_MODEL_DIR), self.model,
                                checkpoint_optimizer([self.optimizer]),
                                optim_path=os.path.join(checkpoint, FSDP_OPTIMIZER_DIR))
        elif kind == "fsdp_full":  # pytorch_model_fsdp.bin and optimizer.bin, by name
            trainer_checkpoint.load_fsdp_full(checkpoint, self.model, checkpoint_optimizer([self.optimizer]))
        elif kind == "peft":  # a PEFT model's adapters and their optimizer state
            empty = trainer_checkpoint.load_adapters(checkpoint, self.model, checkpoint_optimizer([self.optimizer]))
        else:  # model.safetensors and optimizer.pt: DDP's
            empty = trainer_checkpoint.load(checkpoint, self.model, checkpoint_optimizer([self.optimizer]))
        # The Trainer's own files, whichever engine wrote the folder: the
        # schedule here; trainer_state.json (the step, hence the data
        # position) and each rank's RNG state in the base class's train().
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(_without_groups(torch.load(path, weights_only=True), empty or []))

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        zt.load_checkpoint(os.path.join(best, CHECKPOINT_DIR), self.model, None, tag="state")


def _is_peft(model):
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def _deepspeed_without_frozen(checkpoint, model):
    """True if the DeepSpeed checkpoint in `checkpoint` holds the PEFT
    model's trainable params and none of its frozen ones, as
    transformers.Trainer saves a PEFT model under DeepSpeed
    (save_checkpoint(exclude_frozen_parameters=True)): the frozen base
    then stays as built, as DeepSpeed's own resume leaves it. Any other
    difference is a ValueError naming the params."""
    from ..torch import deepspeed_checkpoint
    theirs = set(deepspeed_checkpoint.DeepSpeedCheckpoint(deepspeed_checkpoint.find(checkpoint)).names())
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if theirs >= every:
        return False  # the whole model: loaded strictly
    if trainable <= theirs <= every:
        return True
    raise ValueError(f"zeroshard.hf: the DeepSpeed checkpoint in {checkpoint} and the PEFT model differ: trainable "
                     f"here but not in it {sorted(trainable - theirs)[:5]}, in it but not in the model "
                     f"{sorted(theirs - every)[:5]}: the same PEFT config as the run that saved it?")


def _without_groups(state, empty):
    """A torch LR scheduler's state_dict without the entries of the
    optimizer's groups `empty` (indices into the saved optimizer's groups,
    which held no param and which this Trainer's optimizer leaves out):
    each per-group list (base_lrs, _last_lr, lr_lambdas, ...) loses them."""
    if not empty:
        return state
    per_group = {k for k in ("base_lrs", "_last_lr", "lr_lambdas") if isinstance(state.get(k), list)}
    sizes = {len(state[k]) for k in per_group}
    if len(sizes) != 1 or max(empty) >= min(sizes):
        raise ValueError(f"zeroshard.hf: the checkpoint's scheduler state has per-group entries of sizes "
                         f"{sorted(sizes)}; its optimizer had empty groups {empty} to leave out")
    return {k: [v for i, v in enumerate(state[k]) if i not in empty] if k in per_group else state[k]
            for k in state}


def _resumable(checkpoint):
    """What wrote the Trainer checkpoint folder `checkpoint`: "zeroshard"
    (this Trainer: <checkpoint>/zeroshard), "deepspeed" (transformers.Trainer
    under DeepSpeed: <checkpoint>/latest naming its global_stepN),
    "fsdp_sharded" (transformers.Trainer under FSDP with
    state_dict_type SHARDED_STATE_DICT: Accelerate's pytorch_model_fsdp_0/
    and optimizer_0/, torch DCP folders), "fsdp_full" (the same with
    FULL_STATE_DICT: pytorch_model_fsdp.bin and optimizer.bin), "torch"
    (transformers.Trainer under DDP: model.safetensors and optimizer.pt)
    or "peft" (the same for a PEFT model: adapter_model.safetensors and
    optimizer.pt); anything else is a ValueError saying what the folder
    holds."""
    from ..torch import dcp_checkpoint, deepspeed_checkpoint
    if os.path.isdir(os.path.join(checkpoint, CHECKPOINT_DIR)):
        return "zeroshard"
    if deepspeed_checkpoint.find(checkpoint) is not None:
        return "deepspeed"
    found = sorted(f + ("/" if os.path.isdir(os.path.join(checkpoint, f)) else "") for f in os.listdir(checkpoint)) \
        if os.path.isdir(checkpoint) else None
    if dcp_checkpoint.find(os.path.join(checkpoint, FSDP_MODEL_DIR)):
        if not dcp_checkpoint.find(os.path.join(checkpoint, FSDP_OPTIMIZER_DIR)):
            raise ValueError(f"zeroshard.hf: resume_from_checkpoint={checkpoint!r} holds FSDP's sharded model "
                             f"({FSDP_MODEL_DIR}/) but no {FSDP_OPTIMIZER_DIR}/ (a torch DCP folder with the "
                             f"optimizer's state): it holds {found[:12]}")
        return "fsdp_sharded"
    if trainer_checkpoint.find_fsdp_full(checkpoint):
        return "fsdp_full"
    if trainer_checkpoint.find(checkpoint):
        return "torch"
    if trainer_checkpoint.find_adapters(checkpoint):
        return "peft"
    more = ""
    if found is not None and any(f.startswith("pytorch_model_fsdp") and f.endswith(".bin") for f in found):
        more = (f"; pytorch_model_fsdp*.bin without {trainer_checkpoint.FSDP_FULL_OPTIMIZER} beside it, or per "
                f"rank (_rankN.bin: a sharded state dict saved without DCP, which is not read)")
    raise ValueError(f"zeroshard.hf: resume_from_checkpoint={checkpoint!r} "
                     + ("is not a folder" if found is None else f"holds {found[:12]}")
                     + f": expected a Trainer checkpoint folder written by this Trainer ({CHECKPOINT_DIR}/) or by "
                       f"transformers.Trainer under DeepSpeed (latest and global_stepN/), FSDP with sharded state "
                       f"dicts ({FSDP_MODEL_DIR}/ and {FSDP_OPTIMIZER_DIR}/) or full ones "
                       f"({trainer_checkpoint.FSDP_FULL_WEIGHTS} and {trainer_checkpoint.FSDP_FULL_OPTIMIZER}), "
                       f"or DDP ({trainer_checkpoint.WEIGHTS} "
                       f"or a PEFT model's {trainer_checkpoint.ADAPTER_WEIGHTS[0]}, and {trainer_checkpoint.OPTIMIZER})"
                     + more)


def _steps_on_engine(config, args):
    """Whether create_optimizer makes the engine's AdamW, Adam or SGD (not
    Muon, nor a torch optimizer stepping the shards)."""
    section = config.get("optimizer")
    if section is not None:
        return str(section.get("type", "")).lower() in _OPTIMIZERS
    optim = str(getattr(args.optim, "value", args.optim))
    return optim in _ADAMW_OPTIMS or optim == "sgd"


def _optimizer_from_section(section):
    """(kind, hyper-parameters) of the config's "optimizer" section."""
    kind = str(section.get("type", "")).lower()
    params = dict(section.get("params", {}))
    if kind == "muon":
        return "muon", _muon_params(params)
    if kind not in _OPTIMIZERS:
        raise ValueError(f"zeroshard.hf: optimizer.type {section.get('type')!r} is not supported: the engine steps "
                         "AdamW, Adam and SGD on its shards, and Muon (with its AdamW) as DeepSpeed does")
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


# DeepSpeed 0.19's Muon keys (optimizer.params of "type": "Muon"): each is
# zeroshard.torch.Muon's keyword of the same name.
_MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "betas", "eps", "muon_lr", "adam_lr")


def _muon_params(params):
    if params.pop("per_head_muon", False):
        raise ValueError("zeroshard.hf: optimizer.params.per_head_muon = true is not supported yet: Muon "
                         "orthogonalizes each matrix whole; remove it")
    if not params.pop("adam_w_mode", True):
        raise ValueError("zeroshard.hf: optimizer.params.adam_w_mode = false with Muon: its AdamW half decouples "
                         "weight decay (DeepSpeed's default); remove it")
    params.pop("torch_adam", None)  # which AdamW kernel DeepSpeed picks: the same update
    unknown = sorted(set(params) - set(_MUON_KEYS))
    if unknown:
        raise ValueError(f"zeroshard.hf: optimizer.params {unknown} are not acted on by Muon; it takes "
                         f"{sorted(_MUON_KEYS)}")
    hp = dict(params)
    if "betas" in hp:
        hp["betas"] = tuple(hp["betas"])
    return hp


def _fsdp_route(args):
    """TrainingArguments(fsdp=..., fsdp_config=...): the plugin the Trainer
    would give Accelerate (FSDP2 only), for fully_shard_by_plugin, taken out
    of `args` so that the base Trainer's Accelerator is a plain one."""
    from accelerate import FullyShardedDataParallelPlugin
    mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    plugin = fsdp_settings(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args), mixed)
    args.fsdp_plugin_args = None
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    return plugin


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


def _init_signature(bases):
    """The signature that names the base trainer's parameters (without
    self): the first __init__ along `bases` (its MRO) that is not a bare
    (*args, **kwargs) pass-through (TRL's experimental BEMA DPOTrainer)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for cls in bases:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        if any(p.kind in named for p in params):
            return inspect.Signature(params)
    raise TypeError(f"zeroshard.hf.trainer_class: {bases[0].__name__} is not a transformers.Trainer subclass")


def _bind(signature, name, args, kwargs):
    """`args`/`kwargs` bound to the base trainer's `signature`."""
    try:
        return signature.bind_partial(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


def _arguments_class(signature):
    """The arguments class the base trainer's signature names (TRL's
    DPOConfig, GRPOConfig, ...; else TrainingArguments), made with its
    defaults when no arguments are given, as the base trainer would."""
    annotation = signature.parameters.get("args")
    annotation = annotation.annotation if annotation is not None else None
    for cls in (typing.get_args(annotation) or (annotation,)):
        if isinstance(cls, type) and issubclass(cls, transformers.TrainingArguments):
            return cls
    return transformers.TrainingArguments


def _config_holder(path, args):
    """An object with the `.config` of the model at `path`, for the sized
    "auto"s (the model itself is loaded by the base trainer)."""
    init = dict(getattr(args, "model_init_kwargs", None) or {})
    hub = {k: init[k] for k in ("revision", "cache_dir", "token", "trust_remote_code") if k in init}
    return types.SimpleNamespace(config=transformers.AutoConfig.from_pretrained(os.fspath(path), **hub))


# The arguments and attributes of TRL's trainers that hold models used for
# inference only: the reference model (DPO, KTO, GRPO with beta > 0),
# reward models (GRPO, RLOO: reward_funcs; PPO-style: reward_model) and the
# teacher of distillation (GKD, GOLD). PPO's value_model trains: not one.
_INFERENCE_ONLY = ("ref_model", "reward_model", "reward_funcs", "teacher_model")


def _frozen_models(named):
    for key in _INFERENCE_ONLY:
        value = named.get(key)
        for m in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(m, torch.nn.Module):
                yield m


def _declare_fused_head(model, reads_head=False):
    """TRL's fused LM head (add_fused_lm_head, an instance `forward`) reads
    the output embedding's weight inside the model's own forward without
    calling its module, as a loss that reads it (`reads_head`) does inside
    the model's forward redirected: declared an external param of the
    model, it is fetched with the model's forward (as TRL gathers it under
    DeepSpeed)."""
    if not (reads_head or "forward" in vars(model)) or not callable(getattr(model, "get_output_embeddings", None)):
        return
    head = model.get_output_embeddings()
    if head is not None and head is not model:
        for p in head.parameters(recurse=False):
            if zt.is_partitioned(p):
                zt.register_external_parameter(model, p)


def frozen_model(module, config):
    """An inference-only model (a reference or reward model) on the
    engine: partitioned in the policy's context if it is not yet, its
    params frozen (no gradients, so no gradient shards; not given to the
    optimizer, so no optimizer state) and in eval mode. Its gathers pair
    with the policy's in the same context."""
    zt.partition_module(module, config=config)  # hooks too for one loaded partitioned
    module.requires_grad_(False)
    # Frozen in the engine too, as DeepSpeed treats a param with
    # requires_grad=False: a push is refused by name, and a peer copy for
    # healing carries its shards (frozen params in no optimizer ride in the
    # first optimizer's). Under zero_quantized_nontrainable_weights its
    # shard becomes the quantized codes, as that key asks.
    freeze_untrainable(list(module.parameters()), True)
    module.eval()
    # Its scoring calls under no_grad gather it whole when it fits, and keep
    # that copy for the next calls while it fits in a quarter of the memory
    # (inference_gather.py): one gather, instead of one a module every call.
    zt.set_inference_gather(module, "auto", keep="auto")
    return module


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
        _classes[base] = type(base.__name__, (HealingTrainerMixin, ZeroShardTrainerMixin, base), attrs)
    return _classes[base]


Trainer = trainer_class(transformers.Trainer)
Seq2SeqTrainer = trainer_class(transformers.Seq2SeqTrainer)
