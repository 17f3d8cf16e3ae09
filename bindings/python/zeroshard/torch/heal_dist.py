"""torch.distributed's default group over the engine's world group, for
programs that heal in place (docs/healing.md, section 3, "torch.distributed").

A Hugging Face Trainer gathers through torch.distributed every step (the
token count of get_batch_samples, the logged loss). A Gloo group cannot
outlive a lost member: its pairs to the dead rank are gone, a survivor's
collective fails with a socket error (or waits for Gloo's 30 minute
timeout), and a replacement cannot rejoin it. Routed over the engine's
"world" group instead, the same collectives learn of a loss from the
heartbeat (RankLostError, which the trainer heals like any other), and
after the heal they run on the engine's reconnected groups with the
replacement in place, with nothing to rebuild.

- `use_engine_process_group()`: every rank, once the context keeps peer
  copies, makes this the default group (the Gloo one is destroyed).
- In a replacement (ZS_HEAL_REPLACEMENT) `route_replacement_init()` makes
  the program's own init_process_group (Accelerate's, before any context
  exists) give this group at once, without a rendezvous: the survivors' old
  group is gone and they wait in the heal.

What it carries: all_reduce, all_gather (both forms), broadcast and
barrier of CPU tensors, the small control-plane collectives of trainers
(its all_reduce is an all-gather and a sum in rank order, the same bits on
every rank). Others raise NotImplementedError naming them. Until a
replacement has joined, a barrier passes at once (the survivors passed it
long ago) and any other collective is refused by name.

`answering_locally(True)`: a replacement that joined but has not yet
caught up with the survivors (a Lightning fit re-entering its loop: the
survivors ran its setup's collectives long ago) answers every collective
as if each rank held its own values, without a message: a barrier passes,
a broadcast keeps its tensor, an all-gather repeats it, an all-reduce
reduces `size` copies of it. Its trainer turns that off where the
survivors are. (A broadcast of objects, which receives sizes into an empty
tensor first, must be answered above torch.distributed: Lightning's
strategy returns the object it was given.) A hollow window (hollow.py: a
loss cut the step short, it heals at its optimizer step) answers so too,
from the collective the loss is learned in.
"""
import datetime
import os

import torch
import torch.distributed as dist
from torch.futures import Future

from . import _context, hollow

BACKEND = "zeroshard"
_registered = [False]


class _Done(dist._Work):
    """A collective that finished before its Work was returned."""

    def __init__(self, result):
        super().__init__()
        self._future = Future()
        self._future.set_result(result)

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        return self._future


_local = [False]  # answering_locally: a replacement catching up with the survivors


def answering_locally(on):
    """Collectives answer locally (module docstring) while on."""
    _local[0] = bool(on)


def answers_locally():
    """Collectives answer locally: a replacement catching up, or a hollow
    window (hollow.py: a loss cut the step short, it heals at its end)."""
    return _local[0] or hollow.active()


def _run(ctx, op, *args):
    with ctx.group("world") as world, getattr(world, op)(*args) as work:
        work.wait()


def _in_step(ctx, op, *args):
    """The world group's `op`(*args), waited for; False when a loss turned
    the window hollow instead (the caller answers locally)."""
    return hollow.call(_run, ctx, op, *args)


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


