"""What the hooks of every model keep of one context: its HookState
(hook_state()), and the step-level bookkeeping on it that optimizers read
(which models' HookEngines a step ends).

The hooks are plain functions that find their state on the module
(`_zs_unit`, `_zs_hooks`: gather_unit.py, hooks.py); what they share
across models (the forwards running, the scopes opened, the coordinator's
step, fp16 loss scaling) is the context's: its HookState. No module of the
hooks keeps state of its own (test_hook_state.py).
"""
from ._context import context_state, drop_context_state, on_shutdown
from ._params import is_partitioned


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
        # it since, so the forward that began it ends it (see
        # forward_scope._scope_ends).
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
