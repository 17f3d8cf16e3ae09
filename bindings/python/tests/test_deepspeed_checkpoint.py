"""DeepSpeed checkpoints resumed by zeroshard.torch: DeepSpeed itself
(DS_ACCELERATOR=cpu, 2 ranks) trains the GPT example 3 steps with AdamW and
WarmupLR, saves with engine.save_checkpoint and trains 2 more; zeroshard
loads the saved directory at another world size and trains the same 2
steps. fp32 runs: the losses equal DeepSpeed's continuation (1e-6). Every
run: each rank's loaded fp32 masters equal DeepSpeed's own zero_to_fp32
consolidation bit for bit. ZeRO-1, 2 and 3; fp32 and bf16 (DeepSpeed's CPU
accelerator refuses fp16, so no fp16 run is made here: its files have the
fp32 run's layout). Files are read with weights_only=True; one holding
another class is refused, naming it."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from launch_env import zsrun

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("safetensors")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
WORKER = HERE / "ds_ckpt_worker.py"


def launch(n, *args, timeout=300, made=()):
    """rank 0's output of the worker on n ranks. `made`: the folders a
    DeepSpeed side writes; a launch that wrote every one of them whole and
    then lost a rank to DeepSpeed's own teardown abort ("terminate called
    without an active exception", seen once in CI in DeepSpeed's CPU
    process, no zeroshard code loaded) is said and taken as made."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", ZS_TIMEOUT_MS="60000")
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(zsrun(n, WORKER.name, *args), env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    whole = made and all((p / "continuation.json").is_file() and (p / "fp32.safetensors").is_file() for p in made)
    if proc.returncode != 0 and whole and "terminate called without an active exception" in proc.stderr:
        print(f"DeepSpeed's side wrote every checkpoint, then a rank aborted in its teardown:\n{output}")
        return proc.stdout
    assert proc.returncode == 0, output
    return proc.stdout


# The checkpoints DeepSpeed makes (stage, dtype), all in one 2-rank launch,
# and the world size each is resumed at (the resumes of one size share a launch).
MADE = {(3, "fp32"): 3, (2, "fp32"): 1, (1, "bf16"): 3, (3, "bf16"): 1}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(stage, dtype): the path of DeepSpeed's checkpoint."""
    root = tmp_path_factory.mktemp("deepspeed")
    paths = {key: root / f"zero{key[0]}_{key[1]}" for key in MADE}
    launch(2, "deepspeed", *[a for (stage, dtype), path in paths.items() for a in (str(path), str(stage), dtype)],
           timeout=600, made=list(paths.values()))
    return lambda stage, dtype: paths[stage, dtype]


def resume(ranks, *checkpoints):
    """{path: rank 0's result} of zeroshard resuming each (path, dtype) on
    `ranks` ranks, in one launch."""
    out = launch(ranks, "zeroshard", *[str(a) for c in checkpoints for a in c], timeout=600)
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["path"]: r for r in results}


@pytest.fixture(scope="module")
def resumed(made):
    """resumed(stage, dtype): zeroshard's resume of that checkpoint at its MADE world size."""
    cache = {}

    def get(stage, dtype):
        ranks = MADE[stage, dtype]
        if ranks not in cache:
            cache[ranks] = resume(ranks, *[(made(s, d), d) for (s, d), n in MADE.items() if n == ranks])
        return cache[ranks][str(made(stage, dtype))]
    return get


@pytest.mark.parametrize("stage,dtype", list(MADE))
def test_resume_continues_as_deepspeed(made, resumed, stage, dtype):
    path = made(stage, dtype)
    theirs = json.loads((path / "continuation.json").read_text())["losses"]
    r = resumed(stage, dtype)
    assert r["master_max_diff"] == 0.0, r
    assert r["steps"] == 5 and r["global_steps"] == 3 and r["zero_stage"] == stage and r["dp_world_size"] == 2, r
    assert r["client"] == {"epoch": 7}, r
    # fp32: the same numbers. bf16: the model computes in bf16, and each
    # rank's loss is rounded to bf16 over its own rows (3 on DeepSpeed's
    # ranks, 2 or 6 here) before the mean: a few bf16 ulps (1/128 relative).
    tol = 1e-6 if dtype == "fp32" else 3 / 128
    for a, b in zip(theirs, r["losses"]):
        assert abs(a - b) <= tol * abs(a), (theirs, r["losses"])


def test_a_file_holding_another_class_is_refused(made, tmp_path):
    import shutil
    from zeroshard.torch import deepspeed_checkpoint

    src = made(3, "fp32")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tagdir = dst / (dst / "latest").read_text().strip()
    victim = tagdir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Evil()}, victim)
    with pytest.raises(ValueError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt holds __builtin__.getattr, "
                                         r"test_deepspeed_checkpoint.Evil, which cannot be read .*weights_only"):
        deepspeed_checkpoint.DeepSpeedCheckpoint(tagdir)
    assert not Evil.ran
    victim.unlink()
    with pytest.raises(ValueError, match=r"optimizer files for ranks \[0\], expected 0..0|model state files"):
        deepspeed_checkpoint.DeepSpeedCheckpoint(tagdir)


