"""Model state dicts: consolidated on rank 0, loaded from rank 0; and
torch's own module.state_dict() / load_state_dict() on a partitioned
module (arm_state_dict)."""
import hashlib

import torch

import zeroshard

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


def arm_state_dict(module):
    """torch's state_dict() and load_state_dict() on `module`, whose own
    params are partitioned, see and set their full values: without this
    state_dict() holds the empty placeholders, which torch.save or Hugging
    Face's save_pretrained write without a word (DeepSpeed's ZeRO-3 does
    so), and load_state_dict() of a full dict fails on every shape."""
    if module.__dict__.get("_zs_state_dict_armed"):
        return
    module.register_state_dict_post_hook(_full_values_into_state_dict)
    module.register_load_state_dict_pre_hook(_state_dict_into_shards)
    module._zs_state_dict_armed = True


def _own_partitioned(module):
    # dict.items: the module's FetchOnAccess would gather what it lists.
    return [(name, p) for name, p in dict.items(module._parameters) if p is not None and is_partitioned(p)]


def _full_values_into_state_dict(module, state_dict, prefix, local_metadata):
    """Each partitioned param's entry becomes a copy of its full value, on
    every rank (torch's full state dict as FSDP makes it). Gathers the
    module's params together: collective, every rank calls state_dict().
    Entries that are the Parameters themselves (keep_vars=True) stay."""
    own = [(name, p) for name, p in _own_partitioned(module)
           if prefix + name in state_dict and state_dict[prefix + name] is not p]
    if not own:
        return
    try:
        with GatheredParameters([p for _, p in own]):
            for name, p in own:
                state_dict[prefix + name] = p.data.detach().clone()
    except (zeroshard.ZsTimeoutError, zeroshard.CommError) as e:
        # The usual cause: a save under `if rank == 0:` (torch.save,
        # save_pretrained), where the other ranks never come to gather.
        raise type(e)(f"zeroshard.torch: state_dict() of a partitioned model gathers its params' full values "
                      f"(here {prefix}{own[0][0]}, of a {type(module).__name__}), a collective over every rank: call "
                      f"state_dict() (or save_pretrained) on every rank at the same point and write the file "
                      f"on rank 0 alone (save_pretrained's is_main_process=), or take "
                      f"zeroshard.torch.consolidated_state_dict(model) on every rank, which keeps the values "
                      f"on rank 0 only. {e.message}", e.status, e.status_name) from e


def _state_dict_into_shards(module, state_dict, prefix, local_metadata, strict, missing_keys,
                            unexpected_keys, error_msgs):
    """Each partitioned param's full value in the dict (the same on every
    rank, as torch.load of one file gives) rewrites this rank's shard: local,
    no traffic. Its entry is then the param itself, which torch copies onto
    itself. A value of another shape is torch's size-mismatch error, with
    the param's real shape."""
    for name, p in _own_partitioned(module):
        key = prefix + name
        value = state_dict.get(key)
        if not torch.is_tensor(value):
            continue  # absent, or not a tensor: torch reports it
        z = p.zs
        if tuple(value.shape) != z.shape:
            hint = (" (an empty tensor: a state dict of a partitioned model saved before zeroshard filled "
                    "in full values?)" if value.numel() == 0 else "")
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {torch.Size(z.shape)} (partitioned by "
                              f"zeroshard){hint}.")
        else:
            z.zparam.write(value.detach().to(device=z.device, dtype=z.dtype).contiguous())
        state_dict[key] = p.detach()


def training_digest(optimizer, model):
    """(sha256 of this rank's optimizer state: the fp32 masters and moments
    of its shards; its optimizer step count; on rank 0 the sha256 of the
    consolidated params, names included, else None), to check that two
    runs (say one that healed a lost rank, and one that did not) reached
    the same state bit for bit. `optimizer` a ZeroShardOptimizer.
    Collective (the consolidation)."""
    z = optimizer.state_dict()["zeroshard"]
    state = hashlib.sha256()
    for index in sorted(z["shards"]):
        for slot in sorted(z["shards"][index]):
            state.update(_raw_bytes(z["shards"][index][slot]))
    full = consolidated_state_dict(model)
    params = None
    if get_context().rank == 0:
        p = hashlib.sha256()
        for k in sorted(full):
            p.update(k.encode())
            p.update(_raw_bytes(full[k]))
        params = p.hexdigest()
    return state.hexdigest(), z["steps"], params


def _raw_bytes(t):
    """A tensor's bytes, whatever its dtype (NumPy has no bfloat16)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
