"""zeroshard for PyTorch: partition an nn.Module's parameters across ranks,
gather them just in time for forward and backward, and train them with the
engine's sharded optimizer or any torch optimizer (stepped on the shards:
shard_optim).

    import zeroshard.torch as zt
    with zt.Init(config=ds_config):
        model = MyModel()
    zt.partition_module(model)
    optimizer = zt.ZeroShardOptimizer(model.parameters(), lr=1e-3)
    loss = model(x).loss; loss.backward(); optimizer.step()
"""
from ._context import current_context, get_context, init_context, shutdown
from .checkpoint import (export_dcp, export_deepspeed, export_safetensors, load_checkpoint, load_pretrained,
                         save_checkpoint, wait_checkpoint)
from ._params import is_partitioned
from .gathered import GatheredParameters
from .heal import StepRecord, enable_healing, healing_loop
from .generation import set_generation_gather
from .inference_gather import set_inference_gather
from .forward_scope import run_as_forward
from .init import Init, partition_module
from .leaf_modules import register_external_parameter, set_leaf_modules, unset_leaf_modules
from .memory import format_memory_report, memory_report
from .optim import ZeroShardOptimizer
from .muon import Muon, muon_param_groups
from .shard_optim import clip_grad_norm_, register_optimizer
from .state import consolidated_state_dict, load_consolidated_state_dict, training_digest
from .weight_stream import full_weights
from . import zero_grad as _zero_grad  # noqa: F401  (zero_grad drops pushed gradients)

# FSDP2's API loads on first use: its policies are torch.distributed.fsdp's
# own classes, whose import (torch.distributed.tensor, sympy) is half a
# second of CPU and 40 MiB of every rank's start that a script not calling
# fully_shard (a replacement's included) need not pay.
_FULLY_SHARD_NAMES = ("CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "ZeroShardFSDPModule",
                      "fully_shard")


def __getattr__(name):
    if name in _FULLY_SHARD_NAMES:
        from . import fsdp2
        globals().update({n: getattr(fsdp2, n) for n in _FULLY_SHARD_NAMES})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FULLY_SHARD_NAMES))


__all__ = [
    "CPUOffloadPolicy", "GatheredParameters", "Init", "MixedPrecisionPolicy", "OffloadPolicy", "ZeroShardFSDPModule", "Muon", "ZeroShardOptimizer", "clip_grad_norm_", "consolidated_state_dict",
    "current_context",
    "StepRecord", "enable_healing", "healing_loop",
    "export_dcp", "export_deepspeed", "export_safetensors", "format_memory_report", "full_weights", "fully_shard", "wait_checkpoint", "get_context",
    "init_context", "is_partitioned", "load_checkpoint", "load_consolidated_state_dict", "load_pretrained",
    "memory_report", "muon_param_groups", "partition_module", "register_optimizer",
    "save_checkpoint", "set_generation_gather", "set_inference_gather",
    "register_external_parameter", "run_as_forward", "set_leaf_modules", "shutdown", "training_digest",
    "unset_leaf_modules",
]
