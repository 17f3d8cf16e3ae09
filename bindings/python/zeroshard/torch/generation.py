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

Kept after the call. Nothing changes the params between a generate() and
what usually follows it: the training forward of an online RL step
(GRPO, RLOO, online DPO: generate, score, then train on the same
weights), or the next generate() of an evaluation loop. When the params
also fit in a quarter of the available memory (KEEP_FRACTION, agreed by
every rank), the whole gather is handed to the engine's fetch
coordinator instead of being released: the next generate() gathers
nothing, and the next step's forward finds each unit gathered and
releases it after its use by the coordinator's usual rules (the backward
gathers again as it would), so the forward's gathers are saved at no new
peak (the call itself held the whole model). What no step uses goes at
the next step's end, and everything at the next optimizer step (which
rewrites the shards) or when set_generation_gather(model, keep=False)
lets it go. Only between steps: a generate() inside an open step (between
a training forward and its optimizer step) releases at its end as
before. set_generation_gather(model, mode, keep) chooses: keep "auto"
(the default), True (whenever gathered whole), False (released at the
call's end).
"""
import types

import torch

from ._context import get_context
from ._params import GatheredParameters, attach_views, detach_views, is_partitioned, zparams
from .hook_state import hook_state
from .hooks import hooks_suspended

FIT_FRACTION = 0.5  # of the device's available memory the gathered params may take
# Of the device's available memory, for a whole gather kept after a call for
# what follows (generate()'s, and a frozen model's calls: inference_gather.py).
KEEP_FRACTION = 0.25


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


def set_generation_gather(model, mode="auto", keep="auto"):
    """How `model.generate()` gathers: "auto" (whole when the params fit
    in half the available memory, agreed by all ranks), True (whole), False
    (module by module, per decode step); and whether a whole gather stays
    for what follows (the next step's forward, the next generate()): "auto"
    (when the params fit in KEEP_FRACTION of it), True, False (released at
    the call's end; what an earlier call kept is let go now: every rank
    calls this alike, as it calls generate())."""
    check_gather_mode(mode)
    check_gather_mode(keep)
    target = _generating_model(model)
    target = model if target is None else target
    target.__dict__["_zs_generation_gather"] = mode
    target.__dict__["_zs_generation_keep"] = keep
    if mode is False or keep is False:
        _let_go(target)
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
        keep = model.__dict__.get("_zs_generation_keep", "auto")
        # Every rank's step is open or not alike (the same program), so the
        # ranks agree on it as on the fit.
        kept = not hook_state().step_open and gathers_whole(model, keep, ctx, KEEP_FRACTION)
        with (_KeptGather(params) if kept else GatheredParameters(params)), hooks_suspended(model):
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


class _KeptGather:
    """A whole gather through the fetch coordinator, outside any step: the
    gathered params become its live ones, released by its rules after the
    block (see the module docstring), not at its end. The block's views
    are dropped at its end as a release would: the next forward's hooks
    attach them again from the coordinator, and a param it releases
    leaves no view behind. If the block raises, the params go at once."""

    def __init__(self, params):
        self.params = params
        self.fetched = []
        self.viewed = []

    def __enter__(self):
        self.viewed = [p for p in self.params if not p.zs.attached]
        self.fetched = [p for p in self.viewed if p.zs.zparam.status != "AVAILABLE"]
        if self.fetched:
            get_context().coord_fetch(zparams(self.fetched))  # collective: every rank's list is alike
        attach_views(self.params)
        return self

    def __exit__(self, *exc):
        # Raised: released at once; those a heal meanwhile dropped (no
        # longer gathered) are not the coordinator's to release.
        held = [p for p in self.fetched if p.zs.zparam.status == "AVAILABLE"] if exc[0] is not None else []
        if held:
            get_context().coord_release(zparams(held))
        # Persistent params keep theirs, as after a unit's release.
        detach_views([p for p in self.viewed if not p.zs.persistent], held=True)
        return False


def _let_go(model):
    """Release what the coordinator holds of `model`'s params between
    steps (what a kept generate() left). Local, but every rank's program
    calls it alike, so the coordinators' live params stay equal. Inside
    an open step they are the step's: left to it."""
    if hook_state().step_open:
        return
    held = [p for p in model.parameters() if is_partitioned(p) and p.zs.zparam.status == "AVAILABLE"]
    if held:
        get_context().coord_release(zparams(held))
        detach_views(held)


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
