"""Context: one engine context per process and data-parallel world."""
import atexit
import collections
import json
import os
import time
import warnings
import weakref

from ._ffi import ffi, lib
from . import errors
from .errors import check
from ._types import (_GROUP_BY_NAME, _INIT_BY_NAME, _OPTIM_BY_NAME, _code, _device_option,
                     device_string, dtype_code)
from ._util import (_buffer, _cstr, _finalizing, _name_array, _new_struct, _progress_callback,
                    _struct_dict)
from .config import _config_source, inactive_config_message
from .group import Group
from .optimizer import Optimizer
from .param import Param, _param_array
from .work import Gather


_live_contexts = weakref.WeakSet()


@atexit.register
def _close_live_contexts():
    # Contexts still open at exit are destroyed before the interpreter tears
    # down, so that the engine's threads stop while everything is alive.
    for ctx in list(_live_contexts):
        try:
            ctx.close()
        except Exception:
            pass


class Context:
    """One engine context per process and data-parallel world.

    Arguments left None come from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, ...). ``config`` is a dict, JSON text (a string
    starting with "{") or a path to a DeepSpeed JSON file.

    ``device``: "cpu", "cuda" or "cuda:N" (or a torch.device) for shards,
    gathered params, gradients and optimizer state; None: the config's
    "device" key, else $ZS_DEVICE, else this rank's GPU (LOCAL_RANK modulo
    the GPUs) when there is one, else "cpu". ``backend``: "gloo" or "nccl";
    None: $ZS_BACKEND, else NCCL on a GPU when libnccl loads, else Gloo
    (GPU memory staged through pinned host memory)."""

    def __init__(self, rank=None, world_size=None, local_rank=None, local_world_size=None,
                 store_host=None, store_port=None, file_store_path=None, config=None,
                 timeout_ms=0, transport_host=None, device=None, backend=None):
        self._closed = True
        self._h = ffi.NULL
        self._device = None
        keep = []
        o = _new_struct("zs_context_options")
        o.rank = -1 if rank is None else int(rank)
        o.world_size = -1 if world_size is None else int(world_size)
        o.local_rank = -1 if local_rank is None else int(local_rank)
        o.local_world_size = -1 if local_world_size is None else int(local_world_size)
        o.store_host = _cstr(store_host, keep)
        o.store_port = -1 if store_port is None else int(store_port)
        o.file_store_path = _cstr(file_store_path, keep)
        text, path = _config_source(config)
        o.config_json = _cstr(text, keep)
        o.config_path = _cstr(path, keep)
        o.timeout_ms = int(timeout_ms or 0)
        o.transport_host = _cstr(transport_host, keep)
        o.device = _cstr(_device_option(device), keep)
        o.backend = _cstr(backend, keep)
        out = ffi.new("zs_context*")
        check(lib.zs_context_create(out, o))
        self._h = out[0]
        self._closed = False
        # (ticket, owner) of the gradients the engine may still read
        # (Param.lend_grad), oldest first; dropped as it releases them.
        self._lent = collections.deque()
        self._released = ffi.new("uint64_t*")
        _live_contexts.add(self)
        try:
            self._warn_inactive_config()
        except BaseException:  # the warning turned into an error by a filter
            self.close()
            raise

    def _warn_inactive_config(self):
        # Once per context, on rank 0 (every rank parses the same config;
        # each can read the list through inactive_config_keys).
        keys = self.inactive_config_keys
        if keys and self.rank == 0:
            warnings.warn(errors.ZeroShardConfigWarning(inactive_config_message(keys), keys),
                          stacklevel=3)

    # -- lifetime --------------------------------------------------------
    @property
    def closed(self):
        return self._closed

    @property
    def handle(self):
        return self._h

    def close(self):
        """Destroy the context and everything registered in it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _live_contexts.discard(self)
        try:
            check(lib.zs_context_destroy(self._h))
        finally:
            self._lent.clear()  # nothing reads them once the context is gone

    def release_lent(self, wait=False):
        """Let go of the lent gradients the engine no longer reads; wait:
        of every one, once the engine has read them all."""
        lent = self._lent
        pause = 50e-6
        while lent:
            check(lib.zs_grad_released(self._h, self._released))
            upto = self._released[0]
            while lent and lent[0][0] <= upto:
                lent.popleft()
            if not wait or not lent:
                return
            # Their reductions run on the groups' threads, which end every
            # one (done, or failed at the communicator's timeout or a heal's
            # abort): polled, as no call waits for them alone.
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if self._closed or _finalizing():
                return
            self._closed = True
            lib.zs_context_destroy(self._h)
            self._lent.clear()
        except Exception:
            pass

    def __repr__(self):
        if self._closed:
            return "<zeroshard.Context closed>"
        try:
            return "<zeroshard.Context rank %d of %d on %s>" % (self.rank, self.world_size,
                                                                 self.device)
        except errors.ZeroShardError:
            return "<zeroshard.Context (invalid)>"

    # -- identity and config -------------------------------------------
    def _int(self, fn):
        out = ffi.new("int*")
        check(fn(self._h, out))
        return out[0]

    @property
    def rank(self):
        return self._int(lib.zs_context_rank)

    @property
    def world_size(self):
        return self._int(lib.zs_context_world_size)

    @property
    def live_ranks(self):
        """The world ranks live now, ascending: every rank until a shrink in
        memory (zeroshard.healing.min_ranks) leaves some out, and again
        after the regrow takes them back. A rank keeps its id (`rank`,
        `world_size` do not change); what is laid out per rank (shards,
        checkpoint files) goes by position in this list."""
        with self.group("world") as world:
            return world.ranks()

    @property
    def local_rank(self):
        return self._int(lib.zs_context_local_rank)

    @property
    def local_world_size(self):
        return self._int(lib.zs_context_local_world_size)

    def _device_info(self):
        if self._device is None:  # fixed for the context's life
            t = ffi.new("zs_device_type*")
            i = ffi.new("int*")
            b = ffi.new("const char**")
            check(lib.zs_context_device(self._h, t, i, b))
            self._device = (int(t[0]), int(i[0]), ffi.string(b[0]).decode("ascii"))
        return self._device

    @property
    def device(self):
        """Where the context's memory lives: "cpu" or "cuda:N"."""
        t, i, _ = self._device_info()
        return device_string(t, i)

    @property
    def device_type(self):
        """DEVICE_CPU (1) or DEVICE_CUDA (2): DLPack's device type codes."""
        return self._device_info()[0]

    @property
    def device_id(self):
        """The device ordinal (0 on the CPU)."""
        return self._device_info()[1]

    @property
    def backend(self):
        """What collectives run on: "gloo" or "nccl"."""
        return self._device_info()[2]

    @property
    def config(self):
        """The effective config (defaults filled in, "auto" resolved)."""
        out = ffi.new("const char**")
        check(lib.zs_context_config_json(self._h, out))
        return json.loads(ffi.string(out[0]).decode("utf-8"))

    @property
    def unused_config_keys(self):
        """Keys accepted but not used by the engine (trainer keys)."""
        out = ffi.new("const char**")
        check(lib.zs_context_unused_config_keys(self._h, out))
        return list(json.loads(ffi.string(out[0]).decode("utf-8")))

    @property
    def inactive_config_keys(self):
        """Config keys the engine accepts but does not act on yet, computed
        once by the engine: a list of {"key": JSON path as written, "value":
        the value, "reason": what the engine does instead}. Context creation
        warns about them (ZeroShardConfigWarning, once, on rank 0)."""
        out = ffi.new("const char**")
        check(lib.zs_context_inactive_config_keys(self._h, out))
        return list(json.loads(ffi.string(out[0]).decode("utf-8")))

    def memory(self):
        """This rank's memory counters in bytes (and num_params)."""
        s = _new_struct("zs_memory_stats")
        check(lib.zs_context_memory(self._h, s))
        return _struct_dict(s, "zs_memory_stats")

    def memory_by_kind(self, phase=None):
        """Bytes the engine holds by kind ("shards", "masters", ...), now
        (phase None) or the most each held in a phase ("construction",
        "forward", "backward", "step", "checkpoint"), with "total": the sum
        now, or the most all kinds held together in the phase
        (zs_memory_by_kind; process-wide)."""
        code = lib.ZS_PHASE_NOW if phase is None else _memory_phase_code(phase)
        return _by_kind(lambda values, n, total: lib.zs_memory_by_kind(self._h, code, values, n, ffi.NULL, total),
                        lib.ZS_MEM_KIND_COUNT, lib.zs_memory_kind_name)

    def copied_bytes(self, last_step=False):
        """Bytes the engine copied by kind ("grad_into_bucket",
        "into_grad_shard", "master_refresh", ...), with "total": since the
        context was created, or (last_step) between its last two optimizer
        step ends, one forward, backward and step (zs_copied_bytes;
        process-wide counters, this context's spans)."""
        span = lib.ZS_COPIES_LAST_STEP if last_step else lib.ZS_COPIES_TOTAL
        return _by_kind(lambda values, n, total: lib.zs_copied_bytes(self._h, span, values, n, ffi.NULL, total),
                        lib.ZS_COPY_KIND_COUNT, lib.zs_copy_kind_name)

    def memory_pools_in_use(self):
        """Bytes the engine's caching pools hand out now: what every kind
        of memory_by_kind but io_staging and inboxes adds up to."""
        out = ffi.new("uint64_t*")
        check(lib.zs_memory_pools_in_use(self._h, out))
        return int(out[0])

    def host_memory_held(self):
        """memory_pools_in_use() plus the host pool's idle blocks: what the
        engine keeps resident. Cheap (one struct, reused), for hooks that
        read it after every unit's backward (zeroshard.torch's trims);
        memory() builds a dict of every counter, ten times slower."""
        s = self.__dict__.get("_held_stats")
        if s is None:
            s = self._held_stats = _new_struct("zs_memory_stats")
        check(lib.zs_context_memory(self._h, s))
        return self.memory_pools_in_use() + int(s.host_cache_bytes)

    @property
    def memory_phase(self):
        """The phase the engine's allocations count toward (it follows
        registration, fetches, gradient pushes, steps and checkpoints by
        itself); settable by name."""
        out = ffi.new("zs_memory_phase*")
        check(lib.zs_memory_get_phase(self._h, out))
        return ffi.string(lib.zs_memory_phase_name(out[0])).decode()

    @memory_phase.setter
    def memory_phase(self, phase):
        check(lib.zs_memory_set_phase(self._h, _memory_phase_code(phase)))

    def reset_memory_peaks(self):
        """Every phase's peaks start again from what is held now."""
        check(lib.zs_memory_reset_peaks(self._h))

    def fetch_stats(self):
        s = _new_struct("zs_fetch_stats")
        check(lib.zs_context_fetch_stats(self._h, s))
        return _struct_dict(s, "zs_fetch_stats")

    def coord_stats(self):
        s = _new_struct("zs_coord_stats")
        check(lib.zs_coord_get_stats(self._h, s))
        return _struct_dict(s, "zs_coord_stats")

    def step_stats(self):
        """The last optimizer step's summary: time and bytes of all-gathers,
        reduce-scatters, all-reduces and other collectives, the time the
        trainer waited for them, the update's time (zs_context_step_stats)."""
        s = _new_struct("zs_step_stats")
        check(lib.zs_context_step_stats(self._h, s))
        return _struct_dict(s, "zs_step_stats")

    def check_async_error(self):
        """Raise the first error of background work in this context, if any."""
        check(lib.zs_context_async_error(self._h))

    # -- healing -----------------------------------------------------------
    def heal_set_shared_state(self, data):
        """The state every rank has alike (bytes: loop position, scheduler),
        as of the last committed step; kept here, and handed to a
        replacement at the join (zs_heal_set_shared_state)."""
        data = bytes(data)
        check(lib.zs_heal_set_shared_state(self._h, ffi.from_buffer(data), len(data)))

    def heal_joined_state(self, which):
        """What the last join handed this rank, a replacement: which "rank"
        (its own blob, as set before step C), "shared" (the survivors'
        shared state) or "donor" (in a rank that came back at a regrow:
        the lowest survivor's own blob); bytes, or None when there was
        none."""
        kinds = {"rank": lib.ZS_HEAL_RANK_STATE, "shared": lib.ZS_HEAL_SHARED_STATE,
                 "donor": lib.ZS_HEAL_DONOR_STATE}
        if which not in kinds:
            raise ValueError(f"heal_joined_state: which {which!r}: expected 'rank', 'shared' or 'donor'")
        size = ffi.new("size_t*")
        found = ffi.new("int*")
        check(lib.zs_heal_joined_state(size, found, self._h, kinds[which], ffi.NULL, 0))
        if not found[0]:
            return None
        buf = ffi.new("char[]", max(1, int(size[0])))
        check(lib.zs_heal_joined_state(size, found, self._h, kinds[which], buf, len(buf)))
        return bytes(ffi.buffer(buf, int(size[0])))

    # -- groups ------------------------------------------------------------
    def group(self, kind="world"):
        """A handle to one of the context's groups: "world", "partition",
        "mics_shard", "mics_replica", "hpz", "mics_inter", "mics_intra"."""
        k = _code(kind, _GROUP_BY_NAME, "group kind")
        out = ffi.new("zs_group*")
        check(lib.zs_context_group(out, self._h, k))
        return Group(self, out[0])

    def new_group(self, ranks):
        """A sub-group of world ranks (collective over the world)."""
        ranks = [int(r) for r in ranks]
        arr = ffi.new("int[]", ranks)
        out = ffi.new("zs_group*")
        check(lib.zs_group_create(out, self._h, arr, len(ranks)))
        return Group(self, out[0])

    # -- params ------------------------------------------------------------
    def register(self, name, dtype, shape, init="zeros", data=None, src_rank=0, seed=0, a=0.0,
                 b=1.0, group=None):
        """Register a partitioned param; this rank keeps only its shard.

        init: "zeros", "from_rank" (data read on group rank src_rank),
        "from_all" (identical data everywhere), "normal" (mean a, std b) or
        "uniform" ([a, b)), both from seed. group: a Group, or None for the
        partition group."""
        keep = []
        if isinstance(shape, int) or hasattr(shape, "__index__"):
            shape = (int(shape),)
        shape = [int(d) for d in shape]
        o = _new_struct("zs_param_options")
        o.name = _cstr(name, keep)
        o.dtype = dtype_code(dtype)
        o.ndim = len(shape)
        shape_c = ffi.new("int64_t[]", shape if shape else [0])
        o.shape = shape_c if shape else ffi.NULL
        o.init = _code(init, _INIT_BY_NAME, "init")
        ptr, nbytes, k = _buffer(data, False, "data")
        keep.append(k)
        o.data = ptr
        o.data_bytes = nbytes
        o.src_rank = int(src_rank)
        o.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        o.a = float(a)
        o.b = float(b)
        if group is None:
            o.group = ffi.NULL
        elif isinstance(group, Group):
            o.group = group._h
        else:
            raise TypeError("group: expected a Group or None, got %s" % type(group).__name__)
        out = ffi.new("zs_param*")
        check(lib.zs_param_register(out, self._h, o))
        return Param(self, out[0])

    def fetch(self, params):
        """Gather params (one coalesced asynchronous all-gather) -> Gather."""
        arr, n, keep = _param_array(params)
        out = ffi.new("zs_gather*")
        check(lib.zs_fetch(out, self._h, arr, n))
        return Gather(self, out[0], keep)

    def release(self, params):
        """Free the full data of AVAILABLE params."""
        arr, n, _ = _param_array(params)
        check(lib.zs_release(self._h, arr, n))

    def update(self, params, modifier_rank=0):
        """GatheredParameters: broadcast the full data from modifier_rank and
        re-partition, so changes survive release (collective, blocking)."""
        arr, n, _ = _param_array(params)
        check(lib.zs_param_update(self._h, arr, n, int(modifier_rank)))

    # -- coordinator -------------------------------------------------------
    def step_begin(self):
        check(lib.zs_step_begin(self._h))

    def step_end(self, token=None):
        """End the coordinator's step (collective). With `token` (a 64-bit
        int), whether every rank passed the same token (zs_step_end_agree),
        or None where a quiet step compared nothing."""
        if token is None:
            check(lib.zs_step_end(self._h))
            return None
        same = ffi.new("int*")
        check(lib.zs_step_end_agree(self._h, int(token) & 0xFFFFFFFFFFFFFFFF, same))
        return None if same[0] < 0 else bool(same[0])

    def coord_fetch(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_coord_fetch(self._h, arr, n))

    def coord_release(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_coord_release(self._h, arr, n))

    def leaf_group(self, params):
        arr, n, _ = _param_array(params)
        check(lib.zs_leaf_group(self._h, arr, n))

    # -- training ------------------------------------------------------------
    def grad_sync(self):
        check(lib.zs_grad_sync(self._h))
        self.release_lent()

    def grad_discard(self, params):
        """torch's zero_grad between a backward and the step
        (zs_grad_discard): the gradients pushed for params since their last
        step are dropped, so the step sees only what is pushed after. No
        collective when none of them has one pushed; else a collective
        point, reached alike on every rank."""
        arr, n, _ = _param_array(params)
        check(lib.zs_grad_discard(self._h, arr, n))

    def clip_grad_norm(self, params, max_norm):
        """Sync the gradients, return the L2 norm of params' averaged
        gradients and scale their shards by max_norm / (norm + 1e-6) when it
        exceeds max_norm (zs_grad_clip_norm). Collective."""
        from .param import _param_array
        arr, n, keep = _param_array(params)
        out = ffi.new("double*")
        check(lib.zs_grad_clip_norm(self._h, arr, n, float(max_norm), out))
        self.release_lent()
        return float(out[0])

    def set_accumulation_steps(self, n):
        check(lib.zs_grad_set_accumulation_steps(self._h, int(n)))

    def save_checkpoint(self, dir, params, optimizer=None, tag=None, names=None, user_json=None,
                        timeout_ms=0, overwrite=False, update_latest=True, progress=None, async_save=False):
        """Save params (and the optimizer's state) into dir/tag, crash-safe;
        collective over the world (README, "Checkpoints"). names: what each
        param is saved under (default: registration names). user_json: text
        kept as is. progress(phase, done, total) is called on this thread.
        async_save: return once this rank's shards are staged in host memory
        and write in the background (wait_checkpoint; the next save, a load
        and close wait too). Returns the checkpoint directory."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_checkpoint_save_options")
        held = []
        o.tag = _cstr(tag, held)
        o.user_json = _cstr(user_json, held)
        o.timeout_ms = int(timeout_ms)
        o.overwrite = 1 if overwrite else 0
        o.update_latest = 1 if update_latest else 0
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        o.async_save = 1 if async_save else 0
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_checkpoint_save(self._h, arr, n, opt, os.fsencode(dir), o))
        if tag is None:
            tag = "step-%d" % (optimizer.steps if optimizer is not None else 0)
        return os.path.join(dir, tag)

    def wait_checkpoint(self):
        """Wait for the asynchronous save in flight (if any); raises its
        error, which names the checkpoint."""
        check(lib.zs_checkpoint_wait(self._h))

    def load_checkpoint(self, path, params, optimizer=None, tag=None, names=None, strict=True,
                        progress=None):
        """Load params (and the optimizer's state, step, hyper-parameters and
        loss scaler) from a checkpoint saved at any world size; collective.
        Returns {"dir", "step", "user_json", "bytes_read"}."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_checkpoint_load_options")
        held = []
        o.tag = _cstr(tag, held)
        o.strict = 1 if strict else 0
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        info = _new_struct("zs_checkpoint_info")
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_checkpoint_load(self._h, arr, n, opt, os.fsencode(path), o, info))
        out = {"dir": os.fsdecode(ffi.string(info.dir)), "step": int(info.step),
               "user_json": ffi.string(info.user_json).decode("utf-8"), "bytes_read": int(info.bytes_read)}
        if optimizer is not None:
            # The engine restored the groups' hyper-parameters; keep ours in step.
            with open(os.path.join(out["dir"], "manifest.json"), "r", encoding="utf-8") as f:
                groups = json.load(f)["optimizer"]["groups"]
            for i, g in enumerate(groups):
                h = g["hparams"]
                if i < len(optimizer._groups):
                    optimizer._groups[i] = dict(
                        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                        weight_decay=h["weight_decay"], momentum=h["momentum"], dampening=h["dampening"],
                        nesterov=bool(h["nesterov"]), bias_correction=bool(h["bias_correction"]),
                        use_muon=None if h.get("use_muon", -1) == -1 else bool(h["use_muon"]),
                        ns_method=("gram", "standard")[h.get("ns_method", 0)], ns_steps=h.get("ns_steps", 5))
        return out

    def export_safetensors(self, out_file, params, names=None, progress=None):
        """One safetensors file of the full params (gathered one at a time,
        written by rank 0); collective."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_export_options")
        held = []
        o.names = _name_array(names, n, held)
        o.progress, o.progress_user = _progress_callback(progress, held)
        check(lib.zs_export_safetensors(self._h, arr, n, os.fsencode(out_file), o))

    def load_safetensors(self, path, params, optimizer=None, names=None, strict=True, from_rank0=False,
                         progress=None):
        """Full tensors from a safetensors file, an HF index (.json) or a
        directory of them into partitioned params; each rank reads only its
        own shards' bytes. Collective."""
        arr, n, keep = _param_array(params)
        o = _new_struct("zs_safetensors_load_options")
        held = []
        o.names = _name_array(names, n, held)
        o.strict = 1 if strict else 0
        o.from_rank0 = 1 if from_rank0 else 0
        o.progress, o.progress_user = _progress_callback(progress, held)
        opt = ffi.NULL if optimizer is None else optimizer._h
        check(lib.zs_load_safetensors(self._h, arr, n, opt, os.fsencode(path), o))

    def optimizer(self, kind="adamw"):
        """A sharded optimizer: "adamw", "adam", "sgd", "muon" (DeepSpeed's
        Muon with its AdamW, each group's use_muon saying which), or
        "external" (the caller's update rule between step_begin and
        step_end)."""
        k = _code(kind, _OPTIM_BY_NAME, "optimizer kind")
        out = ffi.new("zs_optimizer*")
        check(lib.zs_optimizer_create(out, self._h, k))
        name = kind if isinstance(kind, str) else {v: n for n, v in _OPTIM_BY_NAME.items()}.get(
            k, str(k))
        return Optimizer(self, out[0], name)


MEMORY_PHASES = ("construction", "forward", "backward", "step", "checkpoint")


def _memory_phase_code(phase):
    if phase not in MEMORY_PHASES:
        raise ValueError(f"memory phase {phase!r}: expected one of {MEMORY_PHASES}")
    return MEMORY_PHASES.index(phase)


def _by_kind(fill, count, name):
    """{kind name: bytes, ..., "total": ...} from a C call filling one
    uint64 per kind of an enum of `count` kinds and their total
    (zs_memory_by_kind, zs_copied_bytes): fill(values, n, total) -> status;
    name(k) -> the kind's C name."""
    n = int(count)
    values = ffi.new("uint64_t[]", n)
    total = ffi.new("uint64_t*")
    check(fill(values, n, total))
    out = {ffi.string(name(k)).decode(): int(values[k]) for k in range(n)}
    out["total"] = int(total[0])
    return out
