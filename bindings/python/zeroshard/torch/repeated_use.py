"""A param used again in the same forward (a head tied to the token
embedding, a module called twice) reaches autograd through an alias whose
backward hands that use's gradient to the engine at once.

Autograd sums every use's gradient of a leaf in the leaf's input buffer
before AccumulateGrad, and only then do the engine's hooks see it. For
GPT-2's tied head that means the head's gradient of the whole table (the
backward's first) stays alive through the entire backward, and at its end
the embedding's gradient and their sum are allocated beside it: three
full tables (196 MiB each at GPT-2 medium) on top of every gradient shard,
at the step's memory peak. Routed through an alias, each later use's
gradient goes to the engine's reduction as soon as its backward computes
it, as a micro-batch's would under gradient accumulation, and is freed;
the first use's comes through AccumulateGrad as before. What reaches the
optimizer is the same sum, reduced per use: each rank's shard is
sum over ranks of each use, added, instead of sum over ranks of the uses'
sum, so the tied param's update may differ from the unaliased one in the
last bit (deterministic and the same on every rank).

The alias is put in the module's parameter slot for its forward (the pre
hook) and taken out after it (the post hook, which also runs when the
forward raises). Only where the use differentiates (grad enabled, not in a
backward's recompute, not while torch.compile traces) and the param's
gradient goes straight to the reduction (not persistent, not in a leaf
unit, which keep theirs until the backward's end or the step).
"""
import torch

from ._autograd import in_backward

_enabled = True  # tests compare against the unaliased path


class _RepeatedUse(torch.autograd.Function):
    """The identity on a param; its backward gives the use's gradient to
    the param's engine and none to the param itself."""

    @staticmethod
    def forward(ctx, param):
        ctx.param = param  # not saved for backward: saved.py would count it as a read of its values
        return param.view_as(param)  # a view: a forward that saves it saves the param by reference

    @staticmethod
    def backward(ctx, grad):
        param = ctx.param
        param.zs.engine.take_repeated_use_grad(param, grad)
        return None


def _eligible(p):
    z = p.zs
    return p.requires_grad and not z.persistent and not z.leaf and z.engine is not None


def alias_repeated_uses(unit):
    """Before `unit`'s forward: its params this forward already used get
    the alias in their module slots. Returns the slots changed, for
    restore()."""
    if not _enabled or not torch.is_grad_enabled() or in_backward():
        return None
    if torch.compiler.is_compiling():
        return None
    engine = unit.engine
    changed = None
    for p in unit.params:
        z = p.zs
        if z.used_in != engine.forwards:
            z.used_in = engine.forwards
            continue
        if not _eligible(p):
            continue
        alias = _RepeatedUse.apply(p)
        for module in unit.modules:
            slots = module._parameters
            for name, value in slots.items():
                if value is p:
                    slots[name] = alias
                    changed = changed or []
                    changed.append((slots, name, p))
    return changed


def restore(changed):
    """After the forward: the params back in their slots."""
    for slots, name, p in changed:
        slots[name] = p