def test_finds_deepspeed_directories_only(made, tmp_path):
    from zeroshard.torch import deepspeed_checkpoint

    src = made(3, "fp32")
    tag = (src / "latest").read_text().strip()
    assert deepspeed_checkpoint.find(src) == src / tag
    assert deepspeed_checkpoint.find(src, tag) == src / tag
    assert deepspeed_checkpoint.find(src / tag) == src / tag
    assert deepspeed_checkpoint.find(tmp_path) is None  # empty: the engine's own loader reports it
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "mp_rank_00_model_states.pt").write_bytes((src / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
                                                      .read_bytes())
    assert deepspeed_checkpoint.find(bare) == bare
    with pytest.raises(ValueError, match="holds model states but no zero_pp_rank_"):
        deepspeed_checkpoint.DeepSpeedCheckpoint(bare)


class Evil:
    """Unpickling it would run code (a weights-only load must not)."""
    ran = False

    def __reduce__(self):
        return (Evil._run, ())

    @staticmethod
    def _run():
        Evil.ran = True
        return Evil()


def test_safe_load_never_runs_pickled_code(tmp_path):
    from zeroshard.torch import deepspeed_checkpoint

    f = tmp_path / "x.pt"
    torch.save({"a": torch.ones(2), "b": Evil()}, f)
    with pytest.raises(ValueError, match="cannot be read without running pickled code"):
        deepspeed_checkpoint.safe_load(f)
    assert not Evil.ran
    # a plain pickle (no torch zip) is named as such
    g = tmp_path / "y.pt"
    g.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises((ValueError, Exception), match="not a torch zip checkpoint|zip"):
        deepspeed_checkpoint.safe_load(g)


def test_zsckpt_import_writes_a_zeroshard_checkpoint_that_resumes_alike(made, tmp_path):
    """zsckpt import (python -m zeroshard.convert): the DeepSpeed checkpoint
    as a zeroshard one, verified, resumed at 3 ranks as DeepSpeed's own."""
    import shutil
    src = made(3, "fp32")
    out = tmp_path / "imported"
    env = dict(os.environ, ZS_PYTHON=sys.executable)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([str(REPO / "build" / "bin" / "zsckpt"), "import", str(src), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == str(out / "step-3")
    assert subprocess.run([str(REPO / "build" / "bin" / "zsckpt"), "verify", str(out)],
                          capture_output=True, timeout=120).returncode == 0
    for f in ("fp32.safetensors", "continuation.json"):
        shutil.copy(src / f, out / f)
    r = resume(3, (out, "fp32"))[str(out)]
    theirs = json.loads((src / "continuation.json").read_text())["losses"]
    assert r["master_max_diff"] == 0.0 and r["steps"] == 5 and r["client"] == {"epoch": 7}, r
    for a, b in zip(theirs, r["losses"]):
        assert abs(a - b) <= 1e-6 * abs(a), (theirs, r["losses"])
    bad = subprocess.run([str(REPO / "build" / "bin" / "zsckpt"), "import", str(tmp_path), str(tmp_path / "x")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "neither a DeepSpeed checkpoint" in bad.stderr, bad.stderr


def _manifest(tmp_path, kind="adamw", dtype="F32", optimizer=True):
    """A zeroshard checkpoint's manifest alone (no rank files): enough for
    the DeepSpeed export's checks, which refuse before reading a tensor."""
    d = tmp_path / f"{kind}-{dtype}-{optimizer}"
    d.mkdir()
    params = [{"name": "w", "dtype": dtype, "shape": [3, 5], "numel": 15, "states": {}}]
    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True}
    opt = {"kind": kind, "steps": 2, "groups": [{"hparams": hp, "params": ["w"]}]} if optimizer else None
    (d / "manifest.json").write_text(json.dumps({"format": "zeroshard-checkpoint", "world_size": 2, "step": 2,
                                                 "files": [], "params": params, "optimizer": opt, "user": {}}))
    return d


def test_deepspeed_export_cuts_sub_groups_as_deepspeed_and_refuses_what_it_cannot_write(tmp_path):
    """zeroshard.torch.deepspeed_export: a param group cut into sub-groups
    where the rank's elements reach zero_optimization.sub_group_size, as
    DeepSpeed stage3's own _create_fp16_sub_groups cuts it (run here on
    stand-in params); an fp16 run, an optimizer other than Adam/AdamW and a
    checkpoint without optimizer state are refused by name."""
    from zeroshard.torch import deepspeed_export
    cases = [([7, 3, 10, 1, 4], 8), ([7, 3, 10, 1, 4], 100), ([5, 5, 5], 5), ([1], 0), ([9, 2, 2], 11)]
    ours = [deepspeed_export._sub_groups([f"p{i}" for i in range(len(n))], {f"p{i}": x for i, x in enumerate(n)}, s)
            for n, s in cases]
    script = (
        "import json, sys, types\n"
        "from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S\n"
        "class P:\n"
        "    def __init__(self, i, n): self.i, self.n = i, n\n"
        "    def partition_numel(self): return self.n\n"
        "out = []\n"
        f"for numels, size in {cases!r}:\n"
        "    params = [P(i, n) for i, n in enumerate(numels)]\n"
        "    groups = S._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=size), params)\n"
        "    out.append([[f'p{p.i}' for p in g] for g in groups])\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ours, (ours, proc.stdout)
    for kwargs, message in (({"dtype": "F16"}, "fp16 params"), ({"kind": "sgd"}, "optimizer is 'sgd'"),
                            ({"optimizer": False}, "holds no optimizer state")):
        with pytest.raises(ValueError, match=message):
            deepspeed_export.export(_manifest(tmp_path, **kwargs), tmp_path / "out")
    with pytest.raises(ValueError, match="holds no zeroshard checkpoint"):
        deepspeed_export.export(tmp_path, tmp_path / "out")
