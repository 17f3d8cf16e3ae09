"""Partitioned torch Parameters.

A partitioned nn.Parameter keeps its Python identity (optimisers, hooks and
user code hold it) and its model shape at all times (param_type.py): while
only the shard exists its .data is a storage-less tensor of that shape and
its values are refused by name; while it is gathered, .data is a zero-copy
view of the engine's gathered buffer (DLPack). Both are on the context's
device (a CUDA tensor on a GPU context). Its engine state lives in
`param.zs`.

`copy.deepcopy` of a partitioned Parameter (nn.TransformerEncoder clones
its layer that way, under Init or after) gives an independent partitioned
Parameter with the same values: gathered, copied, registered anew.

A partitioned Parameter that Python collects (its model and optimizer
dropped) gives its shard back to the engine, but not at once: garbage
collection runs at different times on different ranks, while the engine's
coordinator must hold the same params on every rank. Each rank notes the
params it collected; the optimizer step's agreement (zs_step_end_agree)
compares the notes, and once every rank has collected the same ones each
destroys them at that same point (see settle_dropped).
"""
import copy
import gc
import hashlib
import itertools
import weakref

import torch
import torch.utils.dlpack

import zeroshard

from . import param_type
from ._context import awaiting_join, get_context, on_shutdown, zs_dtype


class ParamState:
    """Engine state attached to a partitioned Parameter as `param.zs`."""

    __slots__ = ("zparam", "name", "shape", "dtype", "index", "stash", "owner", "device", "holds",
                 "attached", "view_ptr", "leaf", "engine", "grad_hook", "persistent", "frozen",
                 "finalizer", "init_dtype", "released", "gathered_cls", "released_cls", "saved", "used_in",
                 "scratch")

    def __init__(self, zparam, name, shape, dtype, index, device=None):
        self.zparam = zparam
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.index = index  # registration order: the same on every rank
        self.stash = None   # leaf-module gradient held until the step
        self.owner = None   # the hooked unit of the module that holds it
        self.engine = None  # the HookEngine of the model that holds it
        self.grad_hook = None  # the HookEngine whose gradient hook it carries
        self.leaf = False   # in a leaf unit: gradients are stashed until the step
        self.holds = 0      # hooked units that need it gathered now
        self.saved = 0      # forwards' saved tensors that read it by reference, not unpacked yet (saved.py)
        self.used_in = -1   # the engine's forward that last used it with gradients (repeated_use.py)
        self.attached = False  # .data is a view of the gathered buffer
        self.view_ptr = 0      # that view's address: another one means user code set .data
        self.scratch = False   # attached to a scratch tensor of a replacement's constructor (heal.py)
        self.persistent = False  # hooked, and under the persistence threshold: a release keeps it
        self.frozen = False  # frozen in the engine (freeze_untrainable): under ZeRO++, kept as quantized codes
        self.finalizer = None  # notes the zparam in _dropped when Python collects the Parameter
        self.init_dtype = dtype  # what the module built it in (bf16.enabled casts it to dtype)
        self.device = device if device is not None else torch.device(zparam.device)
        # The .data of the param while it is not gathered: its shape, 0 bytes.
        self.released = param_type.storage_less_like(shape, dtype, self.device)
        self.gathered_cls = self.released_cls = None  # its classes (param_type.classes_for)

    def __deepcopy__(self, memo):
        raise TypeError("zeroshard.torch: a param's engine state is not copied on its own; "
                        "copy.deepcopy the Parameter (or its module)")


_registered = weakref.WeakValueDictionary()  # index -> partitioned Parameter, while it lives
_indices = itertools.count()  # registration order: the same on every rank
_dropped = {}  # index -> zparam of a Parameter Python collected, not yet destroyed
_disagreements = [0]  # step ends at which the ranks' _dropped differed
_agreement = []  # (indices, agreed) of the last step end, until settle_dropped


def is_partitioned(param):
    return getattr(param, "zs", None) is not None


def quantizes_frozen(ctx=None):
    """Whether the context's config sets zero_quantized_nontrainable_weights."""
    ctx = ctx or get_context()
    return bool(ctx.config["zero_optimization"].get("zero_quantized_nontrainable_weights"))