class EngineProcessGroup(dist.ProcessGroup):
    """The default group of a healing program: collectives over the engine's
    world group (module docstring)."""

    def __init__(self, rank, size):
        super().__init__(rank, size)

    def getBackendName(self):
        return BACKEND

    # -- the engine ---------------------------------------------------------
    def _world(self, what):
        ctx = _context.current_context()
        if ctx is None or _context.awaiting_join(ctx):
            raise RuntimeError(f"zeroshard: torch.distributed {what} in a replacement before it joined the "
                               "survivors (they wait in the heal and run no such collective): the program's "
                               "collectives before the model is built cannot be replayed")
        with ctx.group("world") as world:
            live = world.size  # after a shrink, fewer than ctx.world_size (heal_world)
        if live != self.size():
            raise RuntimeError(f"zeroshard: torch.distributed {what}: the engine's world has {live} live "
                               f"ranks, this group {self.size()}")
        return ctx

    def _gather_bytes(self, what, tensor):
        """Every rank's `tensor` (same shape and dtype everywhere), stacked in
        rank order: one engine all-gather of its bytes (answering locally:
        this rank's, `size` times)."""
        src = tensor.detach().to("cpu").contiguous()
        if not answers_locally():
            ctx = self._world(what)
            out = torch.empty((self.size(),) + tuple(src.shape), dtype=src.dtype)
            n = src.numel() * src.element_size()
            if not n or _in_step(ctx, "allgather", _bytes(src), _bytes(out), n, "uint8"):
                return out
        return src.unsqueeze(0).expand((self.size(),) + tuple(src.shape)).clone()

    # -- torch.distributed's entry points -------------------------------------
    def allgather(self, output_lists, inputs, opts=None):
        if len(inputs) != 1:
            raise NotImplementedError("zeroshard: torch.distributed all_gather of several tensors per rank")
        parts = self._gather_bytes("all_gather", inputs[0])
        for out, part in zip(output_lists[0], parts):
            out.copy_(part)
        return _Done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        parts = self._gather_bytes("all_gather_into_tensor", input)
        output.copy_(parts.reshape(output.shape))
        return _Done(output)

    def allreduce(self, tensors, opts=None):
        if len(tensors) != 1:
            raise NotImplementedError("zeroshard: torch.distributed all_reduce of several tensors")
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        parts = self._gather_bytes("all_reduce", tensors[0])
        tensors[0].copy_(_reduce(parts, op))
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        if len(tensors) != 1:
            raise NotImplementedError("zeroshard: torch.distributed broadcast of several tensors")
        if answers_locally():
            return _Done(tensors)
        root = getattr(opts, "rootRank", 0)
        ctx = self._world("broadcast")
        t = tensors[0]
        buf = t.detach().to("cpu").contiguous().clone()
        n = buf.numel() * buf.element_size()
        if n and _in_step(ctx, "broadcast", _bytes(buf), n, "uint8", int(root)):
            t.copy_(buf)
        return _Done(tensors)

    def barrier(self, opts=None):
        ctx = _context.current_context()
        if ctx is None or _context.awaiting_join(ctx) or answers_locally():
            return _Done(None)  # a replacement's: the survivors passed it long ago
        _in_step(ctx, "barrier")
        return _Done(None)


def _refused(what):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"zeroshard: torch.distributed {what} is not carried by the engine's group that "
                                  "healing programs use (all_reduce, all_gather, broadcast and barrier are)")
    return refuse


# The rest of torch.distributed's entry points, refused by name.
for _method, _what in (("reduce_scatter", "reduce_scatter"), ("_reduce_scatter_base", "reduce_scatter_tensor"),
                       ("alltoall_base", "all_to_all"), ("alltoall", "all_to_all"), ("gather", "gather"),
                       ("scatter", "scatter"), ("reduce", "reduce"), ("send", "send"), ("recv", "recv")):
    setattr(EngineProcessGroup, _method, _refused(_what))


def _reduce(parts, op):
    """parts[0] op parts[1] op ... in rank order (the same bits on every rank)."""
    if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        if op == dist.ReduceOp.AVG:
            out = out / len(parts) if out.is_floating_point() else out // len(parts)
        return out
    if op == dist.ReduceOp.PRODUCT:
        out = parts[0].clone()
        for p in parts[1:]:
            out *= p
        return out
    if op == dist.ReduceOp.MAX:
        return parts.amax(dim=0)
    if op == dist.ReduceOp.MIN:
        return parts.amin(dim=0)
    name = getattr(getattr(op, "op", op), "name", op)
    raise NotImplementedError(f"zeroshard: torch.distributed all_reduce with {name}: SUM, AVG, PRODUCT, MAX and MIN "
                              "are carried")


def _create(store, rank, size, timeout):
    return EngineProcessGroup(rank, size)


def _register():
    if not _registered[0]:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
        _registered[0] = True


def is_engine_group():
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == BACKEND


def _init(rank, size, timeout=None):
    _register()
    # A store no one else reads: the group rendezvouses through the engine.
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=size,
                            timeout=timeout or datetime.timedelta(minutes=30))


def use_engine_process_group():
    """Make torch.distributed's default group this module's, on every rank
    at the same point of the program (the context keeps peer copies): the
    Gloo group torch.distributed had, if any, is destroyed; none is made
    when torch.distributed was never initialised. Returns whether it is."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    if is_engine_group():
        return True
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    _init(rank, size)
    return True


def remake(rank, size):
    """The default group again, over the engine's world as a shrink or a
    regrow left it: `rank` this rank's position among the live ranks,
    `size` their count (heal_world.follow); kept when it is that already."""
    if (dist.get_rank(), dist.get_world_size()) != (rank, size):
        dist.destroy_process_group()
        _init(rank, size)


_original_init = [None]


def route_replacement_init():
    """In a replacement: the program's first init_process_group (say
    Accelerate's) makes this module's group instead, with the rank and
    world size of the launcher's environment and no rendezvous. Once."""
    if _original_init[0] is not None or not _context.is_replacement():
        return
    _original_init[0] = dist.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           *args, **kwargs):
        rank = rank if rank is not None and rank >= 0 else int(os.environ["RANK"])
        world_size = world_size if world_size is not None and world_size > 0 else int(os.environ["WORLD_SIZE"])
        dist.init_process_group = _original_init[0]
        _init(rank, world_size, timeout)

    dist.init_process_group = init_process_group
