"""DeepSpeed ZeRO-3 checkpoints out: a zeroshard checkpoint written again in
the layout DeepSpeed's engine.save_checkpoint writes under ZeRO-3, so that
DeepSpeed's load_checkpoint (and transformers.Trainer under DeepSpeed,
resume_from_checkpoint) resumes it and DeepSpeed's zero_to_fp32.py
consolidates it.

    out/latest                      "global_step<N>"
    out/global_step<N>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
    out/global_step<N>/zero_pp_rank_<r>_mp_rank_00_model_states.pt
    out/zero_to_fp32.py, out/zero_to_torch.py   (copied from DeepSpeed, as it does)

for every rank r of the world that will resume it: DeepSpeed ZeRO-3 loads
its optimizer files only at the world size that wrote them ("Automatic
adjustment of ZeRO's optimizer state partitioning with a new world size is
not currently supported"), so the layout is written for a chosen world size
(default: the zeroshard checkpoint's).

What each file holds, as DeepSpeed 0.19's stage3.py state_dict and
engine._save_checkpoint write it:
- optim_states: `optimizer_state_dict` = {zero_stage: ZeroStageEnum.weights,
  loss_scaler: LossScaler(1.0), dynamic_loss_scale, overflow,
  partition_count: world, fp32_flat_groups: one fp32 tensor per sub-group,
  optimizer_state_dict: the torch optimizer's state_dict over those flat
  tensors (state[i] = {step, exp_avg, exp_avg_sq} of sub-group i; each param
  group lists its sub-groups)}, ds_config, ds_version. A sub-group is a
  param group's params in order, cut where the rank's elements reach
  zero_optimization.sub_group_size (1e9 by default); its flat tensor is each
  param's partition in turn: elements [r * ceil(numel / world), ...) of the
  flattened param, the last rank's zero-padded to ceil(numel / world).
- model_states: `module` (the state_dict's keys: each param an empty tensor
  of its dtype, as a partitioned param's is; persistent buffers whole),
  buffer_names, param_shapes (one ordered {name: shape} per sub-group),
  frozen_param_shapes / frozen_param_fragments (params in no optimizer
  group: this rank's partition, zero-padded), shared_params (tied
  aliases, rank 0), the counters (global_steps, global_samples,
  skipped_steps), dp_world_size, mp_world_size, ds_config, ds_version.

The groups are the zeroshard optimizer's (their params in order): they
must be the groups the resuming DeepSpeed engine gets from its optimizer;
zeroshard.hf.Trainer's are transformers.Trainer's (decay, no decay, in
named_parameters order). DeepSpeed's own classes (ZeroStageEnum,
LossScaler) are pickled into the optimizer files, so DeepSpeed must be
importable here, as it must be where the checkpoint is resumed.
"""
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


def find(path):
    """The zeroshard checkpoint directory (its manifest.json) that `path`
    names: the directory itself, a directory of them (its `latest`), or a
    Trainer checkpoint folder holding one (`zeroshard/`); else None."""
    path = Path(path)
    for _ in range(3):
        if (path / "manifest.json").is_file():
            return path
        if (path / "latest").is_file() and (path / (path / "latest").read_text().strip() / "manifest.json").is_file():
            return path / (path / "latest").read_text().strip()
        if (path / "zeroshard").is_dir():
            path = path / "zeroshard"
            continue
        return None
    return None


class ZeroshardCheckpoint:
    """A zeroshard checkpoint directory read without the engine: its
    manifest, and any element range of a param's state from the rank files
    (safetensors, memory-mapped)."""

    def __init__(self, tagdir):
        self.dir = Path(tagdir)
        with open(self.dir / "manifest.json", encoding="utf-8") as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != "zeroshard-checkpoint":
            raise ValueError(f"zeroshard: {self.dir}/manifest.json is not a zeroshard checkpoint's")
        self.files = {f["rank"]: self.dir / f["name"] for f in self.manifest["files"]}
        self.params = OrderedDict((p["name"], p) for p in self.manifest["params"])
        self.optimizer = self.manifest.get("optimizer")
        self.user = self.manifest.get("user") or {}
        if isinstance(self.user, str):
            self.user = json.loads(self.user) if self.user else {}
        self.step = int(self.manifest.get("step", 0))
        self.world_size = int(self.manifest["world_size"])
        self._open = {}

    def _file(self, index):
        if index not in self._open:
            from safetensors import safe_open
            self._open[index] = safe_open(str(self.files[index]), framework="pt")
        return self._open[index]

    def has(self, name, state):
        return state in self.params[name]["states"]

    def dtype(self, name):
        return _DTYPES[self.params[name]["dtype"]]

    def read(self, name, state, begin, count, dtype=torch.float32):
        """Elements [begin, begin + count) of the flattened param's `state`
        (param, master, exp_avg, exp_avg_sq) as `dtype`; elements past the
        param's end are zeros (DeepSpeed's padding)."""
        p = self.params[name]
        out = torch.zeros(count, dtype=dtype)
        end = min(begin + count, p["numel"])
        for c in p["states"][state]:
            lo, hi = max(begin, c["offset"]), min(end, c["offset"] + c["numel"])
            if lo < hi:
                part = self._file(c["file"]).get_slice(c["key"])[lo - c["offset"]:hi - c["offset"]]
                out[lo - begin:hi - begin].copy_(part)
        return out

    def master(self, name, begin, count):
        """The fp32 master's elements: `master/` for a 16-bit param, else
        the param itself."""
        return self.read(name, "master" if self.has(name, "master") else "param", begin, count)


