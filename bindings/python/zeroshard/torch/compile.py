"""torch.compile over a partitioned model.

What compiles: the module code between the engine's hooks. A partitioned
param is an ordinary Parameter of fixed shape, dtype and strides while its
module runs (param_type.py), so a graph compiled at the first step holds at
every later one: no recompilation, whatever the gathers' addresses.

What does not: the hooks themselves (gather_unit.py and forward_scope.py:
gather before a unit's forward, release after; grad_arrival.py: gradients
handed over; saved.py: tensors saved for backward kept by reference).
They call the engine through its C ABI, which dynamo cannot trace, so each
is a deliberate graph break at a unit boundary, as FSDP2's hooks stay
outside torchtitan's compiled blocks:

- `torch.compile(model)`: one graph per stretch of code between units;
- `block.compile()` before partitioning: the block is one gather unit
  (compiled_block), fetched around the compiled call with no hook inside,
  so its graph has no break;
- `block.compile()` after partitioning: the block's own code between its
  submodules' hooks;
- `fullgraph=True` on a block with no hook inside it (compiled before
  partitioning, or a leaf module: set_leaf_modules).
"""
import importlib.abc
import sys

import torch

# torch._dynamo takes about a second to import, as long as the rest of
# zeroshard.torch, and a script that never compiles never needs it: each
# rank and each replacement of a healed one would pay it at its start. So
# an engine call made before it is loaded is a wrapper marked as
# torch.compiler.disable marks its own (a traced caller breaks its graph
# there and never inlines it), calling the hook as it is; the moment
# torch._dynamo is imported (a finder at the front of sys.meta_path sees
# it come, before anything can compile) each wrapper calls
# torch.compiler.disable(hook) instead, its own frame skipped by dynamo:
# compilation off for the hook and all it calls, as with the decorator.
_deferred = []  # [holder]: [hook] until torch._dynamo is loaded, then [its disabled form]


def _deferring(holder):
    def engine_call_wrapper(*args, **kwargs):
        return holder[0](*args, **kwargs)
    return engine_call_wrapper


_WRAPPER_CODE = _deferring([None]).__code__  # every wrapper's frame, skipped once dynamo is loaded


def engine_call(fn):
    """`fn` (a hook that calls the engine) runs as it is under torch.compile:
    a graph break where it is called, nothing of it traced."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    holder = [fn]
    call = _deferring(holder)
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(call, name, getattr(fn, name, None))
    call._torchdynamo_disable = True
    _deferred.append(holder)
    return call


def _bind_deferred():
    """torch._dynamo is loaded: every wrapper made before calls its hook's
    torch.compiler.disable form, and dynamo runs the wrapper's frame as it
    is."""
    from torch._dynamo.eval_frame import skip_code
    skip_code(_WRAPPER_CODE)
    for holder in _deferred:
        holder[0] = torch.compiler.disable(holder[0])
    _deferred.clear()


class _BindOnLoad(importlib.abc.Loader):
    """torch._dynamo's own loader, then _bind_deferred; anything else asked
    of it (source for tracebacks, resources) is its loader's."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _bind_deferred()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: torch._dynamo's spec from the finders after
    it, its loader wrapped by _BindOnLoad. Gone from sys.meta_path once it
    has seen it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _BindOnLoad(spec.loader)
                return spec
        return None


if "torch._dynamo" not in sys.modules:
    sys.meta_path.insert(0, _WhenDynamoLoads())


def compiled_block(module):
    """Whether `module` was compiled on its own before its model was
    partitioned (`block.compile()`, or a torch.compile'd module put in its
    place): it becomes one gather unit, fetched around the compiled call,
    as FSDP2's fully_shard(block) with torchtitan's per-block compile."""
    return (module.__dict__.get("_compiled_call_impl") is not None
            or ("torch._dynamo" in sys.modules  # else nothing was compiled
                and isinstance(module, torch._dynamo.eval_frame.OptimizedModule)))
