"""Module hooks: fetch a module's params before its forward, release them
after, fetch them again before its backward, and hand each gradient to the
engine as autograd produces it.

Units: by default a module's own params (recurse=False) plus any external
params registered on it; a leaf module's unit is every param of its
subtree, fetched and released as one (see set_leaf_modules). Gradients of
leaf params are summed locally and pushed at the step in registration
order, zeros for params a rank did not use, so that ranks routing to
different experts still issue identical collectives.

On a GPU context gradients are handed over as CUDA pointers, without a copy
to the host: the engine's stream is a blocking stream, so its copy runs
after the backward kernels queued on torch's (legacy) default stream, and
torch's later work on that stream runs after the copy.
"""
import torch

from ._context import get_context
from ._params import attach_views, detach_views, is_partitioned, registered_params, zparams
from .gathered import GatheredParameters


class _Unit:
    """The params one hooked module fetches and releases together."""

    def __init__(self, engine, module, params, leaf):
        self.engine = engine
        self.module = module
        self.params = params
        self.leaf = leaf
        self.pending = set()  # params whose gradient has not arrived yet
        self.grad_accs = []   # AccumulateGrad nodes (kept alive for their hooks)


class _PreBackward(torch.autograd.Function):
    """Identity on a module's output; its backward runs before the
    module's own, which is when the module's params must be back."""

    @staticmethod
    def forward(ctx, unit, engine, output):
        ctx.unit = unit
        ctx.engine = engine
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.engine.fetch_for_backward(ctx.unit)
        return None, None, grad


class HookEngine:
    """Hooks of one model, and the step-level bookkeeping they share."""

    def __init__(self, model):
        self.model = model
        self.units = []
        self.handles = []
        self.in_step = False
        self.leaf_params = []  # in registration order

    # -- installing ---------------------------------------------------
    def install(self):
        ctx = get_context()
        # First, so that the step begins before any unit fetches.
        self.handles.append(self.model.register_forward_pre_hook(self._root_pre_forward))
        self._walk(self.model, inside_leaf=False)
        self.leaf_params.sort(key=lambda p: p.zs.index)
        for unit in self.units:
            self._hook_grads(unit)
        for unit in self.units:
            if unit.leaf and len(unit.params) > 1:
                ctx.leaf_group(zparams(unit.params))

    def _walk(self, module, inside_leaf):
        if inside_leaf:
            return
        leaf = getattr(module, "_zs_leaf", False)
        own = list(module.parameters(recurse=leaf)) + list(getattr(module, "_zs_external", []))
        params = []
        for p in own:
            if is_partitioned(p) and all(p is not q for q in params):  # tensors: identity
                params.append(p)
        if params:
            unit = _Unit(self, module, params, leaf)
            for p in params:
                if p.zs.owner is None or leaf:
                    p.zs.owner = unit
                if leaf:
                    self.leaf_params.append(p)
            self.units.append(unit)
            self.handles.append(module.register_forward_pre_hook(
                lambda m, inputs, unit=unit: self._pre_forward(unit)))
            self.handles.append(module.register_forward_hook(
                lambda m, inputs, output, unit=unit: self._post_forward(unit, output)))
        for child in module.children():
            self._walk(child, inside_leaf=leaf)

    def _hook_grads(self, unit):
        # Autograd records a param's shape in its AccumulateGrad node when
        # the node is made, so make it while the param is whole. Keeping the
        # node alive keeps it (and the hook) the param's accumulator.
        owned = [p for p in unit.params if p.requires_grad and p.zs.owner is unit]
        if not owned:
            return
        with GatheredParameters(owned):
            for p in owned:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(lambda *unused, p=p, unit=unit: self._on_grad(unit, p))
                unit.grad_accs.append(acc)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.units.clear()

    # -- forward --------------------------------------------------------
    def _root_pre_forward(self, module, inputs):
        if not self.in_step:
            get_context().step_begin()
            self.in_step = True

    def _pre_forward(self, unit):
        get_context().coord_fetch(zparams(unit.params))
        attach_views(unit.params)

    def _post_forward(self, unit, output):
        get_context().coord_release(zparams(unit.params))
        detach_views(unit.params)
        if torch.is_grad_enabled():
            unit.pending = {p for p in unit.params if p.requires_grad and p.zs.owner is unit}
            return self._wrap(unit, output)
        return None

    def _wrap(self, unit, output):
        if torch.is_tensor(output):
            return _PreBackward.apply(unit, self, output) if output.requires_grad else output
        if isinstance(output, tuple):
            return tuple(self._wrap(unit, o) for o in output)
        if isinstance(output, list):
            return [self._wrap(unit, o) for o in output]
        if isinstance(output, dict):
            return {k: self._wrap(unit, v) for k, v in output.items()}
        return output

    # -- backward -------------------------------------------------------
    def fetch_for_backward(self, unit):
        if all(p.zs.zparam.status == "AVAILABLE" and p.data.numel() == p.zs.zparam.numel for p in unit.params):
            return
        get_context().coord_fetch(zparams(unit.params))
        attach_views(unit.params)

    def _on_grad(self, unit, p):
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        grad = grad.detach().to(p.zs.dtype).contiguous()
        if unit.leaf:
            p.zs.stash = grad.clone() if p.zs.stash is None else p.zs.stash.add_(grad)
        else:
            p.zs.zparam.push_grad((grad.data_ptr(), grad.numel() * grad.element_size()), p.zs.zparam.dtype)
        unit.pending.discard(p)
        if not unit.pending and not unit.leaf:
            get_context().coord_release(zparams(unit.params))
            detach_views(unit.params)

    # -- step -----------------------------------------------------------
    def before_step(self):
        """Push leaf gradients, release what backward left gathered, end
        the coordinator's step. Called by the optimizer; collective."""
        ctx = get_context()
        for p in self.leaf_params:
            if not p.requires_grad:
                continue
            g = p.zs.stash if p.zs.stash is not None else torch.zeros(p.zs.shape, dtype=p.zs.dtype,
                                                                      device=p.zs.device)
            p.zs.zparam.push_grad((g.data_ptr(), g.numel() * g.element_size()), p.zs.zparam.dtype)
            p.zs.stash = None
        for unit in self.units:
            gathered = [p for p in unit.params if p.zs.zparam.status == "AVAILABLE"]
            if gathered:
                ctx.coord_release(zparams(gathered))
                detach_views(gathered)
            unit.pending.clear()
        if self.in_step:
            ctx.step_end()
            self.in_step = False

    def after_step(self):
        """The optimizer changed the shards: drop views of stale copies."""
        detach_views([p for p in registered_params() if p.zs is not None])


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
