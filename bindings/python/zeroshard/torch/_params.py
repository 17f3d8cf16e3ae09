"""Partitioned torch Parameters.

A partitioned nn.Parameter keeps its Python identity (optimisers, hooks and
user code hold it), but its .data is an empty tensor while only the shard
exists, and a zero-copy view of the engine's gathered buffer (DLPack) while
it is gathered. Both are on the context's device (a CUDA tensor on a GPU
context). Its engine state lives in `param.zs`.
"""
import torch
import torch.utils.dlpack

import zeroshard

from ._context import get_context, zs_dtype


class ParamState:
    """Engine state attached to a partitioned Parameter as `param.zs`."""

    __slots__ = ("zparam", "shape", "dtype", "index", "stash", "owner", "device")

    def __init__(self, zparam, shape, dtype, index, device=None):
        self.zparam = zparam
        self.shape = shape
        self.dtype = dtype
        self.index = index  # registration order: the same on every rank
        self.stash = None   # leaf-module gradient held until the step
        self.owner = None   # the hooked unit that fetches it
        self.device = device if device is not None else torch.device(zparam.device)

    def placeholder(self):
        """The empty .data of a param that is not gathered."""
        return torch.empty(0, dtype=self.dtype, device=self.device)


_registered = []  # every partitioned Parameter, in registration order


def is_partitioned(param):
    return getattr(param, "zs", None) is not None


def partition_param(param, name="", dtype=None, src_rank=0, ctx=None):
    """Register `param` with the engine (its values from `src_rank`) and
    drop everything but this rank's shard. Idempotent. The values are read
    where they are (host or CUDA memory); afterwards the param lives on the
    context's device."""
    if is_partitioned(param):
        return param
    data = param.data
    ctx = ctx or get_context(like=data.device)
    if dtype is not None and data.dtype != dtype:
        data = data.to(dtype)
    data = data.detach().contiguous()
    if data.device.type not in ("cpu", "cuda"):
        data = data.cpu()
    zparam = ctx.register(name, zs_dtype(data.dtype), tuple(data.shape), init="from_rank",
                          data=(data.data_ptr(), data.numel() * data.element_size()), src_rank=src_rank)
    param.zs = ParamState(zparam, tuple(data.shape), data.dtype, len(_registered))
    _registered.append(param)
    param.data = param.zs.placeholder()
    return param


def registered_params():
    return list(_registered)


def forget_all():
    for p in _registered:
        p.zs = None
    _registered.clear()


def attach_views(params):
    """Point each AVAILABLE param's .data at its gathered buffer (on the
    context's device, no copy)."""
    for p in params:
        if p.data.numel() == 0 and p.zs.zparam.status == "AVAILABLE":
            full = torch.utils.dlpack.from_dlpack(p.zs.zparam.to_dlpack())
            p.data = full.view(p.zs.shape)


def detach_views(params):
    """Drop views of params the engine no longer holds gathered."""
    for p in params:
        if p.zs.zparam.status != "AVAILABLE":
            p.data = p.zs.placeholder()


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
