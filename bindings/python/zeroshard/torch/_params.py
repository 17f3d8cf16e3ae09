"""Partitioned torch Parameters.

A partitioned nn.Parameter keeps its Python identity (optimisers, hooks and
user code hold it), but its .data is an empty tensor while only the shard
exists, and a zero-copy view of the engine's gathered buffer (DLPack) while
it is gathered. Its engine state lives in `param.zs`.
"""
import torch
import torch.utils.dlpack

from ._context import get_context, zs_dtype


class ParamState:
    """Engine state attached to a partitioned Parameter as `param.zs`."""

    __slots__ = ("zparam", "shape", "dtype", "index", "stash", "owner")

    def __init__(self, zparam, shape, dtype, index):
        self.zparam = zparam
        self.shape = shape
        self.dtype = dtype
        self.index = index  # registration order: the same on every rank
        self.stash = None   # leaf-module gradient held until the step
        self.owner = None   # the hooked unit that fetches it


_registered = []  # every partitioned Parameter, in registration order


def is_partitioned(param):
    return getattr(param, "zs", None) is not None


def partition_param(param, name="", dtype=None, src_rank=0, ctx=None):
    """Register `param` with the engine (its values from `src_rank`) and
    drop everything but this rank's shard. Idempotent."""
    if is_partitioned(param):
        return param
    ctx = ctx or get_context()
    data = param.data
    if dtype is not None and data.dtype != dtype:
        data = data.to(dtype)
    data = data.detach().contiguous().cpu()
    zparam = ctx.register(name, zs_dtype(data.dtype), tuple(data.shape), init="from_rank",
                          data=(data.data_ptr(), data.numel() * data.element_size()), src_rank=src_rank)
    param.zs = ParamState(zparam, tuple(data.shape), data.dtype, len(_registered))
    _registered.append(param)
    param.data = torch.empty(0, dtype=data.dtype)
    return param


def registered_params():
    return list(_registered)


def forget_all():
    for p in _registered:
        p.zs = None
    _registered.clear()


def attach_views(params):
    """Point each AVAILABLE param's .data at its gathered buffer."""
    for p in params:
        if p.data.numel() == 0 and p.zs.zparam.status == "AVAILABLE":
            full = torch.utils.dlpack.from_dlpack(p.zs.zparam.to_dlpack())
            p.data = full.view(p.zs.shape)


def detach_views(params):
    """Drop views of params the engine no longer holds gathered."""
    for p in params:
        if p.zs.zparam.status != "AVAILABLE":
            p.data = torch.empty(0, dtype=p.zs.dtype)


def zparams(params):
    return [p.zs.zparam for p in params]
