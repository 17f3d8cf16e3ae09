"""DeepSpeed ZeRO checkpoints in: read a directory DeepSpeed's
engine.save_checkpoint wrote (ZeRO-1, 2 or 3; fp32, bf16 or fp16 runs, any
data-parallel world size) and load its fp32 master weights, Adam moments,
step count and hyper-parameters into a partitioned model at this world
size. zt.load_checkpoint calls it when `path` is such a directory.

No pickled code runs: every file is read with torch.load(weights_only=True).
DeepSpeed's own objects in its optimizer files (the loss scaler, the ZeRO
stage enum) are read as inert records of their class name and state: the
allow-list maps each `deepspeed.*` class to a stand-in that only keeps its
constructor arguments and pickled state. A file holding any other class is
refused, naming the file and the class.

Layouts (what DeepSpeed's zero_to_fp32 reads too):
- ZeRO-3: each rank's `fp32_flat_groups` (one per sub-group) concatenate,
  in `param_shapes` order, every param's partition of ceil(numel / world)
  elements (the last rank's padded); the optimizer state of sub-group i
  (`optimizer_state_dict.state[i]`) matches fp32_flat_groups[i] element
  for element. Frozen params: each rank's `frozen_param_fragments`.
- ZeRO-1/2: per param group, the ranks' `single_partition_of_fp32_groups`
  concatenate into the group's flat buffer, params one after another in
  `param_shapes[g]` order (each followed by its `param_alignment_paddings`);
  `base_optimizer_state.state[g]` matches the partition. Frozen params are
  in `mp_rank_00_model_states.pt`'s module, whole.
"""
import pickletools
import re
import zipfile
from pathlib import Path

import torch

_DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
            "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
            "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
            "ds_version", "checkpoint_parallel_dimensions", "iteration"}
_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class _Foreign:
    """A DeepSpeed object read without its class: constructor arguments and
    pickled state, nothing run."""
    qualname = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.qualname} {self.args or ''}{self.state or ''}>"


def _globals_of(file):
    """The module.name of every global a torch zip file's pickle names."""
    with zipfile.ZipFile(file) as z:
        pkl = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError(f"{file}: not a torch zip checkpoint (no data.pkl): saved by a torch older than 1.6?")
        data = z.read(pkl)
    names, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.add(f"{strings[-2]}.{strings[-1]}")
    return names


def safe_load(file, kind="DeepSpeed checkpoint file"):
    """torch.load(weights_only=True, mmap=True) with DeepSpeed's classes as
    inert stand-ins; anything else a weights-only load refuses is an error
    naming the file and what it holds."""
    names = sorted(_globals_of(file))
    stand_ins = [(type(n.rsplit(".", 1)[1], (_Foreign,), {"qualname": n}), n)
                 for n in names if n.startswith("deepspeed.")]
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch's UnpicklingError names the first global it refused
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        other = [n for n in names if not n.startswith(("torch.", "collections.", "deepspeed."))]
        what = ", ".join(other) or (found.group(1) if found else "an object torch refuses")
        raise ValueError(f"zeroshard: {kind} {file} holds {what}, which cannot be read without "
                         f"running pickled code (torch.load weights_only=True refuses it); nothing was loaded") from None


def find(path, tag=None):
    """The global_stepN directory if `path` (or path/tag, or what path/latest
    names) is a DeepSpeed checkpoint, else None."""
    path = Path(path)
    if not path.is_dir():
        return None
    if tag is not None:
        candidates = [path / str(tag)]
    elif (path / "latest").is_file() and not (path / "manifest.json").exists():
        candidates = [path / (path / "latest").read_text().strip(), path]
    else:
        candidates = [path]
    for c in candidates:
        if c.is_dir() and any(_OPTIM_FILE.match(f.name) or f.name.endswith("_model_states.pt")
                              for f in c.iterdir()):
            return c
    return None


