"""Checkpoints of a partitioned torch model and its optimizer (a
ZeroShardOptimizer, or any torch optimizer stepping the shards).

    zt.save_checkpoint("ckpt", model, optimizer, client_state={"epoch": 3})
    client_state = zt.load_checkpoint("ckpt", model, optimizer)

The engine writes each rank's shards (safetensors, xxHash checksums) and a
manifest, crash-safe; loading works at any world size. Params are saved
under the model's qualified names (named_parameters), so an exported file
(zeroshard.checkpoint_export) is a state dict Hugging Face's
from_pretrained reads. client_state is JSON (no pickle anywhere).
"""
import json

from ._context import get_context
from ._params import is_partitioned, optimizer_state_view, persistent_buffers
from .optim import ZeroShardOptimizer, _hook_engines
from . import dcp_checkpoint, deepspeed_checkpoint, deepspeed_export, shard_optim, shard_optim_checkpoint


def _named_params(model, what):
    named = list(model.named_parameters())
    plain = [n for n, p in named if not is_partitioned(p)]
    if plain:
        raise ValueError(f"zeroshard.torch.{what}: params {plain[:5]}{' ...' if len(plain) > 5 else ''} are not "
                         "partitioned (zeroshard.torch.Init or partition_module first)")
    return [n for n, _ in named], [p.zs.zparam for _, p in named]


def _param_names(model):
    return [(p, n) for n, p in model.named_parameters()]


def _engine_of(optimizer):
    """The engine optimizer whose state a checkpoint holds: a
    ZeroShardOptimizer's, or the external one a torch optimizer steps
    the shards through."""
    if isinstance(optimizer, ZeroShardOptimizer):
        return optimizer._engine
    return shard_optim.stepper(optimizer).engine


def save_checkpoint(dir, model, optimizer=None, client_state=None, tag=None, overwrite=False,
                    timeout_ms=0, progress=None, async_save=False):
    """Save the model's params (and the optimizer's state) into dir/tag
    (default tag "step-<optimizer steps>"), and point dir/latest at it.
    Collective: every rank calls it. client_state must be JSON-serialisable;
    persistent buffers are kept in it as lists. async_save=True returns once
    this rank's shards are staged in host memory; the write and commit run
    in the background until wait_checkpoint(), the next save, a load or
    shutdown, which raise its error naming the checkpoint. Returns the
    directory."""
    names, zparams = _named_params(model, "save_checkpoint")
    user = {"client_state": client_state,
            "buffers": {n: {"dtype": str(b.dtype), "values": b.detach().cpu().tolist()}
                        for n, b in persistent_buffers(model)}}
    aliases = _aliases(model)
    if aliases:  # tied params' other names: export_deepspeed lists them as DeepSpeed's shared_params
        user["aliases"] = aliases
    stock = optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer)
    if stock:  # a torch optimizer on the shards: its state beside the engine's
        user["torch_optimizer"] = shard_optim_checkpoint.checkpoint_state(optimizer, _param_names(model))
    try:
        user = json.dumps(user, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"zeroshard.torch.save_checkpoint: client_state must be JSON-serialisable "
                        f"(finite floats): {e}") from None
    engine = None if optimizer is None else _engine_of(optimizer)
    if optimizer is not None and not stock:
        # The groups' hyper-parameters as they stand now (a scheduler
        # stepped since the last step), as torch's optimizer.state_dict()
        # holds them: the engine's copy is from the last step.
        optimizer.sync_hparams()
    return get_context().save_checkpoint(dir, zparams, optimizer=engine, tag=tag, names=names, user_json=user,
                                         timeout_ms=timeout_ms, overwrite=overwrite, progress=progress,
                                         async_save=async_save)


def _aliases(model):
    """{other name: saved name} of params reachable under several names
    (GPT-2's lm_head.weight is transformer.wte.weight)."""
    first, out = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def wait_checkpoint():
    """Wait for the asynchronous save in flight (save_checkpoint's
    async_save), if any; raises its error, naming the checkpoint."""
    get_context().wait_checkpoint()


