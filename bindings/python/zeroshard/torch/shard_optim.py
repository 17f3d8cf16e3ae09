"""Any torch optimizer over partitioned params, stepped on this rank's shards.

    zt.partition_module(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)  # any torch optimizer
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
    opt.step(); opt.zero_grad()

This is what FSDP2 users write (there each param is a DTensor shard). Here
the engine holds each param's averaged gradient shard and, for a 16-bit
param, its fp32 master shard. Torch's global step hooks wrap every
optimizer step. Before it, an engine optimizer of kind "external" (one per
torch optimizer) syncs the gradients, takes the global norm, skips the step
on inf/NaN (fp16 overflow), unscales and clips (gradient_clipping), all as
the engine's own step does. For the length of the step each partitioned
param then *is* its fp32 master: `.data` a zero-copy view of it, `.grad` a
view of its averaged gradient (None when it got none, as torch has it), and
torch's own step code runs on those. After it the params hold no values
again, 16-bit working shards are written from the masters, and the step is
counted.

Two modes, by the optimizer's class:

- on shards: an elementwise update rule (Adam, AdamW, SGD, RMSprop,
  Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop; by default any
  class not registered otherwise, e.g. Lion or schedule-free from
  packages) steps the 1-D view of this rank's elements of each param;
- whole tensors (Muon's Newton-Schulz on the 2-D update, Adafactor's
  factored moments and RMS-scaled steps): each param has one owner rank of
  its partition group, owners balanced by size; the owner sees the full
  fp32 master and averaged gradient in the param's shape and steps them,
  and the new master is broadcast back into every rank's shard. Register
  other such classes with `register_optimizer(cls, whole_tensor=True)`.

State: on shards, the per-element state tensors (exp_avg, square_avg, ...)
become views of the engine optimizer's named state after the step that
makes them, so zeroshard.torch.save_checkpoint saves and reshards them with
the params at any world size; whole-tensor state is scattered into named
state when a checkpoint is saved and gathered back by the owner at a load;
the rest (step counts, Adafactor's row and column moments) rides in the
checkpoint's JSON, exactly (shard_optim_checkpoint.py). torch's own
optimizer.state_dict() and load_state_dict() work at the same world size.
"""
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import zeroshard
from . import heal_world
from .hook_state import step_done, stepping_engines
from ._context import get_context, working_dtype
from .optim import ZeroShardOptimizer
from ._params import (adopt_assigned, freeze_untrainable, is_partitioned, optimizer_state_view, quantizes_frozen,
                      settle_dropped)
from .param_type import mark_gathered, raw_data, storage_less_like

# Classes (and their subclasses) whose update needs each param whole, and
# those that cannot run on shards at all, with why; by class or by
# "module.QualifiedName" for classes of packages not imported here.
def _class_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


_WHOLE_TENSOR = {_class_name(torch.optim.Muon), _class_name(torch.optim.Adafactor),
                 "transformers.optimization.Adafactor"}
_REFUSED = {
    _class_name(torch.optim.LBFGS): "it calls its closure many times inside one step (a forward and a backward "
                                    "each), which needs the params gathered while it steps them",
    _class_name(torch.optim.SparseAdam): "it takes sparse gradients; the engine's gradient shards are dense",
}


def register_optimizer(cls, whole_tensor):
    """Say how a torch optimizer class steps partitioned params:
    whole_tensor=True when its update of a param reads the whole tensor
    (a norm, a matrix function, factored moments), False when it is
    elementwise (the default for classes not registered)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_optimizer: expected a torch.optim.Optimizer subclass, got {cls!r}")
    name = _class_name(cls)
    (_WHOLE_TENSOR.add if whole_tensor else _WHOLE_TENSOR.discard)(name)


def _registered(cls, table):
    for c in cls.__mro__:
        if _class_name(c) in table:
            return _class_name(c)
    return None


def whole_tensor(optimizer, group=None):
    """Whether this optimizer steps a group's partitioned params whole (on
    an owner rank) rather than on this rank's shard: the group's
    "whole_tensor" key where it has one (an optimizer with Muon and AdamW
    groups), else its class's registration."""
    if group is not None and "whole_tensor" in group:
        return bool(group["whole_tensor"])
    return _registered(type(optimizer), _WHOLE_TENSOR) is not None


# -- the step --------------------------------------------------------------------------------


