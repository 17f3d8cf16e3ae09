"""Models nobody here wrote (Hugging Face GPT-2, Llama, BERT, T5, Mixtral,
ViT; torch's nn.Transformer, nn.MultiheadAttention, nn.LSTM/nn.GRU; frozen
LoRA-style adapters with activation checkpointing; params of mixed dtypes
and buffers), built under zt.Init from
small configs with random weights and trained unchanged on real ranks: the
losses equal torch DDP's (fp32, 1e-5 relative per step, 10 steps).

The whole zoo runs once per world size (one zsrun launch: torch and
transformers import once per rank), and each model is its own test.
"""
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from launch_env import zsrun

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent

MODELS = ["gpt2", "gpt2_checkpointed", "llama", "bert", "t5", "mixtral", "vit", "transformer", "mha", "rnn",
          "frozen", "mixed", "gpt2_persistent", "frozen_persistent"]
PATTERNS = ["deepcopy", "generate", "inference_gather", "convert", "save_pretrained", "resize", "checkpointed"]
WORLDS = [int(w) for w in os.environ.get("ZS_ZOO_WORLDS", "2 3").split()]
_runs = {}


def zoo(world, names=(*MODELS, *PATTERNS)):
    """Rank 0's JSON for `names` (the whole zoo) on `world` ranks (run once)."""
    key = (world, tuple(names))
    if key not in _runs:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
        env["ZS_TIMEOUT_MS"] = "120000"
        env["PYTHONWARNINGS"] = "ignore::FutureWarning"
        env["ZS_ZOO_DIR"] = tempfile.mkdtemp(prefix="zs_zoo_")
        proc = subprocess.run(zsrun(world, "zoo_worker.py", *names), env=env, capture_output=True, text=True,
                              timeout=1200)
        shutil.rmtree(env["ZS_ZOO_DIR"], ignore_errors=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        _runs[key] = (proc, json.loads(lines[-1]) if proc.returncode == 0 and lines else None)
    proc, result = _runs[key]
    assert result is not None, f"zoo {' '.join(names)} on {world} ranks failed ({proc.returncode}):\n" + \
        proc.stdout[-4000:] + proc.stderr[-8000:]
    return result


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", MODELS)
def test_trains_like_ddp(model, world):
    r = zoo(world)[model]
    assert len(r["zeroshard"]) == len(r["ddp"]) == 10
    for step, (ref, ours) in enumerate(zip(r["ddp"], r["zeroshard"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), (model, step, ref, ours, r)
    assert r["zeroshard"][-1] < r["zeroshard"][0], r
    assert r["frozen_equal"], "a frozen param changed"
    assert r["left_gathered"] == 0, "params left gathered after the step"


@pytest.mark.parametrize("world", WORLDS)
def test_a_checkpointed_backward_gathers_about_what_one_without_checkpointing_does(world):
    """Activation checkpointing re-runs each layer's forward in the
    backward: the units it gathers stay held for that layer's backward
    (as FSDP2 keeps a block), so the backward gathers about what the same
    model's without checkpointing does (0.94-1.13x here; before 1.8x, each
    param twice; a release waits for the param's readers, so which fetch
    finds it still gathered moves a little with timing), both of torch's
    checkpoint kinds, with the same losses bit for bit."""
    r = zoo(world)["checkpointed"]
    plain = r["plain"]
    assert plain["recomputed"] == 0, r
    for kind in ("checkpointed", "reentrant", "whole"):
        assert r[kind]["losses"] == plain["losses"] and r[kind]["left_gathered"] == 0, r
        assert r[kind]["recomputed"] == 3, r  # once a step
    for kind in ("checkpointed", "reentrant"):
        assert 0 < r[kind]["backward_bytes"] <= 1.3 * plain["backward_bytes"], r


@pytest.mark.parametrize("world", WORLDS)
def test_one_checkpoint_around_the_whole_model_recomputes_and_holds_at_most_a_quarter_of_it(world):
    """torch's non-reentrant checkpoint around the whole partitioned model:
    its forward keeps no activation and the backward runs the model again
    (before, the root's saved-tensor hooks took what the checkpoint drops:
    every activation kept, nothing recomputed). That recompute runs every
    layer before any of their backwards, so the units it holds for their
    backward stay within a quarter of the model: the most gathered at once
    stays under half of it (without the bound, all of it)."""
    whole = zoo(world)["checkpointed"]["whole"]
    assert whole["recomputed"] == 3, whole
    assert whole["peak_live_elements"] <= 0.5 * whole["elements"], whole


# Under bf16.enabled: every model of the zoo but "mixed" (whose dtypes are
# the point) and the persistent twins.
BF16_MODELS = [m for m in MODELS if m != "mixed" and not m.endswith("_persistent")]


@pytest.mark.parametrize("model", BF16_MODELS)
def test_trains_in_bf16_within_two_percent_of_fp32(model):
    """The zoo under "bf16": {"enabled": true} on 2 ranks: params bf16, the
    optimizer's masters fp32, floating buffers as built; each step's loss
    within 2% of the fp32 DDP run's and not equal to it (so bf16 ran)."""
    r = zoo(2, tuple(f"{m}@bf16" for m in BF16_MODELS))[f"{model}@bf16"]
    fp32 = zoo(2)[model]["ddp"]
    assert r["param_dtypes"] == ["torch.bfloat16"], r
    assert r["master_dtypes"] == ["torch.float32"], r
    assert "torch.bfloat16" not in r["buffer_dtypes"], r
    bf16 = r["zeroshard"]
    assert len(bf16) == len(fp32) == 10
    for step, (ref, ours) in enumerate(zip(fp32, bf16)):
        assert abs(ours - ref) <= 0.02 * abs(ref), (model, step, ref, ours)
    assert any(a != b for a, b in zip(fp32, bf16)), (model, "the bf16 run equals the fp32 run")
    assert bf16[-1] < bf16[0], r


def test_fetch_on_access_warns_once_naming_module_and_param():
    r = zoo(WORLDS[0])
    # nn.MultiheadAttention reads out_proj's params without calling out_proj.
    notes = r["mha"]["warnings"]
    assert len(notes) == 2, notes
    assert any("attn (MultiheadAttention) reads attn.out_proj.weight" in n for n in notes), notes
    assert all("register_external_parameter" in n for n in notes), notes
    # A model that calls every module it reads from warns about nothing.
    assert r["gpt2"]["warnings"] == [] and r["llama"]["warnings"] == []


def test_deepcopy_of_a_partitioned_model_is_independent():
    r = zoo(WORLDS[0])["deepcopy"]
    assert r == {"copy_equal": True, "original_unchanged": True, "copy_trained": True, "shares_params": False,
                 "layer_error": True, "layer_after_partition_module": True}


@pytest.mark.parametrize("world", WORLDS)
def test_generate_with_ranks_stopping_at_different_lengths(world):
    ranks = zoo(world)["generate"]["ranks"]
    assert [r["length"] for r in ranks] == [4 + 3 + 4 * k for k in range(world)], ranks
    assert all(r["equal"] and r["per_forward_equal"] and r["released_after"] and r["peft_equal"] for r in ranks), ranks
    # synced_gpus=True on the whole-gathered model: the same tokens, each
    # rank at its own length, and only the fit agreement's all-reduce, not
    # one per token (before, the bytes grew with the longest rank's tokens).
    assert all(r["synced_equal"] for r in ranks), ranks
    assert all(r["synced_allreduce_bytes"] == r["agreement_allreduce_bytes"] > 0 for r in ranks), ranks


@pytest.mark.parametrize("world", WORLDS)
def test_a_generate_whole_gather_is_kept_for_the_training_step_that_follows(world):
    """GRPO's shape: generate(), then train on the same weights. Kept (the
    default), the step's forward gathers nothing (the released twin's
    forward gathers the whole model again), with the same tokens, losses
    and weights bit for bit; nothing stays gathered past an optimizer
    step; a second generate() back to back gathers nothing; keep=False
    lets go of what a call kept."""
    for r in zoo(world)["generate"]["ranks"]:
        rl = r["rl"]
        kept, released = rl["kept"], rl["released"]
        assert kept["tokens"] == released["tokens"] and kept["losses"] == released["losses"], rl
        assert rl["same_weights"], rl
        assert all(kept["kept_after_generate"]) and not any(released["kept_after_generate"]), rl
        assert all(kept["none_after_step"]) and all(released["none_after_step"]), rl
        whole = released["generate_bytes"][0]
        assert whole > 0 and kept["generate_bytes"] == released["generate_bytes"] == [whole] * 3, rl
        for mine, theirs in zip(kept["step_bytes"], released["step_bytes"]):
            assert mine <= theirs - whole, rl  # at least the forward's whole gather saved
        assert kept["again_bytes"] == 0 and kept["let_go"], rl


@pytest.mark.parametrize("world", WORLDS)
def test_a_frozen_models_call_under_no_grad_gathers_it_whole_once_and_keeps_it(world):
    for r in zoo(world)["inference_gather"]["ranks"]:
        calls = r["calls"]
        assert all(c["equal"] for c in calls.values()), r  # the unsharded model's logits every way
        # whole once, kept: no gather for the next call, nor after another
        # model's optimizer step
        for name in ("first", "again", "after_policy_step"):
            assert calls[name]["kept"], (name, r)
        assert calls["first"]["gathers"] == 1 and calls["again"]["gathers"] == 0, r
        assert calls["after_policy_step"]["gathers"] == 0, r
        # a write through the engine moves the shard's version: gathered
        # again, with the new values (equal above), and kept; so after the
        # mode went off and on again
        for name in ("after_update", "after_data_assign", "kept_again"):
            assert calls[name]["gathers"] == 1 and calls[name]["kept"], (name, r)
        # let go, and module by module: with gradients on, mode off, a
        # param trainable again (while kept: an optimizer step would move
        # no shard version)
        for name in ("with_grad", "off", "trainable"):
            assert calls[name]["gathers"] > 10 and not calls[name]["kept"], (name, r)
        assert calls["not_kept"]["gathers"] == 1 and not calls["not_kept"]["kept"], r
        assert calls["copy"]["gathers"] == 1 and calls["copy"]["kept"], r
        assert r["tokens_equal"] and r["same_name"] and r["isinstance"], r
        mode, keep = r["refused"]
        assert "'always'" in mode and "expected 'auto', True or False" in mode, r
        assert "'forever'" in keep, r


def test_resize_token_embeddings_through_zeroshard_torch_alone():
    """Before (issue 59), without `import zeroshard.hf`: "param ... is
    partitioned and not gathered now"."""
    r = zoo(WORLDS[0])["resize"]
    assert r["hf_imported"] is False, r
    for name in ("gpt2", "llama"):
        assert r[name] == {"equal": True, "vocab": 64 + 7, "logits": [2, 12, 64 + 7], "partitioned": True}, r


@pytest.mark.parametrize("world", WORLDS)
def test_save_pretrained_writes_the_full_trained_weights(world):
    # torch's state_dict() of a partitioned model holds full values, so
    # Hugging Face's save_pretrained writes the real weights (ZeRO-3 under
    # DeepSpeed writes empty placeholders), tied embeddings kept tied.
    assert zoo(world)["save_pretrained"] == {"equal": True, "trained": True, "tied": True}


def test_converting_a_partitioned_module_is_a_clear_error():
    error = zoo(WORLDS[0])["convert"]["error"]
    assert error is not None and "Linear.weight is partitioned as torch.float32" in error, error
    assert "torch.float16" in error, error


def test_init_refuses_the_offload_it_does_not_do():
    import zeroshard.torch as zt
    with pytest.raises(NotImplementedError, match=r"remote_device='cpu' \(param offload\) is not acted on"):
        zt.Init(remote_device="cpu")
    with pytest.raises(NotImplementedError, match="pin_memory=True"):
        zt.Init(pin_memory=True)


LORA_MODES = ["plain", "checkpoint", "reentrant", "shared", "keyword", "mix"]


@pytest.mark.parametrize("mode", LORA_MODES)
def test_lora_frozen_base_released_during_backward(mode):
    """A frozen base (6 Linear(256, 256), not persistent) with small LoRA
    adapters on 2 ranks, no prefetch: each frozen layer's backward fetch is
    let go once its backward is done (its input's gradient came), so at
    most about two frozen layers are gathered during the backward and none
    after it, before the optimizer step; before, every frozen layer stayed
    gathered from its backward until the step. Plain, under non-reentrant
    and reentrant checkpointing, with one base called twice, with the
    bases' input passed as a keyword argument, and after a frozen unit no
    input of which needs a gradient (released when the backward ends)."""
    r = zoo(2, tuple(f"lora_memory_{m}" for m in LORA_MODES))[f"lora_memory_{mode}"]
    for step, (ref, ours) in enumerate(zip(r["ddp"], r["zeroshard"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), (mode, step, ref, ours, r)
    assert r["zeroshard"][-2] < r["zeroshard"][0], r  # two batches, alternating
    layer = r["layer_bytes"]
    # During the backward (sampled as each pair of layers' gradient
    # arrives): at most two frozen layers, plus small trainable params.
    for gathered, frozen in r["during"]:
        assert frozen <= 2 and gathered <= 2.5 * layer, (mode, r)
    # After the backward, before the step: no frozen layer.
    for gathered, frozen in r["after"]:
        assert frozen == 0 and gathered < 0.5 * layer, (mode, r)
    assert r["peak_gathered_bytes"] <= 3.5 * layer, (mode, r)
    assert r["left_gathered"] == 0, r