class _Flat:
    """Tensors that read as one flat vector (a rank's sub-groups)."""

    def __init__(self, parts):
        self.parts = [p.detach().reshape(-1) for p in parts]  # fp32_flat_groups were saved requiring grad
        self.starts = []
        n = 0
        for p in self.parts:
            self.starts.append(n)
            n += p.numel()
        self.numel = n

    def read(self, begin, count, out):
        """Elements [begin, begin + count) into out (fp32, count long)."""
        if begin + count > self.numel:
            raise ValueError(f"zeroshard: DeepSpeed checkpoint: elements {begin}..{begin + count} read past a flat "
                             f"buffer of {self.numel}")
        done = 0
        for start, p in zip(self.starts, self.parts):
            lo, hi = max(begin + done, start), min(begin + count, start + p.numel())
            if lo < hi:
                out[lo - begin:hi - begin].copy_(p[lo - start:hi - start])
                done = hi - begin
        return out


class DeepSpeedCheckpoint:
    """One DeepSpeed checkpoint (a global_stepN directory), opened lazily:
    tensors stay memory-mapped; read() copies only the elements asked for."""

    STATES = ("param", "exp_avg", "exp_avg_sq")

    def __init__(self, tagdir):
        self.dir = Path(tagdir)
        files = {}
        for f in self.dir.iterdir():
            m = _OPTIM_FILE.match(f.name)
            if m:
                if int(m.group(3)) != 0:
                    raise ValueError(f"zeroshard: DeepSpeed checkpoint {self.dir}: model-parallel rank {m.group(3)} "
                                     f"({f.name}): tensor/pipeline-parallel checkpoints are not read")
                files[int(m.group(2))] = f
        self.world = len(files)
        if not files:
            raise ValueError(f"zeroshard: DeepSpeed checkpoint {self.dir} holds model states but no "
                             f"zero_pp_rank_*_mp_rank_00_optim_states.pt: a run without ZeRO, or a copy that left "
                             f"them out; its fp32 masters are in those files")
        if sorted(files) != list(range(self.world)):
            raise ValueError(f"zeroshard: DeepSpeed checkpoint {self.dir}: optimizer files for ranks {sorted(files)}, "
                             f"expected 0..{self.world - 1}")
        optims = [safe_load(files[r])["optimizer_state_dict"] for r in range(self.world)]
        stage = optims[0].get("zero_stage")
        self.stage = int(stage.args[0]) if isinstance(stage, _Foreign) and stage.args else int(stage or 0)
        model_files = sorted(self.dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"),
                             key=lambda f: int(f.name.split("_")[3]))
        if self.stage == 3:
            if len(model_files) != self.world:
                missing = [f.name.replace("_model_states.pt", "_optim_states.pt") for f in model_files
                           if int(f.name.split("_")[3]) not in files]
                raise ValueError(f"zeroshard: DeepSpeed ZeRO-3 checkpoint {self.dir}: {len(model_files)} model state "
                                 f"files for {self.world} optimizer files"
                                 + (f": {', '.join(missing)} missing (each rank's fp32 masters and optimizer state)"
                                    if missing else ""))
            models = [safe_load(f) for f in model_files]
        else:
            single = self.dir / "mp_rank_00_model_states.pt"
            if not single.exists():
                raise ValueError(f"zeroshard: DeepSpeed ZeRO-{self.stage} checkpoint {self.dir}: {single.name} is missing")
            models = [safe_load(single)]
        self.model = models[0]
        if self.model.get("mp_world_size", 1) != 1:
            raise ValueError(f"zeroshard: DeepSpeed checkpoint {self.dir}: mp_world_size "
                             f"{self.model['mp_world_size']}: tensor-parallel checkpoints are not read")
        self.groups = [list(g.items()) for g in self.model["param_shapes"]]
        self.shared = dict(self.model.get("shared_params") or {})
        self._locate(optims, models)

    def _locate(self, optims, models):
        """Where each param's elements are: name -> (kind, data...)."""
        self.where = {}
        if self.stage == 3:
            inner = [o["optimizer_state_dict"] for o in optims]
            fp32 = [_Flat(o["fp32_flat_groups"]) for o in optims]
            moments = {s: [_Flat([st["state"][k][s] for k in sorted(st["state"])]) for st in inner]
                       for s in ("exp_avg", "exp_avg_sq") if all(st["state"] for st in inner)}
            offset = 0
            for group in self.groups:
                for name, shape in group:
                    numel = shape.numel()
                    part = -(-numel // self.world)
                    self.where[name] = ("zero3", numel, offset, part)
                    offset += part
            if offset != fp32[0].numel:
                raise ValueError(f"zeroshard: DeepSpeed ZeRO-3 checkpoint {self.dir}: param_shapes cover {offset} "
                                 f"elements per rank, fp32_flat_groups hold {fp32[0].numel}")
            self.flats = {"param": fp32, **moments}
            self.steps_state = inner[0]["state"]
            self.param_groups = inner[0]["param_groups"]
            for r, m in enumerate(models):
                for name, frag in (m.get("frozen_param_fragments") or {}).items():
                    self.where.setdefault(name, ("frozen3", m["frozen_param_shapes"][name].numel(), []))[2].append(frag)
        else:
            fp32 = [_Flat([o["single_partition_of_fp32_groups"][g] for o in optims])
                    for g in range(len(self.groups))]
            base = [o["base_optimizer_state"] for o in optims]
            self.flats = {"param": fp32}
            if all(b["state"] for b in base):
                for s in ("exp_avg", "exp_avg_sq"):
                    self.flats[s] = [_Flat([b["state"][g][s] for b in base]) for g in range(len(self.groups))]
            paddings = optims[0].get("param_alignment_paddings") or [[0] * len(g) for g in self.groups]
            for g, group in enumerate(self.groups):
                offset = 0
                for (name, shape), pad in zip(group, paddings[g]):
                    self.where[name] = ("zero12", shape.numel(), g, offset)
                    offset += shape.numel() + pad
                if offset > fp32[g].numel:
                    raise ValueError(f"zeroshard: DeepSpeed ZeRO-{self.stage} checkpoint {self.dir}: group {g}'s params "
                                     f"need {offset} elements, its partitions hold {fp32[g].numel}")
            self.steps_state = base[0]["state"]
            self.param_groups = base[0]["param_groups"]
            module = self.model.get("module") or {}
            for name in (self.model.get("frozen_param_shapes") or {}):
                self.where.setdefault(name, ("whole", module[name]))

    def names(self):
        return list(self.where) + list(self.shared)

    def has(self, state):
        return state in self.flats

    def numel(self, name):
        w = self.where[self.shared.get(name, name)]
        return w[1] if w[0] != "whole" else w[1].numel()

    def read(self, name, state, begin, count):
        """Elements [begin, begin + count) of the flattened param's state
        (param, exp_avg, exp_avg_sq) as fp32."""
        name = self.shared.get(name, name)
        w = self.where[name]
        out = torch.empty(count, dtype=torch.float32)
        if w[0] == "zero3":
            _, numel, offset, part = w
            flats, e = self.flats[state], begin
            while e < begin + count:
                r, within = divmod(e, part)
                n = min(part - within, begin + count - e)
                flats[r].read(offset + within, n, out[e - begin:e - begin + n])
                e += n
        elif w[0] == "zero12":
            _, numel, g, offset = w
            self.flats[state][g].read(offset + begin, count, out)
        elif state == "param":
            whole = w[1].reshape(-1) if w[0] == "whole" else torch.cat([f.reshape(-1) for f in w[2]])
            out.copy_(whole[begin:begin + count])
        else:
            raise KeyError(f"{name} is frozen: no {state}")
        return out

    def buffers(self):
        """{name: whole tensor} of the module's buffers (each rank's model
        states hold them whole)."""
        module = self.model.get("module") or {}
        return {n: module[n] for n in (self.model.get("buffer_names") or []) if n in module}

    def frozen(self, name):
        return self.where[self.shared.get(name, name)][0] in ("frozen3", "whole")

    def step(self):
        steps = {int(s["step"]) for s in self.steps_state.values() if "step" in s}
        return max(steps) if steps else int(self.model.get("global_steps", 0))

    def client_state(self):
        """The caller's client_state keys, and DeepSpeed's own counters and
        scheduler state under "deepspeed"."""
        user = {k: v for k, v in self.model.items() if k not in _DS_KEYS}
        user["deepspeed"] = {k: self.model.get(k) for k in ("lr_scheduler", "global_steps", "global_samples",
                                                            "skipped_steps", "ds_config", "ds_version")}
        user["deepspeed"]["dp_world_size"] = self.world
        user["deepspeed"]["zero_stage"] = self.stage
        return user