class ShardStepper:
    """The engine side of one torch optimizer over partitioned params: its
    external engine optimizer, which params it holds, their owners (whole-
    tensor mode), and the step under way."""

    def __init__(self, optimizer):
        ctx = get_context()
        if working_dtype() is torch.float16:
            raise NotImplementedError(
                f"zeroshard.torch: {type(optimizer).__name__} over fp16 params: fp16.enabled runs the engine's dynamic "
                f"loss scaler, whose scale multiplies the loss in ZeroShardOptimizer.backward(loss); a torch "
                f"optimizer's backward is torch's. Use bf16.enabled (fp32's range, no scaler), or "
                f"zeroshard.torch.ZeroShardOptimizer (AdamW, Adam, SGD)")
        heal_world.refuse(ctx, f"zeroshard.torch: {type(optimizer).__name__} stepped on shards",
                          "its state is views of the engine's shards; use zeroshard.torch.ZeroShardOptimizer")
        self.engine = ctx.optimizer("external")
        self.params = []      # partitioned params joined, in order
        self._joined = set()  # their ids
        self.owner = {}       # whole-tensor params: id(param) -> partition-group rank
        self._load = None     # elements owned per rank
        self._group = None    # the partition group, once a whole-tensor param joins
        self._open = None     # the step under way: [(param, class, data)] to restore
        self._engines = []
        self._views = {}      # id(param) -> (master view, grad address, grad view)
        self._full = {}       # whole-tensor params this rank owns: id(param) -> its full master, in a step
        self.last_result = None
        self.sync(optimizer)

    # params ----------------------------------------------------------------------------------
    def sync(self, optimizer):
        """Params new to the optimizer (its constructor, add_param_group) join
        the engine optimizer (one group: the hyper-parameters are torch's)."""
        new = [(p, whole_tensor(optimizer, g)) for g in optimizer.param_groups for p in g["params"]
               if is_partitioned(p) and id(p) not in self._joined]
        if not new:
            return
        freeze_untrainable([p for p, _ in new], quantizes_frozen())
        self.engine.add_group([p.zs.zparam for p, _ in new])
        for p, _ in new:
            self._joined.add(id(p))
            self.params.append(p)
        whole = [p for p, w in new if w]
        if whole:
            self._assign_owners(whole)

    def whole(self, p):
        """Whether p steps whole, on its owner rank."""
        return id(p) in self.owner

    def _assign_owners(self, new):
        if self._group is None:
            self._group = get_context().group("partition")
        size = self._group.size
        for p in new:
            z = p.zs.zparam
            if z.padded_numel != z.shard_numel * size:
                raise NotImplementedError(
                    f"zeroshard.torch: {p.zs.name or tuple(p.shape)} is partitioned over another group than the "
                    f"context's partition group ({size} ranks); a whole-tensor optimizer cannot step it")
        if self._load is None:
            self._load = [0] * size
        # Largest first onto the least loaded rank: the same on every rank.
        for p in sorted(new, key=lambda p: -p.zs.zparam.numel):
            r = min(range(size), key=lambda i: (self._load[i], i))
            self.owner[id(p)] = r
            self._load[r] += p.zs.zparam.numel

    def owns(self, p):
        return self._group is not None and self.owner.get(id(p)) == self._group.rank

    # views -----------------------------------------------------------------------------------
    def master_view(self, p):
        """This rank's fp32 master shard of p, padding included (zero-copy)."""
        cached = self._views.get(id(p))
        if cached is None:
            cached = self._views[id(p)] = [optimizer_state_view(self.engine, p.zs.zparam, 0), 0, None]
        return cached[0]

    def grad_view(self, p):
        """This rank's averaged fp32 gradient shard of p (zero-copy, padding
        included): read through zs_grad_shard_data at each step, as the
        engine asks (that call also zeroes an old one)."""
        z = p.zs.zparam
        self.master_view(p)
        cached = self._views[id(p)]
        addr = z.grad_shard_ptr()
        if cached[1] != addr or cached[2] is None:
            cached[1] = addr
            cached[2] = torch.utils.dlpack.from_dlpack(z.grad_shard_dlpack())
        return cached[2]

    def _show(self, p, data, grad):
        self._open.append((p, type(p), raw_data(p)))
        mark_gathered(p, data)
        p.grad = grad

    # step ------------------------------------------------------------------------------------
    def begin(self, optimizer):
        if self._open is not None:  # the previous step raised inside torch's code: closed first
            self.end(optimizer)
        self.sync(optimizer)
        self._engines = stepping_engines(self.params)
        for e in self._engines:
            e.before_step()
            adopt_assigned(e.params())  # a param.data = t since the forward
        self.last_result = self.engine.step_begin()
        self._open = []
        if self.last_result["skipped"]:
            return  # every .grad stays None: torch's step updates nothing
        stepped = [p for p in self.params if p.requires_grad and p.zs.zparam.grad_pushed]
        self._show_whole([p for p in stepped if self.whole(p)])
        for p in stepped:
            if self.whole(p):
                continue
            z = p.zs.zparam
            self._slice_full_state(optimizer, p)
            self._show(p, self.master_view(p)[:z.shard_valid], self.grad_view(p)[:z.shard_valid])

    @staticmethod
    def _slice_full_state(optimizer, p):
        """State an optimizer made in its constructor from the param's shape
        (Adagrad's sum: full_like(p)) becomes this rank's elements of it."""
        state = optimizer.state.get(p)
        if not state:
            return
        z = p.zs.zparam
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.zs.shape) and value.dim() > 0:
                state[key] = value.reshape(-1)[z.shard_offset:z.shard_offset + z.shard_valid].to(
                    torch.float32).clone()

    def _gather(self, p, shard):
        """The full tensor of a param from every rank's fp32 shard."""
        z = p.zs.zparam
        full = torch.empty(z.padded_numel, dtype=torch.float32, device=shard.device)
        self._group.allgather(shard, full, z.shard_numel, zeroshard.FLOAT32).wait()
        return full

    def _show_whole(self, stepped):
        self._full = {}
        for p in stepped:
            grad = self._gather(p, self.grad_view(p))
            master = self._gather(p, self.master_view(p))
            if self.owns(p):
                numel, shape = p.zs.zparam.numel, tuple(p.zs.shape)
                self._full[id(p)] = master
                self._show(p, master[:numel].view(shape), grad[:numel].view(shape))

    def end(self, optimizer):
        opened, self._open = self._open, None
        try:
            for p, cls, data in opened:
                p.grad = None
                p.__class__ = p.zs.gathered_cls
                p.data = data
                p.__class__ = cls
            if not self.last_result["skipped"]:
                self._scatter_masters()
                self._adopt_state(optimizer, [entry for entry in opened if not self.whole(entry[0])])
        finally:
            self._full = {}
            self.last_result = self.engine.step_end()
            for e in self._engines:
                e.after_step()
            self._engines = []
            step_done()
            settle_dropped()

    def _scatter_masters(self):
        """Each owner's stepped master back into every rank's shard, in the
        order every rank holds the params."""
        if self._group is None:
            return
        rank = self._group.rank
        for p in self.params:
            if not (self.whole(p) and p.requires_grad and p.zs.zparam.grad_pushed):
                continue
            z = p.zs.zparam
            root = self.owner[id(p)]
            full = self._full.get(id(p)) if root == rank else None
            if full is None:
                full = torch.empty(z.padded_numel, dtype=torch.float32, device=self.master_view(p).device)
            self._group.broadcast(full, z.padded_numel, zeroshard.FLOAT32, root).wait()
            self.master_view(p).copy_(full[rank * z.shard_numel:(rank + 1) * z.shard_numel])

    def _adopt_state(self, optimizer, opened):
        """Per-element state the step made becomes the engine's named state
        (one copy, once), which checkpoints save with the shards."""
        for p, _, _ in opened:
            state = optimizer.state.get(p)
            valid = p.zs.zparam.shard_valid
            if not state or valid == 0:
                continue
            for key, value in list(state.items()):
                if not _per_element(value, valid):
                    continue
                named = self.named_view(p, key)
                if named.data_ptr() != value.data_ptr():
                    named.copy_(value)
                    state[key] = named

    def named_view(self, p, key, create=True):
        capsule = self.engine.named_state_dlpack(p.zs.zparam, _state_name(key), create)
        if capsule is None:
            return None
        return torch.utils.dlpack.from_dlpack(capsule)[:p.zs.zparam.shard_valid]


