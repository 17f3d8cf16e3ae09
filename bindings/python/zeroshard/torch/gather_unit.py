"""The gather unit: the params one hooked module fetches and releases
together (_Unit), the holds that keep them gathered, and the forward hooks
its module carries.

Units: by default a module's own params (recurse=False) plus any external
params registered on it; a leaf module's unit is every param of its
subtree, fetched and released as one (leaf_modules.py; its gradients wait
for the step: grad_arrival.py).

Holds: a param stays gathered while any unit holds it (its forward, its
backward, a forward re-run by activation checkpointing during backward);
the coordinator is told to release it when the last hold goes.

Before its module's forward a unit's params are fetched and held; after it
the hold goes, and a gradient hook on the forward's outputs fetches them
again for the backward, until their gradients come (grad_arrival.py) or,
for a unit with no trainable param, its frozen calls end (frozen_call.py).
A unit whose module runs outside any scope opens one (forward_scope.py).
"""
import copy

import torch

import zeroshard

from . import hollow, repeated_use, saved
from ._autograd import in_backward
from .compile import engine_call
from ._context import get_context
from ._params import attach_views, detach_views, zparams
from .forward_scope import _close_scope, _open_scope, _output_tensors
from .frozen_call import _FrozenCall
from .hook_state import hook_state


class _Unit:
    """The params one hooked module fetches and releases together."""

    def __init__(self, module, name, params, leaf):
        self.module = module
        self.name = name
        self.params = params
        self.leaf = leaf
        self.engine = None
        self.pending = set()     # params whose gradient this backward has not produced yet
        self.bwd_held = False    # holds its params for its backward
        self.open_calls = 0      # frozen unit: its forwards whose backward began and has not ended
        self.persistent = False  # every param persistent (set with the handles)
        self.armed = False       # its module carries the forward hooks
        self.inner_leaf = ()     # a compiled block's params in leaf modules inside it
        # fully_shard (fsdp2.py): kept gathered from the forward to the
        # backward (reshard_after_forward=False), from the backward to the
        # step's end (set_reshard_after_backward(False)); held by unshard().
        self.keep_for_backward = False
        self.recompute_held = 0  # elements of its hold from a recompute, kept for its backward (_kept_for_backward)
        self.keep_after_backward = False
        self.kept_after_backward = False
        self.user_hold = False
        # Its backward reads its params (saved.py): fetched for it then; else
        # the backward hold is only a mark (bwd_fetched False).
        self.packs_at_entry = 0
        self.bwd_needs = False
        self.bwd_fetched = False
        self.released_early = set()  # of its params, their backward hold gone before the rest's
        self.modules = (module,)  # whose param slots hold its params (a whole unit's: its subtree)
        self.aliased = None  # slots its running forward reads a repeated use's alias from (repeated_use.py)
        self._handles = None

    @property
    def hookless_inside(self):
        """Modules inside it run without hooks of their own (a whole unit,
        a fully_shard'd subtree): see _unit_post_forward."""
        return len(self.modules) > 1

    def forget_step(self):
        """The step's bookkeeping dropped (its end, or a heal that dropped
        it): holds, backward waits, frozen calls, saved-reference counts.
        Returns the params it held, for the caller to release or not."""
        self.pending.clear()
        self.bwd_held = self.bwd_needs = False
        self.released_early.clear()
        self.open_calls = 0
        self.kept_after_backward = self.user_hold = False
        self.recompute_held = 0
        held = []
        for p in self.params:
            z = p.zs
            z.saved = 0  # a forward whose backward never ran (saved.py)
            if z.holds > 0:
                z.holds = 0
                held.append(p)
        return held

    def handles(self):
        """The params' engine handles as one prebuilt array (rebuilt when a
        param joins the unit)."""
        if self._handles is None or self._handles.n != len(self.params):
            self._handles = zeroshard.ParamArray(zparams(self.params))
            self.persistent = all(p.zs.persistent for p in self.params)
        return self._handles

    def __deepcopy__(self, memo):
        # The copied model's HookEngine (copied after every module) adopts it.
        unit = _Unit(copy.deepcopy(self.module, memo), self.name,
                     [copy.deepcopy(p, memo) for p in self.params], self.leaf)
        unit.armed = self.armed  # the copied module carries copies of the same hooks
        unit.modules = [copy.deepcopy(m, memo) for m in self.modules]
        unit.inner_leaf = [copy.deepcopy(p, memo) for p in self.inner_leaf]
        memo[id(self)] = unit
        return unit

    def arm(self, prepend=False):
        """Install the module's forward hooks (prepend: before hooks user
        code added since, as they were when first installed)."""
        if not self.armed:
            self.module.register_forward_pre_hook(_unit_pre_forward, prepend=prepend)
            # always_call: a forward that raises still drops its hold.
            # Activation checkpointing's recompute stops early by raising
            # inside the last module it needs; without this every
            # checkpointed block kept that module's params gathered until
            # the step.
            # with_kwargs: a frozen unit's inputs that need a gradient may
            # come as keyword arguments (see _FrozenCall).
            self.module.register_forward_hook(_unit_post_forward, prepend=prepend, always_call=True,
                                              with_kwargs=True)
            self.armed = True

    def disarm(self):
        _strip_hooks(self.module, (_unit_pre_forward, _unit_post_forward))
        self.armed = False

    def kept(self):
        """Whether every param is persistent and gathered: the unit needs
        no fetch or release (see the module docstring)."""
        return bool(self.params) and not self.leaf and all(p.zs.persistent and p.zs.attached
                                                            for p in self.params)


