"""Mixed precision as DeepSpeed users configure it, on real ranks:
bf16.enabled and fp16.enabled in zeroshard.torch (precision_worker.py), and
torch.autocast over a zeroshard model. The model zoo under bf16 is in
test_model_zoo.py."""
import pytest

from launch_env import once, rank0_result, zsrun

torch = pytest.importorskip("torch")

# The modes each world size runs, in one launch per size.
WORLDS = {2: ["bf16", "fp16", "autocast"], 3: ["bf16", "fp16"]}


@once
def world(n):
    return rank0_result(zsrun(n, "precision_worker.py", ",".join(WORLDS[n])), "zs_precision_", 600)


def run_ranks(n, mode):
    """(rank 0's result of `mode`, the stderr of its world's launch)."""
    results, stderr = world(n)
    return results[mode], stderr


def relative(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("ranks", [2, 3])
def test_bf16_enabled_trains_bf16_params_on_fp32_masters(ranks):
    r, stderr = run_ranks(ranks, "bf16")
    # The key is acted on, so nothing warns that it is not.
    assert "bf16.enabled" not in stderr, stderr
    assert r["param_dtypes"] == ["torch.bfloat16"], r
    assert r["buffer_dtype"] == "torch.float32", r
    assert r["master_dtypes"] == ["torch.float32"] and r["master_sizes"], r
    assert r["masters_finer_than_bf16"], "the masters hold no more than bf16 values"
    assert r["gathered_dtype"] == "torch.bfloat16", r
    # torch's state_dict holds full bf16 params (and the fp32 buffer), as
    # DeepSpeed's module.state_dict() under ZeRO-3 bf16 (gathered).
    assert r["state_dict_dtypes"] == ["torch.bfloat16", "torch.float32"] and r["state_dict_full"], r
    # Within bf16's tolerance of the fp32 run, and not the fp32 run.
    fp32, bf16 = r["fp32"], r["bf16"]
    assert len(fp32) == len(bf16) == 10
    assert max(relative(b, a) for a, b in zip(fp32, bf16)) <= 0.02, (fp32, bf16)
    assert any(a != b for a, b in zip(fp32, bf16)), "the bf16 run equals the fp32 run"
    # Half the gathered bytes; gradients reduced in bf16 (DeepSpeed's
    # default under bf16.enabled) unless communication_data_type says fp32.
    wire = r["wire"]
    assert wire["bf16"]["gather_bytes_sent"] * 2 == wire["fp32"]["gather_bytes_sent"], wire
    assert wire["bf16"]["reduce_scatter_bytes_sent"] * 2 == wire["fp32"]["reduce_scatter_bytes_sent"], wire
    assert wire["bf16_fp32_comm"]["reduce_scatter_bytes_sent"] == wire["fp32"]["reduce_scatter_bytes_sent"], wire
    assert max(relative(b, a) for a, b in zip(r["fp32_comm"], bf16)) <= 0.02, r
    # Checkpoint round trip: fp32 masters saved and restored bit for bit,
    # the bf16 working copy rebuilt from them, training goes on identically.
    assert r["masters_equal"] and r["working_equal"], r
    assert r["after_load"] == r["after_save"], r


@pytest.mark.parametrize("ranks", [2, 3])
def test_fp16_overflow_is_skipped_logged_and_the_scale_halves(ranks):
    r, _ = run_ranks(ranks, "fp16")
    assert r["param_dtypes"] == ["torch.float16"], r
    # Step 3's gradients overflow on rank 0 only: every rank skips it, no
    # param changes, the scale halves (hysteresis 1), training goes on.
    assert r["skipped"] == [False, False, False, True, False, False, False, False], r
    assert r["skipped_steps"] == 1 and r["unchanged"], r
    assert r["scales"] == [256.0] * 3 + [128.0] * 5, r
    assert len(r["logged"]) == 1 and "skipped at loss scale 256, now 128" in r["logged"][0], r
    for step, (a, b) in enumerate(zip(r["fp32"], r["fp16"])):
        if b is not None:
            assert relative(b, a) <= 0.02, (step, a, b, r)
    # An unscaled backward is refused, naming the call to use.
    assert r["error"] and "optimizer.backward(loss)" in r["error"] and "loss scale now 128" in r["error"], r


def test_autocast_over_a_zeroshard_model_trains_as_ddp_under_it():
    r, _ = run_ranks(2, "autocast")
    assert r["param_dtypes"] == ["torch.float32"], r
    for step, (a, b) in enumerate(zip(r["ddp"], r["zeroshard"])):
        assert relative(b, a) <= 1e-5, (step, a, b, r)
