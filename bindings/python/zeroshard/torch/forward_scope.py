"""The forward's scope: what the root's forward hooks (or a scope a unit
opens, or run_as_forward) do around a forward.

What a forward saves for backward holds gathered params by reference
(saved.py): the root's forward hooks push and pop that for the forward.

The root's forward is the scope of a forward: it begins the coordinator's
step, re-evaluates which units are kept (hooks.py), saves by reference, and
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
"""
import dataclasses
import sys

import torch

from . import _params, hollow, saved
from ._autograd import in_backward
from .compile import engine_call
from ._context import get_context
from .hook_state import _forget_ran, hook_state


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


# -- the root's hook functions (module-level: copied models share them) ------
def _root_pre_forward(module, inputs):
    engine = module.__dict__.get("_zs_hooks")
    if engine is not None:
        engine.begin_step()
        hook_state().scopes += 1
        if engine.units_to_check:
            engine.hook_kept_units_only_when_needed()
    # Not over another saved-tensor hook: under torch's non-reentrant
    # checkpoint around the whole model, ours would take what the
    # checkpoint drops, and the model would keep every activation and
    # never recompute (as a scope a unit opens, _open_scope).
    saved.push(by_reference=(engine is None or engine.saves_by_reference) and not _other_saved_hooks())


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
    agreed = hollow.value(ctx.step_end, token)
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
    if in_backward():
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


# torch.compile: graph breaks at unit boundaries (compile.py).
_root_pre_forward = engine_call(_root_pre_forward)
_root_post_forward = engine_call(_root_post_forward)
