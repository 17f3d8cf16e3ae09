"""Hugging Face generate() on a partitioned model."""
import types

import torch

from ._context import get_context


def install(model):
    """Hugging Face generate() on a partitioned model: ranks that finish
    early keep running forwards (dummy steps) until every rank has, so their
    gathers stay paired (HF's synced_gpus, which HF turns on by itself only
    for DeepSpeed and FSDP). The ranks agree through the engine, so
    torch.distributed need not be initialised."""
    if not callable(getattr(type(model), "_has_unfinished_sequences", None)):
        return
    model.generate = types.MethodType(_generate_synced, model)
    model._has_unfinished_sequences = types.MethodType(_unfinished_on_any_rank, model)


def _generate_synced(model, *args, **kwargs):
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = get_context().world_size > 1
    return type(model).generate(model, *args, **kwargs)


def _unfinished_on_any_rank(model, this_peer_finished, synced_gpus, device=None):
    if not synced_gpus:
        return not this_peer_finished
    ctx = get_context()
    flag = torch.tensor([0.0 if this_peer_finished else 1.0], dtype=torch.float32, device=ctx.device)
    with ctx.group("world") as world, world.allreduce(flag, flag, 1, "fp32", "sum") as work:
        work.wait()
    return flag.item() > 0.0
