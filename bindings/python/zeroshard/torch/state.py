"""Model state dicts: consolidated on rank 0, loaded from rank 0."""
import torch

from ._context import get_context
from ._params import is_partitioned
from .gathered import GatheredParameters


def consolidated_state_dict(model):
    """The model's full state dict on rank 0 (an empty dict elsewhere),
    gathering one param at a time. Collective."""
    rank = get_context().rank
    out = {}
    for name, p in model.named_parameters():
        if not is_partitioned(p):
            if rank == 0:
                out[name] = p.detach().clone()
            continue
        with GatheredParameters([p]):
            if rank == 0:
                out[name] = p.data.detach().clone()
    for name, b in model.named_buffers():
        if rank == 0:
            out[name] = b.detach().clone()
    return out if rank == 0 else {}


def load_consolidated_state_dict(model, state_dict, strict=True):
    """Load what rank 0 read (other ranks may pass None) into the sharded
    model: each param is broadcast from rank 0 and re-partitioned.
    Collective."""
    rank = get_context().rank
    if rank == 0:
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        missing = sorted(names - set(state_dict))
        unexpected = sorted(set(state_dict) - names)
        if strict and (missing or unexpected):
            raise KeyError(f"load_consolidated_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for name, p in model.named_parameters():
        if not is_partitioned(p):
            continue
        with GatheredParameters([p], modifier_rank=0):
            if rank == 0 and name in state_dict:
                value = state_dict[name]
                if tuple(value.shape) != p.zs.shape:
                    raise ValueError(f"load_consolidated_state_dict: {name} has shape {tuple(value.shape)}, "
                                     f"the model's is {p.zs.shape}")
                p.data.copy_(value)
    for name, b in model.named_buffers():
        if rank == 0 and name in state_dict:
            b.copy_(state_dict[name])