def _per_element(value, valid):
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.dim() == 1
            and value.numel() == valid and valid > 0)


def _state_name(key):
    name = str(key)
    if not name or "/" in name or any(c.isspace() for c in name) or name in ("param", "master"):
        raise ValueError(f"zeroshard.torch: optimizer state key {key!r} cannot name engine state (expected a "
                         f"word without '/' or spaces, not 'param' or 'master')")
    return name


def stepper(optimizer, create=True):
    """The ShardStepper of a torch optimizer over partitioned params (made
    on first use), or None when it holds none."""
    s = optimizer.__dict__.get("_zs_stepper")
    if s is None and create:
        s = optimizer.__dict__["_zs_stepper"] = ShardStepper(optimizer)
    return s


def _holds_partitioned(optimizer):
    # Checked again only when its params change (add_param_group): DDP's
    # optimizers pay one count a step.
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    seen = optimizer.__dict__.get("_zs_checked_params")
    if seen is not None and seen[0] == count:
        return seen[1]
    holds = any(is_partitioned(p) for g in optimizer.param_groups for p in g["params"])
    optimizer.__dict__["_zs_checked_params"] = (count, holds)
    return holds


# The code of torch's step wrapper, which runs the step hooks: one frame of
# it per step of an optimizer under way.
_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _nested(optimizer):
    """Whether this step runs inside another step of the same optimizer: a
    subclass's step calling super().step(), both hooked by torch, runs the
    hooks twice; the engine's step is the outer one's. (A step that raised
    inside torch's code left no frame: the next one is not nested.)"""
    depth = 0
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER and frame.f_locals.get("self") is optimizer:
            depth += 1
        frame = frame.f_back
    return depth > 1


