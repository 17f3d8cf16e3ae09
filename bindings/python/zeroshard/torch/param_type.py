"""The type of a partitioned Parameter: a real tensor of the model's shape.

A partitioned param keeps its Python identity and its model shape, dtype,
device and `ndim` at all times. What changes between gathers is its
storage, as in FSDP2:

- gathered: its class is `Partitioned<C>` (C: the class the module built it
  as, nn.Parameter or a subclass), which behaves exactly as C (torch
  functions go straight to C++), and its `.data` is a zero-copy view of the
  engine's gathered buffer;
- released: its `.data` is a tensor of the full shape whose storage holds 0
  bytes (allocated once per param, freed at once), and its class is
  `Released<C>`, which answers what needs no values (shape, size(), ndim,
  dtype, device, numel(), views, zeros_like, hooks, requires_grad_, no-op
  .to()) and refuses every read or write of values with an error naming
  the param. A bare storage-less tensor would crash the process on its
  first read (FSDP2's released params do); a stale or empty one would give
  wrong numbers silently. Views and `.data`/`.detach()` of a released param
  are `ReleasedTensor`s, which refuse the same way.

Swapping the class costs one attribute store per gather and release, and a
gathered param carries no Python `__torch_function__`: the forward, the
backward and torch.compile's graphs see an ordinary Parameter (compile
guards on its shape, dtype and stride, which never change).

For code written for DeepSpeed, `ds_shape` and `ds_numel` are attributes
(set when the param is partitioned) and `ds_tensor` is this rank's shard
as a 1-D tensor over the engine's memory (no copy).
"""
import torch
import torch.utils.dlpack

_DisableSubclass = torch._C.DisableTorchFunctionSubclass

# Methods that read only metadata (or make tensors of the same metadata):
# their result needs no values of the param.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous",
    "storage_offset", "data_ptr", "untyped_storage", "get_device", "is_floating_point", "is_complex",
    "is_signed", "__hash__", "__len__", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "_is_view", "is_pinned", "is_shared",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided",
    "dim_order", "is_inference", "is_conj", "is_neg", "_is_zerotensor", "is_nested", "is_quantized",
    "is_sparse", "is_mkldnn", "is_meta", "_has_compatible_shallow_copy_type",
}
# Views: their result is released too (a ReleasedTensor).
_VIEWS = {
    "detach", "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "chunk", "split",
    "unbind", "movedim", "swapaxes", "swapdims", "alias",
}
# Conversions: allowed when they convert nothing (module.to() on the
# device and dtype the param already has), refused otherwise.
_CONVERSIONS = {"to", "type", "cpu", "cuda", "float", "double", "half", "bfloat16"}


def _name(func):
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return f"{getattr(owner, '__name__', '?')}.{name}"
    return name


def _storage_less(t):
    return (isinstance(t, torch.Tensor) and t.numel() != 0
            and t.untyped_storage().nbytes() == 0)


def _wrap_released(result, state):
    """Released views stay released: a ReleasedTensor that names `state`."""
    if isinstance(result, (tuple, list)):
        return type(result)(_wrap_released(r, state) for r in result)
    if _storage_less(result) and not isinstance(result, _Released):
        result = result.as_subclass(ReleasedTensor)
        result._zs_of = state
    return result


def _released_view(func, t, args, kwargs):
    """A view of a released tensor: torch checks a view's bounds against
    its storage (0 bytes), so the view's geometry comes from a meta tensor
    like t, and the result is a storage-less tensor of that geometry."""
    z = _state_of(args)
    with _DisableSubclass():
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        out = func(meta, *args[1:], **kwargs)

        def released(m):
            return storage_less_like(m.shape, m.dtype, t.device, m.stride())
        out = type(out)(released(m) for m in out) if isinstance(out, (tuple, list)) else released(out)
    return _wrap_released(out, z)


def _state_of(args):
    """The ParamState of the first released param (or view of one) in args."""
    for a in args:
        if isinstance(a, torch.Tensor):
            z = getattr(a, "zs", None) or getattr(a, "_zs_of", None)
            if z is not None:
                return z
    return None


def _describe(z, shape, dtype):
    name = f"'{z.name}' " if z is not None and z.name else ""
    return f"{name}{tuple(shape)} {str(dtype).replace('torch.', '')}"


def _refuse(func, z, t):
    return RuntimeError(
        f"zeroshard.torch: param {_describe(z, t.shape, t.dtype)} is partitioned and not gathered now, so "
        f"{_name(func)} has no values to read or write: they live in the engine's shards. Read or change "
        f"them inside `with zeroshard.torch.GatheredParameters(params, modifier_rank=...)` (on every "
        f"rank), or use model.state_dict() / load_state_dict() / "
        f"zeroshard.torch.consolidated_state_dict(model)")


def _converts(func, t, args, kwargs):
    """Whether a conversion would change t's dtype or device (tried on an
    empty tensor like it)."""
    with _DisableSubclass():
        probe = torch.empty(0, dtype=t.dtype, device=t.device)
        out = getattr(probe, _name(func))(*args[1:], **kwargs)
    if isinstance(out, str):  # t.type() with no argument: the type's name
        return False
    return out.dtype != t.dtype or out.device != t.device


