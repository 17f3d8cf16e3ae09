"""Which modules are gathered whole: DeepSpeed's
zero_optimization.(stage3_)module_granularity_threshold.

Every module is a gather unit by default, with hooks of its own: a model of
many small modules (a transformer block's projections and norms) pays a
gather, a release and four hooks per module and step, on tensors too small
to keep the wire busy. With the threshold set, a module whose subtree holds
at most that many params per layer becomes one unit with its whole
subtree (fetched and released together, no hooks inside), chosen as
DeepSpeed chooses its "z3 leaf modules" for the same key
(deepspeed/runtime/zero/parameter_offload.py, 0.19): a layer is a module
with params and no children, or a module with children that is not a
container (Sequential, ModuleList, ModuleDict, ...); granularity is its
subtree's params // its layers (never a module of more than 1e9 params);
outermost first. Unlike a leaf module (leaf_modules.py) the unit's
gradients go to the reduction as they arrive: only the gathering changes,
so losses and params are bit for bit those of the default units.
"""
import torch

from ._params import is_partitioned

# DeepSpeed's Z3_MAX_LEAF_SIZE: a larger module is never one unit (its whole
# subtree would be gathered at once).
MAX_WHOLE_PARAMS = 10 ** 9
_CONTAINERS = frozenset(torch.nn.modules.container.__all__)


def _numel(p):
    return p.zs.zparam.numel if is_partitioned(p) else p.numel()


def whole_modules(model, threshold):
    """The modules of `model` gathered as one unit each under
    module_granularity_threshold `threshold` (0: none): a set."""
    if threshold <= 0:
        return set()
    granularity = {}

    def measure(module):
        """(layers, params) of module's subtree; records its granularity."""
        params = sum(_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return (1, params) if any(True for _ in module.parameters(recurse=False)) else (0, 0)
        layers = 0
        for child in children:
            child_layers, child_params = measure(child)
            layers += child_layers
            params += child_params
        if params == 0 or type(module).__name__ in _CONTAINERS:
            return layers, params
        layers += 1
        if params <= MAX_WHOLE_PARAMS:
            granularity[module] = params // layers
        return layers, params

    measure(model)
    chosen = set()

    def choose(module):
        if granularity.get(module, threshold + 1) <= threshold:
            chosen.add(module)
            return
        for child in module.children():
            choose(child)

    choose(model)
    return chosen
