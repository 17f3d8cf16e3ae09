"""What a module's gather unit fetches, as the user says it: a leaf
module's whole subtree as one unit, fetched and released as one (a
mixture-of-experts block, so that ranks routing to different experts fetch
the same params), and params another module owns that a module uses
(register_external_parameter). The HookEngine reads both when it makes
the units (hooks.py).
"""
from ._params import is_partitioned


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
