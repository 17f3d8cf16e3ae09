"""A Hugging Face Trainer checkpoint folder that torch itself wrote into a
partitioned model and its optimizer. `transformers.Trainer` under DDP
leaves `model.safetensors` (the full weights by name, tied ones once) and
`optimizer.pt` (torch's optimizer state_dict: full-size tensors keyed by
each param's index in the optimizer's groups, then the groups'
hyper-parameters); on a PEFT model, `adapter_model.safetensors` (the
adapters alone, by PEFT's key names) instead of the weights. Each rank
reads the weights' bytes of its own shards (load_pretrained) and takes its
shards' elements of each param's Adam moments, at any world size; then the
step and each group's hyper-parameters. The index order is the Trainer's
own (its decay and no-decay groups over named_parameters()), which
zeroshard.hf.Trainer builds alike; each moment's shape is checked against
its param's, so a different order is an error naming the param, never
state loaded into the wrong one.

Under FSDP with full state dicts the Trainer (through Accelerate) leaves
`pytorch_model_fsdp.bin` and `optimizer.bin` instead, the optimizer's
state keyed by each param's name (load_fsdp_full); its sharded state dicts
are torch DCP folders, read by dcp_checkpoint.
"""
import os

import torch

from ._params import optimizer_state_view, persistent_buffers
from .optim import ZeroShardOptimizer

WEIGHTS, OPTIMIZER = "model.safetensors", "optimizer.pt"
# A PEFT model's checkpoint holds its adapters alone (PeftModel.save_pretrained)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def find(folder):
    """True if `folder` holds torch's Trainer checkpoint files."""
    return all(os.path.isfile(os.path.join(folder, f)) for f in (WEIGHTS, OPTIMIZER))


def find_adapters(folder):
    """The adapter weights file of a PEFT model's Trainer checkpoint in
    `folder` (with optimizer.pt beside it), or None."""
    if not os.path.isfile(os.path.join(folder, OPTIMIZER)):
        return None
    return next((os.path.join(folder, f) for f in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, f))), None)


def load_adapters(folder, model, optimizer):
    """A PEFT model's Trainer checkpoint (transformers.Trainer under DDP:
    the adapters alone, adapter_model.safetensors, and optimizer.pt over
    the trainable params) into the partitioned PeftModel `model`: each rank
    its shards of each adapter weight (and its fp32 masters), then the
    adapters' Adam moments, step and hyper-parameters. The saved keys are
    matched to the model's params by PEFT's own naming
    (get_peft_model_state_dict over the trainable params: no gather); a
    key of one side missing on the other is a ValueError naming it.
    Collective only in that every rank calls it. Returns
    load_optimizer_state's empty groups (a LoRA model's no-decay group)."""
    import peft
    if not isinstance(model, peft.PeftModel):
        raise ValueError(f"zeroshard.torch: {folder} holds a PEFT model's adapters ({ADAPTER_WEIGHTS[0]} or "
                         f"{ADAPTER_WEIGHTS[1]}) and its optimizer state; the model is a {type(model).__name__}, not "
                         f"a peft.PeftModel: wrap the base with the same PEFT config (get_peft_model) first")
    _check_optimizer(optimizer)  # before anything loads
    path = find_adapters(folder)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        saved = load_file(path)
    else:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # The keys save_pretrained gives each trainable param: PEFT's function on
    # the Parameters themselves (values untouched, nothing gathered).
    keyed = peft.get_peft_model_state_dict(model, state_dict=dict(trainable), adapter_name=model.active_adapter,
                                           save_embedding_layers=False)
    names = {id(p): n for n, p in trainable.items()}
    ours = {k: names[id(v)] for k, v in keyed.items() if id(v) in names}
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    untracked = sorted(set(trainable) - set(ours.values()))
    if missing or unexpected or untracked:
        raise ValueError(f"zeroshard.torch: {path} and the PEFT model's trainable params differ: missing from the "
                         f"file {missing[:5]}, in the file but not trainable here {unexpected[:5]}, trainable but "
                         f"not an adapter weight {untracked[:5]}: the same PEFT config (target_modules, r, "
                         f"modules_to_save) as the run that saved it?")
    load_state_dict_shards(model, optimizer, {ours[k]: v for k, v in saved.items()}, path, strict=False)
    if optimizer is None:
        return
    state = torch.load(os.path.join(folder, OPTIMIZER), map_location="cpu", weights_only=True)
    return load_optimizer_state(model, optimizer, state, f"{folder}/{OPTIMIZER}")


def load(folder, model, optimizer):
    """Weights, Adam moments, step and hyper-parameters from `folder` (see
    the module docstring); optimizer None: the weights only. Collective.
    Returns load_optimizer_state's empty groups."""
    from .checkpoint import load_pretrained
    _check_optimizer(optimizer)  # before anything loads
    load_pretrained(model, os.path.join(folder, WEIGHTS), optimizer=optimizer)  # the masters too
    if optimizer is None:
        return
    saved = torch.load(os.path.join(folder, OPTIMIZER), map_location="cpu", weights_only=True)
    return load_optimizer_state(model, optimizer, saved, f"{folder}/{OPTIMIZER}")