def freeze_untrainable(params, freeze):
    """With `freeze` (ZeRO++'s zero_quantized_nontrainable_weights, or an
    inference-only model of zeroshard.hf), each partitioned param with
    requires_grad=False is frozen in the engine (zs_param_freeze): it takes
    no gradient, a peer copy for healing carries it, and under that key its
    shard is kept only as block-quantized codes and gathered as them.
    Freezing is one-way: a param frozen so and set back to
    requires_grad=True is an error (quantized, its exact values are gone).
    Without `freeze`, nothing is frozen: requires_grad can change between
    steps as in torch."""
    if not freeze:
        return
    for p in params:
        if not is_partitioned(p):
            continue
        if p.zs.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"zeroshard.torch: {p.zs.name or 'a param'} {tuple(p.zs.shape)} was frozen while "
                    f"zero_quantized_nontrainable_weights is on, so the engine keeps it only as "
                    f"quantized codes; it cannot be trained again (requires_grad was set back to True)")
        elif not p.requires_grad:
            p.zs.zparam.freeze()
            p.zs.frozen = True


def partition_param(param, name="", dtype=None, src_rank=0, ctx=None):
    """Register `param` with the engine (its values from `src_rank`) and
    drop everything but this rank's shard. Idempotent. The values are read
    where they are (host or CUDA memory); afterwards the param lives on the
    context's device."""
    if is_partitioned(param):
        return param
    gone = getattr(param, "_zs_gone", None)
    if gone is not None:
        # Its placeholder would register as an empty param: wrong values
        # with no error.
        raise RuntimeError(f"zeroshard.torch: param '{gone}' was partitioned in a context that has been shut "
                           "down (zeroshard.torch.shutdown(), or a ZeroShardStrategy set up with another "
                           "config); its values went with that context: build the model again, or load "
                           "its weights from a checkpoint into a new model")
    data = param.data
    built = data.dtype
    ctx = ctx or get_context(like=data.device)
    if dtype is not None and data.dtype != dtype:
        data = data.to(dtype)
    data = data.detach().contiguous()
    if data.device.type not in ("cpu", "cuda"):
        data = data.cpu()
    zparam = ctx.register(name, zs_dtype(data.dtype), tuple(data.shape), init="from_rank",
                          data=(data.data_ptr(), data.numel() * data.element_size()), src_rank=src_rank)
    index = next(_indices)
    param.zs = ParamState(zparam, name, tuple(data.shape), data.dtype, index)
    param.zs.init_dtype = built
    _registered[index] = param
    # The finalizer holds the zparam, so the shard outlives the Parameter
    # until settle_dropped; it runs inside the garbage collector, so it
    # only takes a note.
    param.zs.finalizer = weakref.finalize(param, _dropped.__setitem__, index, zparam)
    param.zs.finalizer.atexit = False
    # The full shape where DeepSpeed keeps it, for libraries that read it
    # from a partitioned param (PEFT sizes its adapters by it).
    param.ds_shape = torch.Size(param.zs.shape)
    param.ds_numel = param.zs.zparam.numel
    param.zs.gathered_cls, param.zs.released_cls = param_type.classes_for(type(param))
    param_type.mark_released(param)
    return param


def repartition(param, data):
    """Register `param` anew with `data`, a full value of another shape
    (rank 0's values; Hugging Face's resize_token_embeddings sets
    `embedding.weight.data` to a tensor of the new vocabulary size): its
    old shard is destroyed and the Parameter keeps its identity, hooks and
    place in its model. Collective: every rank, the same params in the same
    order. Before an optimizer is built over it (its state is by shape)."""
    old = param.zs
    ctx = get_context()
    old.finalizer.detach()
    _registered.pop(old.index, None)
    param.zs = None
    param.__class__ = param_type.unpartitioned_class(param)
    param.data = data
    partition_param(param, name=old.name, dtype=old.dtype, ctx=ctx)
    new = param.zs
    new.init_dtype = old.init_dtype
    # Its place in the hooks: the same units, and the gradient hook it carries.
    for attr in ("owner", "engine", "grad_hook", "leaf", "persistent"):
        setattr(new, attr, getattr(old, attr))
    old.zparam.close()
    return param


def registered_params():
    """The partitioned Parameters alive now, in registration order."""
    return list(_registered.values())  # indices only grow: insertion order is theirs


