"""The hooks of one model (HookEngine): it makes a gather unit of each
module and arms its forward hooks (gather_unit.py), puts the root's hooks
that open each forward's scope around them (forward_scope.py), takes the
params' gradients (grad_arrival.py), releases a frozen unit's backward
fetch when its calls end (frozen_call.py), and at the optimizer step
pushes the leaf gradients, releases what units still hold and ends the
coordinator's step. Leaf modules and external params shape its units
(leaf_modules.py); what it shares with other models' engines is the
context's HookState (hook_state.py).

Fetch on access: a module that reads another module's param without
calling that module's forward (nn.MultiheadAttention reads
out_proj.weight) finds it gathered: the read fetches it, warns once, and
makes it an external param of the running module from then on.

Kept units go without hooks: a unit whose params are all persistent and
gathered (they stay so across optimizer steps, refreshed in place) needs
neither a fetch nor a release, so at each step's begin its module's
forward hooks are removed, and put back once any of its params is not
gathered any more. The engine's coordinator does not count such a unit
as an event either, so the trace stays the same. A module without hooks
is no fetch unit for fetch on access: a read of a param that is not
gathered inside it is a read of the module that called it.

The hooks are plain functions that find their state on the module
(`_zs_unit`, `_zs_hooks`), so `copy.deepcopy` of a hooked model gives a
hooked copy with its own units and partitioned params.
"""
import contextlib
import copy
import warnings

import torch

from . import _params, hollow
from .compile import compiled_block
from ._context import get_context
from ._params import (adopt_assigned, detach_views, fetch_on_access, freeze_untrainable, is_partitioned,
                      param_path, quantizes_frozen, registered_params, zparams)
from .forward_scope import _root_post_forward, _root_pre_forward
from .unit_plan import whole_modules
from .gather_unit import _UNIT_HOOKS, _Unit, _acquire, _acquire_unit, _release, _strip_hooks, release_backward_hold
from .grad_arrival import GradArrival
from .hook_state import hook_state

_HOOKS = (_root_pre_forward, _root_post_forward) + _UNIT_HOOKS


@contextlib.contextmanager
def hooks_suspended(model):
    """The engine's forward hooks taken off `model`'s modules for the block
    and put back in their places after (its params must be gathered: a
    forward then reads them as an unsharded model's; generation.py)."""
    taken = []
    for m in model.modules():
        if any(fn in _HOOKS for d in (m._forward_pre_hooks, m._forward_hooks) for fn in d.values()):
            taken.append((m, dict(m._forward_pre_hooks), dict(m._forward_hooks),
                          dict(m._forward_hooks_always_called), dict(m._forward_hooks_with_kwargs)))
            _strip_hooks(m, _HOOKS)
    try:
        yield model
    finally:
        for m, pre, post, always, with_kwargs in taken:
            for hooks, before in ((m._forward_pre_hooks, pre), (m._forward_hooks, post)):
                added = [(k, fn) for k, fn in hooks.items() if k not in before]  # the block's own, kept after ours
                hooks.clear()
                hooks.update(before)
                hooks.update(added)
            m._forward_hooks_always_called.update(always)
            m._forward_hooks_with_kwargs.update(with_kwargs)


def _forward_access(p):
    running = hook_state().running
    if running and p.zs.engine is not None:
        running[-1].engine.fetch_on_access(running[-1], p)


_params.on_forward_access = _forward_access


