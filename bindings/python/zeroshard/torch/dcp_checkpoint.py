"""torch Distributed Checkpoint (DCP) directories in and out: what FSDP2 users
save with dcp.save({"model": msd, "optim": osd, ...}) where
msd, osd = get_state_dict(model, optimizer).

In: zt.load_checkpoint(path, model, optimizer) calls load() when `path`
holds DCP's `.metadata`. The model's params are found by their qualified
names under one top-level key (the one whose entries end in every name;
"model" by convention), Adam's moments and step under the other
(`<key>.state.<name>.exp_avg`), each group's hyper-parameters under its
`param_groups`. Every rank reads whole tensors through torch's own DCP
reader, a batch of at most 256 MiB at a time, and keeps its shard's
elements: memory is bounded by the batch, not the model.

Out: save() writes a DCP directory FSDP2's dcp.load + set_state_dict read:
the same keys get_state_dict gives (model, optim with state and
param_groups), each param and moment a row-split of the full tensor, every
rank writing the rows it gathers, one param at a time.
"""
import warnings
from pathlib import Path

import torch

BATCH_BYTES = 256 << 20
_ADAM = ("exp_avg", "exp_avg_sq")
_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def find(path):
    """True if `path` is a DCP checkpoint directory."""
    return (Path(path) / ".metadata").is_file()


def _metadata(path):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(str(path)).read_metadata()


def _read(path, wanted):
    """dcp.load of a flat {key: preallocated tensor or None} on this rank
    alone (no collective: every rank reads what it asks for)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's deprecation note
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    return wanted


def _paths(md):
    return md.planner_data or {k: tuple(k.split(".")) for k in md.state_dict_metadata}


def _optim_prefix(paths, names):
    """The top-level key holding '<key>.state.<param name>.*' for most of
    the params, or None."""
    found, name_set = {}, set(names)
    for path in paths.values():
        if len(path) == 4 and path[1] == "state" and path[2] in name_set:
            found.setdefault(path[0], set()).add(path[2])
    return max(found, key=lambda p: len(found[p])) if found else None


def _layout(md, names):
    """(model prefix, optimizer prefix or None) from the keys' paths."""
    paths = _paths(md)
    model_prefixes = {}
    name_set = set(names)
    for key, path in paths.items():
        if len(path) == 2 and path[1] in name_set:
            model_prefixes.setdefault(path[0], set()).add(path[1])
    model = [p for p, found in model_prefixes.items() if found]
    if not model:
        raise KeyError("zeroshard.torch.load_checkpoint: no key of this DCP checkpoint is '<prefix>.<param name>' for "
                       f"the model's params (e.g. 'model.{names[0]}'): saved from another model?")
    model.sort(key=lambda p: -len(model_prefixes[p]))
    if len(model) > 1 and len(model_prefixes[model[0]]) == len(model_prefixes[model[1]]):
        raise KeyError(f"zeroshard.torch.load_checkpoint: the DCP checkpoint holds the model's params under several "
                       f"keys ({sorted(model)}): which is the model is ambiguous")
    return model[0], _optim_prefix(paths, names), paths


