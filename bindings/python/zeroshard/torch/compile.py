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
import torch


def engine_call(fn):
    """`fn` (a hook that calls the engine) runs as it is under torch.compile:
    a graph break where it is called, nothing of it traced."""
    return torch.compiler.disable(fn)


def compiled_block(module):
    """Whether `module` was compiled on its own before its model was
    partitioned (`block.compile()`, or a torch.compile'd module put in its
    place): it becomes one gather unit, fetched around the compiled call,
    as FSDP2's fully_shard(block) with torchtitan's per-block compile."""
    return (module.__dict__.get("_compiled_call_impl") is not None
            or isinstance(module, torch._dynamo.eval_frame.OptimizedModule))
