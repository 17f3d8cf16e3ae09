"""A frozen model's forwards under no_grad, gathered whole, and kept
gathered between them while memory allows.

A model none of whose params trains (TRL's reference and reward models, a
distillation teacher) is called under no_grad once or twice a step to
score what the policy did. Gathered module by module as a training
forward is, each of its units is a gather both ranks meet in and the
compute waits on (75 for an 8-layer Llama). When its params fit
(generate()'s rule: at most half the memory available on the context's
device, agreed by every rank), such a call instead gathers them all at
once and runs with the engine's hooks off, as an unsharded model would.

Its params never change between calls (nothing trains them), so
gathering them again every step only repeats the same collective (52 ms
of DPO's step in bench/bench_trl.py). When they also fit in a quarter of
the available memory (KEEP_FRACTION, agreed by every rank) the first
call's gather is kept: later calls run on it with no collective at all,
as DDP's whole copy does, at DDP's memory for that model. The copy is
current while every param's shard_version stays (an update under
GatheredParameters(modifier_rank=...), as TRL's sync_ref_model does, a
`param.data = t`, a checkpoint or safetensors load move it: the next call
gathers again), while the engine still holds each param gathered and its
`.data` is the engine's view (a heal's relayout, a user's own `.data`).
A call with gradients on, or with any param requiring one, lets the copy
go first, as does set_inference_gather(model, keep=False), and a heal lets
every copy go on every rank (a replacement starts with none).

What it gains, bench/bench_trl.py's GRPO (2 CPU ranks, 8 layers, hidden
512): the reference model's scoring 0.41 -> 0.31 s a step (DDP 0.28) from
the whole gather; see docs/benchmarks.md for keeping it.

Calls with gradients enabled, calls while any of its params requires a
gradient, and calls that find nothing to gather (generate()'s per-token
calls once it gathered the model) run as before. set_inference_gather(
model, mode, keep) turns it on for a model: mode "auto" (when the params
fit), True (always), False (off again); keep "auto" (when they fit in
KEEP_FRACTION), True (whenever gathered whole), False (never: released at
each call's end); zeroshard.hf does so for the trainers' inference-only
models ("auto", "auto").
"""
import copyreg
import weakref

import torch

from ._params import GatheredParameters, adopt_assigned, assigned, detach_views, is_partitioned, zparams
from .generation import KEEP_FRACTION, bytes_to_gather, check_gather_mode, gathers_whole
from .hooks import hooks_suspended
from ._context import get_context


# A subclass of each model class whose __call__ decides per call; a
# model's class is swapped for it (as torch's fully_shard swaps a module's
# class), so the decision wraps the root's hooks, which run inside
# nn.Module.__call__. Same name and module as the class it extends.
_subclasses = {}
# model -> _Kept: what its last call kept gathered. Beside the model, not in
# its __dict__, so that a copy (deepcopy, pickle) starts with nothing kept.
_kept = weakref.WeakKeyDictionary()


def set_inference_gather(model, mode="auto", keep="auto"):
    """How `model`'s calls under no_grad gather while none of its params
    trains: mode "auto" (whole when they fit in half the available memory,
    agreed by all ranks), True (whole), False (module by module); keep
    whether a whole gather stays for the next call: "auto" (when the
    params fit in KEEP_FRACTION of it), True, False."""
    check_gather_mode(mode)
    check_gather_mode(keep)
    if not getattr(type(model), "_zs_inference_gather", False):
        model.__class__ = _subclass_of(type(model))
    model.__dict__["_zs_inference_gather_mode"] = mode
    model.__dict__["_zs_inference_keep"] = keep
    if mode is False or keep is False:
        let_go(model)
    return model