def _nested(paths, values, skip):
    """Rebuild the nesting (dicts; lists where the path holds an index) of
    the entries whose top-level key is not in skip."""
    out = {}
    for key, value in values.items():
        path = paths[key]
        if path[0] in skip:
            continue
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = [] if isinstance(path[i + 1], int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = nxt
                node = node[part]
            else:
                node = node.setdefault(part, nxt)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return out


def _groups_and_step(path, meta, paths, oprefix, names):
    """The saved param groups (nested as saved) and the step of the
    optimizer under `oprefix`."""
    groups = [k for k in meta if paths[k][0] == oprefix and paths[k][1] == "param_groups"]
    steps = [f"{oprefix}.state.{n}.step" for n in names if f"{oprefix}.state.{n}.step" in meta][:1]
    wanted = {**{k: None for k in groups}, **{k: torch.empty(()) for k in steps}}
    got = _read(path, wanted) if wanted else {}
    saved = _nested(paths, {k: got[k] for k in groups}, ())[oprefix]["param_groups"] if groups else []
    return saved, int(got[steps[0]].item()) if steps else None


def _others(path, meta, paths, skip):
    """The top-level entries not in `skip`, nested as saved."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    small = {k: None if isinstance(meta[k], BytesStorageMetadata) else torch.empty(tuple(meta[k].size),
                                                                                 dtype=meta[k].properties.dtype)
             for k in meta if paths[k][0] not in skip
             and isinstance(meta[k], (BytesStorageMetadata, TensorStorageMetadata))}
    got = _read(path, small) if small else {}
    return _nested(paths, {k: got[k] for k in small}, skip)


class _EngineSink:
    """Where a ZeroShardOptimizer keeps a param's masters and moments."""

    def __init__(self, optimizer, state_view):
        self.optimizer, self.engine, self.state_view = optimizer, optimizer._engine, state_view

    def view(self, p, slot):
        return self.state_view(self.engine, p.zs.zparam, slot)

    def finish(self, step):
        if step is not None:
            self.engine.steps = step
        self.optimizer.sync_hparams()
        self.engine.sync_params()


class _ShardStepperSink:
    """Where a torch Adam / AdamW stepping the shards (shard_optim) keeps
    them: the masters, and its state as the engine's named state, which
    becomes optimizer.state[p] (per-element, this rank's elements) with the
    step as torch keeps it."""

    def __init__(self, optimizer):
        from .shard_optim import stepper
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(f"zeroshard.torch.load_checkpoint: a DCP checkpoint's Adam moments load into a "
                            f"ZeroShardOptimizer or a torch Adam/AdamW, not a {type(optimizer).__name__}")
        self.optimizer, self.s = optimizer, stepper(optimizer)
        self.s.sync(optimizer)
        self.loaded = {}

    def view(self, p, slot):
        if slot == 0:
            return self.s.master_view(p)
        self.loaded[id(p)] = p
        return self.s.named_view(p, _ADAM[slot - 1])

    def finish(self, step):
        for p in self.loaded.values():
            if p.zs.zparam.shard_valid == 0:
                continue
            self.optimizer.state[p] = {"step": torch.tensor(float(step or 0)),
                                       **{k: self.s.named_view(p, k) for k in _ADAM}}


def optimizer_sink(optimizer, state_view):
    """Where another engine's masters and Adam moments go for `optimizer`
    (view(p, slot): 0 master, 1 exp_avg, 2 exp_avg_sq; finish(step)), as
    the DCP and DeepSpeed readers write them."""
    from .optim import ZeroShardOptimizer
    if isinstance(optimizer, ZeroShardOptimizer):
        return _EngineSink(optimizer, state_view)
    return _ShardStepperSink(optimizer)


def load(path, model, optimizer, strict, optimizer_state_view, hook_engines, optim_path=None):
    """A DCP checkpoint into the partitioned model (and a ZeroShardOptimizer).
    optim_path: a second DCP folder holding the optimizer's state (as
    Accelerate saves FSDP's: pytorch_model_fsdp_0/ and optimizer_0/).
    Returns the checkpoint's other top-level entries (e.g. a scheduler's
    state saved beside model and optim), nested as saved."""
    md = _metadata(path)
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    mprefix, oprefix, paths = _layout(md, names)
    meta = md.state_dict_metadata
    opath, ometa, opaths = path, meta, paths
    if optim_path is not None:
        omd = _metadata(optim_path)
        opath, ometa, opaths = optim_path, omd.state_dict_metadata, _paths(omd)
        oprefix = _optim_prefix(opaths, names)
    sink = None if optimizer is None else optimizer_sink(optimizer, optimizer_state_view)
    if sink is not None and oprefix is None:
        raise ValueError(f"zeroshard.torch.load_checkpoint: DCP checkpoint {opath} holds no optimizer state "
                         f"('<prefix>.state.<param name>.exp_avg'): pass optimizer=None for the weights alone")
    buffers = {n for n, _ in model.named_buffers()}
    # A tied param's other names (GPT-2's lm_head.weight) are saved too.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(names)
    theirs = {paths[k][1] for k in meta if paths[k][0] == mprefix and len(paths[k]) == 2}
    saved_buffers = sorted(theirs & buffers)
    theirs -= buffers | aliases
    if strict and set(names) != theirs:
        raise KeyError(f"zeroshard.torch.load_checkpoint: DCP checkpoint {path} and the model differ: missing from "
                       f"the checkpoint {sorted(set(names) - theirs)[:5]}, not in the model "
                       f"{sorted(theirs - set(names))[:5]}")
    # One batch of whole tensors at a time: (param, kind, key), the model's
    # from its folder, the moments from the optimizer's.
    weights, moments = [], []
    for name, p in named:
        if name not in theirs:
            continue
        key = f"{mprefix}.{name}"
        shape = tuple(meta[key].size)
        if shape != tuple(p.zs.shape):
            raise ValueError(f"zeroshard.torch.load_checkpoint: {name} is {list(shape)} in DCP checkpoint {path}, "
                             f"{list(p.zs.shape)} in the model")
        weights.append((p, "param", key))
        if sink is not None and not p.zs.frozen:
            for k in _ADAM:
                okey = f"{oprefix}.state.{name}.{k}"
                if okey not in ometa:
                    raise KeyError(f"zeroshard.torch.load_checkpoint: DCP checkpoint {opath} has no {okey} (an "
                                   f"optimizer other than Adam/AdamW, or saved before its first step)")
                moments.append((p, k, okey))
    slot = {"param": 0, "exp_avg": 1, "exp_avg_sq": 2}
    for where, where_meta, todo in ((path, meta, weights), (opath, ometa, moments)):
        i = 0
        while i < len(todo):
            batch, size = [], 0
            while i < len(todo) and (not batch or size + todo[i][0].zs.zparam.numel * 4 <= BATCH_BYTES):
                batch.append(todo[i])
                size += todo[i][0].zs.zparam.numel * 4
                i += 1
            got = _read(where, {key: torch.empty(tuple(where_meta[key].size), dtype=torch.float32)
                                for _, _, key in batch})
            with torch.no_grad():
                for p, kind, key in batch:
                    z = p.zs.zparam
                    mine = got[key].reshape(-1)[z.shard_offset:z.shard_offset + z.shard_valid]
                    if kind == "param":
                        shard = torch.utils.dlpack.from_dlpack(z.shard_dlpack())
                        shard[:z.shard_valid].copy_(mine)
                    if sink is not None and not p.zs.frozen:
                        sink.view(p, slot[kind])[:z.shard_valid].copy_(mine)
    if saved_buffers:  # whole, as FSDP saves them
        got = _read(path, {f"{mprefix}.{n}": torch.empty(tuple(meta[f"{mprefix}.{n}"].size),
                                                         dtype=meta[f"{mprefix}.{n}"].properties.dtype)
                           for n in saved_buffers})
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved_buffers:
                    b.copy_(got[f"{mprefix}.{n}"].reshape(b.shape).to(b.dtype))
    saved, step = _groups_and_step(opath, ometa, opaths, oprefix, names) if sink is not None else ([], None)
    others = _others(path, meta, paths, (mprefix, oprefix) if optim_path is None else (mprefix,))
    if sink is not None:
        by_name = {n: g for g in saved for n in g.get("params", [])}
        for group in optimizer.param_groups:
            first = next((n for n, p in named if any(p is q for q in group["params"])), None)
            hp = by_name.get(first)
            if hp is None:
                raise KeyError(f"zeroshard.torch.load_checkpoint: no param group of DCP checkpoint {path} holds "
                               f"{first!r}")
            for k in _HPARAMS:
                if k in hp:
                    group[k] = tuple(hp[k]) if k == "betas" else hp[k]
        sink.finish(step)
    for e in hook_engines():
        e.after_step()
    return others


def _full(flat_shard, z, world):
    """The full flat values of a param's state from every rank's padded
    shard (torch.distributed all-gather: ranks hold equal, consecutive
    shards under plain ZeRO-3)."""
    import torch.distributed as dist
    padded = torch.zeros(z.shard_numel, dtype=torch.float32)
    padded[:z.shard_valid].copy_(flat_shard[:z.shard_valid])
    out = torch.empty(z.shard_numel * world, dtype=torch.float32)
    dist.all_gather_into_tensor(out, padded)
    return out[:z.numel]


def _rows(full, shape, mesh):
    """This rank's row block of a full tensor, as torch.chunk splits it
    (what Shard(0) means), wrapped as a DTensor of the full shape."""
    from torch.distributed.tensor import DTensor, Shard
    t = full.reshape(shape)
    if t.dim() == 0:
        return t.clone()
    rank, world = mesh.get_local_rank(), mesh.size()
    per = -(-t.shape[0] // world)
    local = t[min(rank * per, t.shape[0]):min((rank + 1) * per, t.shape[0])].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


class _StateSource:
    """Where the optimizer's masters, moments and step are read from for a
    DCP save: a ZeroShardOptimizer's engine, or a torch Adam/AdamW stepping
    the shards (shard_optim: its master views and named state); None: the
    params' own working shards, no optimizer state."""

    def __init__(self, optimizer, optimizer_state_view):
        from .optim import ZeroShardOptimizer
        self.optimizer, self.state_view = optimizer, optimizer_state_view
        self.engine = self.stepper = None
        if isinstance(optimizer, ZeroShardOptimizer):
            self.engine = optimizer._engine
        elif optimizer is not None:
            from .shard_optim import stepper
            if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
                raise TypeError(f"zeroshard.torch: DCP's optimizer layout is torch Adam/AdamW's: a "
                                f"ZeroShardOptimizer or a torch Adam/AdamW stepping the shards, not a "
                                f"{type(optimizer).__name__}")
            self.stepper = stepper(optimizer)
        trained = set() if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.trained = lambda p: id(p) in trained and not p.zs.frozen

    def view(self, p, slot):
        z = p.zs.zparam
        if self.engine is not None:
            return self.state_view(self.engine, z, slot)
        if slot == 0:
            return self.stepper.master_view(p)
        got = self.stepper.named_view(p, _ADAM[slot - 1], create=False)
        return got if got is not None else torch.zeros(z.shard_valid)

    def step(self):
        """The optimizer's step count, the same on every rank (collective
        for a torch optimizer: a rank without elements of a param has no
        state for it)."""
        if self.engine is not None:
            return int(self.engine.steps)
        import torch.distributed as dist
        found = [int(v["step"]) for v in self.optimizer.state.values() if "step" in v]
        step = torch.tensor([max(found, default=0)], dtype=torch.int64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        return int(step.item())


def _state_dicts(model, optimizer, optimizer_state_view, group_extras=None, aliases_and_buffers=False):
    """(model state dict, optimizer state dict or None) of the partitioned
    model as get_state_dict gives them under FSDP2: each param and Adam
    moment a row-split DTensor of its full fp32 value (the masters where
    the optimizer keeps them), the step, the groups' hyper-parameters
    (torch AdamW's keys; group_extras: per group, more of them) naming
    their params. aliases_and_buffers: a tied param under each of its
    names, and the persistent buffers whole, as FSDP2's
    get_model_state_dict lists them. Collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("zeroshard.torch.export_dcp: torch.distributed is not initialised (DCP writes through "
                           "its process group: dist.init_process_group('gloo') first)")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    source = _StateSource(optimizer, optimizer_state_view)
    named = list(model.named_parameters())
    step = source.step() if optimizer is not None else None
    msd, state, full_of = {}, {}, {}
    with torch.no_grad():
        for name, p in named:
            z = p.zs.zparam
            if z.shard_offset != dist.get_rank() * z.shard_numel or z.padded_numel != z.shard_numel * world:
                raise NotImplementedError(f"zeroshard.torch.export_dcp: {name}'s shards are not one per rank in "
                                          f"rank order (MiCS or hpZ partitioning): not written to DCP yet")
            if source.trained(p):
                master = source.view(p, 0)
            else:
                master = torch.utils.dlpack.from_dlpack(z.shard_dlpack()).float()
            full_of[id(p)] = _full(master, z, world)
            msd[name] = _rows(full_of[id(p)], p.zs.shape, mesh)
            if source.trained(p):
                state[name] = {"step": torch.tensor(float(step)),
                               **{k: _rows(_full(source.view(p, s), z, world), p.zs.shape, mesh)
                                  for s, k in ((1, "exp_avg"), (2, "exp_avg_sq"))}}
        if aliases_and_buffers:
            for name, p in model.named_parameters(remove_duplicate=False):
                if name not in msd:
                    msd[name] = _rows(full_of[id(p)], p.zs.shape, mesh)
            from ._params import persistent_buffers
            for name, b in persistent_buffers(model):
                msd[name] = b.detach().clone()
    if optimizer is None:
        return msd, None
    if source.engine is not None:
        cls = torch.optim.AdamW if optimizer.kind == "adamw" else torch.optim.Adam
        defaults = {k: v for k, v in cls([torch.zeros(1)]).param_groups[0].items() if k != "params"}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        members = [n for n, p in named if any(p is q for q in group["params"])]
        if source.engine is not None:
            g = dict(defaults, lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                     weight_decay=group["weight_decay"], initial_lr=group.get("initial_lr", group["lr"]))
        else:  # the torch optimizer's own group, as FSDP2's would be
            g = {k: v for k, v in group.items() if k != "params"}
        g.update((group_extras or [{}] * len(optimizer.param_groups))[i])
        g["params"] = members
        groups.append(g)
    return msd, {"state": state, "param_groups": groups}


def save(path, model, optimizer, client_state, optimizer_state_view):
    """Writes a DCP directory of {"model": ..., "optim": ...} (and the
    client_state's entries as further top-level keys) in get_state_dict's
    layout: an FSDP2 model and torch AdamW load it with dcp.load and
    set_state_dict. Collective; needs torch.distributed initialised."""
    import torch.distributed.checkpoint as dcp

    msd, osd = _state_dicts(model, optimizer, optimizer_state_view)
    out = {"model": msd}
    if osd is not None:
        out["optim"] = osd
    for k, v in (client_state or {}).items():
        if k in out:
            raise ValueError(f"zeroshard.torch.export_dcp: client_state key {k!r} is taken by the model or optimizer")
        out[k] = v
    dcp.save(out, checkpoint_id=str(path))


def save_accelerate_fsdp(model_dir, optim_dir, model, optimizer, optimizer_state_view, group_extras=None):
    """What Accelerate's save_fsdp_model and save_fsdp_optimizer write under
    FSDP2 with SHARDED_STATE_DICT (transformers.Trainer's checkpoint-N):
    model_dir (pytorch_model_fsdp_0/) a DCP folder of {"model":
    get_model_state_dict}, tied aliases and persistent buffers included;
    optim_dir (optimizer_0/) one of {"optimizer": get_optimizer_state_dict}.
    load_fsdp_model and load_fsdp_optimizer read them at any world size.
    Collective."""
    import torch.distributed.checkpoint as dcp

    msd, osd = _state_dicts(model, optimizer, optimizer_state_view, group_extras, aliases_and_buffers=True)
    dcp.save({"model": msd}, checkpoint_id=str(model_dir))
    if osd is not None:
        dcp.save({"optimizer": osd}, checkpoint_id=str(optim_dir))