# transformers.Trainer under FSDP with FULL_STATE_DICT: Accelerate's files
FSDP_FULL_WEIGHTS, FSDP_FULL_OPTIMIZER = "pytorch_model_fsdp.bin", "optimizer.bin"


def find_fsdp_full(folder):
    """True if `folder` holds FSDP's full state dict files as Accelerate
    writes them (pytorch_model_fsdp.bin and optimizer.bin)."""
    return all(os.path.isfile(os.path.join(folder, f)) for f in (FSDP_FULL_WEIGHTS, FSDP_FULL_OPTIMIZER))


def load_fsdp_full(folder, model, optimizer):
    """transformers.Trainer's checkpoint under FSDP with full state dicts:
    pytorch_model_fsdp.bin (the full model state dict by name, tied
    aliases too) and optimizer.bin (FSDP's full optimizer state dict:
    whole moments and step keyed by each param's qualified name, groups
    listing names) into the partitioned model and its optimizer (a
    ZeroShardOptimizer, or a torch Adam/AdamW stepping the shards): each
    rank its shards of the weights, masters and moments, then the step and
    each group's hyper-parameters, matched by name. Both files are memory-
    mapped, read only where this rank's shards lie. Collective only in
    that every rank calls it."""
    weights = torch.load(os.path.join(folder, FSDP_FULL_WEIGHTS), map_location="cpu", weights_only=True, mmap=True)
    load_state_dict_shards(model, None, weights, f"{folder}/{FSDP_FULL_WEIGHTS}")
    if optimizer is None:
        return
    where = f"{folder}/{FSDP_FULL_OPTIMIZER}"
    saved = torch.load(os.path.join(folder, FSDP_FULL_OPTIMIZER), map_location="cpu", weights_only=True, mmap=True)
    load_named_optimizer_state(model, optimizer, weights, saved, where)


def load_named_optimizer_state(model, optimizer, weights, saved, where):
    """Full optimizer state keyed by param name (FSDP's full optimizer
    state dict, get_optimizer_state_dict(full_state_dict=True)) into the
    optimizer: the masters from `weights` (name -> full tensor), each
    rank its shards of exp_avg and exp_avg_sq, the step, and each group's
    hyper-parameters from the saved group that lists its first param."""
    from ._params import optimizer_state_view
    from .dcp_checkpoint import _HPARAMS, optimizer_sink
    from .optim import _hook_engines
    state, groups = saved.get("state"), saved.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        raise ValueError(f"zeroshard.torch: {where} is not an optimizer state_dict (keys {sorted(saved)[:6]})")
    sink = optimizer_sink(optimizer, optimizer_state_view)
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in trained]
    steps = set()
    with torch.no_grad():
        for name, p in named:
            entry = state.get(name)
            if entry is None:
                raise KeyError(f"zeroshard.torch: {where} holds no optimizer state for {name} (saved before the "
                               f"first step, or from another model)")
            z = p.zs.zparam
            begin, count = z.shard_offset, z.shard_valid
            for slot, value in ((0, weights[name]), (1, entry.get("exp_avg")), (2, entry.get("exp_avg_sq"))):
                if value is None:
                    raise ValueError(f"zeroshard.torch: {where} holds no exp_avg / exp_avg_sq for {name} (not "
                                     f"Adam/AdamW state)")
                if tuple(value.shape) != tuple(p.zs.shape):
                    raise ValueError(f"zeroshard.torch: {name}'s state in {where} is {list(value.shape)}, the "
                                     f"param {list(p.zs.shape)}")
                sink.view(p, slot)[:count].copy_(value.reshape(-1)[begin:begin + count])
            steps.add(int(entry["step"]) if "step" in entry else 0)
    if len(steps) > 1:
        raise ValueError(f"zeroshard.torch: {where} has params at different steps {sorted(steps)}: the engine keeps "
                         f"one step count")
    by_name = {n: g for g in groups for n in g.get("params", [])}
    for group in optimizer.param_groups:
        first = next((n for n, p in named if any(p is q for q in group["params"])), None)
        hp = by_name.get(first)
        if hp is None:
            raise KeyError(f"zeroshard.torch: no param group of {where} lists {first!r}")
        for k in _HPARAMS:
            if k in hp:
                group[k] = tuple(hp[k]) if k == "betas" else hp[k]
    sink.finish(steps.pop() if steps else 0)
    for e in _hook_engines():
        e.after_step()


