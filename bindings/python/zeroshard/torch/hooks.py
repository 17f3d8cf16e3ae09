"""Module hooks: fetch a module's params before its forward, release them
after, fetch them again before its backward, and hand each gradient to the
engine as autograd produces it.

Units: by default a module's own params (recurse=False) plus any external
params registered on it; a leaf module's unit is every param of its
subtree, fetched and released as one (see set_leaf_modules). Gradients of
leaf params are summed locally and pushed at the step in registration
order, zeros for params a rank did not use, so that ranks routing to
different experts still issue identical collectives.

Holds: a param stays gathered while any unit holds it (its forward, its
backward, a forward re-run by activation checkpointing during backward);
the coordinator is told to release it when the last hold goes.

What a forward saves for backward holds gathered params by reference
(saved.py): the root's forward hooks push and pop that for the forward.

The root's forward is the scope of a forward: it begins the coordinator's
step, re-evaluates which units are kept (below), saves by reference, and
hooks its outputs for the sweep when the backward ends. The optimizer step
ends the coordinator's step, except that a step a forward under no_grad
began ends with that forward (an evaluation loop, generate(): see
_scope_ends). Code that calls a
partitioned model's submodules without the root's forward (Lightning's
training_step calling self.net(x); model.encoder(x)) gets the scope two
ways:

- run_as_forward(model, fn, *args): fn runs as the root's forward would,
  in one scope (ZeroShardStrategy runs Lightning's steps so);
- otherwise the outermost hooked module that runs outside any scope opens
  one for its own forward (its pre-hook) and closes it when that forward
  ends (its post-hook, which also runs when the forward raises): the step
  begins, saved tensors go by reference, and that module's outputs get the
  sweep hook. Kept units are only re-evaluated at a root forward (or
  run_as_forward): arming a module's hooks while an unhooked ancestor of
  it runs would release what was never fetched. No scope is opened for a
  forward re-run in backward (activation checkpointing's recompute runs
  outside the root's scope too), and a scope opened under another
  saved-tensor hook (torch's non-reentrant checkpoint, save_on_cpu) does not
  push ours over it.

A unit with no trainable param (a LoRA adapter's frozen base) whose
output needs a gradient has no gradient of its own to say when its
backward is done: its inputs' gradients do (_FrozenCall), else the end of
the backward; before, it stayed gathered until the optimizer step.

Fetch on access: a module that reads another module's param without
calling that module's forward (nn.MultiheadAttention reads
out_proj.weight) finds it gathered: the read fetches it, warns once, and
makes it an external param of the running module from then on.

Gradients of params that only kept units hold (persistent, not in a leaf
or in a unit that also holds non-persistent params) need no hook each:
autograd accumulates them in .grad, and once the backward ends (a
callback a scope's output's gradient queues) they go to the engine as the
hooks would have pushed them, and .grad is None again. Params of other
units keep their per-param hooks: their gradient is what lets the unit's
gathered params go during the backward (a swept param that a unit of
them fetches on access later releases that unit when the backward ends).

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
hooked copy with its own units and partitioned params. What they share
across models (the forwards running, the scopes opened, the coordinator's
step, fp16 loss scaling) is the context's: its HookState (hook_state()).

On a GPU context gradients are handed over as CUDA pointers, without a copy
to the host: the engine's stream is a blocking stream, so its copy runs
after the backward kernels queued on torch's (legacy) default stream, and
torch's later work on that stream runs after the copy.
"""
import contextlib
import copy
import dataclasses
import sys
import warnings
import weakref

import torch

import zeroshard

from . import _params, saved
from .compile import compiled_block, engine_call
from ._context import context_state, drop_context_state, get_context, on_shutdown
from ._malloc import trim_when_freed
from ._params import (adopt_assigned, attach_views, detach_views, fetch_on_access,
                      freeze_untrainable, is_partitioned, param_path, quantizes_frozen,
                      registered_params, zparams)

