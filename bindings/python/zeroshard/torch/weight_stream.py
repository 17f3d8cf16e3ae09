"""The full weights of a partitioned model as a stream of (name, tensor),
a bounded number of bytes gathered at a time: weight sync to an inference
server (vLLM's and SGLang's `load_weights(weights)` take such an iterable)
without ever holding the full model on a rank.

    for name, tensor in zt.full_weights(model, max_bytes=512 << 20):
        llm.load_weights([(name, tensor)])   # on rank 0, say: every rank iterates

Collective: every rank iterates the stream to its end (the gathers pair),
whichever ranks use what they get.
"""
from ._params import GatheredParameters
from .generation import bytes_to_gather

DEFAULT_MAX_BYTES = 256 << 20


def full_weights(model, max_bytes=DEFAULT_MAX_BYTES, buffers=True):
    """(name, full tensor) for every param of `model` in named_parameters
    order (each name of a tied one), then its persistent buffers
    (`buffers`): the keys of its state_dict.

    Params are gathered in consecutive batches of at most `max_bytes` (a
    param larger than that alone: the bound is then its size) and released
    when the stream moves past their batch, so the extra memory the stream
    takes is at most max(max_bytes, the largest param). A param is yielded
    itself, gathered, without a copy: use or copy it before asking for the
    next batch; once released, reading it is an error that names it (never
    stale values)."""
    max_bytes = int(max_bytes)
    if max_bytes <= 0:
        raise ValueError(f"zeroshard.torch.full_weights: max_bytes={max_bytes}: expected a positive number of "
                         "bytes")
    batch, size, seen = [], 0, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        cost = 0
        if id(p) not in seen:
            seen.add(id(p))
            cost = bytes_to_gather([p])
        if batch and size + cost > max_bytes:
            yield from _gathered(batch)
            batch, size = [], 0
        batch.append((name, p))
        size += cost
    if batch:
        yield from _gathered(batch)
    if buffers:
        for name, b in model.named_buffers():
            if _persistent(model, name):
                yield name, b


def _gathered(batch):
    params = list({id(p): p for _, p in batch}.values())
    with GatheredParameters(params):
        yield from batch


def _persistent(model, name):
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf not in module._non_persistent_buffers_set
