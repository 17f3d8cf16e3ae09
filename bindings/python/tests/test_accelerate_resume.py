"""zeroshard.hf.Accelerator.load_state of folders that
accelerate.Accelerator.save_state wrote under DeepSpeed ZeRO-3 (DeepSpeed
0.19.8, DS_ACCELERATOR=cpu) and under FSDP2 with sharded and with full
state dicts (issue 59 item 2). Two launched worlds (accelerate_resume_worker.py under
zsrun): at 2 ranks each source engine runs the script (3 steps, save_state,
3 more, its own load_state and the 3 again) and the same script with
zeroshard.hf.Accelerator loads the folder and runs the 3 steps; at 3 ranks
zeroshard does that again, then is given bad folders. The FSDP2 source runs
Accelerate's own FSDP2 code with the state's distributed_type set to FSDP
(Accelerate takes FSDP on accelerators only; the worker's docstring)."""
import shutil

import pytest

from launch_env import rank0_result, zsrun

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

SOURCES = ("deepspeed", "fsdp2", "fsdp2_full")


def _launch(n, modes, root):
    return rank0_result(zsrun(n, "accelerate_resume_worker.py", modes), "zs_accelerate_resume_", 300,
                        extra_env={"DS_ACCELERATOR": "cpu"}, directory=str(root))[0]


def _bad_inputs(root):
    bad = root / "bad"
    bad.mkdir()
    (bad / "neither").mkdir()
    (bad / "neither" / "notes.txt").write_text("not a checkpoint")
    shutil.copytree(root / "deepspeed", bad / "deepspeed_missing_optim")
    (bad / "deepspeed_missing_optim" / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    shutil.copytree(root / "fsdp2", bad / "fsdp2_missing_optim")
    shutil.rmtree(bad / "fsdp2_missing_optim" / "optimizer_0")
    shutil.copytree(root / "fsdp2_full", bad / "fsdp_full_missing_optim")
    (bad / "fsdp_full_missing_optim" / "optimizer.bin").unlink()
    (bad / "fsdp_local").mkdir()  # FSDP's LOCAL_STATE_DICT names
    (bad / "fsdp_local" / "pytorch_model_fsdp_0_rank0.bin").write_bytes(b"")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate_resume")
    two = _launch(2, "deepspeed,fsdp2,fsdp2_full,zeroshard:deepspeed,zeroshard:fsdp2,zeroshard:fsdp2_full", root)
    _bad_inputs(root)
    three = _launch(3, "zeroshard:deepspeed:fsdp2,zeroshard:fsdp2,zeroshard:fsdp2_full,zeroshard:deepspeed,bad", root)
    return two, three


def _close(got, want, tol):
    assert len(got) == len(want) == 3
    for step, (x, y) in enumerate(zip(got, want)):
        assert abs(x - y) <= tol * abs(y), (step, got, want)


@pytest.mark.parametrize("source", SOURCES)
def test_load_state_of_a_folder_accelerate_saved(worlds, source):
    two, three = worlds
    src = two[source]
    assert src["type"] == ("DistributedType.DEEPSPEED" if source == "deepspeed" else "DistributedType.FSDP")
    assert src["model_type"] == ("DeepSpeedEngine" if source == "deepspeed" else "FSDPGPT2LMHeadModel")
    assert {"pytorch_model"} <= set(src["files"]) if source == "deepspeed" else \
        {"pytorch_model_fsdp_0", "optimizer_0"} <= set(src["files"]) if source == "fsdp2" else \
        {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(src["files"])
    assert src["own"] == src["continuation"]  # the source's own load_state: its uninterrupted run
    for ours in (two[f"zeroshard:{source}"], three[f"zeroshard:{source}"]):  # at 2 ranks, then at 3
        assert ours["partitioned"]
        _close(ours["resumed"], src["continuation"], 1e-5)
        # The scheduler (Accelerate's scheduler.bin), its lr, and the Adam step.
        assert ours["state"] == pytest.approx(src["own_state"])
        assert ours["state"]["optimizer_step"] == 3


def test_a_deepspeed_folder_loads_into_the_fsdp2_scripts_torch_adamw(worlds):
    # The FSDP2 route keeps the script's torch AdamW (stepping the shards):
    # DeepSpeed's masters, moments and step go into it (at 3 ranks).
    ours, theirs = worlds[1]["zeroshard:deepspeed:fsdp2"], worlds[0]["deepspeed"]
    assert ours["partitioned"] and ours["state"] == pytest.approx(theirs["own_state"])
    _close(ours["resumed"], theirs["continuation"], 1e-5)


def test_load_state_errors_name_what_the_folder_holds(worlds):
    errors = worlds[1]["errors"]
    assert set(errors) == {"neither", "deepspeed_missing_optim", "fsdp2_missing_optim", "fsdp_full_missing_optim",
                           "fsdp_local", "absent"}
    assert "ValueError" in errors["neither"] and "notes.txt" in errors["neither"]
    assert "nothing was loaded" in errors["neither"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt missing" in errors["deepspeed_missing_optim"]
    assert "no optimizer_0/" in errors["fsdp2_missing_optim"]
    assert "pytorch_model_fsdp_0/" in errors["fsdp2_missing_optim"]
    assert "optimizer.bin" in errors["fsdp_full_missing_optim"], errors["fsdp_full_missing_optim"]
    assert "nothing was loaded" in errors["fsdp_full_missing_optim"]
    assert "pytorch_model_fsdp_0_rank0.bin" in errors["fsdp_local"] and "not read" in errors["fsdp_local"]
    assert "not a directory" in errors["absent"]