def load_state_dict_shards(model, optimizer, state_dict, where, strict=True):
    """A full state dict in memory (name -> whole tensor, params and
    persistent buffers; memory-mapped is best) into the partitioned model:
    each rank copies its shards' elements of every param (and, with an
    optimizer, into its fp32 masters) and the whole buffers.
    Collective only in that every rank calls it. `where` names the source
    in errors."""
    from ._context import get_context
    from .checkpoint import _engine_of
    from .optim import _hook_engines

    get_context().wait_checkpoint()
    named = list(model.named_parameters())
    buffers = persistent_buffers(model)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in named}
    ours = {n for n, _ in named} | {n for n, _ in buffers}
    theirs = set(state_dict) - aliases
    if strict and ours != theirs:
        raise KeyError(f"zeroshard.torch: {where} and the model differ: missing from the checkpoint "
                       f"{sorted(ours - theirs)[:5]}, not in the model {sorted(theirs - ours)[:5]}")
    engine = None if optimizer is None else _engine_of(optimizer)  # where the masters are
    with torch.no_grad():
        for name, p in named:
            if name not in state_dict:
                continue
            full = state_dict[name]
            if tuple(full.shape) != tuple(p.zs.shape):
                raise ValueError(f"zeroshard.torch: {name} is {list(full.shape)} in {where}, {list(p.zs.shape)} "
                                 f"in the model")
            z = p.zs.zparam
            mine = full.reshape(-1)[z.shard_offset:z.shard_offset + z.shard_valid]
            torch.utils.dlpack.from_dlpack(z.shard_dlpack())[:z.shard_valid].copy_(mine)
            if engine is not None and not p.zs.frozen:
                optimizer_state_view(engine, z, 0)[:z.shard_valid].copy_(mine)
        for name, b in buffers:
            if name in state_dict:
                b.copy_(state_dict[name].to(b.dtype))
    for e in _hook_engines():
        e.after_step()


def load_optimizer_state(model, optimizer, saved, where):
    """torch's optimizer state_dict `saved` (full-size moments keyed by each
    param's index in the groups, as DDP and FSDP's full optimizer state
    dicts hold them) into the optimizer (a ZeroShardOptimizer, or a torch
    Adam/AdamW stepping the shards): each rank its shards' elements of the
    Adam moments, then the step and the groups' hyper-parameters. Each
    moment's shape is checked against its param's. Returns the indices of
    the saved groups that held no param (left out, as zeroshard.hf.Trainer
    leaves them out), for the scheduler's state."""
    from .checkpoint import _set_hparams, adopt_saved_groups
    from .dcp_checkpoint import optimizer_sink
    from .optim import _hook_engines
    sink = optimizer_sink(optimizer, optimizer_state_view)  # a TypeError for another optimizer
    groups, state = saved.get("param_groups"), saved.get("state")
    if groups is None or state is None:
        raise ValueError(f"zeroshard.torch: {where} is not a torch optimizer state_dict "
                         f"(keys {sorted(saved)[:6]})")
    # The Trainer keeps a group that holds no param (a LoRA model's no-decay
    # group); zeroshard.hf.Trainer leaves it out. It has no state to load.
    empty = [i for i, g in enumerate(groups) if not g["params"]]
    groups = [g for g in groups if g["params"]]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(f"zeroshard.torch: {where} has param groups of "
                         f"{[len(g['params']) for g in groups]} params, the optimizer "
                         f"{[len(g['params']) for g in optimizer.param_groups]}")
    names = {id(p): n for n, p in model.named_parameters()}
    steps = set()
    for ours, theirs in zip(optimizer.param_groups, groups):
        for p, index in zip(ours["params"], theirs["params"]):
            entry = state.get(index)
            if entry is None:
                continue  # no step has touched it yet: its moments stay zeros
            z = p.zs.zparam
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in entry:
                    raise ValueError(f"zeroshard.torch: {where} holds no {key} for "
                                     f"{names.get(id(p), 'a param')} (not Adam/AdamW state)")
                if tuple(entry[key].shape) != tuple(p.zs.shape):
                    raise ValueError(f"zeroshard.torch: {where}'s {key} #{index} is "
                                     f"{tuple(entry[key].shape)}, param {names.get(id(p), '?')} is "
                                     f"{tuple(p.zs.shape)}: the checkpoint's param order is not this optimizer's")
            begin, count = z.shard_offset, z.shard_valid
            with torch.no_grad():
                for slot, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                    flat = entry[key].reshape(-1)[begin:begin + count]
                    sink.view(p, slot)[:count].copy_(flat)
            steps.add(int(entry["step"]) if "step" in entry else 0)
    if len(steps) > 1:
        raise ValueError(f"zeroshard.torch: {where} has params at different steps {sorted(steps)}: "
                         f"the engine keeps one step count")
    step = steps.pop() if steps else 0
    if isinstance(optimizer, ZeroShardOptimizer):
        adopt_saved_groups(optimizer, groups, step)
    else:  # the torch optimizer's groups and per-param state
        _set_hparams(optimizer, groups)
        sink.finish(step)
        for e in _hook_engines():
            e.after_step()
    return empty


def _check_optimizer(optimizer):
    """A TypeError, before anything loads, for an optimizer whose state
    these files cannot fill: a ZeroShardOptimizer or a torch Adam/AdamW
    stepping the shards."""
    if optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer) and \
            type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(f"zeroshard.torch: a Trainer checkpoint's Adam moments load into a ZeroShardOptimizer or a "
                        f"torch Adam/AdamW stepping the shards, not a {type(optimizer).__name__}")
