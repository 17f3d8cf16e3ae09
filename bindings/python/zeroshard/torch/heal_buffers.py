"""The module buffers a heal carries: what training changes beside the
params (BatchNorm's running statistics and batch count), which the engine
does not shard. Each rank keeps its own, unsynchronised, as under FSDP and
DeepSpeed's ZeRO-3; so a replacement takes its predecessor's from the
per-rank blob that rides in the peer copy, and a step redone after a loss
starts from the values it began with, not from the cut-short forward's
update (BatchNorm's statistics would take the batch twice).

Which buffers: those of every partitioned root (partition_module) that a
checkpoint would save (persistent ones: running statistics are), and any
other written since the root was partitioned (a new tensor, or an
in-place write by torch's version counter, which BatchNorm's own update
of its statistics does not bump). Constant non-persistent ones (a rotary
table, a causal mask) never travel."""
import os
import warnings
import weakref

import torch

_roots = []  # [(weakref to a partitioned root, [(key, weakref to the owner module, buffer name)])], as partitioned
_baseline = {}  # key -> (id, version) of a non-persistent buffer as its root was partitioned
_PROCESS = os.urandom(8).hex()  # which process took a snapshot (a pid may recur on another host)


def note_root(module):
    """partition_module installed a root: its buffers (those no earlier
    root holds), keyed by the root's ordinal and the buffer's name, which
    a replacement running the same script gives alike."""
    held = {(id(owner()), name) for _, entries in _roots for _, owner, name in entries}
    entries = []
    for prefix, owner in module.named_modules(remove_duplicate=True):
        for name, t in owner._buffers.items():
            if t is None or (id(owner), name) in held:
                continue
            key = f"{len(_roots)}:{prefix}.{name}" if prefix else f"{len(_roots)}:{name}"
            entries.append((key, weakref.ref(owner), name))
            if name in owner._non_persistent_buffers_set:
                _baseline[key] = (id(t), t._version)
    _roots.append((weakref.ref(module), entries))


def _buffers():
    for root, entries in _roots:
        if root() is None:
            continue
        for key, owner, name in entries:
            t = getattr(owner(), "_buffers", {}).get(name)
            if t is not None:
                yield key, t


def _carried(key, t):
    return key not in _baseline or (id(t), t._version) != _baseline[key]


def snapshot():
    """The buffers a heal carries, copied, and the versions of the rest, to
    see at restore() whether one of those was written after all."""
    values, versions = {}, {}
    for key, t in _buffers():
        if _carried(key, t):
            values[key] = t.detach().clone()
        else:
            versions[key] = [id(t), t._version]
    return {"values": values, "versions": versions, "process": _PROCESS}


def restore(snap):
    """snapshot()'s values back into the buffers (in place), taken in this
    process (a redo) or in a lost predecessor (a replacement, from its
    blob). A buffer the snapshot did not copy, written since in this
    process, is named: its first change came in the step being redone,
    and stays."""
    current = dict(_buffers())
    missing = sorted(set(snap["values"]) - set(current))
    if missing:
        raise RuntimeError(f"zeroshard.torch healing: the healed state holds module buffers {missing[:4]} that this "
                           "process's partitioned modules lack (every rank must build the same models in the same "
                           "order)")
    for key, value in snap["values"].items():  # all checked before any is written
        t = current[key]
        if t.shape != value.shape or t.dtype != value.dtype:
            raise RuntimeError(f"zeroshard.torch healing: module buffer {key} is {tuple(t.shape)} {t.dtype} "
                               f"here, {tuple(value.shape)} {value.dtype} in the healed state")
    with torch.no_grad():
        for key, value in snap["values"].items():
            current[key].copy_(value)
    if snap["process"] == _PROCESS:
        written = sorted(k for k, (i, v) in snap["versions"].items()
                         if k in current and [id(current[k]), current[k]._version] != [i, v])
        if written:
            warnings.warn(f"zeroshard.torch healing: module buffers {written[:4]} first changed in the step being "
                          "redone; that step's change to them stays (they were not copied at its start)")
