"""A torch optimizer backed by the engine's sharded optimizer."""
import contextlib
import functools
import logging
import weakref

import torch

from . import heal, heal_world, zero_grad
from .hook_state import hook_state, step_done, stepping_engines
from ..errors import InvalidArgumentError, RankLostError
from ..param import ParamArray
from ._context import get_context, working_dtype

_log = logging.getLogger("zeroshard")
from ._params import (adopt_assigned, freeze_untrainable, is_partitioned, optimizer_state_view,
                      quantizes_frozen, registered_params, settle_dropped)


class ZeroShardOptimizer(torch.optim.Optimizer):
    """AdamW, Adam, SGD or Muon (kind "muon": DeepSpeed's Muon with its
    AdamW, groups tagged "use_muon" as zeroshard.torch.muon_param_groups
    tags them) on the engine's fp32 master shards.

    A torch.optim.Optimizer as far as user code and LR schedulers can tell:
    param_groups with their hyper-parameters (read again at every step),
    step(), zero_grad(), state_dict() / load_state_dict(). The state itself
    is sharded: this rank's slice of masters and moments, as fp32 tensors
    on the context's device (CUDA tensors on a GPU context).

    Mixed precision comes from the config, as under DeepSpeed: with
    bf16.enabled (or fp16.enabled) the params are partitioned in that
    dtype and this optimizer steps fp32 masters of them, writing the
    16-bit working shards from the masters. Under fp16.enabled the engine's
    dynamic loss scaler (loss_scale, initial_scale_power,
    loss_scale_window, hysteresis, min_loss_scale) needs the loss scaled
    before the backward: call `optimizer.backward(loss)` (DeepSpeed's
    engine.backward), not `loss.backward()`, which raises under a scale
    other than 1. A step whose gradients overflow (inf or NaN) is skipped,
    logged on rank 0 (logger "zeroshard") and counted in
    `skipped_steps`; `step_was_skipped` says whether the last one was.
    """

    def __init__(self, params, kind="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 momentum=0.0, dampening=0.0, nesterov=False, bias_correction=True, use_muon=None,
                 ns_method="gram", ns_steps=5):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        dampening=dampening, nesterov=nesterov, bias_correction=bias_correction,
                        use_muon=use_muon, ns_method=ns_method, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.kind = kind
        self._engine = get_context().optimizer(kind)
        quantize_frozen = quantizes_frozen()
        for group in self.param_groups:
            for p in group["params"]:
                if not is_partitioned(p):
                    raise ValueError("ZeroShardOptimizer: every param must be partitioned first "
                                     "(zeroshard.torch.Init or partition_module)")
            # Frozen before joining: the engine keeps no optimizer state for them.
            freeze_untrainable(group["params"], quantize_frozen)
            self._engine.add_group([p.zs.zparam for p in group["params"]], **self._hparams(group))
        self.last_result = None
        self.skipped_steps = 0
        self._discard = None  # zero_grad's params, as a prebuilt array
        self._fp16 = working_dtype() is torch.float16
        self.sync_loss_scale()
        heal.note_optimizer(self)

    def sync_loss_scale(self):
        """The engine's loss scale is what backward scales by and what the
        gradient hooks require (after a step or a checkpoint load)."""
        hook_state().loss_scale = self._engine.loss_scale if self._fp16 else 1.0

    def backward(self, loss, **kwargs):
        """loss.backward(**kwargs), the loss first multiplied by the fp16
        loss scale (1 outside fp16.enabled): DeepSpeed's engine.backward.
        The engine divides the gradients by the same scale at the step."""
        with self.scaled_loss(loss) as scaled:
            scaled.backward(**kwargs)

    @contextlib.contextmanager
    def scaled_loss(self, loss):
        """The loss times the fp16 loss scale, for a backward run inside the
        block by other code (Lightning's precision plugin runs the
        LightningModule's backward hook on it)."""
        scale = self._engine.loss_scale if self._fp16 else 1.0
        hook_state().scaled_backwards += 1
        try:
            yield loss * scale if scale != 1.0 else loss
        finally:
            hook_state().scaled_backwards -= 1  # looked up again: shutdown() in the block drops the state

    @property
    def step_was_skipped(self):
        """Whether the last step was skipped (gradient overflow under fp16,
        or inf/NaN gradients): Accelerate's name for it."""
        return bool(self.last_result and self.last_result["skipped"])

    @classmethod
    def from_torch(cls, opt):
        """The engine-backed twin of torch's AdamW, Adam or SGD, or of
        zeroshard.torch.Muon with "gram" Newton-Schulz, `opt` (its params
        partitioned already): the same param groups and values. Other
        optimizers raise TypeError; options without a sharded counterpart
        (amsgrad, maximize; Muon's bf16 "standard" iteration, which the
        engine runs in fp32) NotImplementedError."""
        from .muon import Muon
        if isinstance(opt, Muon):
            return cls._from_muon(opt)
        kinds = ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd"))
        kind = next((k for c, k in kinds if isinstance(opt, c)), None)
        if kind is None:
            raise TypeError(f"zeroshard.torch: {type(opt).__name__} has no sharded counterpart (use AdamW, Adam "
                            "or SGD)")
        groups = []
        for g in opt.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise NotImplementedError(f"zeroshard.torch: {type(opt).__name__}(amsgrad={g.get('amsgrad')}, "
                                          f"maximize={g.get('maximize')}) has no sharded counterpart yet")
            groups.append({"params": g["params"], "lr": g["lr"], "weight_decay": g.get("weight_decay", 0.0),
                           "betas": g.get("betas", (0.9, 0.999)), "eps": g.get("eps", 1e-8),
                           "momentum": g.get("momentum", 0.0), "dampening": g.get("dampening", 0.0),
                           "nesterov": g.get("nesterov", False)})
        return cls(groups, kind=kind)

    @classmethod
    def _from_muon(cls, opt):
        groups = []
        for g in opt.param_groups:
            if g["ns_method"] != "gram":
                raise NotImplementedError(f"zeroshard.torch: Muon(ns_method={g['ns_method']!r}) iterates in bf16 "
                                          "as DeepSpeed's does; the engine's Muon runs \"gram\" in fp32")
            groups.append({"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"],
                           "betas": tuple(g["betas"]), "eps": g["eps"], "momentum": g["momentum"],
                           "use_muon": bool(g["use_muon"]), "ns_method": "gram", "ns_steps": g["ns_steps"]})
        return cls(groups, kind="muon")

    @classmethod
    def twin_of(cls, opt):
        """from_torch(opt) when the engine's AdamW, Adam or SGD does what
        `opt` does (the same update, fused in C++ over the shards), else
        None: `opt` then steps the shards itself (zeroshard.torch.shard_optim)."""
        try:
            return cls.from_torch(opt)
        except (TypeError, NotImplementedError):
            return None

    @staticmethod
    def _hparams(group):
        return dict(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                    weight_decay=group["weight_decay"], momentum=group["momentum"],
                    dampening=group["dampening"], nesterov=group["nesterov"],
                    bias_correction=group["bias_correction"], use_muon=group["use_muon"],
                    ns_method=group["ns_method"], ns_steps=group["ns_steps"])

    # Set by a trainer that heals in place (zeroshard.hf's Trainer): called
    # with no argument when a lost rank cuts this step short, it heals, and
    # returns True when the step committed (nothing left to do here), or
    # redoes the step's forwards and backwards and returns False (step
    # again). None: the RankLostError reaches the caller (healing_loop
    # heals around the whole train_step).
    on_rank_lost = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        while True:
            try:
                self._step_engine()
                return loss
            except RankLostError:
                if self.on_rank_lost is None:
                    raise
                with torch.enable_grad():  # it may redo the step's forwards and backwards
                    committed = self.on_rank_lost()
                if committed:
                    # Committed by the survivors' agreement: its result as
                    # this rank's norm all-reduce (or roll-forward) had it.
                    self.last_result = self._engine.heal_committed_result()
                    return loss

    def _step_engine(self):
        heal.before_engine_step(self._engine)  # under healing: this rank's blob, before the step can commit
        engines = stepping_engines([p for group in self.param_groups for p in group["params"]])
        for e in engines:
            e.before_step()
            adopt_assigned(e.params())  # a param.data = t since the forward
        self.sync_hparams()
        self.last_result = self._engine.step()
        for e in engines:
            e.after_step()
        attempted = hook_state().loss_scale
        self.sync_loss_scale()
        if self.last_result["skipped"]:
            self._note_skipped(attempted)
        step_done()
        del engines  # else they keep dropped models alive through the collector's run
        settle_dropped()
        if heal_world.follow(get_context()):  # a regrow ran inside the engine's step (under min_ranks)
            heal.forget_step_in_flight()

    def _note_skipped(self, attempted):
        self.skipped_steps += 1
        if get_context().rank == 0:
            _log.warning("zeroshard: gradient overflow (inf or NaN): optimizer step skipped at loss scale %g, "
                         "now %g (%d skipped so far)", attempted, self.last_result["loss_scale"],
                         self.skipped_steps)

    def sync_hparams(self):
        """Each param group's hyper-parameters (lr, betas, ...) to the engine."""
        for i, group in enumerate(self.param_groups):
            hp = self._hparams(group)
            del hp["use_muon"]  # fixed when the group was added
            self._engine.set_hparams(i, **hp)

    def zero_grad(self, set_to_none=True):
        # Gradients live in the engine's shards, zeroed by every step; what a
        # backward pushed since (a GAN's generator loss through these params)
        # is dropped, as torch's zero_grad drops .grad: the next step sees
        # only what is pushed after (zs_grad_discard; no collective when
        # nothing was pushed, as right after a step or before a backward).
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            p.grad = None
        if self._discard is None or self._discard.n != len(params):
            self._discard = ParamArray([p.zs.zparam for p in params])
        zero_grad.discard_engine(self._discard, set_to_none, stacklevel=4)

    def step_stats(self):
        """The last step's summary from the engine (zs_context_step_stats):
        seconds and bytes of the all-gathers, reduce-scatters and
        all-reduces, the seconds the trainer waited for them, the update's
        seconds and the whole step's."""
        return get_context().step_stats()

    def wire_stats(self):
        """Bytes this rank's collectives sent and received since the engine's
        context was made, by kind (gathers, reduce-scatters, all-reduces,
        others), qwZ's quantized gathers and qgZ's quantized gradient
        reduction apart from the full-precision ones, with the fetch counts
        (zs_context_fetch_stats)."""
        return get_context().fetch_stats()

    @property
    def loss_scale(self):
        return self._engine.loss_scale

    def state_dict(self):
        groups = []
        index = {}
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(g)
        ctx = get_context()
        shards = {}
        slots = (0, 1) if self.kind == "sgd" else (0, 1, 2)
        for group in self.param_groups:
            for p in group["params"]:
                per = {}
                for slot in slots:
                    try:
                        view = optimizer_state_view(self._engine, p.zs.zparam, slot)
                    except InvalidArgumentError:
                        continue  # a slot this optimizer does not keep (SGD without momentum)
                    # (bf16 slots, under bf16_optimizer_states, raise: save them with
                    # zeroshard.torch.save_checkpoint, which keeps their dtype.)
                    per[slot] = view.clone()
                shards[index[id(p)]] = per
        return {"state": {}, "param_groups": groups,
                "zeroshard": {"kind": self.kind, **_members(ctx),
                              "steps": self._engine.steps, "shards": shards}}

    def load_state_dict(self, state_dict):
        z = state_dict.get("zeroshard")
        here = _members(get_context())
        if z is None or z["world_size"] != here["world_size"] or z["rank"] != here["rank"]:
            raise ValueError("ZeroShardOptimizer.load_state_dict: the state is sharded for rank "
                             f"{None if z is None else z['rank']} of {None if z is None else z['world_size']}, "
                             f"this is rank {here['rank']} of {here['world_size']}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"ZeroShardOptimizer.load_state_dict: {len(state_dict['param_groups'])} param "
                             f"groups in the state, {len(self.param_groups)} here")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                for slot, values in z["shards"][index].items():
                    view = optimizer_state_view(self._engine, p.zs.zparam, int(slot))
                    if values.numel() != view.numel():
                        raise ValueError(f"ZeroShardOptimizer.load_state_dict: slot {slot} of param {index} "
                                         f"has {values.numel()} elements, expected {view.numel()}")
                    # Any device to the engine's: torch copies across devices.
                    view.copy_(values.detach().reshape(-1))
                index += 1
        self._engine.steps = z["steps"]
        self._engine.sync_params()
        self.sync_loss_scale()
        for e in _hook_engines():
            e.after_step()


def scheduler_follows(scheduler, twin):
    """A torch LR scheduler made on the optimizer that `twin` (the engine's,
    ZeroShardOptimizer.twin_of) replaced steps `twin`'s groups from now on,
    and `twin.step` notes its calls as torch's scheduler wraps its
    optimizer's (for its check that the optimizer stepped first): without
    that the first scheduler step warned that optimizer.step() had been
    overridden."""
    scheduler.optimizer = twin
    if hasattr(twin.step, "_wrapped_by_lr_sched"):
        return
    step, owner = type(twin).step, weakref.ref(twin)

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        o = owner()
        o._opt_called = True
        return step(o, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    twin.step = wrapper


def _members(ctx):
    """How this rank's shards are laid out: its position among the live
    ranks and their count (its id and the world's size until a shrink)."""
    rank, world = heal_world.position(ctx) if heal_world.may_change(ctx) else (ctx.rank, ctx.world_size)
    return {"rank": rank, "world_size": world}


def _hook_engines():
    engines = []
    for p in registered_params():
        if p.zs is None or p.zs.owner is None:
            continue
        if p.zs.owner.engine not in engines:
            engines.append(p.zs.owner.engine)
    return engines
