"""Accelerate on the engine: `accelerate launch` starting a script written
against Accelerate (accelerate_worker.py) on 2 CPU ranks, through
accelerate.Accelerator (DDP) and zeroshard.hf.Accelerator, and
DeepSpeedPlugin's knobs mapped onto the engine's config."""
import sys

import pytest

from launch_env import HERE, REPO, once, rank0_result

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@once
def launch(engine, *flags):
    """Rank 0's result of accelerate_worker.py through `engine` on 2 ranks
    under `accelerate launch` with `flags`."""
    if not (REPO / "build" / "lib" / "libzeroshard.so").exists():
        pytest.skip("libzeroshard is not built")
    # On a host without GPUs, --multi_gpu (or --use_deepspeed) is what
    # makes accelerate launch start several processes (torchrun); the
    # script's Accelerator(cpu=True) runs them as CPU ranks.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *(flags or ("--multi_gpu",)),
           str(HERE / "accelerate_worker.py"), engine]
    return rank0_result(cmd, "zs_accelerate_", 600, cwd="scratch")[0]


def same(a, b):
    assert len(a) == len(b) and a
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(x), (step, x, y, a, b)


def test_accelerator_script_trains_as_ddp():
    """prepare (the torch AdamW and its scheduler converted), accumulate over
    2 micro-batches, backward, clip_grad_norm_ (the config's clipping),
    save_state and load_state: the losses of accelerate.Accelerator's DDP,
    and the same losses again after going back to the saved state."""
    ddp, ours = launch("ddp"), launch("zeroshard")
    assert ddp["world"] == ours["world"] == 2 and ddp["type"] == "DistributedType.MULTI_CPU"
    assert ours["partitioned"] and not ddp["partitioned"]
    same(ddp["losses"], ours["losses"])
    same(ours["losses"][6:], ours["again"])


def test_fsdp2_plugin_routes_to_fully_shard_and_trains_as_ddp():
    """Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    transformer-based wrap)): each GPT2Block and then the model fully_shard'd
    by zeroshard, the torch AdamW kept (stepping the shards): DDP's losses,
    and again after save_state / load_state."""
    ddp, ours = launch("ddp"), launch("zeroshard_fsdp")
    assert ours["partitioned"] and ours["model_type"] == "FSDPGPT2LMHeadModel", ours
    assert ours["fsdp_units"] == ["FSDPGPT2Block", "FSDPGPT2Block", "FSDPGPT2LMHeadModel"], ours
    assert ours["optimizer"] == "AdamW"
    same(ddp["losses"], ours["losses"])
    same(ours["losses"][6:], ours["again"])


def test_accelerate_launch_use_deepspeed_flags_reach_the_engine():
    """accelerate launch --use_deepspeed --zero_stage 3 with its accumulation
    and clipping flags: Accelerate's DeepSpeedPlugin from the environment,
    mapped onto the engine's config (DeepSpeed itself is not started)."""
    ours = launch("zeroshard_env", "--use_deepspeed", "--zero_stage", "3", "--gradient_accumulation_steps", "2",
                  "--gradient_clipping", "1.0")
    cfg = ours["config"]
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["gradient_accumulation_steps"] == 2, cfg
    assert cfg["gradient_clipping"] == 1.0, cfg
    same(launch("ddp")["losses"], ours["losses"])


def test_deepspeed_plugin_knobs_map_or_are_refused():
    from accelerate import DeepSpeedPlugin

    from zeroshard.hf.accelerator import config_from_plugin
    cfg = config_from_plugin(DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.5, gradient_accumulation_steps=4,
                                             offload_optimizer_device="cpu", zero3_save_16bit_model=True),
                             mixed_precision="bf16")
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert cfg["gradient_clipping"] == 0.5 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["bf16"] == {"enabled": True}
    assert "steps_per_print" not in cfg  # Accelerate's inf, which JSON cannot hold
    # Stages 1 and 2 act (params whole on every rank: test_fsdp2.py's stages).
    assert config_from_plugin(DeepSpeedPlugin(zero_stage=2))["zero_optimization"]["stage"] == 2
    with pytest.raises(ValueError, match="set_leaf_modules"):
        config_from_plugin(DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="MixtralSparseMoeBlock"))


_FP16_SKIP = r'''
import json, sys
import torch
from torch import nn
from zeroshard.hf import Accelerator
import zeroshard.torch as zt

acc = Accelerator(zeroshard_config={"zero_optimization": {"stage": 3},
                                    "fp16": {"enabled": True, "initial_scale_power": 8}}, cpu=True)
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model, opt, sched = acc.prepare(model, opt, sched)
out = []
for overflow in (False, True, False):
    x = torch.randn(2, 8).to(torch.float16)
    loss = model(x).float().pow(2).mean() * (float("inf") if overflow else 1.0)
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    out.append({"skipped": opt.step_was_skipped, "accelerator_skipped": acc.optimizer_step_was_skipped,
                "lr": sched.get_last_lr()[0]})
zt.shutdown()
print("RESULT " + json.dumps(out))
'''


def test_a_skipped_fp16_step_does_not_step_the_prepared_scheduler(tmp_path):
    """An fp16 step the engine skips for overflow reads as skipped through
    Accelerate's optimizer wrapper (whose own flag follows a GradScaler
    only), so Accelerate's scheduler does not step on it, as under
    DeepSpeed: one process, the scheduler halving the lr each step; and
    no warning that the optimizer's step was overridden."""
    import json
    import subprocess

    from launch_env import ranks_env
    if not (REPO / "build" / "lib" / "libzeroshard.so").exists():
        pytest.skip("libzeroshard is not built")
    proc = subprocess.run([sys.executable, "-c", _FP16_SKIP], env=ranks_env(), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert [s["skipped"] for s in steps] == [False, True, False], steps
    assert [s["accelerator_skipped"] for s in steps] == [False, True, False], steps
    assert [s["lr"] for s in steps] == [0.05, 0.05, 0.025], steps
    # The scheduler, made on the torch AdamW, follows the engine's twin
    # without torch's "optimizer.step() has been overridden" at each step.
    assert "has been overridden" not in proc.stderr, proc.stderr
