"""torch Distributed Checkpoint (DCP) in and out, against FSDP2 itself:
FSDP2 (2 ranks) saves get_state_dict's model and optim with dcp.save and
zeroshard.torch resumes the directory at 1 and 3 ranks with the losses of
FSDP2's own continuation (1e-6); zeroshard (3 ranks) writes one with
zt.export_dcp and FSDP2 (2 ranks) loads it with dcp.load + set_state_dict:
the same weights, bit for bit, and the losses of zeroshard's continuation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch_env import zsrun

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def launch(n, mode, path, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", ZS_TIMEOUT_MS="60000")
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(zsrun(n, "dcp_worker.py", mode, path), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def close(a, b, tol=1e-6):
    return all(abs(x - y) <= tol * abs(x) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "fsdp2"
    return path, launch(2, "fsdp2_save", path)


@pytest.mark.parametrize("ranks", [1, 3])
def test_fsdp2_checkpoint_resumes_under_zeroshard(fsdp2_saved, ranks):
    path, theirs = fsdp2_saved
    r = launch(ranks, "zeroshard_load", path)
    assert r["extra"] == {"epoch": 7} and r["steps"] == 3, r
    assert r["lr"] == pytest.approx(4e-4), r  # LambdaLR's value after 3 steps, from the saved param group
    assert close(theirs["losses"], r["losses"]), (theirs, r)


def test_zeroshard_export_resumes_under_fsdp2(tmp_path):
    path = tmp_path / "zs"
    ours = launch(3, "zeroshard_export", path)
    r = launch(2, "fsdp2_load", path)
    assert r["weight_max_diff"] == 0.0 and r["extra"] == {"epoch": 7}, r
    assert r["step"] == 3.0 and r["lr"] == pytest.approx(1e-3), r
    assert close(ours["losses"], r["losses"]), (ours, r)


def test_refusals(fsdp2_saved, tmp_path):
    """Weights of another model, and an export without torch.distributed, are named."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO / 'examples' / 'python')!r})
import train_gpt, zeroshard.torch as zt
zt.init_context(config={{"zero_optimization": {{"stage": 3}}}}, device="cpu")
with zt.Init(device="cpu"):
    m = train_gpt.GPT(65, 32, 4, 3, 16)   # one block more than the checkpoint
zt.partition_module(m)
try:
    zt.load_checkpoint({str(fsdp2_saved[0])!r}, m)
except KeyError as e:
    print("KEYERROR", e)
try:
    zt.export_dcp({str(tmp_path / 'x')!r}, m)
except RuntimeError as e:
    print("RUNTIMEERROR", e)
zt.shutdown()
"""
    env = dict(os.environ, PYTHONPATH=str(REPO / "bindings" / "python"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KEYERROR" in proc.stdout and "missing from the checkpoint ['blocks.2." in proc.stdout, proc.stdout
    assert "RUNTIMEERROR" in proc.stdout and "torch.distributed is not initialised" in proc.stdout, proc.stdout


def test_fsdp2_checkpoint_imported_offline_resumes_alike(fsdp2_saved, tmp_path):
    """python -m zeroshard.convert (what zsckpt import runs): the DCP
    directory as a zeroshard checkpoint, resumed at 3 ranks as FSDP2's own."""
    path, theirs = fsdp2_saved
    out = tmp_path / "imported"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "zeroshard.convert", str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = launch(3, "zeroshard_load", out)
    assert r["extra"] == {"epoch": 7} and r["steps"] == 3, r
    assert close(theirs["losses"], r["losses"]), (theirs, r)
