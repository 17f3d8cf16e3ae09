"""FSDP2's API over the engine: torch.distributed.fsdp.fully_shard, its
policies and the methods of the module it returns, so that an FSDP2
script (torchtitan's: fully_shard each block, then the root) moves with
one import:

    from zeroshard.torch import fully_shard, MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # stepped on the shards (shard_optim)

How each argument maps onto the engine (one context per process, made by
the first call from what it asks):

- units: each fully_shard'd module is one gather unit holding the params
  of its subtree but those of fully_shard'd modules inside it (FSDP2's
  param groups); the modules between carry no hooks. The last call (the
  outermost module) is the root: the hooks of the calls inside it make
  way for the root's, which cover them all. A list of modules is one call
  per module (each its own unit: the same numbers, one more gather each).
- reshard_after_forward: True releases after the forward, False (and None
  for the root) keeps the unit gathered until its backward is done, an
  int k keeps a secondary shard within groups of k ranks which the
  backward gathers from (the engine's hpZ, zero_hpz_partition_size, for
  every unit); one int per process.
- mesh: a 1-D mesh of every rank is the shard group (as mesh=None); a 2-D
  (replicate, shard) mesh shards within groups of consecutive ranks and
  replicates across them (the engine's MiCS, mics_shard_size): HSDP.
- mp_policy: param_dtype bfloat16 partitions floating params in bf16 with
  fp32 masters that a torch optimizer steps (bf16.enabled); reduce_dtype
  is the dtype gradients are reduce-scattered in (communication_data_type;
  None: param_dtype's); output_dtype casts each unit's floating outputs;
  cast_forward_inputs casts each unit's floating inputs to param_dtype.
  One param_dtype and reduce_dtype per process.
- device: the shards live where FSDP2 puts them: on the mesh's device
  type, by default torch.cuda's current GPU when there is one, else the
  host; a model built on the host is registered from host memory.
- offload_policy: CPUOffloadPolicy keeps shards, gradients and optimizer
  state in host memory, where a CPU context keeps them already (pin_memory
  then has no device to pin for); a CUDA context refuses it by name.
- ignored_params: left whole and unmanaged on every rank, as FSDP2 leaves
  them: their gradients are not reduced.
- shard_placement_fn: refused (the engine shards each param flat).

The returned module's methods (FSDPModule's) are ZeroShardFSDPModule's
below: each acts or names why it cannot.
"""
import warnings

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from . import _context
from ._context import get_context, working_dtype
from ._params import is_partitioned
from .init import partition_module
from .gather_unit import _acquire_unit, _release
from .input_cast import cast_inputs_to, cast_outputs_to

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