def _sub_groups(names, part, sub_group_size):
    """DeepSpeed stage3's _create_fp16_sub_groups: a group's params cut where
    the rank's elements reach sub_group_size."""
    if sub_group_size is None or sub_group_size >= sum(part[n] for n in names):
        return [list(names)]
    out, cur, size = [], [], 0
    for n in names:
        cur.append(n)
        size += part[n]
        if size >= sub_group_size or n == names[-1]:
            out.append(cur)
            cur, size = [], 0
    return out


def _torch_group(hp, kind, extra):
    """A torch AdamW/Adam param group's saved keys (no params) from the
    manifest's hyper-parameters: what Optimizer.load_state_dict installs."""
    g = {"weight_decay": hp["weight_decay"], "lr": hp["lr"], "betas": (hp["beta1"], hp["beta2"]), "eps": hp["eps"],
         "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
         "fused": None, "decoupled_weight_decay": kind == "adamw", "bias_correction": bool(hp["bias_correction"])}
    g.update(extra or {})
    return g


def _deepspeed():
    try:
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError as e:
        raise ImportError("zeroshard: writing DeepSpeed's checkpoint layout needs DeepSpeed importable (its files "
                          f"pickle DeepSpeed's ZeroStageEnum and LossScaler, and zero_to_fp32.py is DeepSpeed's): {e}"
                          ) from None
    return deepspeed, LossScaler, ZeroStageEnum