class HookState:
    """What the hooks of every model keep of one context: one object per
    context (hook_state()), made on first use, before the context itself
    when a forward's hooks run first (it is then the state of the context
    they create), and dropped when shutdown() closes the context
    (forget_step)."""

    __slots__ = ("running", "opened", "step_open", "scopes", "inference", "loss_scale",
                 "scaled_backwards", "ran")

    def __init__(self):
        self.running = []  # units whose forward is running now, innermost last (all models)
        # Scopes a unit opened because it ran outside any root forward: (unit,
        # len(running) before it ran), innermost last.
        self.opened = []
        # The coordinator's step is one per context, whichever model began it.
        # scopes: forwards (roots' and opened scopes) running in it now;
        # inference: it began under no_grad and no forward with gradients ran in
        # it since, so the forward that began it ends it (see _scope_ends).
        self.step_open = False
        self.scopes = 0
        self.inference = False
        # fp16 loss scaling: the scale gradients must carry (1.0: none required;
        # set by ZeroShardOptimizer under fp16.enabled), and how many
        # ZeroShardOptimizer.backward calls are running (each scales its loss).
        self.loss_scale = 1.0
        self.scaled_backwards = 0
        self.ran = []  # HookEngines whose model ran a forward since the last optimizer step


def hook_state():
    """The HookState of the process's context (of the next one created
    while there is none)."""
    return context_state(HookState)


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
        # fully_shard (fully_shard.py): kept gathered from the forward to the
        # backward (reshard_after_forward=False), from the backward to the
        # step's end (set_reshard_after_backward(False)); held by unshard().
        self.keep_for_backward = False
        self.keep_after_backward = False
        self.kept_after_backward = False
        self.user_hold = False
        self._handles = None

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


def _weakly(method):
    """`method` as a hook that does not keep its object alive. torch keeps
    a param's hooks in C++, where the garbage collector cannot see them:
    a bound method there would keep the HookEngine, its units and through
    them every param and the model alive for ever."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return hook


@on_shutdown
def forget_step():
    """The context is gone: no step is open, no forward runs. Its state goes
    with it, but for the scopes forwards opened: those forwards still run
    (shutdown() inside one), and their post-hooks close them, so the next
    context's state has them."""
    state = drop_context_state(HookState)
    if state is not None:
        _forget_ran(state)
        if state.opened:
            hook_state().opened = state.opened


def stepping_engines(params):
    """The HookEngines an optimizer step over `params` must end the step
    of: those whose model ran since the last step, and those that hold
    `params`. Not every engine alive: a dropped model's engine lives on
    until its rank's garbage collector reaches it, which happens at
    different times on different ranks, and ending its step may push its
    leaf gradients (a collective)."""
    engines = list(hook_state().ran)
    for p in params:
        owner = p.zs.owner if is_partitioned(p) else None
        if owner is not None and owner.engine is not None and all(owner.engine is not e for e in engines):
            engines.append(owner.engine)
    return engines


def step_done():
    """An optimizer step ended every running model's step."""
    _forget_ran(hook_state())


def _forget_ran(state):
    for e in state.ran:
        e.ran = False
    state.ran.clear()


def _acquire(params, handles=None):
    """Gather `params` (through the coordinator, which records the order)
    and hold them. `handles`: their prebuilt zeroshard.ParamArray."""
    if not params:
        return
    get_context().coord_fetch(handles if handles is not None else zparams(params))
    for p in params:
        p.zs.holds += 1
    attach_views(params, available=True)


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
        get_context().coord_release(handles if all_done else zparams(done))
        detach_views([p for p in done if not p.zs.persistent])


