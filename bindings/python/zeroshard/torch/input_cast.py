"""Floating inputs (and outputs) of a module in its working dtype, as
FSDP2's MixedPrecisionPolicy casts them: a model partitioned in bf16 or
fp16 takes float inputs (Whisper's input_features, pixel values) whose
first op would otherwise mix dtypes ("Input type (float) and bias type
(c10::BFloat16) should be the same"). The dtype lives on the module
(`_zs_input_dtype`, `_zs_output_dtype`), so a deepcopy carries it.
"""
import torch
from torch.utils._pytree import tree_map_only


def _cast_floats(obj, dtype):
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def cast_inputs_hook(module, args, kwargs):
    """A forward pre-hook: floating inputs in the module's working dtype
    (FSDP2's cast_forward_inputs; partition_module's under bf16/fp16)."""
    dtype = module.__dict__.get("_zs_input_dtype")
    if dtype is None:
        return None
    return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)


def cast_outputs_hook(module, args, output):
    dtype = module.__dict__.get("_zs_output_dtype")
    return None if dtype is None else _cast_floats(output, dtype)


def cast_inputs_to(module, dtype):
    """Cast `module`'s floating inputs to `dtype` at each of its forwards."""
    if module.__dict__.get("_zs_input_dtype") is None:
        module.register_forward_pre_hook(cast_inputs_hook, with_kwargs=True, prepend=True)
    module.__dict__["_zs_input_dtype"] = dtype


def cast_outputs_to(module, dtype):
    """Cast `module`'s floating outputs to `dtype` at each of its forwards."""
    if module.__dict__.get("_zs_output_dtype") is None:
        module.register_forward_hook(cast_outputs_hook)
    module.__dict__["_zs_output_dtype"] = dtype
