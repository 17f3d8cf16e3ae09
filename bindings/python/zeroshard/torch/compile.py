"""torch.compile over a partitioned model.

What compiles: the module code between the engine's hooks. A partitioned
param is an ordinary Parameter of fixed shape, dtype and strides while its
module runs (param_type.py), so a graph compiled at the first step holds at
every later one: no recompilation, whatever the gathers' addresses.

What does not: the hooks themselves (hooks.py: gather before a unit's
forward, release after, gradients handed over; saved.py: tensors saved for
backward kept by reference). They call the engine through its C ABI,
which dynamo cannot trace, so each is a deliberate graph break at a unit
boundary, as FSDP2's hooks stay outside torchtitan's compiled blocks:

- `torch.compile(model)`: one graph per stretch of code between units;
- `block.compile()` before or after partitioning: the block's own code
  between its units' hooks;
- `fullgraph=True` on a block with no hook inside it (a leaf module,
  set_leaf_modules: one gather unit, fetched around the compiled call).
"""
import torch


def engine_call(fn):
    """`fn` (a hook that calls the engine) runs as it is under torch.compile:
    a graph break where it is called, nothing of it traced."""
    return torch.compiler.disable(fn)
