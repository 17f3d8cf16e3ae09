"""Gathered params saved for backward are kept by reference, not by value.

Autograd keeps what a forward saves for its backward until that backward
runs. F.linear saves `weight.t()`, a view of the gathered buffer, so every
layer's full weight would stay alive from its forward to its backward
whatever the engine releases: the whole model gathered at the peak.

While a hooked model's forward runs, a saved tensor that is a gathered
param (or a view of one) is kept as the param and the view's geometry.
Its backward reads the view again from the param's gathered buffer, which
the unit's backward fetch has brought back: the same bits the forward
used, so the native backward formulas give the same gradients (DeepSpeed
gets there by replacing F.linear with its own autograd Function, whose
gradients are not bitwise torch's). A param the backward fetch did not
bring back (read outside any unit's forward) is fetched for the read.

Persistent params stay gathered anyway and are saved as usual. As with
plain autograd, a param changed in place between its forward and its
backward is an error, not silently different gradients.

What a forward saved also says what its backward reads: a unit none of
whose params were saved (an embedding saves only the indices; the tied
embedding's table once the head's backward read it) needs nothing
gathered for its backward, where its params' gradients are computed from
other saved tensors (gather_unit.py: bwd_needs). `packs` counts what
went through these hooks, so a forward whose saves went elsewhere
(activation checkpointing's own hooks) is not mistaken for one that
saved nothing; each param counts its saved references until unpacked.
Once the last is unpacked, a unit held for its backward until the param's
gradient comes lets the param go at the next hook (the node that read it
has run by then; its view keeps the buffer until it is done with it): a
tied embedding's gradient comes at the backward's end, and the head's
hold would keep the whole table gathered until then (grad_arrival.py).
"""
import torch

from . import _params
from .compile import engine_call


class _SavedView:
    __slots__ = ("param", "size", "stride", "offset", "version")

    def __init__(self, param, t):
        self.param = param
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset() - param.storage_offset()
        self.version = t._version


packs = [0]  # tensors these hooks saw saved, ever (read as a difference)


def _pack(t):
    packs[0] += 1
    p = t._base if t._base is not None else t
    z = getattr(p, "zs", None)
    if z is None or not z.attached or z.persistent or p.data_ptr() != z.view_ptr:
        return t
    z.saved += 1
    return _SavedView(p, t)


def _unpack(s):
    if not isinstance(s, _SavedView):
        return s
    p = s.param
    z = p.zs
    if z is None:
        raise RuntimeError("zeroshard.torch: a param saved for backward was unregistered before "
                           "the backward ran")
    if z.saved > 0:
        z.saved -= 1  # read again by a retained graph's second backward: 0 stays 0
        if z.saved == 0 and z.holds > 0 and z.engine is not None:
            z.engine.unpacked.append(p)  # its backward hold may go once this node is done
    if p._version != s.version:
        raise RuntimeError(
            f"zeroshard.torch: {_params.param_path(p)} was modified in place between its forward and its backward "
            f"(version {p._version}, saved at {s.version}); the gradient would use values the "
            "forward did not")
    if z.attached:
        if s.offset == 0 and s.size == p.size() and s.stride == p.stride():
            return p
        return _view(p, s)
    # Not gathered now: gather it for this read only. The view holds the
    # buffer (zs_param_to_dlpack) after the release, until backward drops it.
    return read_gathered(p, lambda: _view(p, s))


# torch.compile: dynamo may meet the hooks while it traces an op that saves
# for backward; they read the engine's state, so they run as they are.
_pack = engine_call(_pack)
_unpack = engine_call(_unpack)


def _view(p, s):
    return p.as_strided(s.size, s.stride, p.storage_offset() + s.offset)


# read_gathered(param, fn): fn() while param is gathered (set by gather_unit.py,
# which owns fetching and holds).
read_gathered = None


_active = []  # the hook contexts pushed by running forwards, innermost last


def push(by_reference=True):
    """Called as a hooked model's forward begins; pop() as it ends.
    by_reference=False (a model whose params all persist): nothing to do."""
    hooks = None
    if by_reference and torch._C._autograd._saved_tensors_hooks_is_enabled():
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
    _active.append(hooks)


def pop():
    if _active:
        hooks = _active.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