def load_checkpoint(path, model, optimizer=None, tag=None, strict=True, progress=None):
    """Load a checkpoint saved at any world size into the partitioned model
    (and the optimizer: state, step, loss scaler and each group's
    hyper-parameters). path: a checkpoint directory, or a directory of them
    (tag, else its `latest`). Collective. Returns the client_state."""
    import torch

    ds_dir = deepspeed_checkpoint.find(path, tag)
    dcp_dir = None if ds_dir is not None else path if tag is None else f"{path}/{tag}"
    if ds_dir is not None or dcp_checkpoint.find(dcp_dir):
        _named_params(model, "load_checkpoint")  # every param partitioned
        if optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer) \
                and type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(f"zeroshard.torch.load_checkpoint: {path} is a {'DeepSpeed' if ds_dir else 'torch DCP'} "
                            f"checkpoint; its Adam moments load into a ZeroShardOptimizer or a torch Adam/AdamW "
                            f"stepping the shards, not a {type(optimizer).__name__} (pass optimizer=None for the "
                            f"weights only)")
        get_context().wait_checkpoint()  # as the engine's own load does
        if ds_dir is not None:
            return _load_deepspeed(ds_dir, model, optimizer, strict)
        return dcp_checkpoint.load(dcp_dir, model, optimizer, strict, optimizer_state_view, _hook_engines)
    names, zparams = _named_params(model, "load_checkpoint")
    engine = None if optimizer is None else _engine_of(optimizer)
    info = get_context().load_checkpoint(path, zparams, optimizer=engine, tag=tag, names=names, strict=strict,
                                         progress=progress)
    user = json.loads(info["user_json"]) if info["user_json"] else {}
    buffers = dict(model.named_buffers())
    for n, saved in (user.get("buffers") or {}).items():
        if n in buffers:
            with torch.no_grad():
                buffers[n].copy_(torch.tensor(saved["values"], dtype=buffers[n].dtype))
        elif strict:
            raise KeyError(f"zeroshard.torch.load_checkpoint: the checkpoint has buffer {n!r}, the model does not")
    if optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer):
        saved = user.get("torch_optimizer")
        if saved is None:
            raise ValueError(f"zeroshard.torch.load_checkpoint: {info['dir']} holds no torch optimizer's state (it was "
                             f"saved with a ZeroShardOptimizer or none)")
        shard_optim_checkpoint.restore_state(optimizer, saved, _param_names(model))
    elif optimizer is not None:
        for group, hp in zip(optimizer.param_groups, optimizer._engine._groups):
            group["lr"] = hp["lr"]
            group["betas"] = tuple(hp["betas"])
            group["eps"] = hp["eps"]
            group["weight_decay"] = hp["weight_decay"]
            group["momentum"] = hp["momentum"]
            group["dampening"] = hp["dampening"]
            group["nesterov"] = hp["nesterov"]
            group["bias_correction"] = hp["bias_correction"]
            group["ns_method"] = hp["ns_method"]
            group["ns_steps"] = hp["ns_steps"]
        optimizer.sync_loss_scale()  # the loss scaler's state came with it
    # The shards changed: views of gathered copies are stale.
    for e in _hook_engines():
        e.after_step()
    return user.get("client_state")


def load_dcp_checkpoint(path, model, optimizer=None, optim_path=None, strict=True):
    """A torch DCP folder into the partitioned model (and a
    ZeroShardOptimizer), the optimizer's state from `optim_path` when it is
    a folder of its own (Accelerate's FSDP layout: pytorch_model_fsdp_0/
    and optimizer_0/). The optimizer: a ZeroShardOptimizer, or a torch
    Adam/AdamW stepping the shards (FSDP2's route). Collective. Returns the
    other top-level entries."""
    _named_params(model, "load_checkpoint")  # a torch Adam/AdamW stepping the shards is taken too
    get_context().wait_checkpoint()
    return dcp_checkpoint.load(path, model, optimizer, strict, optimizer_state_view, _hook_engines,
                               optim_path=optim_path)


