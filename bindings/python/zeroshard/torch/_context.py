"""The process's zeroshard context for PyTorch code.

One context per process, created on first use: from torch.distributed when
it is initialised (rank, world size, and a store port agreed through it, so
the engine's store never collides with torch's own on MASTER_PORT), else
from the launcher's environment (torchrun, zsrun, Open MPI, Slurm).

Launch order does not matter: torch.distributed may be initialised before
or after the context, because the engine's store never takes MASTER_PORT:
- torch.distributed initialised first: a free port, broadcast through it;
- torchrun: a free port, published in torchrun's own store (which holds
  MASTER_PORT);
- zsrun: ZS_STORE_PORT, a second free port zsrun exports (the engine
  reads it before MASTER_PORT);
- anything else (Slurm, Open MPI, variables set by hand): ZS_STORE_PORT if
  set, else MASTER_PORT + 1 (MASTER_PORT - 1 when MASTER_PORT is 65535;
  29501 without MASTER_PORT), leaving MASTER_PORT to torch.distributed.

Device: the context lives where the model does. Unless a device is named
(the `device` argument, the config's "device" key, or $ZS_DEVICE), the
context is created on the device of the first params it partitions: "cpu"
for a model built on the host (even on a machine with a GPU), "cuda:N" for
one built on GPU N. Params then live on the context's device: their full
data is a zero-copy view of the engine's memory there.
"""
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

import zeroshard

from .._ffi import ZS_EXIT_NOT_TAKEN as EXIT_NOT_TAKEN
from ._malloc import fix_mmap_threshold

_context = None
# zeroshard.torch.enable_healing() was called: ZS_HEAL=auto keeps the peer
# copies on (heal.py), for a program that trains with healing_loop.
heal_wanted = [False]
# Why the frontend in use cannot heal (a frontend's sentence), said in
# place of the general line when ZS_HEAL=auto turns the copies off.
heal_declined = [None]
replacement_joined = [False]  # this process replaced a lost rank and joined (heal.join_as_replacement)
_pending = []  # (config, device) of the Init blocks entered before the context exists
# Called in order, with no argument, once shutdown() closed the context: the
# modules that keep state of the context register here (on_shutdown), so
# that this module imports none of them.
_shutdown_callbacks = []
# What the modules above this one keep of the context (hook_state.HookState), by
# class (context_state): one object of each, made on first use, for the
# context in `_context` or, while there is none, for the one get_context()
# creates next (a forward's hooks note their step before they create the
# context). Each owner drops its own in an on_shutdown callback
# (drop_context_state), and says there what outlives the context.
_context_state = {}


def heals(ctx):
    """Whether the context keeps peer copies (zeroshard.healing.peer_copy
    resolved on), i.e. a loss can be healed."""
    return bool(ctx.config.get("zeroshard", {}).get("healing", {}).get("peer_copy"))


def is_replacement():
    """zsrun started this process in a lost rank's place (ZS_HEAL_REPLACEMENT)."""
    return os.environ.get("ZS_HEAL_REPLACEMENT", "") not in ("", "0")


def awaiting_join(ctx):
    """This process replaces a lost rank and has not joined yet: the
    survivors wait in the join, so it runs nothing collective (its
    constructors' reads of partitioned params stay local: _params)."""
    return not replacement_joined[0] and is_replacement() and heals(ctx)


def on_shutdown(fn):
    """Call fn() after shutdown() closed the context (every later shutdown,
    in registration order). Returns fn."""
    _shutdown_callbacks.append(fn)
    return fn


def context_state(cls):
    """The context's `cls` object, made by cls() on first use: the state a
    module keeps of the process's context, or before there is a context,
    of the next one created (the two are one object). It lasts until its
    owner drops it (drop_context_state, from an on_shutdown callback)."""
    state = _context_state.get(cls)
    if state is None:
        state = _context_state[cls] = cls()
    return state