def _acquire(params, handles=None):
    """Gather `params` (through the coordinator, which records the order)
    and hold them. `handles`: their prebuilt zeroshard.ParamArray."""
    if not params:
        return
    fetched = hollow.call(get_context().coord_fetch, handles if handles is not None else zparams(params))
    for p in params:
        p.zs.holds += 1
    if fetched:
        attach_views(params, available=True)
    else:
        hollow.show_zeros(params)


def _acquire_unit(unit, when):
    """_acquire of a unit's params for its forward or backward. Ranks that
    ran different modules (experts chosen by the batch, a branch on the
    data) fetch different params: the engine stops them with "ranks
    disagree"; this says which module and what makes them agree."""
    try:
        _acquire(unit.params, unit.handles())
    except zeroshard.CommError as e:
        if "ranks disagree on collective" not in e.message:
            raise
        raise type(e)(f"zeroshard.torch: fetching the params of {unit.name} ({type(unit.module).__name__}) for "
                      f"its {when}: {e.message}. Ranks ran different modules here: a module that picks "
                      f"among submodules by the data (a mixture-of-experts block routing to its experts, a "
                      f"branch on the batch) must be one fetch unit on every rank: "
                      f"zeroshard.torch.set_leaf_modules(model, [ThatBlockClass])", e.status,
                      e.status_name) from e


def _release(params, handles=None):
    """Drop one hold of each of `params`; the coordinator frees those no
    unit holds any more (persistent ones stay gathered until the step)."""
    done = []
    for p in params:
        p.zs.holds -= 1
        if p.zs.holds <= 0:
            p.zs.holds = 0
            done.append(p)
    if done:
        all_done = handles is not None and len(done) == len(params)
        hollow.call(get_context().coord_release, handles if all_done else zparams(done))
        detach_views([p for p in done if not p.zs.persistent])


def release_backward_hold(unit):
    """The hold fetch_for_backward took, less the params that went early
    (GradArrival.release_unpacked)."""
    if unit.released_early:
        _release([p for p in unit.params if p not in unit.released_early])
        unit.released_early.clear()
    else:
        _release(unit.params, unit.handles())


def _read_gathered(p, read):
    _acquire([p])
    try:
        return read()
    finally:
        _release([p])


saved.read_gathered = _read_gathered


# -- the unit's hook functions (module-level: copied models share them) ------
def _unit_pre_forward(module, inputs):
    unit = _live_unit(module)
    if not saved._active:  # no root forward runs: this module's forward is the scope
        _open_scope(unit)
    if unit.params:
        _acquire_unit(unit, "forward")
        unit.packs_at_entry = saved.packs[0]
        unit.aliased = repeated_use.alias_repeated_uses(unit)
    hook_state().running.append(unit)


