"""A torch optimizer's state in zeroshard checkpoints (the optimizer steps
partitioned params through shard_optim.py's ShardStepper).

At a save (checkpoint_state, collective), per-element state on shards is
already the engine's named state, which the engine saves and reshards with
the params; whole-tensor state is scattered from its owner rank into named
state (_spill_whole); the rest (param groups, step counts, Adafactor's row
and column moments) goes to the checkpoint's JSON, exactly, never pickled.
At a load (restore_state, collective), the engine has restored the named
state at this world size: the torch optimizer's groups and state are built
again from it and the JSON, whole-tensor state gathered by its owner.
"""
import base64
import json

import torch

import zeroshard
from .shard_optim import _class_name, _per_element, _state_name, stepper


def _encode(value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {"tensor": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode(),
                "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return None  # not kept (a callable hyper-parameter, e.g. Muon's adjust_lr_fn: the live one stays)


def _decode(enc, device):
    if "tensor" in enc:
        dtype = getattr(torch, enc["dtype"])
        raw = base64.b64decode(enc["tensor"])
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return t.view(dtype).reshape(enc["shape"]).to(device) if raw else torch.empty(enc["shape"], dtype=dtype,
                                                                                         device=device)
    if "tuple" in enc:
        return tuple(_decode(v, device) for v in enc["tuple"])
    return enc["value"]


def _broadcast_json(group, obj, root):
    """obj (JSON) of group rank root, on every rank of the group."""
    data = json.dumps(obj).encode() if group.rank == root else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast(n.view(torch.uint8), 8, zeroshard.UINT8, root).wait()
    n = int(n)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(n, dtype=torch.uint8)
    if n:
        group.broadcast(buf, n, zeroshard.UINT8, root).wait()
    return json.loads(bytes(buf.numpy()).decode())


def _spill_whole(s, optimizer, p):
    """Whole-tensor mode, at a save: the owner's state of p, every entry of
    the param's size scattered into named state (every rank its part), the
    others returned as they are (on every rank, for rank 0's JSON)."""
    z = p.zs.zparam
    root = s.owner[id(p)]
    state = optimizer.state.get(p, {}) if s.owns(p) else {}
    layout = {str(k): [str(v.dtype), list(v.shape)] if isinstance(v, torch.Tensor) else None
              for k, v in state.items()}
    layout = _broadcast_json(s._group, layout, root)
    out = {}
    for key, kind in layout.items():
        value = next((v for k, v in state.items() if str(k) == key), None)
        if kind is not None and kind[0] == "torch.float32" and _numel(kind[1]) == z.numel and z.numel > 0:
            full = torch.zeros(z.padded_numel, dtype=torch.float32, device=s.master_view(p).device)
            if value is not None:
                full[:z.numel].copy_(value.reshape(-1))
            s._group.broadcast(full, z.padded_numel, zeroshard.FLOAT32, root).wait()
            lo = s._group.rank * z.shard_numel
            named = torch.utils.dlpack.from_dlpack(s.engine.named_state_dlpack(z, _state_name(key)))
            named.copy_(full[lo:lo + z.shard_numel])
            out[key] = {"named": True, "shape": kind[1]}
        else:
            enc = _broadcast_json(s._group, _encode(value) if s.owns(p) else None, root)
            out[key] = _decode(enc, "cpu") if enc is not None else None
    return out


def checkpoint_state(optimizer, names):
    """Before a checkpoint save (collective): the optimizer's state as the
    engine saves it (whole-tensor state scattered into named state) and the
    rest as JSON: param groups (params by name) and each param's other
    state entries."""
    s = stepper(optimizer)
    if s._open is not None:
        raise RuntimeError("zeroshard.torch.save_checkpoint: called inside the optimizer's step")
    s.sync(optimizer)
    name_of = {id(p): n for p, n in names}
    groups = []
    for g in optimizer.param_groups:
        hp = {k: e for k, e in ((k, _encode(v)) for k, v in g.items() if k != "params") if e is not None}
        groups.append({"hparams": hp, "params": [name_of.get(id(p)) for p in g["params"]]})
    state = {}
    for p in s.params:
        whole = s.whole(p)
        entries = _spill_whole(s, optimizer, p) if whole else optimizer.state.get(p, {})
        valid = p.zs.zparam.shard_valid
        kept = {}
        for key, value in entries.items():
            if not whole and _per_element(value, valid):
                kept[str(key)] = {"named": True}
            elif whole and isinstance(value, dict) and "named" in value:
                kept[str(key)] = value
            elif not whole and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == valid > 0:
                # Per element but not fp32: rank 0's copy in the JSON would
                # lose every other rank's elements.
                raise NotImplementedError(
                    f"zeroshard.torch.save_checkpoint: state {key!r} of {p.zs.name} is a {value.dtype} tensor of "
                    f"this rank's shard size; the engine saves per-element state in float32 only")
            else:
                enc = _encode(value)
                if enc is None:
                    raise TypeError(f"zeroshard.torch.save_checkpoint: state {key!r} of {name_of.get(id(p))} is a "
                                    f"{type(value).__name__}, which a checkpoint cannot hold")
                kept[str(key)] = enc
        if kept:
            state[name_of[id(p)]] = kept
    # On shards, the other entries are rank 0's in the file: step counts
    # agree across ranks, as every rank steps every param that had a gradient.
    return {"class": _class_name(type(optimizer)), "param_groups": groups, "state": state}


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def restore_state(optimizer, saved, names):
    """After a checkpoint load (collective): the torch optimizer's groups and
    state from what checkpoint_state saved; the engine restored the named
    state (resharded to this world size)."""
    s = stepper(optimizer)
    s.sync(optimizer)
    if saved.get("class") != _class_name(type(optimizer)):
        raise ValueError(f"zeroshard.torch.load_checkpoint: the checkpoint's optimizer is {saved.get('class')}, "
                         f"this one is {_class_name(type(optimizer))}")
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"zeroshard.torch.load_checkpoint: {len(groups)} param groups in the checkpoint, "
                         f"{len(optimizer.param_groups)} here")
    for g, sg in zip(optimizer.param_groups, groups):
        for k, enc in sg["hparams"].items():
            v = _decode(enc, "cpu")
            if isinstance(g.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                g[k].fill_(v)
            elif isinstance(g.get(k), torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = v
    optimizer.state.clear()
    name_of = {id(p): n for p, n in names}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p in s.params:
        entries = saved["state"].get(name_of.get(id(p)))
        if not entries:
            continue
        device = s.master_view(p).device
        # A scalar (a step count) stays on the CPU, as torch keeps it, unless
        # the group steps it on the device (capturable, fused).
        group = group_of.get(id(p), {})
        scalar_device = device if group.get("capturable") or group.get("fused") else torch.device("cpu")
        state = {}
        for key, enc in entries.items():
            if enc.get("named"):
                if s.whole(p):
                    named = torch.utils.dlpack.from_dlpack(s.engine.named_state_dlpack(p.zs.zparam, key))
                    full = s._gather(p, named)
                    if s.owns(p):
                        state[key] = full[:p.zs.zparam.numel].view(enc["shape"]).clone()
                else:
                    state[key] = s.named_view(p, key)
            elif not s.whole(p) or s.owns(p):
                value = _decode(enc, "cpu")
                if isinstance(value, torch.Tensor):
                    value = value.to(device if value.dim() > 0 else scalar_device)
                state[key] = value
        if state:
            optimizer.state[p] = state