# Properties that never return a tensor of the param's storage: answered
# first (the hooks read requires_grad and shape of released params every step).
_PLAIN_GETTERS = frozenset(getattr(torch.Tensor, n).__get__ for n in (
    "requires_grad", "shape", "dtype", "device", "ndim", "is_leaf", "grad_fn", "_version", "is_cuda",
    "is_cpu", "is_meta", "layout", "grad", "_base", "itemsize", "nbytes", "names", "is_sparse",
    "is_quantized", "_backward_hooks", "_post_accumulate_grad_hooks"))


class _Released:
    """What released params and their views do with torch functions."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _PLAIN_GETTERS:
            with _DisableSubclass():
                return func(*args)
        kwargs = kwargs or {}
        name = _name(func)
        with _DisableSubclass():
            this = args[0] if args and isinstance(args[0], torch.Tensor) else None
            # Values written into it (`param.data = t` by user code, adopted at
            # the next step): an ordinary tensor until then.
            if this is not None and not _storage_less(this) and isinstance(this, _Released):
                return func(*args, **kwargs)
        if "." in name:  # a property ("data.__get__"): every getter and setter reads metadata only
            with _DisableSubclass():
                result = func(*args, **kwargs)
            return _wrap_released(result, _state_of(args))
        if name in ("__repr__", "__str__"):
            return _repr(args[0])
        if name == "__format__":
            return format(_repr(args[0]), *args[1:])
        if name in _METADATA:
            with _DisableSubclass():
                return func(*args, **kwargs)
        if name in _VIEWS:
            return _released_view(func, this, args, kwargs)
        z = _state_of((*args, *kwargs.values()))  # torch.nn.init passes the tensor by keyword
        if name in _CONVERSIONS and this is not None and not _converts(func, this, args, kwargs):
            return args[0]
        if name == "copy_" and len(args) >= 2 and z is not None and _state_of(args[1:2]) is z:
            return args[0]  # a released param copied onto itself (load_state_dict after our pre-hook)
        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, _Released) and _storage_less(a)), this)
        raise _refuse(func, z, t)


def _repr(t):
    z = getattr(t, "zs", None) or getattr(t, "_zs_of", None)
    kind = "Parameter" if isinstance(t, torch.nn.Parameter) else "tensor"
    name = f" '{z.name}'" if z is not None and z.name else ""
    with _DisableSubclass():
        shape, dtype, device = tuple(t.shape), t.dtype, t.device
    return (f"{kind}{name} partitioned by zeroshard (size={shape}, dtype={dtype}, device={device}): "
            f"not gathered; read it inside zeroshard.torch.GatheredParameters")


class ReleasedTensor(_Released, torch.Tensor):
    """A view, `.data` or `.detach()` of a released partitioned param."""


def _ds_tensor(self):
    """This rank's shard (DeepSpeed's `param.ds_tensor`): 1-D, the param's
    dtype, over the engine's memory (no copy); padded to the shard size."""
    return torch.utils.dlpack.from_dlpack(self.zs.zparam.shard_dlpack())


_classes = {}  # the class a module built a param as -> (gathered class, released class)


def classes_for(cls):
    """(Partitioned<cls>, Released<cls>) for a Parameter class."""
    for pair in _classes.values():
        if cls in pair:  # already a partitioned class
            return pair
    pair = _classes.get(cls)
    if pair is None:
        gathered = type(f"Partitioned{cls.__name__}", (cls,), {
            "__module__": __name__, "ds_tensor": property(_ds_tensor),
            "__doc__": f"A {cls.__name__} partitioned by zeroshard, gathered now (see zeroshard.torch.param_type)."})
        released = type(f"Released{cls.__name__}", (_Released, gathered), {
            "__module__": __name__, "__repr__": _repr,
            "__doc__": f"A {cls.__name__} partitioned by zeroshard, not gathered now: its values are refused."})
        pair = _classes[cls] = (gathered, released)
    return pair


def storage_less_like(shape, dtype, device, stride=None):
    """A tensor of `shape` (contiguous, or `stride`) whose storage holds 0
    bytes: what a released param's .data is (made once per param), and its
    views."""
    t = (torch.empty(shape, dtype=dtype, device=device) if stride is None else
         torch.empty_strided(shape, stride, dtype=dtype, device=device))
    t.untyped_storage().resize_(0)
    return t


def mark_gathered(param, data):
    """`param` shows `data` (the gathered buffer's view) from now on."""
    param.__class__ = param.zs.gathered_cls
    param.data = data


def mark_released(param):
    """`param` holds no values from now on (its storage-less tensor)."""
    param.__class__ = param.zs.gathered_cls
    param.data = param.zs.released
    param.__class__ = param.zs.released_cls


def unpartitioned_class(param):
    """The class `param` was built as, before it was partitioned."""
    for cls, (gathered, released) in _classes.items():
        if type(param) in (gathered, released):
            return cls
    return type(param)


def raw_data(param):
    """param.data as an ordinary tensor, whatever its state (for the
    engine's own bookkeeping: no refusal)."""
    with _DisableSubclass():
        return param.data