def _load_deepspeed(tagdir, model, optimizer, strict):
    """A DeepSpeed ZeRO checkpoint into the partitioned model: each rank
    reads its own shards' elements of the fp32 masters (and of the Adam
    moments, with a ZeroShardOptimizer), then the step count and each
    group's hyper-parameters. Returns the client_state (DeepSpeed's
    counters and scheduler state under "deepspeed")."""
    import torch

    ckpt = deepspeed_checkpoint.DeepSpeedCheckpoint(tagdir)
    theirs = set(ckpt.names())
    named = list(model.named_parameters())
    # A tied param (GPT-2's lm_head.weight is transformer.wte.weight) is in
    # the checkpoint once, its other names as DeepSpeed's shared_params
    # (ckpt.names() lists both): the model's names count every alias too.
    ours = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if strict and ours != theirs:
        raise KeyError(f"zeroshard.torch.load_checkpoint: DeepSpeed checkpoint {tagdir} and the model differ: "
                       f"missing from the checkpoint {sorted(ours - theirs)[:5]}, not in the model "
                       f"{sorted(theirs - ours)[:5]}")
    sink = None if optimizer is None else dcp_checkpoint.optimizer_sink(optimizer, optimizer_state_view)
    if sink is not None and not ckpt.has("exp_avg"):
        raise ValueError(f"zeroshard.torch.load_checkpoint: DeepSpeed checkpoint {tagdir} holds no Adam moments "
                         f"(an optimizer other than Adam/AdamW, or saved before its first step)")
    for name, p in named:
        if name not in theirs:
            continue
        z = p.zs.zparam
        if ckpt.numel(name) != z.numel:
            raise ValueError(f"zeroshard.torch.load_checkpoint: {name} has {ckpt.numel(name)} elements in DeepSpeed "
                             f"checkpoint {tagdir}, {z.numel} in the model")
        begin, count = z.shard_offset, z.shard_valid
        master = ckpt.read(name, "param", begin, count)
        with torch.no_grad():
            shard = torch.utils.dlpack.from_dlpack(z.shard_dlpack())
            shard[:count].copy_(master)  # the working dtype, rounded once
            if sink is not None and not ckpt.frozen(name) and not p.zs.frozen:
                for slot, state in ((0, "param"), (1, "exp_avg"), (2, "exp_avg_sq")):
                    view = sink.view(p, slot)
                    view[:count].copy_(master if slot == 0 else ckpt.read(name, state, begin, count))
    _copy_buffers(model, ckpt.buffers(), f"DeepSpeed checkpoint {tagdir}")
    if sink is not None:
        saved = ckpt.param_groups
        if len(saved) != len(optimizer.param_groups):
            raise ValueError(f"zeroshard.torch.load_checkpoint: DeepSpeed checkpoint {tagdir} has {len(saved)} param "
                             f"groups, the optimizer {len(optimizer.param_groups)}")
        if isinstance(optimizer, ZeroShardOptimizer):
            adopt_saved_groups(optimizer, saved, ckpt.step())
        else:  # a torch Adam/AdamW stepping the shards: its groups and state
            _set_hparams(optimizer, saved)
            sink.finish(ckpt.step())
            for e in _hook_engines():
                e.after_step()
    else:
        for e in _hook_engines():
            e.after_step()
    return ckpt.client_state()


def _copy_buffers(model, saved, where):
    """The model's buffers that `saved` ({name: tensor}) holds, copied in;
    a shape that differs is an error naming the buffer."""
    import torch
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                if tuple(saved[name].shape) != tuple(b.shape):
                    raise ValueError(f"zeroshard.torch.load_checkpoint: buffer {name} is {list(saved[name].shape)} "
                                     f"in {where}, {list(b.shape)} in the model")
                b.copy_(saved[name].to(b.dtype))