class _Spec:
    """What fully_shard(module, ...) asked for that the hooks read."""

    __slots__ = ("reshard_after_forward",)

    def __init__(self, reshard_after_forward):
        self.reshard_after_forward = reshard_after_forward

    def keeps_for_backward(self, is_root):
        """Whether the unit stays gathered from its forward to its backward."""
        after = self.reshard_after_forward
        return (is_root if after is None else after is False)


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), ignored_params=None):
    """Shard `module`'s params across ranks with torch 2.11's fully_shard
    signature and meaning (see the module docstring); returns the module,
    whose class now also derives from ZeroShardFSDPModule. Collective."""
    if isinstance(module, (list, tuple)):
        for m in module:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                        offload_policy=offload_policy, ignored_params=ignored_params)
        return module
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"zeroshard.torch.fully_shard: expected an nn.Module or a list of them, got "
                        f"{type(module).__name__}")
    if shard_placement_fn is not None:
        raise NotImplementedError("zeroshard.torch.fully_shard: shard_placement_fn is not supported: the "
                                  "engine shards each param flat over the ranks (Shard(0)'s numbers); leave "
                                  "it None")
    if not isinstance(reshard_after_forward, (bool, int, type(None))):
        raise TypeError(f"zeroshard.torch.fully_shard: reshard_after_forward must be a bool, an int or None, "
                        f"got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"zeroshard.torch.fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"zeroshard.torch.fully_shard: offload_policy must be an OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    device = next((p.device for p in module.parameters()), None)
    if device is not None and device.type == "meta":
        raise NotImplementedError("zeroshard.torch.fully_shard: the module's params are on the meta device; "
                                  "build it on its device (or under zeroshard.torch.Init, which never holds "
                                  "more than one module whole) and then call fully_shard")
    _check_not_inside_a_root(module)
    _context_for(mesh, reshard_after_forward, mp_policy, offload_policy)
    for p in ignored_params or ():
        p._zs_ignored = True
    module.__dict__["_zs_fsdp"] = _Spec(reshard_after_forward)
    _cast_hooks(module, mp_policy)
    # The calls inside this one were roots until now: their hooks make way
    # for this module's, which cover their units.
    for m in module.modules():
        engine = m.__dict__.get("_zs_hooks")
        if engine is not None:
            engine.remove()
            del m.__dict__["_zs_hooks"]
    partition_module(module)
    _become_fsdp(module)
    return module


def _check_not_inside_a_root(module):
    """An outer module fully_shard'd (or partitioned) already holds this
    one's params in its units: FSDP2's order is inner modules first, the
    root last."""
    inside = set(map(id, module.modules()))
    for p in module.parameters():
        engine = p.zs.engine if is_partitioned(p) else None
        if engine is not None and id(engine.model) not in inside:
            raise ValueError(f"zeroshard.torch.fully_shard: {type(module).__name__} is inside "
                             f"{type(engine.model).__name__}, which was fully_shard'd (or partitioned) "
                             "already: call fully_shard on the inner modules first and on the root last")


def _context_for(mesh, reshard_after_forward, mp_policy, offload_policy):
    """The context, made from what this call asks if none exists yet; an
    existing one must agree with it (one config per process)."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else None
    zero = {"stage": 3}
    if mesh is not None:
        if world is not None and mesh.size() != world:
            raise ValueError(f"zeroshard.torch.fully_shard: the mesh spans {mesh.size()} ranks of {world}; "
                             "the engine shards over every rank: give a mesh of the whole world")
        if mesh.ndim == 2:
            replicate, shard = mesh.shape
            ranks = mesh.mesh.flatten().tolist()
            if ranks != list(range(mesh.size())):
                raise ValueError(f"zeroshard.torch.fully_shard: a 2-D mesh's shard groups must be consecutive "
                                 f"ranks (init_device_mesh(..., ({replicate}, {shard}))), got {mesh.mesh.tolist()}")
            zero["mics_shard_size"] = shard
        elif mesh.ndim != 1:
            raise ValueError(f"zeroshard.torch.fully_shard: a {mesh.ndim}-D mesh; expected 1-D (shard) or 2-D "
                             "(replicate, shard)")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        zero["zero_hpz_partition_size"] = reshard_after_forward
    config = {"zero_optimization": zero}
    dtype = mp_policy.param_dtype
    if dtype == torch.float16:
        raise NotImplementedError("zeroshard.torch.fully_shard: param_dtype torch.float16 is not supported "
                                  "(the engine's fp16 scales the loss itself); use torch.bfloat16")
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"zeroshard.torch.fully_shard: param_dtype {dtype}; expected torch.bfloat16, "
                         "torch.float32 or None")
    reduce = mp_policy.reduce_dtype if mp_policy.reduce_dtype is not None else dtype
    if reduce not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"zeroshard.torch.fully_shard: reduce_dtype {reduce}; expected torch.bfloat16, "
                         "torch.float32 or None")
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if reduce is not None:
        config["communication_data_type"] = _DTYPE_NAMES[reduce]
    # Where FSDP2 puts the shards: the mesh's device type, by default the
    # accelerator's (torch.cuda's current GPU when there is one); a model
    # built on the host is registered from host memory into it.
    kind = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    if _context._context is None:
        ctx = get_context(config, device=where)
    else:
        ctx = get_context(device=where)
        _check_agrees(ctx, config, mesh, reshard_after_forward)
    if isinstance(offload_policy, CPUOffloadPolicy) and ctx.device != "cpu":
        raise NotImplementedError(f"zeroshard.torch.fully_shard: CPUOffloadPolicy on a {ctx.device} context: "
                                  "the engine keeps a GPU model's shards on its GPU; use the config's "
                                  "offload_param / offload_optimizer with device \"nvme\", or leave the policy out")
    return ctx


def _check_agrees(ctx, config, mesh, reshard_after_forward):
    have = ctx.config
    zero = have.get("zero_optimization", {})
    wanted = config["zero_optimization"]
    if working_dtype(ctx) != (torch.bfloat16 if "bf16" in config else None):
        raise ValueError(f"zeroshard.torch.fully_shard: param_dtype differs from an earlier call's (the context "
                         f"partitions in {working_dtype(ctx) or 'the dtype each param was built in'}): one "
                         "param_dtype per process")
    if "communication_data_type" in config and \
            str(have.get("communication_data_type", "")).lower() != config["communication_data_type"]:
        raise ValueError(f"zeroshard.torch.fully_shard: reduce_dtype {config['communication_data_type']} "
                         f"differs from an earlier call's ({have.get('communication_data_type')}): one "
                         "reduce_dtype per process")
    if mesh is not None and zero.get("mics_shard_size", -1) != wanted.get("mics_shard_size", -1):
        raise ValueError(f"zeroshard.torch.fully_shard: mesh {tuple(mesh.shape)} differs from an earlier "
                         f"call's (mics_shard_size {zero.get('mics_shard_size')}): one mesh per process")
    if "zero_hpz_partition_size" in wanted and zero.get("zero_hpz_partition_size") != wanted["zero_hpz_partition_size"]:
        raise ValueError(f"zeroshard.torch.fully_shard: reshard_after_forward={reshard_after_forward} differs "
                         f"from an earlier call's (secondary shard groups of {zero.get('zero_hpz_partition_size')} "
                         "ranks): one int per process")


def _cast_hooks(module, mp_policy):
    if mp_policy.cast_forward_inputs and mp_policy.param_dtype not in (None, torch.float32):
        cast_inputs_to(module, mp_policy.param_dtype)
    if mp_policy.output_dtype is not None:
        cast_outputs_to(module, mp_policy.output_dtype)


# -- the returned module ------------------------------------------------------
class ZeroShardFSDPModule:
    """The methods FSDP2's FSDPModule gives a fully_shard'd module."""

    def _zs_units(self, recurse=True):
        modules = self.modules() if recurse else [self]
        return [m.__dict__["_zs_unit"] for m in modules
                if m.__dict__.get("_zs_fsdp") is not None and m.__dict__.get("_zs_unit") is not None]

    def unshard(self, async_op=False):
        """Gather this module's params (its own unit) and hold them until
        reshard(). The gather is complete when this returns, so the handle
        an async_op=True call returns has nothing left to wait for."""
        unit = self.__dict__["_zs_unit"]
        if not unit.user_hold:
            _acquire_unit(unit, "unshard()")
            unit.user_hold = True
        return _Done() if async_op else None

    def reshard(self):
        """Drop what unshard() gathered."""
        unit = self.__dict__["_zs_unit"]
        if unit.user_hold:
            unit.user_hold = False
            _release(unit.params, unit.handles())

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"zeroshard.torch: set_reshard_after_forward({reshard_after_forward!r}): a bool; an "
                             "int (hpZ's secondary shard) is fixed by fully_shard when the context is made")
        for unit in self._zs_units(recurse):
            unit.keep_for_backward = not reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False keeps each unit gathered from its backward until the
        optimizer step ends the step (gradient accumulation's forwards then
        gather nothing)."""
        for unit in self._zs_units(recurse):
            unit.keep_after_backward = not reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """Accepted either way: each micro-batch's gradient is reduce-
        scattered into this rank's shard as it is produced and summed
        there, so the step sees the same sum FSDP2's last synced backward
        gives, without an unsharded gradient kept between backwards."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync: expected a bool, got {requires_gradient_sync!r}")

    def set_is_last_backward(self, is_last_backward):
        """Accepted: the engine ends a step at the optimizer step, whatever
        the number of backwards before it."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward: expected a bool, got {is_last_backward!r}")

    def set_modules_to_forward_prefetch(self, modules):
        _check_prefetch(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules):
        _check_prefetch(modules, "backward")


