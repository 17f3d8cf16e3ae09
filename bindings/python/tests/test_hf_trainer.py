"""Hugging Face's Trainer on real ranks: the same script and DeepSpeed JSON
through transformers.Trainer under DDP and through zeroshard.hf.Trainer
(hf_trainer_worker.py), compared step by step."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ZSRUN = REPO / "build" / "bin" / "zsrun"
_runs = {}


def run(n, mode, engine, directory=None, launcher="zsrun", timeout=600):
    """Rank 0's result of `mode` through `engine` on n ranks."""
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
              "ZS_LAUNCHER", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION"):
        env.pop(k, None)
    env["ZS_TIMEOUT_MS"] = "60000"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    with tempfile.TemporaryDirectory(prefix="zs_hf_") as scratch:
        env["ZS_TEST_DIR"] = directory or scratch
        env["ZS_TEST_RESULT"] = result = os.path.join(scratch, "result.json")
        worker = [sys.executable, str(HERE / "hf_trainer_worker.py"), mode, engine]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   *worker[1:]]
        else:
            cmd = [str(ZSRUN), "-n", str(n), "--no-prefix", "--", *worker]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        assert os.path.exists(result), "rank 0 wrote no result\n" + proc.stdout + proc.stderr[-8000:]
        with open(result) as f:
            return json.load(f)


def cached(n, mode, engine, launcher="zsrun"):
    key = (n, mode, engine, launcher)
    if key not in _runs:
        _runs[key] = run(n, mode, engine, launcher=launcher)
    return _runs[key]


def same(a, b, rel=1e-5):
    assert len(a) == len(b) and a, (a, b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(x), (step, x, y, a, b)


@pytest.mark.parametrize("kind", ["causal_lm", "classifier", "seq2seq"])
def test_trainer_with_a_deepspeed_json_trains_as_ddp(kind):
    """One import changed: the same TrainingArguments (deepspeed= a JSON of
    "auto"s, gradient accumulation 2, clipping, a linear schedule with
    warmup, evaluation every 3 steps, early stopping for the classifier),
    the same losses per logged step as the Trainer under DDP, the same
    evaluation losses, predictions (generate() in the eval loop for the
    encoder-decoder), learning rates and gradient norms."""
    ddp, ours = cached(2, kind, "ddp"), cached(2, kind, "zeroshard")
    assert ours["partitioned"] and not ddp["partitioned"]
    same(ddp["losses"], ours["losses"])
    same(ddp["eval_losses"], ours["eval_losses"])
    assert ours["lrs"] == ddp["lrs"]
    same(ddp["grad_norms"], ours["grad_norms"], rel=1e-4)
    assert ours["predict_shape"] == ddp["predict_shape"]
    assert ours["predictions"] == ddp["predictions"]


def test_trainer_on_three_ranks_under_torchrun():
    ddp = run(3, "causal_lm", "ddp", launcher="torchrun")
    ours = run(3, "causal_lm", "zeroshard", launcher="torchrun")
    same(ddp["losses"], ours["losses"])
    same(ddp["eval_losses"], ours["eval_losses"])


def test_save_model_writes_what_from_pretrained_reads():
    r = cached(2, "save", "zeroshard")
    assert "model.safetensors" in r["files"] and "config.json" in r["files"], r
    assert r["equal"] and r["keys_missing"] == [], r


def test_resume_from_checkpoint_at_another_world_size(tmp_path):
    """save_strategy "steps" on 2 ranks writes the engine's sharded
    checkpoint at step 4; resume_from_checkpoint on 3 ranks (the same
    global batch) goes on as DDP's run resumed likewise does."""
    results = {}
    for engine in ("ddp", "zeroshard"):
        directory = str(tmp_path / engine)
        os.makedirs(directory)
        first = run(2, "resume_save", engine, directory)
        resumed = run(3, "resume_load", engine, directory)
        assert first["steps"] == resumed["steps"] == 8
        results[engine] = (first, resumed)
        if engine == "zeroshard":
            assert os.path.isdir(os.path.join(directory, engine, "checkpoint-4", "zeroshard"))
    same(results["ddp"][0]["losses"], results["zeroshard"][0]["losses"])
    same(results["ddp"][1]["losses"], results["zeroshard"][1]["losses"])


def test_from_pretrained_partitions_at_load_time():
    """TrainingArguments(deepspeed=...), then from_pretrained, then the
    Trainer (DeepSpeed's order): the model comes back partitioned, each
    rank having read its own shards' bytes of model.safetensors, equal to
    the saved weights, and trains as DDP's plainly loaded copy."""
    ddp, ours = cached(2, "pretrained", "ddp"), cached(2, "pretrained", "zeroshard")
    assert ours["partitioned_at_load"] and not ddp["partitioned_at_load"]
    assert ours["loaded"] and ddp["loaded"]
    same(ddp["losses"], ours["losses"])


def test_peft_lora_on_a_frozen_base_trains_as_ddp():
    """get_peft_model on a base that from_pretrained partitioned (PEFT sizes
    its adapters by the params' ds_shape): the adapters train as under DDP,
    the frozen base is unchanged, save_model writes PEFT's adapter files."""
    pytest.importorskip("peft")
    ddp, ours = cached(2, "lora", "ddp"), cached(2, "lora", "zeroshard")
    assert ours["trainable"] == ddp["trainable"] and ours["trainable"]
    assert ours["base_unchanged"] and ddp["base_unchanged"]
    same(ddp["losses"], ours["losses"])
    assert "adapter_model.safetensors" in ours["adapter_files"], ours


def test_trl_sft_trainer_trains_as_under_ddp():
    """TRL's SFTTrainer on text (a tokenizer built here, no Hub), through
    zeroshard.hf.trainer_class(SFTTrainer): the losses of SFTTrainer under
    DDP."""
    pytest.importorskip("trl")
    same(cached(2, "sft", "ddp")["losses"], cached(2, "sft", "zeroshard")["losses"])


def test_bf16_training_arguments_train_bf16_params():
    """TrainingArguments(bf16=True) with "bf16": {"enabled": "auto"}: the
    engine trains bf16 params on fp32 masters (DeepSpeed's reading of it);
    DDP runs autocast over fp32 params. Within bf16's tolerance."""
    ddp, ours = cached(2, "bf16", "ddp"), cached(2, "bf16", "zeroshard")
    assert ours["dtypes"] == ["torch.bfloat16"] and ddp["dtypes"] == ["torch.float32"]
    same(ddp["losses"], ours["losses"], rel=0.02)
    assert ours["losses"] != ddp["losses"]