def _check_scaled_backward():
    """Under fp16 loss scaling, a gradient autograd produces now must come
    from ZeroShardOptimizer.backward(loss), which scales the loss: the
    engine divides every gradient by the scale, so an unscaled backward
    would train with updates `scale` times too small, silently."""
    state = hook_state()
    scale = state.loss_scale
    if (scale != 1.0 and state.scaled_backwards == 0
            and torch._C._current_graph_task_id() != -1):
        raise RuntimeError(
            f"zeroshard.torch: fp16.enabled scales the loss (loss scale now {scale:g}), so the backward must "
            "be optimizer.backward(loss) (ZeroShardOptimizer.backward, as DeepSpeed's engine.backward), not "
            "loss.backward(): the engine divides every gradient by the loss scale")


def _take_grad(p):
    """p's gradient as the engine takes it (the param's dtype, contiguous),
    or None; p.grad is None afterwards."""
    grad = p.grad
    if grad is None:
        return None
    p.grad = None
    if grad.dtype != p.zs.dtype or not grad.is_contiguous():
        grad = grad.detach().to(p.zs.dtype).contiguous()
    return grad


def _output_tensors(output, out, depth=0):
    """The tensors in a module's output that autograd will differentiate:
    tensors, tuples, lists, dicts (HF ModelOutput), dataclasses."""
    if depth > 8:
        return out
    if torch.is_tensor(output):
        if output.requires_grad:
            out.append(output)
    elif isinstance(output, (tuple, list)):
        for o in output:
            _output_tensors(o, out, depth + 1)
    elif isinstance(output, dict):
        for o in output.values():
            _output_tensors(o, out, depth + 1)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            _output_tensors(getattr(output, f.name, None), out, depth + 1)
    return out


def _gradient_node(t):
    """The autograd node that takes t's gradient (AccumulateGrad for a
    leaf), or None."""
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None:
        return edge(t).node
    return t.grad_fn


class _FrozenCall:
    """One forward of a unit none of whose params needs a gradient (the
    frozen base of a LoRA adapter, a frozen encoder) while its output does.
    No gradient of its own tells when its backward is done, so what does:
    the gradients of the forward's inputs (positional and keyword) that
    need one. Their nodes run only once every op between them and the
    output has, the ones that read the gathered params included. The
    backward fetch is released when every such input of every forward of
    the unit whose backward began has its gradient (a unit called twice
    stays gathered while either call's backward runs), or, when that never
    comes (no input needs a gradient: a frozen module whose output needs
    one through a trainable child; torch.autograd.grad(inputs=...) stopping
    short), when the backward ends. A call begins at its outputs' first
    gradient, so a forward whose graph is never differentiated (the re-run
    of non-reentrant checkpointing, whose recomputed outputs only feed
    saved tensors) holds nothing; reentrant checkpointing's re-run is
    differentiated by a backward of its own (its inputs: detached leaves),
    whose end is then the fallback.

    A release that comes too early (an op reading the params that is on
    no path from an input, run after the inputs' nodes) costs a gather,
    not a wrong gradient: a saved param not gathered is gathered for its
    read (saved.py). The call keeps the input's gradient node, not the
    input (a leaf's AccumulateGrad does hold the leaf): a frozen Linear
    saves no input, and keeping it would keep the activation."""

    __slots__ = ("unit", "nodes", "left", "handles")

    def __init__(self, unit, inputs):
        self.unit = unit
        self.nodes = []
        for t in inputs:
            node = _gradient_node(t)
            if node is not None and all(node is not n for n in self.nodes):
                self.nodes.append(node)
        self.left = 0
        self.handles = None  # while its backward runs

    def backward_begins(self, grad):
        """A gradient hook on the forward's outputs."""
        if self.handles is not None:
            return
        unit = self.unit
        engine = unit.engine
        engine.fetch_for_backward(unit)
        unit.open_calls += 1
        engine.open_frozen_call(self)
        self.left = len(self.nodes)
        self.handles = [node.register_prehook(self._input_grad) for node in self.nodes]

    def _input_grad(self, grad_outputs):
        self.left -= 1
        if self.left == 0 and self.handles is not None:
            self.end()
            self.unit.engine.release_frozen(self.unit)

    def end(self):
        """This call's backward is done (or the backward ended)."""
        if self.handles is not None:
            for h in self.handles:
                h.remove()
            self.handles = None
            self.unit.open_calls -= 1
            self.unit.engine.frozen_calls.discard(self)