def _check_prefetch(modules, which):
    for m in modules:
        if m.__dict__.get("_zs_fsdp") is None:
            raise ValueError(f"zeroshard.torch: set_modules_to_{which}_prefetch: {type(m).__name__} was not "
                             "fully_shard'd")
    if not getattr(_check_prefetch, "warned", False):
        _check_prefetch.warned = True
        warnings.warn(f"zeroshard.torch: set_modules_to_{which}_prefetch: the engine prefetches along the "
                      "unit order it traced at the first step (the next units, as these lists name them "
                      "in a block-by-block model), not along explicit lists", stacklevel=3)


def _refuse(name, why):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"zeroshard.torch: {type(self).__name__}.{name} is not supported: {why}")
    method.__name__ = name
    return method


_ENGINE_COMMS = "the engine runs its own collectives over its own transport, not torch.distributed's"
for _name, _why in {
    "set_all_reduce_hook": _ENGINE_COMMS,
    "set_custom_all_gather": _ENGINE_COMMS,
    "set_custom_reduce_scatter": _ENGINE_COMMS,
    "set_allocate_memory_from_process_group_for_comm": _ENGINE_COMMS,
    "set_post_optim_event": "the step's gathers run on the engine's stream, ordered after the step already",
    "set_reduce_scatter_divide_factor": "gradients are averaged over the data-parallel ranks",
    "set_gradient_divide_factor": "gradients are averaged over the data-parallel ranks",
    "set_force_sum_reduction_for_comms": "gradients are averaged over the data-parallel ranks",
    "set_requires_all_reduce": "HSDP's replica all-reduce is part of each step (MiCS)",
    "set_unshard_in_backward": "a unit whose params a backward needs is always gathered for it",
}.items():
    setattr(ZeroShardFSDPModule, _name, _refuse(_name, _why))


class _Done:
    """unshard(async_op=True)'s handle: the gather is already complete."""

    def wait(self):
        return None


_classes = {}


def _become_fsdp(module):
    cls = type(module)
    if issubclass(cls, ZeroShardFSDPModule):
        return
    new = _classes.get(cls)
    if new is None:
        new = _classes[cls] = type(f"FSDP{cls.__name__}", (ZeroShardFSDPModule, cls), {})
    module.__class__ = new


__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "ZeroShardFSDPModule", "fully_shard"]
