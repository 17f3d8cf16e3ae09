"""The hollow window (docs/healing.md, "Accelerate scripts"): where the
training loop is the user's, a survivor cannot redo a step a lost rank cut
short, so it runs the rest of that step without the engine and heals at the
step's end.

Armed by a loop that can heal so (zeroshard.hf.Accelerator, while its
training DataLoader iterates), the first RankLostError at a call of the
engine inside a step does not propagate: the window turns hollow and from
then on nothing calls the engine. A unit's params get zeros of their full
shapes (views of one zero buffer per dtype and device), gradients are
dropped, and torch.distributed answers locally (heal_dist). The forward and
backward on zeros give finite values, thrown away: the optimizer's step at
the window's end heals (heal.recover), says the step was skipped, and the
DataLoader yields the window's batches again. Not armed, RankLostError
reaches the caller as before. A replacement runs hollow from its join to
the survivors' step (catch_up); so does a Lightning replacement's manual
training_step up to its optimizer step, when that step committed in the
loss (lightning_heal.Healing.manual_step).

The state is the context's (hook_state's rule: the hooks' modules keep
none of their own).
"""
import math
import sys

import torch

from ..errors import RankLostError
from . import param_type
from ._context import context_state, drop_context_state, on_shutdown


class HollowState:
    __slots__ = ("armed", "on", "zeroed", "buffers")

    def __init__(self):
        self.armed = False   # a loop that heals with a hollow window runs a step now
        self.on = False      # the window is hollow: nothing calls the engine until the heal
        self.zeroed = []     # params showing zeros now (their views go at the heal)
        self.buffers = {}    # (dtype, device) -> flat zeros, as large as the largest param shown


def _state():
    return context_state(HollowState)


@on_shutdown
def _forget():
    """The context is gone: so is its window."""
    drop_context_state(HollowState)


def arm(on):
    """A loop that heals at its step's end runs (on) or not: only then does
    a loss turn the window hollow."""
    _state().armed = bool(on)


def active():
    """The window is hollow: call nothing of the engine."""
    return _state().on


def enter(error):
    """In an `except RankLostError as error` around a call of the engine:
    True when the window turns (or is) hollow and the caller goes on
    without the engine; False when no loop heals so (the caller re-raises)."""
    state = _state()
    if not state.armed:
        return False
    if not state.on:
        state.on = True
        print(f"zeroshard.torch: {error}; the rest of this step runs hollow (zeros, no collective) and heals "
              "at its optimizer step", file=sys.stderr, flush=True)
    return True


def catch_up():
    """A replacement that joined but has not reached the survivors' step:
    hollow until it does (its code before that step ran on the survivors
    long ago: an evaluation of an epoch it skips would gather alone)."""
    state = _state()
    state.armed = state.on = True


_SKIPPED = object()


def value(fn, *args, otherwise=None):
    """fn(*args)'s value, a call of the engine within a step, unless the
    window is or turns hollow: then `otherwise`."""
    if _state().on:
        return otherwise
    try:
        return fn(*args)
    except RankLostError as e:
        if not enter(e):
            raise
        return otherwise


def call(fn, *args):
    """fn(*args) as value() calls it: whether the engine ran it."""
    return value(fn, *args, otherwise=_SKIPPED) is not _SKIPPED


def show_zeros(params):
    """Each of `params` not shown gathered shows zeros of its full shape."""
    state = _state()
    for p in params:
        z = p.zs
        if z.attached:
            continue
        key = (z.dtype, torch.device(z.device))
        n = math.prod(z.shape)
        buf = state.buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = state.buffers[key] = torch.zeros(max(n, 1), dtype=z.dtype, device=z.device)
        param_type.mark_gathered(p, buf[:n].view(z.shape))
        z.view_ptr = p.data_ptr()
        z.attached = True
        state.zeroed.append(p)


def leave():
    """The heal ran: the window is over, and no param shows zeros (the
    engine's own views come back at the next gather)."""
    state = _state()
    for p in state.zeroed:
        z = p.zs
        if z is not None and z.attached and p.data_ptr() == z.view_ptr:
            param_type.mark_released(p)
            z.attached = False
    state.zeroed.clear()
    state.buffers.clear()
    state.on = False
