"""Gradient arrival: how each param's gradient reaches the engine, and
what its arrival releases (GradArrival, the HookEngine's half that takes
gradients).

Gradients of params that only kept units hold (persistent, not in a leaf
or in a unit that also holds non-persistent params) need no hook each:
autograd accumulates them in .grad, and once the backward ends (a
callback a scope's output's gradient queues) they go to the engine as the
hooks would have pushed them, and .grad is None again. Params of other
units keep their per-param hooks: their gradient is what lets the unit's
gathered params go during the backward (a swept param that a unit of
them fetches on access later releases that unit when the backward ends).

Gradients of leaf params (leaf_modules.py) are summed locally and pushed
at the step in registration order, zeros for params a rank did not use,
so that ranks routing to different experts still issue identical
collectives.

On a GPU context gradients are handed over as CUDA pointers, without a copy
to the host: the engine's stream is a blocking stream, so its copy runs
after the backward kernels queued on torch's (legacy) default stream, and
torch's later work on that stream runs after the copy.
"""
import weakref

import torch

import zeroshard

from . import hollow
from ._autograd import in_backward
from ._context import get_context
from ._malloc import trim_as_engine_grows, trims_on
from ._params import zparams
from .gather_unit import _release, release_backward_hold
from .hook_state import hook_state


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


def _check_scaled_backward():
    """Under fp16 loss scaling, a gradient autograd produces now must come
    from ZeroShardOptimizer.backward(loss), which scales the loss: the
    engine divides every gradient by the scale, so an unscaled backward
    would train with updates `scale` times too small, silently."""
    state = hook_state()
    scale = state.loss_scale
    if (scale != 1.0 and state.scaled_backwards == 0
            and in_backward()):
        raise RuntimeError(
            f"zeroshard.torch: fp16.enabled scales the loss (loss scale now {scale:g}), so the backward must "
            "be optimizer.backward(loss) (ZeroShardOptimizer.backward, as DeepSpeed's engine.backward), not "
            "loss.backward(): the engine divides every gradient by the loss scale")


def _as_taken(grad, z):
    """A gradient as the engine takes it: the param's dtype, contiguous."""
    if grad.dtype != z.dtype or not grad.is_contiguous():
        grad = grad.detach().to(z.dtype).contiguous()
    return grad


def _take_grad(p):
    """p's gradient as the engine takes it, or None; p.grad is None
    afterwards."""
    grad = p.grad
    if grad is None:
        return None
    p.grad = None
    return _as_taken(grad, p.zs)


def _lend(z, grad):
    """Lent, not copied: a large gradient is reduced straight from
    autograd's tensor, which the context holds until then."""
    hollow.call(z.zparam.lend_grad, grad.data_ptr(), grad.numel() * grad.element_size(), z.zparam.dtype, grad)


class GradArrival:
    """The gradients of one model's params (a base of HookEngine, whose
    units hold the params): swept when the backward ends or pushed by a
    hook of their own, and the units held for their backward until they
    come."""

    def __init__(self):
        self.waiting = {}      # param -> units held for backward until its gradient arrives
        self.unpacked = []     # params whose saved references were all read (saved.py)
        self.swept = []        # params whose gradients are taken when the backward ends
        self._batches = None   # self.swept by dtype, with their zeroshard.GradBatch
        self._sweepable = set()  # ids of the params that may be swept
        self._sweep_queued = False
        self.recompute_elements = 0  # of units held from a recompute for their backward
        self._recompute_budget = None

    @property
    def recompute_budget(self):
        """Elements the units a recompute holds for their backward may
        total: the largest unit's, or a quarter of the model's if more
        (a checkpointed layer of a model of per-module units, down to a
        model of 4 layers; a checkpoint around more layers or the whole
        model holds no more than that)."""
        if self._recompute_budget is None:
            sizes = [sum(p.numel() for p in unit.params) for unit in self.units]
            self._recompute_budget = max(max(sizes, default=0), sum(sizes) // 4)
        return self._recompute_budget

    def hold_recompute(self, unit):
        """Whether `unit`, run again in a backward, keeps its hold for its
        own backward (within recompute_budget); counted if so."""
        size = sum(p.numel() for p in unit.params)
        if self.recompute_elements + size > self.recompute_budget:
            return False
        self.recompute_elements += size
        unit.recompute_held = size
        return True

    def _end_recompute_hold(self, unit):
        self.recompute_elements -= unit.recompute_held
        unit.recompute_held = 0

    def _choose_swept(self, params):
        """Which of `params` (every unit's) are swept: the persistent ones
        that only kept units hold (not in a leaf, nor in a unit with
        non-persistent params); then their gradient hooks."""
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
                hollow.call(batch.push)
                if self.waiting:
                    for p in arrived:
                        self._grad_arrived(p)

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
            _lend(z, grad)
        self._grad_arrived(p)

    def take_repeated_use_grad(self, p, grad):
        """The gradient of one of p's later uses in a forward
        (repeated_use.py): to the engine now, as a micro-batch's would be;
        p's own hook takes the first use's, which completes it."""
        _check_scaled_backward()
        _lend(p.zs, _as_taken(grad, p.zs))

    def release_unpacked(self):
        """Params no saved tensor reads any more go from the backward holds
        of units still waiting for their gradients (saved.py), once the
        node that read them last is done: called from the hooks that run
        between nodes."""
        while self.unpacked:
            p = self.unpacked.pop()
            if p.zs is None or p.zs.saved:
                continue  # read again meanwhile: activation checkpointing's recompute
            for unit in self.waiting.get(p, ()):
                if (unit.bwd_held and unit.bwd_fetched and not unit.keep_after_backward
                        and p not in unit.released_early):
                    unit.released_early.add(p)
                    _release([p])

    def _grad_arrived(self, p):
        """Units held for their backward until p's gradient came go now."""
        self.release_unpacked()
        for unit in self.waiting.pop(p, ()):
            unit.pending.discard(p)
            if unit.bwd_held and not unit.pending:
                unit.bwd_held = False
                self._end_recompute_hold(unit)
                if unit.keep_after_backward and not unit.kept_after_backward:
                    unit.kept_after_backward = True  # until the step's end (release_held)
                    continue
                if unit.bwd_fetched:  # else its backward read none of them (fetch_for_backward)
                    release_backward_hold(unit)
                self.trim_heap()  # the activations' heap, as the gradients grow

    @staticmethod
    def trim_heap():
        """glibc's free heap back to the system if the engine's host memory
        grew enough since the last time (_malloc.py). With trims off the
        engine's memory is not even read: this runs after every unit."""
        if not trims_on():
            return
        trim_as_engine_grows(get_context().host_memory_held())

    def _push_leaf_grads(self):
        """Each leaf param's gradient summed since the last step (zeros for
        one this rank did not use) to the engine, in registration order."""
        for p in self.leaf_params:
            if not p.requires_grad:
                continue
            g = p.zs.stash if p.zs.stash is not None else torch.zeros(p.zs.shape, dtype=p.zs.dtype,
                                                                      device=p.zs.device)
            hollow.call(p.zs.zparam.push_grad, (g.data_ptr(), g.numel() * g.element_size()), p.zs.zparam.dtype)
            p.zs.stash = None