class _Layout:
    """What every rank's files share: the groups cut into sub-groups, the
    frozen params, the counters."""

    def __init__(self, ck, world_size, ds_config, aliases, group_extras):
        opt = ck.optimizer
        if not opt or not opt.get("groups"):
            raise ValueError(f"zeroshard: {ck.dir} holds no optimizer state: DeepSpeed's ZeRO-3 layout is the "
                             f"optimizer's fp32 partitions (save the checkpoint with the optimizer)")
        if opt["kind"] not in ("adamw", "adam"):
            raise ValueError(f"zeroshard: {ck.dir}'s optimizer is {opt['kind']!r}: DeepSpeed's layout is written for "
                             f"Adam/AdamW (exp_avg, exp_avg_sq)")
        f16 = [n for n in ck.params if ck.params[n]["dtype"] == "F16"]
        if f16:
            raise ValueError(f"zeroshard: {ck.dir} holds fp16 params ({f16[0]}, ...): DeepSpeed's fp16 layout (its "
                             f"dynamic loss scaler) is not written; fp32 and bf16 are")
        self.world = int(world_size)
        if self.world < 1:
            raise ValueError(f"zeroshard: world_size {world_size}: at least 1")
        self.kind = opt["kind"]
        self.step = int(opt.get("steps", ck.step))
        self.part = {n: -(-p["numel"] // self.world) for n, p in ck.params.items()}
        zero = (ds_config or {}).get("zero_optimization") or {}
        sub_size = zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
        sub_size = DEFAULT_SUB_GROUP_SIZE if sub_size in (None, "auto") else int(float(sub_size))
        self.sub_groups, self.group_of_sub, self.groups = [], [], []
        placed = set()
        for g, group in enumerate(opt["groups"]):
            # DeepSpeed counts a param with no elements as frozen (not in its flat groups)
            names = [n for n in group["params"] if ck.params[n]["numel"] > 0]
            placed.update(names)
            extra = group_extras[g] if group_extras and g < len(group_extras) else None
            self.groups.append(_torch_group(group["hparams"], self.kind, extra))
            if not names:  # DeepSpeed leaves a group without trainable params out of its sub-groups
                continue
            for sub in _sub_groups(names, self.part, sub_size):
                self.sub_groups.append(sub)
                self.group_of_sub.append(g)
        missing = [n for g in self.sub_groups for n in g if not ck.has(n, "exp_avg")]
        self.moments = not missing
        if missing and self.step > 0:
            raise ValueError(f"zeroshard: {ck.dir} has no Adam moments for {missing[:3]} after {self.step} steps")
        self.frozen = [n for n in ck.params if n not in placed]
        self.bf16 = any(ck.params[n]["dtype"] == "BF16" for n in ck.params)
        self.aliases = dict(aliases or {})
        self.ds_config = ds_config if ds_config is not None else {"zero_optimization": {"stage": 3}}
        tbs = self.ds_config.get("train_batch_size")
        self.global_samples = self.step * tbs if isinstance(tbs, int) else None

    def optim_name(self, r):
        return f"{'bf16_' if self.bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"

    @staticmethod
    def model_name(r):
        return f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"


def _write_rank(ck, lay, r, tagdir, ds):
    """Rank r's optim_states and model_states files into tagdir."""
    deepspeed, LossScaler, ZeroStageEnum = ds
    flats, state = [], {}
    for i, names in enumerate(lay.sub_groups):
        spans = [(n, r * lay.part[n], lay.part[n]) for n in names]
        flat = torch.cat([ck.master(n, b, c) for n, b, c in spans]).requires_grad_(True)
        flats.append(flat)
        if lay.moments and lay.step > 0:
            state[i] = {"step": torch.tensor(float(lay.step)),
                        "exp_avg": torch.cat([ck.read(n, "exp_avg", b, c) for n, b, c in spans]),
                        "exp_avg_sq": torch.cat([ck.read(n, "exp_avg_sq", b, c) for n, b, c in spans])}
    groups = []
    for g, hp in enumerate(lay.groups):
        groups.append({**hp, "params": [i for i, owner in enumerate(lay.group_of_sub) if owner == g]})
    version = deepspeed.__version__
    optim = {"optimizer_state_dict": {
        "zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(scale=1.0), "dynamic_loss_scale": False,
        "overflow": False, "partition_count": lay.world,
        "optimizer_state_dict": {"state": state, "param_groups": groups},
        "fp32_flat_groups": flats}, "ds_config": lay.ds_config, "ds_version": version}
    torch.save(optim, tagdir / lay.optim_name(r))
    del optim, flats, state

    module = OrderedDict()
    for name in ck.params:
        module[name] = torch.empty(0, dtype=ck.dtype(name))
    for alias, name in lay.aliases.items():
        module[alias] = torch.empty(0, dtype=ck.dtype(name))
    buffers = (ck.user.get("buffers") or {})
    for name, b in buffers.items():
        module[name] = torch.tensor(b["values"], dtype=getattr(torch, b["dtype"].replace("torch.", "")))
    frozen_shapes, frozen_fragments = OrderedDict(), OrderedDict()
    for name in lay.frozen:
        frozen_shapes[name] = torch.Size(ck.params[name]["shape"])
        frozen_fragments[name] = ck.read(name, "param", r * lay.part[name], lay.part[name], dtype=ck.dtype(name))
    model = {
        "module": module, "buffer_names": list(buffers), "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(ck.params[n]["shape"])) for n in names)
                         for names in lay.sub_groups],
        "frozen_param_shapes": frozen_shapes, "shared_params": dict(lay.aliases) if r == 0 else {},
        "frozen_param_fragments": frozen_fragments, "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": lay.step}
    if lay.global_samples is not None:
        model["global_samples"] = lay.global_samples
    model.update({"dp_world_size": lay.world, "mp_world_size": 1,
                  "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                  "ds_config": lay.ds_config, "ds_version": version})
    torch.save(model, tagdir / lay.model_name(r))


def export(src, out, world_size=None, tag=None, ds_config=None, aliases=None, group_extras=None,
           rank=0, world=1, barrier=None):
    """Write zeroshard checkpoint `src` (a checkpoint directory, a directory
    of them, or a Trainer checkpoint folder holding `zeroshard/`) into `out`
    in DeepSpeed ZeRO-3's layout for `world_size` ranks (default: the
    checkpoint's): out/<tag> (default global_step<N>), out/latest, and
    DeepSpeed's zero_to_fp32.py. An existing out/<tag> is replaced whole.

    ds_config: the DeepSpeed config recorded in the files (and its
    zero_optimization.sub_group_size, train_batch_size). aliases: {tied
    name: saved name}, else what zeroshard.torch.save_checkpoint recorded.
    group_extras: per param group, torch optimizer keys to record (e.g.
    {"fused": True, "initial_lr": 3e-3}). rank/world/barrier: this process's
    share when several write together (each writes the target ranks
    r = rank, rank + world, ...; barrier() is called between the phases on
    every process). Returns out/<tag>."""
    tagdir_src = find(src)
    if tagdir_src is None:
        raise ValueError(f"zeroshard: {src} holds no zeroshard checkpoint (manifest.json, a `latest` naming one, "
                         f"or a Trainer folder's zeroshard/)")
    ck = ZeroshardCheckpoint(tagdir_src)
    if aliases is None:
        aliases = ck.user.get("aliases") or {}
    lay = _Layout(ck, world_size or ck.world_size, ds_config, aliases, group_extras)
    ds = _deepspeed()
    out = Path(out)
    tag = str(tag or f"global_step{lay.step}")
    final, partial = out / tag, out / f".{tag}.partial"
    barrier = barrier or (lambda: None)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    barrier()
    for r in range(rank, lay.world, world):
        _write_rank(ck, lay, r, partial, ds)
    barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        base = Path(ds[0].__file__).parent / "utils"
        for script in _SCRIPTS:
            if (base / script).is_file():
                shutil.copyfile(base / script, out / script)
                os.chmod(out / script, 0o755)
        with open(out / "latest.tmp", "w") as f:
            f.write(tag)
        os.replace(out / "latest.tmp", out / "latest")
    barrier()
    return str(final)