class HookEngine(GradArrival):
    """Hooks of one model, and the step-level bookkeeping they share."""

    def __init__(self, model):
        super().__init__()  # GradArrival's: the gradients' bookkeeping
        self.model = model
        self.units = []
        self._whole = set()  # modules gathered as one unit (unit_plan.py)
        self.leaf_params = []  # in registration order
        self.warned = set()
        self._params = None    # every unit's params, once each (built on first use)
        self.frozen_calls = set()  # _FrozenCalls whose backward runs
        self._frozen_end_queued = False
        self.saves_by_reference = True  # some param is not persistent (saved.py)
        self.units_to_check = True  # which units need hooks (at the root's next forward)
        self.ran = False  # a forward ran since the last optimizer step (in HookState.ran)
        self.forwards = 0  # forward scopes begun: a param used twice in one is aliased (repeated_use.py)
        self.learned = []  # (unit name, param index) fetch_on_access added, in order (healing hands them over)

    # -- installing ---------------------------------------------------
    def install(self):
        for m in self.model.modules():
            _strip_hooks(m, _HOOKS)
            m.__dict__.pop("_zs_unit", None)
        # First, so that the step begins before any unit fetches.
        self.model.register_forward_pre_hook(_root_pre_forward)
        names = {m: n for n, m in self.model.named_modules()}
        if self.model.__dict__.get("_zs_fsdp") is not None:
            self._walk_sharded(self.model, names)
        else:
            threshold = get_context().config["zero_optimization"]["module_granularity_threshold"]
            self._whole = whole_modules(self.model, threshold)
            self._walk(self.model, names, inside_leaf=False)
        # Last, and also when the forward raises: pops what the pre-hook pushed.
        self.model.register_forward_hook(_root_post_forward, always_call=True)
        self._adopt_units()

    def _walk(self, module, names, inside_leaf):
        if inside_leaf:
            return
        leaf = getattr(module, "_zs_leaf", False)
        # A whole unit: its subtree's params fetched and released together,
        # no hooks inside it. A leaf module is one; so is a block compiled
        # before partitioning (compiled_block), whose graph would otherwise
        # break at every submodule's hooks, and a module of small ones under
        # module_granularity_threshold (unit_plan.py).
        whole = leaf or (module is not self.model and compiled_block(module)) or module in self._whole
        subtree = list(module.modules()) if whole else [module]
        own = list(module.parameters(recurse=whole)) + [p for m in subtree for p in getattr(m, "_zs_external", [])]
        # Every module has a unit, with no params if it owns none: a param
        # it reads of a module it does not call is then fetched with the
        # innermost module that read it, and released when that one ends.
        self._add_unit(module, names, own, leaf, subtree if whole and not leaf else ())
        for child in module.children():
            self._walk(child, names, inside_leaf=whole)

    def _walk_sharded(self, module, names):
        """fully_shard's units (fsdp2.py): a fully_shard'd module
        fetches the params of its subtree but those of the fully_shard'd
        modules inside it, whose units are their own; the modules between
        carry no hooks, as in a compiled block."""
        own, subtree, inner = [], [], []

        def collect(m):
            subtree.append(m)
            own.extend(m.parameters(recurse=False))
            own.extend(getattr(m, "_zs_external", []))
            for child in m.children():
                if child.__dict__.get("_zs_fsdp") is not None:
                    inner.append(child)
                else:
                    collect(child)

        collect(module)
        unit = self._add_unit(module, names, own, False, subtree)
        unit.keep_for_backward = module.__dict__["_zs_fsdp"].keeps_for_backward(module is self.model)
        for child in inner:
            self._walk_sharded(child, names)

    def _add_unit(self, module, names, own, leaf, subtree):
        """`module`'s unit, fetching the partitioned params of `own` (each
        once), with its hooks armed. Leaf modules in `subtree` (a whole
        unit's modules) keep their gradients until the step (ranks may
        route to different experts); the rest push theirs."""
        params = []
        for p in own:
            if is_partitioned(p) and all(p is not q for q in params):  # tensors: identity
                params.append(p)
        unit = _Unit(module, names.get(module, "") or type(module).__name__, params, leaf)
        unit.inner_leaf = [p for m in subtree if getattr(m, "_zs_leaf", False) for p in m.parameters()]
        if subtree:
            unit.modules = list(subtree)
        module.__dict__["_zs_unit"] = unit
        self.units.append(unit)
        unit.arm()
        fetch_on_access(module)
        return unit

    def _adopt_units(self):
        """Make this engine the one of its units: owners, leaf groups,
        gradient hooks. Collective (gathers the params it hooks)."""
        self._params = None
        ctx = get_context()
        threshold = ctx.config["zero_optimization"]["param_persistence_threshold"]
        self.quantize_frozen = quantizes_frozen(ctx)
        self.leaf_params = []
        for unit in self.units:
            unit.engine = self
            for p in unit.params:
                p.zs.engine = self
                p.zs.persistent = p.zs.zparam.numel <= threshold
                if p.zs.owner is None or p.zs.owner.engine is not self or unit.leaf:
                    p.zs.owner = unit
                if unit.leaf or any(p is q for q in unit.inner_leaf):
                    p.zs.leaf = True
                    if all(p is not q for q in self.leaf_params):
                        self.leaf_params.append(p)
        self.leaf_params.sort(key=lambda p: p.zs.index)
        for unit in self.units:
            if unit.leaf and len(unit.params) > 1:
                ctx.leaf_group(zparams(unit.params))
        params = self.params()
        self.saves_by_reference = not all(p.zs.persistent for p in params)
        self._choose_swept(params)

    def __deepcopy__(self, memo):
        model = copy.deepcopy(self.model, memo)
        engine = HookEngine(model)
        memo[id(self)] = engine
        engine.units = [copy.deepcopy(u, memo) for u in self.units]
        engine._adopt_units()
        return engine

    def params_replaced(self):
        """Params of this model were registered anew (_params.repartition):
        each unit's engine handles are built again."""
        for unit in self.units:
            unit._handles = None
        self._params = None
        self._batches = None
        self._recompute_budget = None

    def remove(self):
        for m in self.model.modules():
            _strip_hooks(m, _HOOKS)
            m.__dict__.pop("_zs_unit", None)
        self.units.clear()

    # -- forward --------------------------------------------------------
    def begin_step(self):
        state = hook_state()
        self.forwards += 1
        if not self.ran:
            self.ran = True
            state.ran.append(self)
        if not state.step_open:
            state.running.clear()  # left by a forward that raised
            self.take_user_changes()
            # get_context() creates the context whose state this is, if none exists yet
            hollow.call(get_context().step_begin)
            state.step_open, state.scopes, state.inference = True, 0, True
        if torch.is_grad_enabled():
            state.inference = False  # a backward may follow: the optimizer step ends it

    def hook_kept_units_only_when_needed(self):
        """Remove the forward hooks of kept units, put them back on the
        others (at the first forward after an optimizer step, or of a new
        or copied model). The root keeps its own (its pre-hook is running
        now)."""
        self.units_to_check = False
        for unit in self.units:
            if unit.module is self.model:
                continue
            if unit.kept():
                if unit.armed:
                    unit.disarm()
            elif not unit.armed:
                unit.arm(prepend=True)

    def take_user_changes(self):
        """What user code changed on the params between steps: a param
        unfrozen since partitioning gets its gradient hook, and a
        `param.data = t` becomes the param's value."""
        params = self.params()
        freeze_untrainable(params, self.quantize_frozen)
        self._hook_grads(params)
        adopt_assigned(params)

    def params(self):
        if self._params is None:
            seen = set()
            self._params = [p for unit in self.units for p in unit.params
                            if id(p) not in seen and not seen.add(id(p))]
        return self._params

    def fetch_on_access(self, unit, p):
        """`unit`'s module read `p`, which is not gathered: fetch it now,
        and with `unit` from now on."""
        if p.zs.owner is not None and p.zs.owner.leaf and p.zs.owner is not unit:
            raise RuntimeError(f"zeroshard.torch: {unit.name} reads {p.zs.name}, a param of the leaf "
                               f"module {p.zs.owner.name}, outside that module's forward")
        if all(p is not q for q in unit.params):
            self.learn_fetch(unit, p)
            if p.requires_grad and torch.is_grad_enabled():
                unit.pending.add(p)
                if unit.bwd_held:  # a forward re-run during backward (checkpointing)
                    self.waiting.setdefault(p, []).append(unit)
            if (unit.name, p.zs.name) not in self.warned:
                self.warned.add((unit.name, p.zs.name))
                warnings.warn(
                    f"zeroshard.torch: {unit.name} ({type(unit.module).__name__}) reads {param_path(p)} "
                    f"without calling its module's forward; it was fetched on access and is fetched with "
                    f"{unit.name} from now on. Declare it with "
                    f"zeroshard.torch.register_external_parameter(module, param) to have it prefetched.",
                    stacklevel=3)
        _acquire([p])

    def learn_fetch(self, unit, p):
        """`unit` fetches `p` with its own params from now on (its module
        read it in a forward; or, in a healing replacement, the survivors'
        units had learned so)."""
        unit.params.append(p)
        self._params = None
        self._recompute_budget = None
        ext = unit.module.__dict__.setdefault("_zs_external", [])
        if all(p is not q for q in ext):
            ext.append(p)
        self._hook_grads([p])
        self.learned.append((unit.name, p.zs.index))

    # -- backward -------------------------------------------------------
    def fetch_for_backward(self, unit, gathered=False):
        """Hold `unit`'s params for its backward until their gradients come
        (gathered: the forward's hold is kept for it)."""
        self.release_unpacked()
        if not unit.bwd_held:
            unit.bwd_held = True
            # A backward that reads none of the unit's params (saved.py) gets
            # them not gathered: an embedding's table, at the backward's end
            # where the gradients peak. Leaf units and units kept gathered
            # after their backward (fully_shard) fetch as before.
            unit.bwd_fetched = gathered or unit.bwd_needs or unit.leaf or unit.keep_after_backward
            unit.bwd_needs = False
            if not gathered and unit.bwd_fetched:
                _acquire_unit(unit, "backward")
            if not unit.leaf:  # leaf units hold their params until the step
                for p in unit.pending:
                    self.waiting.setdefault(p, []).append(unit)

    def open_frozen_call(self, call):
        """A frozen unit's backward began (_FrozenCall): whatever no input
        gradient released goes when the backward ends."""
        self.frozen_calls.add(call)
        if not self._frozen_end_queued:
            self._frozen_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_frozen_calls)

    def _end_frozen_calls(self):
        self._frozen_end_queued = False
        for call in list(self.frozen_calls):
            call.end()
            self.release_frozen(call.unit)

    def release_frozen(self, unit):
        """Release a frozen unit's backward fetch once no call of it is in
        its backward (and no param of it waits for a gradient)."""
        if unit.bwd_held and unit.open_calls <= 0 and not unit.pending and not unit.leaf:
            unit.open_calls = 0
            unit.bwd_held = False
            if unit.bwd_fetched:
                release_backward_hold(unit)

    # -- step -----------------------------------------------------------
    def before_step(self):
        """Push leaf gradients (and swept ones a backward that did not go
        through the root's outputs left), release what backward left
        gathered, end the coordinator's step. Called by the optimizer;
        collective."""
        ctx = get_context()
        self.trim_heap()  # the activations' heap, if the gradients grew since
        self.sweep_grads()
        self._push_leaf_grads()
        self.waiting.clear()
        self.unpacked.clear()
        for call in list(self.frozen_calls):
            call.end()
        self._frozen_end_queued = False  # a backward that raised never ran its callback
        self.release_held(ctx)
        state = hook_state()
        if state.step_open:
            token, dropped = _params.dropped_token()
            agreed = ctx.step_end(token)
            state.step_open = False
            _params.note_agreement(dropped, agreed)

    def release_held(self, ctx):
        """Release what units still hold at a step's end (what a backward
        left gathered; a forward that raised)."""
        for unit in self.units:
            held = unit.forget_step()
            if held:
                hollow.call(ctx.coord_release, zparams(held))
                detach_views([p for p in held if not p.zs.persistent])
        self.recompute_elements = 0

    def forget_held(self):
        """A heal dropped the step a loss cut short: the engine released
        every gathered param and forgot the coordinator's step, so the holds,
        queues and views of the abandoned forward and backward go here
        without a call to the engine (heal.py)."""
        for unit in self.units:
            unit.forget_step()
        self.recompute_elements = 0
        self.waiting.clear()
        self.unpacked.clear()
        self.frozen_calls.clear()
        self._frozen_end_queued = False
        self._sweep_queued = False
        self.ran = False
        self.units_to_check = True

    def after_step(self):
        """The optimizer changed the shards: drop views of released copies.
        Persistent params keep theirs: the step gathered their new values
        into the buffers the views show."""
        detach_views([p for p in registered_params() if p.zs is not None])
        self.units_to_check = True