# -- the hook functions (module-level: copied models share them) ------------
def _root_pre_forward(module, inputs):
    engine = module.__dict__.get("_zs_hooks")
    if engine is not None:
        engine.begin_step()
        hook_state().scopes += 1
        if engine.units_to_check:
            engine.hook_kept_units_only_when_needed()
    saved.push(by_reference=engine is None or engine.saves_by_reference)


def _root_post_forward(module, inputs, output):
    saved.pop()
    engine = module.__dict__.get("_zs_hooks")
    if engine is not None:
        _sweep_when_backward_ends(engine, output)
        _scope_ends(output)


def _forward_raised(output):
    """In a post-forward hook: whether the forward raised (torch runs
    always_call hooks from its `except` clause, with no output)."""
    return output is None and sys.exc_info()[1] is not None


def _scope_ends(output):
    """A root's forward, or a scope a unit opened, ended. A step that a
    forward under no_grad began, with no forward with gradients in it
    since, ends with its outermost forward: no backward or optimizer step
    will end it (an evaluation loop, generate()), and without an end its
    order would grow forward by forward and never be followed. A forward
    that raised leaves it open (the step end is a collective): the next
    forward under no_grad ends it."""
    state = hook_state()
    state.scopes = max(0, state.scopes - 1)
    if state.scopes == 0 and state.step_open and state.inference and not _forward_raised(output):
        _end_inference_step(state)


def _end_inference_step(state):
    ctx = get_context()
    for engine in state.ran:
        engine.release_held(ctx)
    token, dropped = _params.dropped_token()
    agreed = ctx.step_end(token)
    state.step_open = False
    if agreed is not None:
        # Not a quiet step: what it gathered may be kept now, so the next
        # forward re-evaluates which units go without hooks (a training
        # loop's optimizer step does so; an inference loop has none).
        for engine in state.ran:
            engine.units_to_check = True
    _forget_ran(state)
    _params.note_agreement(dropped, agreed)
    _params.settle_dropped()  # a dropped model goes at a step end, trained or not


def _sweep_when_backward_ends(engine, output):
    """A scope's forward ended: its output's gradients queue the sweep."""
    if engine.swept and torch.is_grad_enabled():
        for t in _output_tensors(output, []):
            t.register_hook(engine.sweep_after_backward)


def run_as_forward(model, fn, *args, **kwargs):
    """fn(*args, **kwargs) run as the partitioned `model`'s forward would
    run: the coordinator's step begins, kept units are re-evaluated (after
    an optimizer step), what fn's forwards save for backward holds gathered
    params by reference, and fn's output tensors end the backward with the
    gradient sweep. For code that calls submodules of `model` rather than
    `model` itself (ZeroShardStrategy runs Lightning's training_step,
    validation_step, test_step and predict_step in it). Calls of `model`
    inside fn nest."""
    _root_pre_forward(model, args)
    try:
        output = fn(*args, **kwargs)
    except BaseException:
        _root_post_forward(model, args, None)  # in the except clause: _forward_raised sees it
        raise
    _root_post_forward(model, args, output)
    return output


