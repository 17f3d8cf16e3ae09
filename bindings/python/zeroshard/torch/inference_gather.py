"""A frozen model's forwards under no_grad, gathered whole.

A model none of whose params trains (TRL's reference and reward models, a
distillation teacher) is called under no_grad once or twice a step to
score what the policy did. Gathered module by module as a training
forward is, each of its units is a gather both ranks meet in and the
compute waits on (75 for an 8-layer Llama). When its params fit
(generate()'s rule: at most half the memory available on the context's
device, agreed by every rank), such a call instead gathers them all at
once, runs with the engine's hooks off, as an unsharded model would, and
releases them at its end, as generate() does (generation.py). Nothing is
kept after the call, so between calls the model holds its shards only.

What it gains, bench/bench_trl.py's GRPO (2 CPU ranks, 8 layers, hidden
512): the reference model's scoring 0.41 -> 0.31 s a step (DDP 0.28).

Calls with gradients enabled, calls while any of its params requires a
gradient, and calls that find nothing to gather (generate()'s per-token
calls once it gathered the model) run as before. set_inference_gather(
model, mode) turns it on for a model: "auto" (when the params fit), True
(always), False (off again); zeroshard.hf does so for the trainers'
inference-only models.
"""
import copyreg

import torch

from ._params import GatheredParameters, is_partitioned
from .generation import bytes_to_gather, check_gather_mode, gathers_whole
from .hooks import hooks_suspended
from ._context import get_context

# A subclass of each model class whose __call__ decides per call; a
# model's class is swapped for it (as torch's fully_shard swaps a module's
# class), so the decision wraps the root's hooks, which run inside
# nn.Module.__call__. Same name and module as the class it extends.
_subclasses = {}


def set_inference_gather(model, mode="auto"):
    """How `model`'s calls under no_grad gather while none of its params
    trains: "auto" (whole when they fit in half the available memory,
    agreed by all ranks), True (whole), False (module by module)."""
    check_gather_mode(mode)
    if not getattr(type(model), "_zs_inference_gather", False):
        model.__class__ = _subclass_of(type(model))
    model.__dict__["_zs_inference_gather_mode"] = mode
    return model


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
            return base_call(self, *args, **kwargs)
        params = [p for p in self.parameters() if is_partitioned(p)]
        # Every rank decides alike: the same code runs under no_grad on the
        # same model, whose gathered state the ranks share (gathers pair).
        if any(p.requires_grad for p in params) or bytes_to_gather(params) == 0 or \
                not gathers_whole(self, mode, get_context()):
            return base_call(self, *args, **kwargs)
        with GatheredParameters(params), hooks_suspended(self):
            return base_call(self, *args, **kwargs)
    return __call__