def _set_hparams(optimizer, saved_groups):
    for group, hp in zip(optimizer.param_groups, saved_groups):
        for k in ("lr", "eps", "weight_decay", "bias_correction"):
            if k in hp and (k in group or isinstance(optimizer, ZeroShardOptimizer)):
                group[k] = hp[k]
        if "betas" in hp:
            group["betas"] = tuple(hp["betas"])


def adopt_saved_groups(optimizer, saved_groups, step):
    """After another engine's moments were written into the shards: each
    group's saved hyper-parameters (those it has of lr, eps, weight_decay,
    bias_correction, betas) and the step count into the ZeroShardOptimizer,
    pushed to the engine, and the hooks' gathered views refreshed."""
    engine = optimizer._engine
    _set_hparams(optimizer, saved_groups)
    engine.steps = step
    optimizer.sync_hparams()
    engine.sync_params()
    for e in _hook_engines():
        e.after_step()


def load_pretrained(model, path, optimizer=None, strict=True, from_rank0=False, progress=None):
    """Full weights (a .safetensors file, a Hugging Face index .json, or a
    directory with model.safetensors[.index.json]) into the partitioned
    model, under its qualified names; each rank reads only the bytes of its
    own shards (every rank must see the files), or with from_rank0 only rank
    0 reads, one full tensor at a time, and the engine scatters. Collective."""
    names, zparams = _named_params(model, "load_pretrained")
    engine = None if optimizer is None else _engine_of(optimizer)
    get_context().load_safetensors(path, zparams, optimizer=engine, names=names, strict=strict,
                                   from_rank0=from_rank0, progress=progress)
    for e in _hook_engines():
        e.after_step()


def export_safetensors(model, path, progress=None):
    """The partitioned model's full weights as one safetensors file under
    its qualified names (what from_pretrained reads), gathered one param at
    a time and written by rank 0. Collective."""
    names, zparams = _named_params(model, "export_safetensors")
    get_context().export_safetensors(path, zparams, names=names, progress=progress)


def export_deepspeed(checkpoint, out, world_size=None, tag=None, ds_config=None):
    """A zeroshard checkpoint (save_checkpoint's directory, a directory of
    them, or a Hugging Face Trainer checkpoint-N/ holding zeroshard/) written
    into `out` in DeepSpeed ZeRO-3's layout for `world_size` ranks (default:
    the checkpoint's): out/global_step<N>/ (each rank's fp32 partitions, Adam
    moments and step, model states), out/latest and DeepSpeed's
    zero_to_fp32.py. DeepSpeed's load_checkpoint, and transformers.Trainer
    under DeepSpeed with resume_from_checkpoint=out, resume it at
    `world_size` ranks (DeepSpeed ZeRO-3 loads at the world size it was
    written for). Offline, one process; needs DeepSpeed importable.
    ds_config: recorded in the files (its zero_optimization.sub_group_size
    cuts the flat groups as DeepSpeed would). Returns out/<tag>."""
    return deepspeed_export.export(checkpoint, out, world_size=world_size, tag=tag, ds_config=ds_config)


def export_dcp(path, model, optimizer=None, client_state=None):
    """The partitioned model (and a ZeroShardOptimizer's AdamW state) as a
    torch Distributed Checkpoint directory in get_state_dict's layout
    ({"model": ..., "optim": ...}, client_state's entries beside them):
    FSDP2 resumes it with dcp.load and set_state_dict. Collective."""
    _named_params(model, "export_dcp")
    if optimizer is not None and not isinstance(optimizer, ZeroShardOptimizer):
        raise TypeError(f"zeroshard.torch.export_dcp: writes a ZeroShardOptimizer's state, not a "
                        f"{type(optimizer).__name__}'s")
    if optimizer is not None and optimizer.kind not in ("adamw", "adam"):
        raise ValueError(f"zeroshard.torch.export_dcp: DCP's layout here is torch AdamW's; optimizer kind "
                         f"{optimizer.kind!r} is not written")
    if optimizer is not None:
        optimizer.sync_hparams()
    dcp_checkpoint.save(path, model, optimizer, client_state, optimizer_state_view)