def _other_saved_hooks():
    """Whether saved-tensor hooks other than a scope's are in force
    (non-reentrant checkpoint, save_on_cpu): ours would replace them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _open_scope(unit):
    """`unit` runs outside any root forward: open a scope for its forward
    (see the module docstring). Not for a forward re-run in backward."""
    if torch._C._current_graph_task_id() != -1:
        return
    engine = unit.engine
    engine.begin_step()
    state = hook_state()
    state.scopes += 1
    saved.push(by_reference=engine.saves_by_reference and not _other_saved_hooks())
    state.opened.append((unit, len(state.running)))


def _close_scope(output):
    unit, _ = hook_state().opened.pop()
    saved.pop()
    _sweep_when_backward_ends(unit.engine, output)
    _scope_ends(output)


def _unit_pre_forward(module, inputs):
    unit = _live_unit(module)
    if not saved._active:  # no root forward runs: this module's forward is the scope
        _open_scope(unit)
    if unit.params:
        _acquire_unit(unit, "forward")
    hook_state().running.append(unit)


def _unit_post_forward(module, inputs, kwargs, output):
    unit = _live_unit(module)
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
    (_grad_arrived). Only a unit with params that take a gradient and an
    output that needs one; a second forward before that backward
    (activation checkpointing's) gives its own hold back as usual."""
    if not (unit.keep_for_backward and torch.is_grad_enabled()) or unit.persistent or unit.bwd_held:
        return False
    pending = {p for p in unit.params if p.requires_grad}
    if not pending or not _output_tensors(output, []):
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
_root_pre_forward = engine_call(_root_pre_forward)
_root_post_forward = engine_call(_root_post_forward)
_unit_pre_forward = engine_call(_unit_pre_forward)
_unit_post_forward = engine_call(_unit_post_forward)
_HOOKS = (_root_pre_forward, _root_post_forward, _unit_pre_forward, _unit_post_forward)


def _strip_hooks(module, hooks=_HOOKS):
    """Remove our hook functions from a module (a copy may carry them)."""
    for d in (module._forward_pre_hooks, module._forward_hooks):
        for k in [k for k, fn in d.items() if fn in hooks]:
            del d[k]
            module._forward_hooks_always_called.pop(k, None)
            module._forward_hooks_with_kwargs.pop(k, None)


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
            _strip_hooks(m)
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


def _read_gathered(p, read):
    _acquire([p])
    try:
        return read()
    finally:
        _release([p])


saved.read_gathered = _read_gathered