def _before_step(optimizer, args, kwargs):
    if isinstance(optimizer, ZeroShardOptimizer) or not _holds_partitioned(optimizer) or _nested(optimizer):
        return None
    refused = _registered(type(optimizer), _REFUSED)
    if refused is not None:
        raise RuntimeError(
            f"zeroshard.torch: {type(optimizer).__name__} cannot step partitioned params: {_REFUSED[refused]}. "
            f"Use an optimizer that takes one gradient per step (AdamW, Adafactor, Muon, ... or "
            f"zeroshard.torch.ZeroShardOptimizer)")
    # args[0] is the optimizer itself (torch passes step's own arguments).
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None:
        # Its forward and backward need the params gathered: run it now,
        # before they become shards; the step then sees its loss.
        with torch.enable_grad():
            loss = closure()
        args, kwargs = args[:1], dict(kwargs, closure=lambda: loss)
    stepper(optimizer).begin(optimizer)
    return args, kwargs


def _after_step(optimizer, args, kwargs):
    s = optimizer.__dict__.get("_zs_stepper")
    if s is not None and s._open is not None and not _nested(optimizer):
        s.end(optimizer)


# -- clip_grad_norm_ -------------------------------------------------------------------------

_torch_clip_grad_norm = torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ that also sees partitioned params,
    whose gradients are the engine's shards: their norm is the global one
    (every rank's shard, once), combined with the other params' .grad.
    Collective when partitioned params are among them."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    part = [p for p in params if is_partitioned(p) and p.requires_grad]
    if not part:
        return _torch_clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"zeroshard.torch: clip_grad_norm_ with norm_type={norm_type} over partitioned "
                                  f"params; the engine takes the L2 norm (norm_type=2.0)")
    max_norm = float(max_norm)
    ctx = get_context()
    zparams = [p.zs.zparam for p in part]
    grads = [p.grad for p in params if not is_partitioned(p) and p.grad is not None]
    if not grads:
        norm = ctx.clip_grad_norm(zparams, max_norm)
    else:
        # The engine's norm first (nothing scaled), then both scaled by the
        # one coefficient of the combined norm.
        engine_norm = ctx.clip_grad_norm(zparams, float("inf"))
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
        norm = float(torch.linalg.vector_norm(torch.tensor([engine_norm, float(local)], dtype=torch.float64)))
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and torch.isfinite(torch.tensor(norm)):
            ctx.clip_grad_norm(zparams, max_norm * (engine_norm + 1e-6) / (norm + 1e-6))
            torch._foreach_mul_(grads, coef)
    if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           f"non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                           f"by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return torch.tensor(norm, dtype=torch.float32, device=part[0].device)


# -- torch's load_state_dict -----------------------------------------------------------------

_torch_load_state_dict = torch.optim.Optimizer.load_state_dict


def _load_state_dict(self, state_dict):
    """torch's Optimizer.load_state_dict, with partitioned params showing
    the dtype their state steps in (fp32: the masters) while it casts the
    loaded state to each param's dtype and device."""
    if isinstance(self, ZeroShardOptimizer) or not _holds_partitioned(self):
        return _torch_load_state_dict(self, state_dict)
    shown = []
    try:
        for g in self.param_groups:
            for p in g["params"]:
                if is_partitioned(p) and p.dtype != torch.float32 and p.is_floating_point():
                    shown.append((p, type(p), raw_data(p)))
                    p.__class__ = p.zs.gathered_cls
                    p.data = storage_less_like(tuple(p.zs.shape), torch.float32, p.zs.device)
        return _torch_load_state_dict(self, state_dict)
    finally:
        for p, cls, data in shown:
            p.data = data
            p.__class__ = cls


# Every torch optimizer's step runs these around it (torch's global step
# hooks); torch.nn.utils.clip_grad_norm_ and Optimizer.load_state_dict see
# partitioned params from the import of zeroshard.torch on.
register_optimizer_step_pre_hook(_before_step)
register_optimizer_step_post_hook(_after_step)
torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
torch.optim.Optimizer.load_state_dict = _load_state_dict
