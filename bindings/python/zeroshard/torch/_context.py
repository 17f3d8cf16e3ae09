"""The process's zeroshard context for PyTorch code.

One context per process, created on first use: from torch.distributed when
it is initialised (rank, world size, and a store port agreed through it, so
the engine's store never collides with torch's own on MASTER_PORT), else
from the launcher's environment (torchrun, zsrun, Open MPI, Slurm). Under
torchrun without a process group, MASTER_PORT belongs to torchrun's own
store, so the port is agreed through that store instead.
"""
import datetime
import os
import socket

import torch
import torch.distributed as dist

import zeroshard

_context = None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_context(config=None, timeout_ms=0, **kwargs):
    """Create the process's context (collective over the world).

    config: a DeepSpeed config as dict, JSON text or path. Extra keyword
    arguments go to zeroshard.Context. Returns the context.
    """
    global _context
    if _context is not None:
        raise RuntimeError("zeroshard.torch: the context already exists; call shutdown() first")
    if dist.is_available() and dist.is_initialized():
        kwargs.setdefault("rank", dist.get_rank())
        kwargs.setdefault("world_size", dist.get_world_size())
        if dist.get_world_size() > 1 and "store_port" not in kwargs and "file_store_path" not in kwargs:
            port = [_free_port() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(port, src=0)
            kwargs["store_port"] = port[0]
            kwargs.setdefault("store_host", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    elif _under_torchrun() and "store_port" not in kwargs and "file_store_path" not in kwargs:
        kwargs["store_port"] = _port_through_torchrun_store()
        kwargs.setdefault("store_host", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    _context = zeroshard.Context(config=config, timeout_ms=timeout_ms, **kwargs)
    return _context


def _under_torchrun():
    # zsrun sets torchrun's variables too, but leaves MASTER_PORT to us.
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("ZS_LAUNCHER") != "zsrun"


def _port_through_torchrun_store():
    """Rank 0 picks a free port and publishes it in torchrun's store."""
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=300))
    key = f"zeroshard/store_port/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ["RANK"]) == 0:
        store.set(key, str(_free_port()))
    return int(store.get(key))


def get_context(config=None):
    """The process's context, created with `config` if it does not exist."""
    if _context is None:
        return init_context(config=config)
    return _context


def shutdown():
    """Destroy the process's context and every param registered in it."""
    global _context
    if _context is not None:
        _context.close()
        _context = None


_TORCH_TO_ZS = {torch.float32: zeroshard.FLOAT32, torch.bfloat16: zeroshard.BFLOAT16,
                torch.float16: zeroshard.FLOAT16}


def zs_dtype(dtype):
    try:
        return _TORCH_TO_ZS[dtype]
    except KeyError:
        raise TypeError(f"zeroshard partitions float32, bfloat16 and float16 params, not {dtype}") from None
