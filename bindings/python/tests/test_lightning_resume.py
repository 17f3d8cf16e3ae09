"""trainer.fit(ckpt_path=...) under ZeroShardStrategy on checkpoints that
Lightning's own DeepSpeedStrategy (ZeRO-3) and FSDPStrategy (full and
sharded state dicts) wrote (issue 59 item 3). Two launched worlds
(lightning_resume_worker.py under zsrun): at 2 ranks each source strategy
fits 2 epochs saving after each, resumes its own epoch=0.ckpt, and
ZeroShardStrategy resumes it; at 3 ranks ZeroShardStrategy resumes each
again, then is given bad folders. Lightning refuses both strategies on a
CPU by checks alone; the worker steps past exactly those (its docstring
says which), so the files are Lightning's and DeepSpeed's / FSDP's own.
"""
import shutil

import pytest

from launch_env import rank0_result, zsrun

pytest.importorskip("lightning.pytorch")
pytest.importorskip("deepspeed")

SOURCES = ("deepspeed", "fsdp_full", "fsdp_sharded")
PER_EPOCH = 8


def _launch(n, mode, root):
    return rank0_result(zsrun(n, "lightning_resume_worker.py", mode), "zs_lightning_resume_", 300,
                        extra_env={"DS_ACCELERATOR": "cpu"}, directory=str(root))[0]


def _bad_inputs(root):
    import torch
    bad = root / "bad"
    bad.mkdir()
    (bad / "neither").mkdir()
    (bad / "neither" / "notes.txt").write_text("not a checkpoint")
    shutil.copytree(root / "deepspeed" / "epoch=0.ckpt", bad / "deepspeed_missing_optim")
    (bad / "deepspeed_missing_optim" / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    shutil.copytree(root / "fsdp_sharded" / "epoch=0.ckpt", bad / "fsdp_sharded_no_meta")
    (bad / "fsdp_sharded_no_meta" / "meta.pt").unlink()
    full = torch.load(root / "fsdp_full" / "epoch=0.ckpt", weights_only=True)
    del full["optimizer_states"]
    torch.save(full, bad / "weights_only.ckpt")
    (bad / "text.ckpt").write_text("not a checkpoint")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_resume")
    two = _launch(2, "sources", root)
    _bad_inputs(root)
    three = _launch(3, "resume", root)
    return two, three


def _close(got, want, tol=1e-5):
    assert len(got) == len(want) == PER_EPOCH
    for step, (x, y) in enumerate(zip(got, want)):
        assert abs(x - y) <= tol * abs(y), (step, got, want)


def _resumed_state(run):
    # The loops, the scheduler, the optimizer's step and the buffer as the
    # first resumed batch starts: epoch 1 from its first batch.
    s = run["state"]
    assert (s["epoch"], s["global_step"], s["batch_idx"]) == (1, PER_EPOCH, 0)
    assert s["scheduler"] == PER_EPOCH and s["lr"] == pytest.approx(1e-2 * 0.5 ** (PER_EPOCH // 3))
    assert s["seen"] == PER_EPOCH
    assert s["optimizer_step"] == PER_EPOCH  # the engine's Adam step count, for bias correction
    assert run["end_step"] == 2 * PER_EPOCH and run["end_seen"] == 2 * PER_EPOCH
    assert run["end_lr"] == pytest.approx(1e-2 * 0.5 ** (2 * PER_EPOCH // 3))


@pytest.mark.parametrize("source", SOURCES)
def test_resumes_a_lightning_checkpoint_as_the_source_strategy_does(worlds, source):
    two, three = worlds
    runs = two[source]
    assert runs["whole"]["strategy"] == runs["own"]["strategy"] == ("CPUDeepSpeed" if source == "deepspeed"
                                                                     else "CPUFSDP")
    continuation = runs["whole"]["losses"][PER_EPOCH:]
    _close(runs["own"]["losses"], continuation, 1e-6)  # the source's own resume: its uninterrupted run
    for ours in (runs["zeroshard"], three[source]["zeroshard"]):  # at 2 ranks, then at 3
        assert ours["strategy"] == "ZeroShardStrategy"
        _close(ours["losses"], continuation)
        _resumed_state(ours)


def test_bad_checkpoints_are_errors_naming_what_was_found(worlds):
    errors = worlds[1]["errors"]
    assert set(errors) == {"absent", "neither", "deepspeed_missing_optim", "fsdp_sharded_no_meta",
                           "weights_only.ckpt", "text.ckpt"}
    assert "does not exist" in errors["absent"]
    assert "ValueError" in errors["neither"] and "notes.txt" in errors["neither"]
    assert "DeepSpeedStrategy checkpoint" in errors["neither"]  # says what it expected too
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt missing" in errors["deepspeed_missing_optim"]
    assert "without Lightning's meta.pt" in errors["fsdp_sharded_no_meta"]
    assert "__0_0.distcp" in errors["fsdp_sharded_no_meta"]
    assert "holds no optimizer_states" in errors["weights_only.ckpt"]
    assert "not a torch checkpoint file" in errors["text.ckpt"]
