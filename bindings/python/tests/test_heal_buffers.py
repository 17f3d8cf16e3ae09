"""The module buffers a heal carries (zeroshard/torch/heal_buffers.py), in
one process: which buffers a snapshot takes, that restore() puts them back
in place, and what it names. The launched worlds of test_healing.py check
the whole path (a BatchNorm in heal_worker.py's model, each rank's
statistics bit for bit an uninterrupted run's after a redo and a
replacement)."""
import pytest
import torch
from torch import nn

from zeroshard.torch import heal_buffers


@pytest.fixture
def fresh(monkeypatch):
    """No root noted yet (the module's state is per process)."""
    monkeypatch.setattr(heal_buffers, "_roots", [])
    monkeypatch.setattr(heal_buffers, "_baseline", {})


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    m.register_buffer("table", torch.arange(5.0), persistent=False)  # a constant one, as a rotary table
    return m


def test_the_buffers_training_changes_are_snapshot_and_put_back_in_place(fresh):
    m = model()
    heal_buffers.note_root(m)
    m(torch.randn(8, 4))
    before = heal_buffers.snapshot()  # what a checkpoint saves; not the constant table
    assert sorted(before["values"]) == ["0:1.num_batches_tracked", "0:1.running_mean", "0:1.running_var"]
    assert list(before["versions"]) == ["0:table"]
    mean = m[1].running_mean
    kept = mean.clone()
    m(torch.randn(8, 4))  # the step cut short updated them
    assert not torch.equal(mean, kept)
    heal_buffers.restore(before)
    assert m[1].running_mean is mean and torch.equal(mean, kept)  # in place: the module's own tensor
    assert int(m[1].num_batches_tracked) == 1


def test_a_second_root_and_a_replacements_snapshot(fresh):
    a, b = model(), model()
    heal_buffers.note_root(a)
    heal_buffers.note_root(b)
    heal_buffers.note_root(a[1])  # a part of a noted root: nothing new
    b.table = torch.ones(2)  # a non-persistent buffer replaced: carried from then on
    snap = heal_buffers.snapshot()
    assert sorted(snap["values"]) == [f"{i}:{k}" for i in (0, 1) for k in (
        "1.num_batches_tracked", "1.running_mean", "1.running_var")] + ["1:table"]
    b(torch.randn(8, 4))
    want = {k: v.clone() for k, v in snap["values"].items()}
    b(torch.randn(8, 4))
    snap["process"] = "a lost predecessor"  # its versions say nothing here
    heal_buffers.restore(snap)
    assert torch.equal(b[1].running_var, want["1:1.running_var"])


def test_restore_names_a_buffer_it_cannot_put_back(fresh):
    m = model()
    heal_buffers.note_root(m)
    snap = heal_buffers.snapshot()
    m.table.add_(1.0)  # a buffer first written in the step being redone
    with pytest.warns(UserWarning, match=r"module buffers \['0:table'\] first changed in the step being redone"):
        heal_buffers.restore(snap)
    snap["values"]["0:1.running_mean"] = torch.zeros(7)
    with pytest.raises(RuntimeError, match=r"module buffer 0:1.running_mean is \(6,\) torch.float32 here, \(7,\)"):
        heal_buffers.restore(snap)
    snap["values"]["9:gone"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"holds module buffers \['9:gone'\] that this process's partitioned"):
        heal_buffers.restore(snap)