def _unit_post_forward(module, inputs, kwargs, output):
    unit = _live_unit(module)
    if unit.aliased:
        repeated_use.restore(unit.aliased)
        unit.aliased = None
    running = hook_state().running
    if running and running[-1] is unit:
        running.pop()
    try:
        if not unit.params:
            return
        if _kept_for_backward(unit, output):
            return
        _release(unit.params, unit.handles())
        if not torch.is_grad_enabled():
            return
        if unit.persistent:
            # Persistent params stay gathered until the optimizer step: backward
            # needs no fetch for them.
            unit.engine._hook_grads(unit.params)  # params unfrozen since the last step too
            return
        tensors = _output_tensors(output, [])
        if tensors:
            # Its backward reads its params: it saved them, or saved nothing
            # through our hooks, or has modules inside without hooks, whose
            # forward activation checkpointing may re-run in the backward
            # with no fetch of theirs (transformers checkpoints a layer's
            # forward, inside its hooks, after saving the checkpoint's
            # inputs through ours: no param among what we saw saved).
            if unit.hookless_inside or saved.packs[0] == unit.packs_at_entry or \
                    any(p.zs.saved for p in unit.params):
                unit.bwd_needs = True
            unit.pending = {p for p in unit.params if p.requires_grad}
            unit.engine._hook_grads(unit.pending)  # params unfrozen since the last step too
            if unit.pending or unit.leaf:
                for t in tensors:
                    t.register_hook(lambda grad, unit=unit: unit.engine.fetch_for_backward(unit))
            else:
                # No gradient of its own to wait for: released when this
                # forward's backward is done (see _FrozenCall).
                call = _FrozenCall(unit, _output_tensors(kwargs, _output_tensors(inputs, [])))
                for t in tensors:
                    t.register_hook(call.backward_begins)
    finally:
        # The scope this forward opened (not one a forward of the same
        # module nested in it finds open).
        state = hook_state()
        if state.opened and state.opened[-1][0] is unit and len(state.running) <= state.opened[-1][1]:
            _close_scope(output)


def _kept_for_backward(unit, output):
    """A unit fully_shard'd with reshard_after_forward=False (the root by
    default) keeps its forward's hold for its backward, which then gathers
    nothing: the hold goes once its params' gradients have come
    (_grad_arrived). So does every unit's forward re-run inside the
    backward (activation checkpointing's recompute), as FSDP2 leaves a
    block gathered from its recompute to its backward: released after the
    recompute, its params were gathered again moments later for the
    backward of the same layer (a third of a step's gathers under
    TRL's default gradient checkpointing); held, the backward holds one
    checkpointed layer's params at a time. Only a unit with params that
    take a gradient and an output that needs one; a second forward before
    that backward (activation checkpointing's) gives its own hold back as
    usual. The recompute's holds stay within a budget (HookEngine.
    recompute_budget: the largest unit, or a quarter of the model), so a
    checkpoint around many layers, or the whole model, whose recompute runs
    them all before any of their backwards, holds no more than that; the
    units past it release as before."""
    recompute = in_backward()
    if not ((unit.keep_for_backward or recompute) and torch.is_grad_enabled()) or unit.persistent or unit.bwd_held:
        return False
    pending = {p for p in unit.params if p.requires_grad}
    if not pending or not _output_tensors(output, []):
        return False
    if not unit.keep_for_backward and not unit.engine.hold_recompute(unit):
        return False
    unit.pending = pending
    unit.engine._hook_grads(pending)
    unit.engine.fetch_for_backward(unit, gathered=True)
    return True


def _live_unit(module):
    unit = module.__dict__["_zs_unit"]
    if unit.engine is None:
        raise RuntimeError(
            f"zeroshard.torch: {type(module).__name__} was copied out of a partitioned model without "
            "the model's root, so nothing installs its hooks: call "
            "zeroshard.torch.partition_module(copy) on the copy's outermost module")
    return unit


# torch.compile: graph breaks at unit boundaries (compile.py).
_unit_pre_forward = engine_call(_unit_pre_forward)
_unit_post_forward = engine_call(_unit_post_forward)
_UNIT_HOOKS = (_unit_pre_forward, _unit_post_forward)


def _strip_hooks(module, hooks):
    """Remove our hook functions from a module (a copy may carry them)."""
    for d in (module._forward_pre_hooks, module._forward_hooks):
        for k in [k for k, fn in d.items() if fn in hooks]:
            del d[k]
            module._forward_hooks_always_called.pop(k, None)
            module._forward_hooks_with_kwargs.pop(k, None)