class HookEngine:
    """Hooks of one model, and the step-level bookkeeping they share."""

    def __init__(self, model):
        self.model = model
        self.units = []
        self.leaf_params = []  # in registration order
        self.waiting = {}      # param -> units held for backward until its gradient arrives
        self.warned = set()
        self._params = None    # every unit's params, once each (built on first use)
        self.swept = []        # params whose gradients are taken when the backward ends
        self._batches = None   # self.swept by dtype, with their zeroshard.GradBatch
        self._sweepable = set()  # ids of the params that may be swept
        self._sweep_queued = False
        self.frozen_calls = set()  # _FrozenCalls whose backward runs
        self._frozen_end_queued = False
        self.saves_by_reference = True  # some param is not persistent (saved.py)
        self.units_to_check = True  # which units need hooks (at the root's next forward)
        self.ran = False  # a forward ran since the last optimizer step (in HookState.ran)

    # -- installing ---------------------------------------------------
    def install(self):
        for m in self.model.modules():
            _strip_hooks(m)
            m.__dict__.pop("_zs_unit", None)
        # First, so that the step begins before any unit fetches.
        self.model.register_forward_pre_hook(_root_pre_forward)
        names = {m: n for n, m in self.model.named_modules()}
        if self.model.__dict__.get("_zs_fsdp") is not None:
            self._walk_sharded(self.model, names)
        else:
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
        # break at every submodule's hooks.
        whole = leaf or (module is not self.model and compiled_block(module))
        subtree = list(module.modules()) if whole else [module]
        own = list(module.parameters(recurse=whole)) + [p for m in subtree for p in getattr(m, "_zs_external", [])]
        # Every module has a unit, with no params if it owns none: a param
        # it reads of a module it does not call is then fetched with the
        # innermost module that read it, and released when that one ends.
        self._add_unit(module, names, own, leaf, subtree if whole and not leaf else ())
        for child in module.children():
            self._walk(child, names, inside_leaf=whole)

    def _walk_sharded(self, module, names):
        """fully_shard's units (fully_shard.py): a fully_shard'd module
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
        held = {id(p) for unit in self.units if unit.leaf or not all(q.zs.persistent for q in unit.params)
                for p in unit.params}
        self._sweepable = {id(p) for p in params if p.zs.persistent and id(p) not in held}
        self.swept = []
        self._batches = None
        self._hook_grads(params)

    def _hook_grads(self, params):
        """Hand `params`' gradients to this engine as autograd accumulates
        them (once per param; frozen params when they are unfrozen): swept
        when the backward ends, or pushed by a hook of their own."""
        for p in params:
            if p.zs.grad_hook is not self and p.requires_grad:
                p.zs.grad_hook = self
                if id(p) in self._sweepable:
                    self.swept.append(p)
                    self._batches = None
                else:
                    p.register_post_accumulate_grad_hook(_weakly(self._on_grad))

    def sweep_after_backward(self, grad):
        """A gradient hook on the root's outputs: the backward has begun;
        take the swept params' gradients once it ends."""
        if not self._sweep_queued:
            self._sweep_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.sweep_grads)

    def sweep_grads(self):
        """Every swept param's gradient to the engine, one call per dtype."""
        self._sweep_queued = False
        _check_scaled_backward()
        if self._batches is None:
            by_dtype = {}
            for p in self.swept:
                by_dtype.setdefault(p.zs.zparam.dtype, []).append(p)
            self._batches = [(params, zeroshard.GradBatch(get_context(), zparams(params), dtype))
                             for dtype, params in by_dtype.items()]
        for params, batch in self._batches:
            taken, arrived = [], []  # the gradients stay alive until the engine has copied them
            addresses = batch.addresses
            for i, p in enumerate(params):
                grad = _take_grad(p)
                if grad is None:
                    addresses[i] = 0
                    continue
                taken.append(grad)
                arrived.append(p)
                addresses[i] = grad.data_ptr()
            if taken:
                batch.push()
                if self.waiting:
                    for p in arrived:
                        self._grad_arrived(p)

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

    def remove(self):
        for m in self.model.modules():
            _strip_hooks(m)
            m.__dict__.pop("_zs_unit", None)
        self.units.clear()

    # -- forward --------------------------------------------------------
    def begin_step(self):
        state = hook_state()
        if not self.ran:
            self.ran = True
            state.ran.append(self)
        if not state.step_open:
            state.running.clear()  # left by a forward that raised
            self.take_user_changes()
            get_context().step_begin()  # creates the context whose state this is, if none exists yet
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
            unit.params.append(p)
            self._params = None
            ext = unit.module.__dict__.setdefault("_zs_external", [])
            if all(p is not q for q in ext):
                ext.append(p)
            if p.requires_grad and torch.is_grad_enabled():
                unit.pending.add(p)
                if unit.bwd_held:  # a forward re-run during backward (checkpointing)
                    self.waiting.setdefault(p, []).append(unit)
            self._hook_grads([p])
            if (unit.name, p.zs.name) not in self.warned:
                self.warned.add((unit.name, p.zs.name))
                warnings.warn(
                    f"zeroshard.torch: {unit.name} ({type(unit.module).__name__}) reads {param_path(p)} "
                    f"without calling its module's forward; it was fetched on access and is fetched with "
                    f"{unit.name} from now on. Declare it with "
                    f"zeroshard.torch.register_external_parameter(module, param) to have it prefetched.",
                    stacklevel=3)
        _acquire([p])

    # -- backward -------------------------------------------------------
    def fetch_for_backward(self, unit, gathered=False):
        """Hold `unit`'s params for its backward until their gradients come
        (gathered: the forward's hold is kept for it)."""
        if not unit.bwd_held:
            unit.bwd_held = True
            if not gathered:
                _acquire_unit(unit, "backward")
            if not unit.leaf:  # leaf units hold their params until the step
                for p in unit.pending:
                    self.waiting.setdefault(p, []).append(unit)

    def _on_grad(self, p):
        """p's gradient is complete (for this backward): to the engine."""
        _check_scaled_backward()
        grad = _take_grad(p)
        if grad is None:
            return
        z = p.zs
        if z.leaf:
            z.stash = grad.clone() if z.stash is None else z.stash.add_(grad)
        else:
            # Lent, not copied: a large gradient is reduced straight from
            # autograd's tensor, which the context holds until then.
            z.zparam.lend_grad(grad.data_ptr(), grad.numel() * grad.element_size(), z.zparam.dtype, grad)
        self._grad_arrived(p)

    def _grad_arrived(self, p):
        """Units held for their backward until p's gradient came go now."""
        for unit in self.waiting.pop(p, ()):
            unit.pending.discard(p)
            if unit.bwd_held and not unit.pending:
                unit.bwd_held = False
                if unit.keep_after_backward and not unit.kept_after_backward:
                    unit.kept_after_backward = True  # until the step's end (release_held)
                    continue
                _release(unit.params, unit.handles())
                trim_when_freed()  # its activations' heap, as the gradients grow (_malloc.py)

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
            _release(unit.params, unit.handles())

    # -- step -----------------------------------------------------------
    def before_step(self):
        """Push leaf gradients (and swept ones a backward that did not go
        through the root's outputs left), release what backward left
        gathered, end the coordinator's step. Called by the optimizer;
        collective."""
        ctx = get_context()
        trim_when_freed()  # the activations' heap, before the step's peak (_malloc.py)
        self.sweep_grads()
        for p in self.leaf_params:
            if not p.requires_grad:
                continue
            g = p.zs.stash if p.zs.stash is not None else torch.zeros(p.zs.shape, dtype=p.zs.dtype,
                                                                      device=p.zs.device)
            p.zs.zparam.push_grad((g.data_ptr(), g.numel() * g.element_size()), p.zs.zparam.dtype)
            p.zs.stash = None
        self.waiting.clear()
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
            unit.pending.clear()
            unit.bwd_held = False
            unit.open_calls = 0
            unit.kept_after_backward = unit.user_hold = False
            held = [p for p in unit.params if p.zs.holds > 0]
            for p in held:
                p.zs.holds = 0
            if held:
                ctx.coord_release(zparams(held))
                detach_views([p for p in held if not p.zs.persistent])

    def after_step(self):
        """The optimizer changed the shards: drop views of released copies.
        Persistent params keep theirs: the step gathered their new values
        into the buffers the views show."""
        detach_views([p for p in registered_params() if p.zs is not None])
        self.units_to_check = True


def set_leaf_modules(model, leaf_classes):
    """Mark every module of `model` whose class is in `leaf_classes` (or
    subclasses it) as a leaf: its whole subtree is one fetch unit. Call
    before the model's hooks are installed."""
    classes = tuple(leaf_classes)
    marked = []
    for m in model.modules():
        if isinstance(m, classes):
            m._zs_leaf = True
            marked.append(m)
    return marked


def unset_leaf_modules(model, leaf_classes):
    classes = tuple(leaf_classes)
    for m in model.modules():
        if isinstance(m, classes) and getattr(m, "_zs_leaf", False):
            m._zs_leaf = False


def register_external_parameter(module, param):
    """`module` uses `param`, which another module owns: fetch it with
    module's params too (the reference's register_external_parameter)."""
    ext = module.__dict__.setdefault("_zs_external", [])
    if all(param is not q for q in ext):
        ext.append(param)
    unit = module.__dict__.get("_zs_unit")
    if unit is not None and is_partitioned(param) and all(param is not q for q in unit.params):
        unit.params.append(param)
        unit.engine._params = None
        unit.engine._hook_grads([param])