def drop_context_state(cls):
    """Forget the context's `cls` object (the next context_state(cls) makes
    a new one); returns it, or None when none was made."""
    return _context_state.pop(cls, None)


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
    if "store_port" in kwargs or "file_store_path" in kwargs:
        pass
    elif os.environ.get("ZS_STORE_SERVER") == "external":
        # The launcher serves the store (zsrun --restarts: zsstore at
        # ZS_STORE_PORT, which the engine reads): that one, no other.
        kwargs.setdefault("store_host", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    elif dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            port = [_free_port() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(port, src=0)
            kwargs["store_port"] = port[0]
            kwargs.setdefault("store_host", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    elif _under_torchrun():
        kwargs["store_port"] = _port_through_torchrun_store()
        kwargs.setdefault("store_host", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    else:
        port = _port_beside_master_port()
        if port is not None:
            kwargs["store_port"] = port
    _heal_auto_only_where_wanted()
    try:
        _context = zeroshard.Context(config=config, timeout_ms=timeout_ms, **kwargs)
    except zeroshard.NotTakenError as e:
        # A replacement or a rank started to grow back that the job went on
        # without: not a failure (zsrun counts the rank as leaving).
        print(f"zeroshard.torch: {e}; exiting with status {EXIT_NOT_TAKEN}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_NOT_TAKEN) from e
    fix_mmap_threshold()  # large freed tensors go back to the system (_malloc.py)
    return _context


def _heal_auto_only_where_wanted():
    """zsrun --restarts exports ZS_HEAL=auto: peer copies on wherever they
    can act. A Python loop heals through zeroshard.torch.healing_loop,
    zeroshard.hf.Trainer or the Lightning strategy under automatic
    optimization (both call enable_healing() themselves; an Accelerate
    script through zeroshard.hf.Accelerator); elsewhere the copies would cost every step
    for a loss that restarts the job anyway: off here, said once, unless the
    program called enable_healing() first.
    ZS_HEAL=1 or a config that turns the copies on is the user's choice and
    stays."""
    if os.environ.get("ZS_HEAL") != "auto" or heal_wanted[0]:
        return
    os.environ["ZS_HEAL"] = "0"
    if os.environ.get("RANK", "0") != "0":
        return
    if heal_declined[0] is not None:
        print(f"{heal_declined[0]}: no peer copies under ZS_HEAL=auto; a lost rank restarts the job from its last "
              "checkpoint", file=sys.stderr)
    else:
        print("zeroshard.torch: no peer copies under ZS_HEAL=auto: a lost rank restarts the job from its "
              "last checkpoint, as before (what heals in place: zeroshard.hf.Trainer and Accelerator, the "
              "Lightning strategy, and a loop that trains "
              "with zeroshard.torch.healing_loop and calls zeroshard.torch.enable_healing() before the "
              "context is created)", file=sys.stderr)


def _under_torchrun():
    # zsrun sets torchrun's variables too, but leaves MASTER_PORT to us.
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("ZS_LAUNCHER") != "zsrun"


def _port_beside_master_port():
    """The engine's store port when no launcher gave one: None when
    ZS_STORE_PORT is set (the engine reads it), else the port next to
    MASTER_PORT, so that torch.distributed keeps MASTER_PORT (for Slurm and
    other launchers that set only MASTER_PORT). A malformed MASTER_PORT is
    left to the engine, which names it."""
    if os.environ.get("ZS_STORE_PORT"):
        return None
    try:
        master = int(os.environ.get("MASTER_PORT") or 29500)
    except ValueError:
        return None
    if not 1 <= master <= 65535:
        return None
    return master + 1 if master < 65535 else master - 1


def _port_through_torchrun_store():
    """Rank 0 picks a free port and publishes it in torchrun's store."""
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=300))
    key = f"zeroshard/store_port/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ["RANK"]) == 0:
        store.set(key, str(_free_port()))
    return int(store.get(key))


def get_context(config=None, device=None, like=None):
    """The process's context, created if it does not exist yet.

    It is created with `config`, on `device` if given, else on the device
    the config or $ZS_DEVICE names, else on the device of `like` (a
    torch.device or tensor: where the params to partition live), else where
    the engine chooses (this rank's GPU when there is one). An existing
    context (or one just created on the config's or $ZS_DEVICE's device)
    whose device differs from `device`, or from a CUDA `like`, raises
    RuntimeError: it cannot hold those params where they are.
    """
    if _context is None and config is None and device is None and _pending:
        config, device = _pending[-1]  # inside an Init block: its config and device
    if _context is None:
        where = None
        if device is not None:
            where = torch_device_string(device)
        elif like is not None and not device_configured(config):
            where = torch_device_string(_device_of(like))
        init_context(config=config, device=where)
    if device is not None:
        want = torch_device_string(device)
        if want != _context.device:
            raise RuntimeError(f"zeroshard.torch: the context is on {_context.device}, not on {want}; "
                               "one process has one context, on one device (call shutdown() first to "
                               "start over on another)")
    if like is not None:
        have = _device_of(like)
        if have.type == "cuda" and torch_device_string(have) != _context.device:
            raise RuntimeError(f"zeroshard.torch: params on {torch_device_string(have)}, but the zeroshard "
                               f"context is on {_context.device}: build the model on {_context.device}, or "
                               "create the context on the model's device (zeroshard.torch.Init(device=...), "
                               "partition_module(..., device=...), the config's \"device\" key or ZS_DEVICE)")
    return _context


def _device_of(like):
    if isinstance(like, torch.device):
        return like
    if torch.is_tensor(like):
        return like.device
    return torch.device(like)


def torch_device_string(device):
    """The engine's name ("cpu", "cuda:N") of a torch device or device
    string. torch's "cuda" without an index is the current CUDA device,
    as torch itself reads it."""
    if isinstance(device, torch.device):
        d = device
    else:
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            return str(device)  # the engine names what is wrong with it
    if d.type == "cuda":
        if d.index is not None:
            return f"cuda:{d.index}"
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "cuda"  # the engine says why CUDA cannot be used
    if d.type == "cpu":
        return "cpu"
    raise ValueError(f"zeroshard.torch: params on {d}; the engine runs on \"cpu\" or \"cuda\" devices")


def default_device():
    """Where torch creates tensors now (torch.set_default_device, or a
    `with torch.device(...)` block), as a torch.device."""
    return torch.empty(0).device


def device_configured(config):
    """True when the config's "device" key or $ZS_DEVICE names the device."""
    if os.environ.get("ZS_DEVICE"):
        return True
    try:
        if config is None:
            return False
        if isinstance(config, (str, bytes, os.PathLike)) and not isinstance(config, bytes):
            text = os.fspath(config)
            if not text.lstrip().startswith("{"):
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            config = json.loads(text)
        elif isinstance(config, bytes):
            config = json.loads(config.decode("utf-8"))
        return hasattr(config, "get") and config.get("device") not in (None, "")
    except (OSError, ValueError, TypeError):
        return False  # the engine reports a bad config itself


def current_context():
    """The process's context, or None when there is none (get_context
    creates one)."""
    return _context


def shutdown():
    """Destroy the process's context and every param registered in it.
    Partitioned Parameters are forgotten (their .zs is dropped): they hold
    no values any more, and a new context starts from scratch."""
    global _context
    if _context is not None:
        try:
            _context.wait_checkpoint()  # an asynchronous save's error is raised, not only printed
            _context.close()
        finally:
            _context = None
            for fn in list(_shutdown_callbacks):
                fn()


_TORCH_TO_ZS = {torch.float32: zeroshard.FLOAT32, torch.bfloat16: zeroshard.BFLOAT16,
                torch.float16: zeroshard.FLOAT16}


def working_dtype(ctx=None):
    """The dtype floating params are partitioned in under the context's
    config: torch.bfloat16 with bf16.enabled, torch.float16 with
    fp16.enabled, else None (each param keeps the dtype it was built in).
    As under DeepSpeed, whose engine casts the model to the config's
    16-bit dtype; the optimizer keeps fp32 masters of such params."""
    ctx = ctx or get_context()
    cached = getattr(ctx, "_zs_working_dtype", False)
    if cached is False:
        config = ctx.config
        cached = (torch.bfloat16 if config.get("bf16", {}).get("enabled") else
                  torch.float16 if config.get("fp16", {}).get("enabled") else None)
        ctx._zs_working_dtype = cached
    return cached


def zs_dtype(dtype):
    try:
        return _TORCH_TO_ZS[dtype]
    except KeyError:
        raise TypeError(f"zeroshard partitions float32, bfloat16 and float16 params, not {dtype}") from None
