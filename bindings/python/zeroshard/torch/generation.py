"""Hugging Face generate() on a partitioned model, two ways.

Gathered whole (when the full params fit, or when asked): every param is
gathered once for the whole call, the engine's hooks are taken off the
model for its duration and put back after, and the params are released at
its end. Decoding then runs as on an unsharded model: no gather, no hook
and no collective per token, so each rank stops at its own length, also
when the caller passes synced_gpus=True (which only pairs gathers). This
is DeepSpeed ZeRO-3's gather for generation (TRL's
ds3_gather_for_generation), whose absence is the "72 s under ZeRO-3
against 0.8 s under ZeRO-2" its users report.

Per forward (when they do not fit, or when asked): each decode step's
forward gathers and releases module by module as in training, and ranks
that finish early keep running forwards (dummy steps) until every rank
has, so their gathers stay paired (HF's synced_gpus, which HF turns on by
itself only for DeepSpeed and FSDP). The ranks agree through the engine,
so torch.distributed need not be initialised.

"Fit" means the bytes still to gather are at most half of the memory
available on the context's device (the rest is left to the KV cache and
the activations); the ranks agree on it (one all-reduce), as a rank
gathering whole beside one gathering per forward would never pair.
set_generation_gather(model, mode) or generate(..., zs_gather=mode)
chooses: "auto" (the default), True (whole), False (per forward).
"""
import types

import torch

from ._context import get_context
from ._params import GatheredParameters, is_partitioned
from .hooks import hooks_suspended

FIT_FRACTION = 0.5  # of the device's available memory the gathered params may take


def install(model):
    """generate() and its stopping test on `model` (a Hugging Face
    generation model, or a PEFT model's base model, whose generate() PEFT's
    calls) as described in the module docstring."""
    model = _generating_model(model)
    if model is not None:
        model.generate = types.MethodType(_generate, model)
        model._has_unfinished_sequences = types.MethodType(_unfinished_on_any_rank, model)


def _generating_model(model):
    """`model` if it is a Hugging Face generation model, else its PEFT base
    model if that is one, else None."""
    if _generates(model):
        return model
    base = getattr(model, "get_base_model", None)
    base = base() if callable(base) else None
    return base if base is not None and _generates(base) else None


def _generates(model):
    return callable(getattr(type(model), "_has_unfinished_sequences", None))


def set_generation_gather(model, mode="auto"):
    """How `model.generate()` gathers: "auto" (whole when the params fit
    in half the available memory, agreed by all ranks), True (whole), False
    (module by module, per decode step)."""
    check_gather_mode(mode)
    target = _generating_model(model)
    (model if target is None else target).__dict__["_zs_generation_gather"] = mode
    return model


def check_gather_mode(mode):
    if not (mode is True or mode is False or mode == "auto"):
        raise ValueError(f"zeroshard.torch: gather mode {mode!r} (generation's or a frozen model's inference): "
                         "expected 'auto', True or False")


def _generate(model, *args, zs_gather=None, **kwargs):
    mode = model.__dict__.get("_zs_generation_gather", "auto") if zs_gather is None else zs_gather
    check_gather_mode(mode)
    ctx = get_context()
    if gathers_whole(model, mode, ctx):
        params = [p for p in model.parameters() if is_partitioned(p)]
        with GatheredParameters(params), hooks_suspended(model):
            # Nothing in the call pairs across ranks now (no gather, no hook),
            # so synced_gpus=True, as ZeRO-3 users and TRL pass it, would only
            # add an all-reduce per token ("is any rank still decoding"),
            # about half the tokens/s at 2 ranks: each rank stops at its own
            # length instead.
            kwargs["synced_gpus"] = False
            return type(model).generate(model, *args, **kwargs)
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = ctx.world_size > 1
    return type(model).generate(model, *args, **kwargs)


def bytes_to_gather(params):
    """The bytes gathering `params` (each once) would add: those of the
    partitioned ones not gathered now."""
    return sum(p.numel() * p.element_size() for p in params if is_partitioned(p) and not p.zs.attached)


def available_bytes(device):
    """Memory available for new allocations on `device` (a context's
    device string): the GPU's free memory plus what torch's caching
    allocator holds unused; on the host, the kernel's MemAvailable."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gathers_whole(model, mode, ctx, fraction=FIT_FRACTION):
    """Whether `model` is gathered whole under `mode` (False, True or
    "auto": when its bytes to gather are at most `fraction` of the memory
    available), every rank agreeing (collective unless mode is False)."""
    if mode is False:
        return False
    fits = mode is True or bytes_to_gather(model.parameters()) <= fraction * available_bytes(ctx.device)
    if ctx.world_size == 1:
        return fits
    count, live = _ranks_with(fits, ctx)
    return count == live


def _unfinished_on_any_rank(model, this_peer_finished, synced_gpus, device=None):
    if not synced_gpus:
        return not this_peer_finished
    return _ranks_with(not this_peer_finished, get_context())[0] > 0


def _ranks_with(flag, ctx):
    """(How many ranks pass a true `flag`, how many ranks there are: the
    live ones, after a shrink). One all-reduce; collective."""
    count = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=ctx.device)
    with ctx.group("world") as world, world.allreduce(count, count, 1, "fp32", "sum") as work:
        work.wait()
        return int(count.item()), world.size
