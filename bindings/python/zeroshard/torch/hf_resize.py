"""Hugging Face's resize_token_embeddings on a partitioned model.

transformers reads the old embedding's (and an untied head's) values to
copy and to draw the new rows from their mean and covariance, then sets
`weight.data` to a tensor of the new vocabulary size. On a partitioned
model the values live in the engine's shards, so the call runs with those
params gathered, and each param whose value it replaced is registered
anew at its new shape (rank 0's values: the new rows are random). The
params keep their identity, their hooks and their place in the model; as
under DeepSpeed, resize before the optimizer is built. Collective.

Installed on transformers.PreTrainedModel whenever transformers is loaded
and zeroshard.torch partitions a model (Init, partition_module) or
zeroshard.hf is imported: a script that imports zeroshard.torch alone
resizes too (issue 59), where before it got "param ... is partitioned and
not gathered now" unless zeroshard.hf had been imported.
"""
import sys

from . import _params, param_type
from ._params import is_partitioned
from .gathered import GatheredParameters

_original = None  # transformers' own, once installed


def _embedding_modules(model):
    return [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]


def _embedding_params(model):
    found = []
    for module in _embedding_modules(model):
        for p in module.parameters(recurse=False):
            if is_partitioned(p) and all(p is not q for q in found):
                found.append(p)
    return found


def resize_token_embeddings(self, *args, **kwargs):
    params = _embedding_params(self)
    if not params:
        return _original(self, *args, **kwargs)
    engine = getattr(self, "_zs_hooks", None)
    with GatheredParameters(params):
        result = _original(self, *args, **kwargs)
        replaced = [(p, param_type.raw_data(p)) for p in params if _params.assigned(p)]
    for p, data in replaced:
        _params.repartition(p, data.detach().contiguous())
    # An untied head is replaced by a new module (transformers builds it
    # unpartitioned): partitioned here, rank 0's values, as from_pretrained
    # would have. Its hooks come with partition_module (the Trainer's
    # prepare); a model whose hooks are installed has no unit for it.
    new = [(m, n) for m in _embedding_modules(self)
           for n, p in m.named_parameters(recurse=False) if not is_partitioned(p)]
    if new and engine is not None:
        raise RuntimeError(
            f"zeroshard.torch: resize_token_embeddings replaced {type(new[0][0]).__name__} with a new module "
            f"(an untied output head) after partition_module installed the model's hooks, so it would have "
            f"no gather unit: resize before partition_module (before the Trainer or Accelerator prepares it)")
    for module, name in new:
        _params.partition_param(getattr(module, name), name=f"{type(module).__name__}.{name}")
    if engine is not None and replaced:
        engine.params_replaced()
    return result


def install():
    """Put resize_token_embeddings on transformers.PreTrainedModel if
    transformers is loaded (never imports it); once."""
    global _original
    transformers = sys.modules.get("transformers")
    if _original is not None or transformers is None:
        return
    base = transformers.PreTrainedModel  # the lazy module loads modeling_utils here
    _original = base.resize_token_embeddings
    resize_token_embeddings.__doc__ = (_original.__doc__ or "") + "\n\n(zeroshard: " + __doc__.splitlines()[0] + ")"
    base.resize_token_embeddings = resize_token_embeddings