def dropped_token():
    """(token, indices): a 64-bit hash of the params this rank collected
    and has not destroyed yet (0: none), for the step end's agreement."""
    indices = sorted(_dropped)
    if not indices:
        return 0, indices
    digest = hashlib.blake2b(",".join(map(str, indices)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1, indices


def note_agreement(indices, agreed):
    """The step end compared dropped_token()'s token for `indices`; the
    optimizer step settles it (settle_dropped) once it holds no engine of
    a dropped model any more."""
    _agreement[:] = [(indices, agreed)]


def settle_dropped():
    """After a step end that compared the ranks' dropped params: if every
    rank had collected the same ones, destroy them, on every rank at this
    same point, which the coordinator needs. If not, some rank still holds
    a dropped model in a reference cycle its collector has not reached:
    every rank runs the collector here, at the same point, so that the
    next step end agrees. Deterministic (the answer is the same on every
    rank), and backed off (the 1st, 2nd, 4th, 8th... disagreement) in
    case a rank keeps a param alive on purpose."""
    if not _agreement:
        return
    indices, agreed = _agreement.pop()
    if agreed is None:
        return  # a quiet step compared nothing: a later step end will
    if agreed:
        for index in indices:
            _dropped.pop(index).close()
        # Settled: the back-off was for these, and the next dropped model
        # starts from the first disagreement (collected at once) again.
        _disagreements[0] = 0
        return
    _disagreements[0] += 1
    n = _disagreements[0]
    if n & (n - 1) == 0:
        gc.collect()


@on_shutdown
def forget_all():
    """The context is shut down: its params are gone with it."""
    for p in list(_registered.values()):
        p.zs.finalizer.detach()
        p._zs_gone = p.zs.name
        # Its values went with the context: an ordinary empty tensor from
        # now on, which partition_param refuses by _zs_gone.
        p.__class__ = param_type.unpartitioned_class(p)
        p.data = torch.empty(0, dtype=p.zs.dtype, device=p.zs.device)
        p.zs = None
    _registered.clear()
    _dropped.clear()
    _agreement.clear()
    _disagreements[0] = 0


def _attach(p):
    z = p.zs
    full = torch.utils.dlpack.from_dlpack(z.zparam.to_dlpack())
    param_type.mark_gathered(p, full.view(z.shape))
    z.view_ptr = p.data_ptr()
    z.attached = True


def attach_views(params, available=False):
    """Point each AVAILABLE param's .data at its gathered buffer (on the
    context's device, no copy). `available`: the caller knows they are."""
    for p in params:
        z = p.zs
        if not z.attached and (available or z.zparam.status == "AVAILABLE"):
            _attach(p)


def detach_views(params, held=False):
    """Drop views of params the engine no longer holds gathered (with
    `held`: also of those it holds, whose buffer it now owns alone and
    may release without telling, as the fetch coordinator does). A param
    whose .data user code replaced meanwhile keeps it, for adopt_assigned."""
    for p in params:
        z = p.zs
        if z.attached and (held or z.zparam.status != "AVAILABLE"):
            if p.data_ptr() == z.view_ptr:
                param_type.mark_released(p)
            z.attached = False


def assigned(p):
    """Whether user code set `p.data` to a tensor of its own since the
    engine last set it (a view, or the storage-less released tensor)."""
    z = p.zs
    if z.attached:
        return p.data_ptr() != z.view_ptr
    return p.untyped_storage().nbytes() != 0


def adopt_assigned(params):
    """`param.data = t` on a partitioned param, as every rank's code does
    alike: t becomes the param's value (this rank's shard rewritten from
    it, locally), instead of being dropped at the next gather. Returns the
    params adopted."""
    done = []
    for p in params:
        if p.zs is None or not assigned(p):
            continue
        z = p.zs
        t = param_type.raw_data(p)
        if tuple(t.shape) != z.shape:
            raise ValueError(f"zeroshard.torch: {z.name or 'a partitioned param'}: param.data was set to "
                             f"a tensor of shape {tuple(t.shape)}, expected its full shape {z.shape}")
        z.zparam.write(t.detach().to(device=z.device, dtype=z.dtype).contiguous())
        if z.attached:
            _attach(p)  # the gathered buffer holds t's values now
        else:
            param_type.mark_released(p)
        done.append(p)
    return done


def param_path(p):
    """The param's name in its model ("layers.0.self_attn.out_proj.weight")."""
    owner = p.zs.owner
    if owner is not None:
        for key, q in owner.module._parameters.items():
            if q is p:
                return f"{owner.name}.{key}" if owner.name != type(owner.module).__name__ else key
    return p.zs.name


def zparams(params):
    return [p.zs.zparam for p in params]


def optimizer_state_view(engine, zparam, slot):
    """A zero-copy fp32 torch tensor over this rank's shard of a param's
    optimizer state (on the param's device). Valid while the optimizer
    and the param live."""
    addr, n = engine.state_ptr(zparam, slot)
    device = torch.device(zparam.device)
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    return torch.utils.dlpack.from_dlpack(
        zeroshard.dlpack_from_pointer(addr, (n,), zeroshard.FLOAT32, zparam.device, owner=engine))


# -- reads of partitioned params ---------------------------------------------
constructing = []          # per running constructor under Init (innermost last): the params it read
on_forward_access = None   # set by hooks: a read while a hooked forward runs
_TOUCH_CAP_ELEMENTS = 1 << 26  # gathered at once by one constructor before older ones go back


class FetchOnAccess(dict):
    """A module's _parameters once its params are partitioned. Reading a
    param that is not gathered gathers it: inside a constructor under Init
    (a parent initialising a child's params, nn.MultiheadAttention zeroing
    out_proj.bias, HF's post_init, `for p in self.parameters()`), rank 0's
    values after the constructor are then written back to every shard;
    inside a hooked forward, see hooks.fetch_on_access."""

    __slots__ = ()

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        z = getattr(p, "zs", None)
        if z is not None and not z.attached:
            if constructing:
                _touch_in_constructor(p)
            elif on_forward_access is not None:
                on_forward_access(p)
        return p

    def items(self):
        return _touching(dict.items(self), lambda kv: kv[1]) if constructing else dict.items(self)

    def values(self):
        return _touching(dict.values(self), lambda v: v) if constructing else dict.values(self)


def _touching(view, param_of):
    for item in list(view):
        p = param_of(item)
        if getattr(p, "zs", None) is not None and not p.zs.attached:
            _touch_in_constructor(p)
        yield item


def fetch_on_access(module):
    """Make reads of `module`'s partitioned params gather them."""
    if not isinstance(module.__dict__.get("_parameters"), FetchOnAccess):
        module.__dict__["_parameters"] = FetchOnAccess(module._parameters)


def _touch_in_constructor(p):
    frame = constructing[-1]
    ctx = get_context()
    if awaiting_join(ctx):
        # A replacement of a lost rank (docs/healing.md, section 3): the
        # survivors wait in the join, so its constructors run no collective;
        # its values come from the join, so the constructor writes into a
        # scratch tensor of this process, dropped by write_back.
        z = p.zs
        param_type.mark_gathered(p, torch.empty(z.shape, dtype=z.dtype, device=z.device))
        z.view_ptr, z.attached, z.scratch = p.data_ptr(), True, True
    else:
        with ctx.fetch([p.zs.zparam]) as g:
            g.wait()
        attach_views([p])
    if p.zs.init_dtype != p.zs.dtype:
        # Cast by bf16.enabled / fp16.enabled: the constructor initialises
        # it in the dtype it built it in, as in a model built unpartitioned
        # and then cast (torch's trunc_normal_ in bf16 saturates erfinv and
        # clamps values to its bounds); write_back rounds the result.
        p.data = p.data.to(p.zs.init_dtype)
    frame.append(p)
    if sum(q.zs.zparam.numel for q in frame) > _TOUCH_CAP_ELEMENTS:
        write_back(frame[:-1])
        del frame[:-1]


def write_back(params):
    """Rank 0's values of gathered `params` into every rank's shard, then
    release them. Collective."""
    gathered = []
    for p in params:
        if p.zs.scratch:  # a replacement's: nothing gathered, nothing written
            p.zs.scratch = False
            param_type.mark_released(p)
            p.zs.attached = False
        else:
            gathered.append(p)
    params = gathered
    if not params:
        return
    for p in params:
        # `param.data = t` in the constructor (Hugging Face's init of ViT's
        # position embeddings: trunc_normal_ of an fp32 copy, cast back):
        # t's values into the gathered buffer, which the update reads.
        if p.zs.attached and assigned(p):
            t = p.data
            if tuple(t.shape) != p.zs.shape:
                raise ValueError(f"zeroshard.torch: {p.zs.name or 'a partitioned param'}: param.data was set "
                                 f"to a tensor of shape {tuple(t.shape)} in a constructor, expected its full "
                                 f"shape {p.zs.shape}")
            _attach(p)
            p.data.copy_(t)
    ctx = get_context()
    ctx.update(zparams(params), 0)
    ctx.release(zparams(params))
    for p in params:
        p.zs.attached = True  # the view is stale whatever the status says
    detach_views(params)


# Attributes torch keeps on a tensor for its own hooks: the copy gets its
# own (the copied model's hooks register them again).
_NOT_COPIED = ("zs", "_post_accumulate_grad_hooks", "_backward_hooks")


def _deepcopy_partitioned(param, memo):
    """An independent partitioned copy of `param`, with its values.
    Collective: every rank copies the same params in the same order."""
    with GatheredParameters([param]):
        full = param.data.detach().clone()
    result = param_type.unpartitioned_class(param)(full, param.requires_grad)
    memo[id(param)] = result
    for k, v in param.__dict__.items():
        if k not in _NOT_COPIED:
            setattr(result, k, copy.deepcopy(v, memo))
    # In the param's own dtype: a constructor initialising it may hold it
    # in the dtype it was built in (_touch_in_constructor).
    partition_param(result, name=param.zs.name, dtype=param.zs.dtype, ctx=get_context())
    result.zs.init_dtype = param.zs.init_dtype
    return result


_torch_param_deepcopy = torch.nn.Parameter.__deepcopy__


def _param_deepcopy(self, memo):
    if id(self) in memo:
        return memo[id(self)]
    if getattr(self, "zs", None) is not None:
        return _deepcopy_partitioned(self, memo)
    return _torch_param_deepcopy(self, memo)


torch.nn.Parameter.__deepcopy__ = _param_deepcopy


_torch_module_apply = torch.nn.Module._apply


def _module_apply(module, fn, *args, **kwargs):
    """nn.Module._apply (behind .to(), .half(), .cuda(), ...) refuses to
    convert a partitioned param to another dtype or device, naming it:
    the engine holds its shards, so converting what the param shows
    would silently leave the engine's dtype in place."""
    for name, p in module.__dict__.get("_parameters", {}).items():
        z = getattr(p, "zs", None)
        if z is None:
            continue
        probe = fn(torch.empty(0, dtype=z.dtype, device=z.device))
        if probe.dtype != z.dtype or probe.device != z.device:
            raise RuntimeError(
                f"zeroshard.torch: {type(module).__name__}.{name} is partitioned as {z.dtype} on {z.device}; "
                f"converting it to {probe.dtype} on {probe.device} is not supported: build the module in "
                "that dtype (its dtype= argument, torch.set_default_dtype, zeroshard.torch.Init(dtype=...)) "
                "or convert it before it is partitioned")
    return _torch_module_apply(module, fn, *args, **kwargs)


torch.nn.Module._apply = _module_apply


class GatheredParameters:
    """Gather `params` for the block. With modifier_rank set, what that rank
    changed in them is broadcast to every rank and re-partitioned on exit;
    with None, changes are discarded. Collective.

        with GatheredParameters(model.fc.weight, modifier_rank=0):
            if rank == 0:
                model.fc.weight.fill_(1.0)
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if not isinstance(params, (list, tuple)):
            params = [params]
        self.params = [p for p in params if is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._fetched = []

    def __enter__(self):
        if not self.enabled:
            return self
        ctx = get_context()
        status = [p.zs.zparam.status for p in self.params]
        self._fetched = [p for p, s in zip(self.params, status) if s == "NOT_AVAILABLE"]
        if self._fetched:
            with ctx.fetch(zparams(self._fetched)) as g:
                g.wait()
        # Persistent params the coordinator is gathering again after an
        # optimizer step: wait for that gather (they stay the coordinator's).
        inflight = [p for p, s in zip(self.params, status) if s == "INFLIGHT"]
        if inflight:
            ctx.coord_fetch(zparams(inflight))
        attach_views(self.params)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        ctx = get_context()
        if self.modifier_rank is not None and exc[0] is None:
            ctx.update(zparams(self.params), self.modifier_rank)
        if self._fetched:
            ctx.release(zparams(self._fetched))
            detach_views(self._fetched)
        return False


def persistent_buffers(model):
    """(name, buffer) of the model's persistent buffers, those its
    state_dict holds. Not from state_dict()'s keys: that would gather every
    param to list them."""
    persistent = {f"{prefix}.{name}" if prefix else name
                  for prefix, m in model.named_modules(remove_duplicate=False)
                  for name, b in m._buffers.items() if b is not None and name not in m._non_persistent_buffers_set}
    return [(n, b) for n, b in model.named_buffers() if n in persistent]