class _Kept:
    """A whole gather kept for a model's next call: its params (in order),
    the shard_version each had, and those this gather fetched (the ones it
    releases; a param the coordinator keeps gathered stays its)."""

    def __init__(self, params, fetched):
        self.params = params
        self.versions = [p.zs.zparam.shard_version for p in params]
        self.fetched = fetched

    def current(self, params):
        """Whether the copy still serves a call on `params`: the same
        params, each gathered, shown by the engine's view, at the version
        it was gathered at."""
        return (len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params)) and
                all(p.zs.attached and not assigned(p) and p.zs.zparam.status_and_version() == ("AVAILABLE", v)
                    for p, v in zip(params, self.versions)))


def let_go(model):
    """Release what `model`'s calls kept gathered (local: every rank's
    program lets go at the same call)."""
    kept = _kept.pop(model, None)
    if kept is None:
        return
    mine = [p for p in kept.fetched if p.zs is not None and p.zs.zparam.status == "AVAILABLE"]
    if mine:
        get_context().release(zparams(mine))
        detach_views(mine)


def let_go_all():
    """Release every model's kept gathered copy: after a heal, where a
    replacement starts with none, so that every rank gathers at the next
    call alike (a survivor still holding its copy would skip the gather
    the replacement issues)."""
    for model in list(_kept.keys()):
        let_go(model)


def _keep_gathered(model, params):
    """Gather `params` whole for `model` and keep them for its next calls:
    GatheredParameters' entry without its exit."""
    gathered = GatheredParameters(params).__enter__()
    _kept[model] = _Kept(params, gathered._fetched)


def _subclass_of(cls):
    sub = _subclasses.get(cls)
    if sub is None:
        sub = _subclasses[cls] = type(cls.__name__, (cls,), {
            "__call__": _call_of(cls), "__reduce_ex__": _reduce_of(cls), "_zs_inference_gather": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return sub


def _new_of(base, *args):
    """An empty model of `base`'s subclass: pickle (torch.save of the
    model) and copy.deepcopy remake the subclass through this, by its
    base, which is what pickle can name; the mode comes with the state."""
    return base.__new__(_subclass_of(base), *args)


def _reduce_of(base):
    def __reduce_ex__(self, protocol):
        reduced = list(base.__reduce_ex__(self, protocol))
        if reduced[0] is copyreg.__newobj__ and reduced[1][0] is type(self):
            reduced[0], reduced[1] = _new_of, (base,) + tuple(reduced[1][1:])
        return tuple(reduced)
    return __reduce_ex__


def _call_of(base):
    base_call = base.__call__

    def __call__(self, *args, **kwargs):
        mode = self.__dict__.get("_zs_inference_gather_mode", False)
        if mode is False or torch.is_grad_enabled():
            if torch.is_grad_enabled():
                let_go(self)  # a call that may train: its hooks gather as usual
            return base_call(self, *args, **kwargs)
        params = [p for p in self.parameters() if is_partitioned(p)]
        if any(p.requires_grad for p in params):
            # It trains (an optimizer may step it, which moves no shard
            # version): nothing kept, module by module.
            let_go(self)
            return base_call(self, *args, **kwargs)
        # A `param.data = t` since the last call becomes the param's value
        # (the hooks' root would take it; they are off for this call).
        adopt_assigned(params)
        kept = _kept.get(self)
        if kept is not None and kept.current(params):
            with hooks_suspended(self):
                return base_call(self, *args, **kwargs)
        let_go(self)
        # Every rank decides alike: the same code runs under no_grad on the
        # same model, whose gathered state the ranks share (gathers pair).
        ctx = get_context()
        if bytes_to_gather(params) == 0 or not gathers_whole(self, mode, ctx):
            return base_call(self, *args, **kwargs)
        keep = self.__dict__.get("_zs_inference_keep", False)
        if keep is not False and gathers_whole(self, keep, ctx, KEEP_FRACTION):
            _keep_gathered(self, params)
            with hooks_suspended(self):
                return base_call(self, *args, **kwargs)
        with GatheredParameters(params), hooks_suspended(self):
            return base_call(self, *args, **kwargs)
    return __call__
