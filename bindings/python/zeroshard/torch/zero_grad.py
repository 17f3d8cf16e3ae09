"""zero_grad drops what a backward pushed to the engine, as torch's drops
.grad: a gradient of a partitioned param lives in the engine's shards from
its backward on, so torch's zero_grad (None into .grad) alone would leave
it there for the next step. Between a backward and the step that is a
DCGAN's loop: the generator's loss reaches the discriminator's params, and
`netD.zero_grad()` (or its optimizer's) must keep that from the
discriminator's next step. nn.Module.zero_grad and torch.optim.Optimizer's
(a stock optimizer stepped on shards) call zs_grad_discard for their
partitioned params after torch's own; ZeroShardOptimizer.zero_grad does the
same. It returns at once, with no collective, when none of them has a
gradient pushed (zero_grad right after the step, or before the backward)."""
import warnings

import torch

from ..param import ParamArray

_torch_module_zero_grad = torch.nn.Module.zero_grad
_torch_optimizer_zero_grad = torch.optim.Optimizer.zero_grad


def discard(params, set_to_none=True):
    """zs_grad_discard for the partitioned ones among torch params."""
    discard_engine([p.zs.zparam for p in params if getattr(p, "zs", None) is not None], set_to_none)


def discard_engine(zparams, set_to_none, stacklevel=5):
    """zs_grad_discard for engine Params, a list or a prebuilt ParamArray,
    unless the engine is closed; set_to_none=False warns at stacklevel."""
    params = zparams.params if isinstance(zparams, ParamArray) else zparams
    if params and not params[0].context.closed:
        if not set_to_none:
            say_set_to_none(stacklevel=stacklevel)
        params[0].context.grad_discard(zparams)


def say_set_to_none(stacklevel=4):
    warnings.warn("zeroshard.torch: zero_grad(set_to_none=False) acts as set_to_none=True on partitioned params: "
                  "one that gets no gradient before the next step is left alone by it, where torch would step it "
                  "with a zero gradient (its momentum and weight decay)", stacklevel=stacklevel)


def _module_zero_grad(module, set_to_none=True):
    if not set_to_none or getattr(module, "_is_replica", False):  # torch's own path: its warning, zeroed grads
        _torch_module_zero_grad(module, set_to_none)
        discard(module.parameters(), set_to_none)
        return
    # torch's set_to_none loop and the partitioned params in one walk of the
    # tree (on a model of 200 small modules a walk costs about as much as the
    # engine call: 0.6 ms against 0.04).
    zparams = []
    for p in module.parameters():
        if p.grad is not None:
            p.grad = None
        z = getattr(p, "zs", None)
        if z is not None:
            zparams.append(z.zparam)
    discard_engine(zparams, set_to_none)


def _optimizer_zero_grad(optimizer, set_to_none=True):
    _torch_optimizer_zero_grad(optimizer, set_to_none)
    discard((p for group in optimizer.param_groups for p in group["params"]), set_to_none)


torch.nn.Module.zero_grad = _module_zero_grad
torch.optim.Optimizer.zero_grad = _optimizer_zero_grad
