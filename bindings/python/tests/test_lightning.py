"""The Lightning strategy: DeepSpeedStrategy's knobs mapped or refused (never
ignored), importable without Lightning, registered as strategy="zeroshard",
and a real 2-rank CPU fit whose losses equal Lightning's own DDP."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import zeroshard
import zeroshard.lightning as zl

HERE = Path(__file__).resolve().parent


# ---- knobs and config, without Lightning

def test_knobs_the_engine_acts_on_go_into_the_config():
    cfg = zl.config_from_knobs(reduce_bucket_size=1000, overlap_comm=False)
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 1000}
    zeroshard.config_check(cfg, world_size=2)
    # Every default knob maps to something the engine acts on: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", zeroshard.ZeroShardConfigWarning)
        with zeroshard.Context(rank=0, world_size=1, config=zl.config_from_knobs()) as ctx:
            assert ctx.inactive_config_keys == []
    # DeepSpeedStrategy's defaults (stage aside) are accepted as they are.
    assert zl.config_from_knobs(zero_optimization=True, stage=3, offload_optimizer=False,
                                sub_group_size=1_000_000_000_000, allgather_bucket_size=200_000_000,
                                nvme_path="/local_nvme", logging_batch_size_per_gpu="auto")


def test_offload_knobs_map_as_deepspeedstrategy_maps_them():
    cfg = zl.config_from_knobs(offload_parameters=True, offload_params_device="nvme", nvme_path="/tmp/nv",
                               max_in_cpu=10, offload_optimizer=True, offload_optimizer_device="nvme",
                               optimizer_buffer_count=2, sub_group_size=1000, queue_depth=4, thread_count=2)
    zero = cfg["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/tmp/nv", "max_in_cpu": 10}
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/tmp/nv", "buffer_count": 2}
    assert zero["sub_group_size"] == 1000
    assert cfg["aio"] == {"block_size": 1048576, "queue_depth": 4, "single_submit": False,
                          "overlap_events": True, "intra_op_parallelism": 2}
    # The engine acts on every key of it: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", zeroshard.ZeroShardConfigWarning)
        for c in (cfg, zl.config_from_knobs(offload_parameters=True, offload_optimizer=True)):
            zeroshard.config_check(c, world_size=2)
            with zeroshard.Context(rank=0, world_size=1, config=c) as ctx:
                assert ctx.inactive_config_keys == []
    cpu = zl.config_from_knobs(offload_parameters=True, offload_optimizer=True)["zero_optimization"]
    assert cpu["offload_param"] == {"device": "cpu"} and cpu["offload_optimizer"] == {"device": "cpu"}


@pytest.mark.parametrize("knob,value", [
    ("remote_device", "nvme"), ("remote_device", "cpu"), ("offload_params_device", "nvme"),
    ("offload_optimizer_device", "nvme"), ("offload_params_device", "disk"),
    ("nvme_path", "/nvme"), ("params_buffer_count", 8), ("params_buffer_size", 10**9),
    ("max_in_cpu", 10), ("optimizer_buffer_count", 8), ("pin_memory", True), ("block_size", 4096),
    ("queue_depth", 32), ("single_submit", True), ("overlap_events", False), ("thread_count", 4),
    ("sub_group_size", 10**9), ("contiguous_gradients", False), ("allgather_partitions", False),
    ("reduce_scatter", False), ("allgather_bucket_size", 5 * 10**8),
    ("zero_optimization", False), ("logging_batch_size_per_gpu", 8), ("logging_level", 10),
    ("partition_activations", True), ("cpu_checkpointing", True),
    ("contiguous_memory_optimization", True), ("synchronize_checkpoint_boundary", True),
    ("exclude_frozen_parameters", True),
])
def test_knobs_not_acted_on_are_errors_naming_knob_and_value(knob, value):
    with pytest.raises(zl.UnsupportedKnobError) as e:
        zl.config_from_knobs(**{knob: value})
    assert f"{knob}={value!r}" in str(e.value)


def test_every_offending_knob_is_named_at_once():
    with pytest.raises(zl.UnsupportedKnobError) as e:
        zl.config_from_knobs(offload_optimizer_device="nvme", nvme_path="/nvme", pin_memory=True)
    text = str(e.value)
    assert "offload_optimizer_device='nvme': has no effect without offload_optimizer=True" in text
    assert "nvme_path='/nvme': read only by NVMe offload" in text
    assert "pin_memory=True: offloaded state is not pinned" in text


def test_unknown_knob_is_a_type_error():
    with pytest.raises(TypeError, match="reduce_bucket_sise"):
        zl.config_from_knobs(reduce_bucket_sise=5)


def test_trainer_settings():
    cfg = zl.config_from_knobs()
    assert zl.trainer_config(cfg, "32-true", 0.5, "norm")["gradient_clipping"] == 0.5
    assert "gradient_clipping" not in zl.trainer_config(cfg, "bf16-mixed", None, None)
    with pytest.raises(zl.UnsupportedKnobError, match="gradient_clip_algorithm='value'"):
        zl.trainer_config(cfg, "32-true", 0.5, "value")
    with pytest.raises(zl.UnsupportedKnobError, match="disagree"):
        zl.trainer_config(dict(cfg, gradient_clipping=1.0), "32-true", 0.5, "norm")
    for precision in ("64-true", "transformer-engine"):
        with pytest.raises(zl.UnsupportedKnobError, match=f"precision='{precision}'"):
            zl.trainer_config(cfg, precision)


def test_precisions_map_to_the_config_as_deepspeedstrategy_maps_them():
    cfg = zl.config_from_knobs()
    for precision in ("bf16-mixed", "bf16-true"):
        assert zl.trainer_config(cfg, precision)["bf16"] == {"enabled": True}
    knobs = zl.fp16_knobs({"initial_scale_power": 8, "hysteresis": 1})
    for precision in ("16-mixed", "16-true"):
        assert zl.trainer_config(cfg, precision, loss_scaling=knobs)["fp16"] == {
            "enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
            "hysteresis": 1, "min_loss_scale": 1}
    for precision in ("32-true", "32"):
        out = zl.trainer_config(cfg, precision)
        assert "bf16" not in out and "fp16" not in out
    # The engine acts on every key the mapping writes: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", zeroshard.ZeroShardConfigWarning)
        with zeroshard.Context(rank=0, world_size=1, config=zl.trainer_config(cfg, "16-true",
                                                                              loss_scaling=knobs)) as ctx:
            assert ctx.inactive_config_keys == []
    # A config that says otherwise, or knobs that would change nothing, are errors.
    with pytest.raises(zl.UnsupportedKnobError, match="fp16.enabled is true"):
        zl.trainer_config(dict(cfg, fp16={"enabled": True}), "bf16-true")
    with pytest.raises(zl.UnsupportedKnobError, match="bf16.enabled is false"):
        zl.trainer_config(dict(cfg, bf16={"enabled": False}), "bf16-mixed")
    with pytest.raises(zl.UnsupportedKnobError, match="initial_scale_power=8, hysteresis=1: fp16 loss scaling acts only"):
        zl.trainer_config(cfg, "bf16-mixed", loss_scaling=knobs)
    with pytest.raises(zl.UnsupportedKnobError, match="would be ignored"):
        zl.trainer_config(dict(cfg, fp16={"enabled": True}), "16-true", loss_scaling=knobs)
    # The loss-scaling knobs are the strategy's as DeepSpeedStrategy's.
    assert zl.config_from_knobs(loss_scale=0, initial_scale_power=8) == cfg


def test_module_imports_without_lightning():
    code = ("import sys; sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
            "import zeroshard.lightning as zl\n"
            "assert zl.config_from_knobs(stage=3)['zero_optimization']['stage'] == 3\n"
            "try:\n    zl.ZeroShardStrategy\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ImportError: zeroshard.lightning.ZeroShardStrategy needs Lightning" in proc.stdout


# ---- the strategy class (needs Lightning)

@pytest.fixture(scope="module")
def lightning():
    return pytest.importorskip("lightning.pytorch")


def test_registered_as_zeroshard(lightning):
    from lightning.pytorch.strategies import StrategyRegistry
    assert "zeroshard" in StrategyRegistry
    trainer = lightning.Trainer(strategy="zeroshard", accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
    assert type(trainer.strategy) is zl.ZeroShardStrategy
    assert trainer.strategy.zs_config["zero_optimization"]["stage"] == 3


def test_strategy_refuses_knobs_it_would_ignore(lightning, tmp_path):
    with pytest.raises(zl.UnsupportedKnobError, match="pin_memory=True"):
        zl.ZeroShardStrategy(offload_parameters=True, pin_memory=True)
    offloaded = zl.ZeroShardStrategy(offload_parameters=True, offload_params_device="nvme", nvme_path=str(tmp_path))
    assert offloaded.zs_config["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    with pytest.raises(zl.UnsupportedKnobError, match="offload_parameters=True would be ignored"):
        zl.ZeroShardStrategy(config={"zero_optimization": {"stage": 3}}, offload_parameters=True)
    with pytest.raises(zl.UnsupportedKnobError, match="remote_device='nvme'"):
        zl.ZeroShardStrategy(remote_device="nvme", stage=3)
    # A config replaces the knobs: together they would ignore the knobs.
    with pytest.raises(zl.UnsupportedKnobError, match="reduce_bucket_size=5"):
        zl.ZeroShardStrategy(config={"zero_optimization": {"stage": 3}}, reduce_bucket_size=5)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 7}}))
    assert zl.ZeroShardStrategy(config=str(path)).zs_config["zero_optimization"]["reduce_bucket_size"] == 7


# ---- a real fit on 2 CPU ranks

@pytest.fixture(scope="module")
def fits(lightning, tmp_path_factory):
    """One launch, five fits (DDP, zeroshard by name, then both with gradient
    clipping, then zeroshard with NVMe offload), through Lightning's own
    subprocess launcher."""
    env = dict(os.environ)
    env["ZS_TEST_NVME_DIR"] = str(tmp_path_factory.mktemp("nvme"))
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
              "ZS_LAUNCHER", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    env["ZS_TIMEOUT_MS"] = "60000"
    proc = subprocess.run([sys.executable, str(HERE / "lightning_fit.py")], env=env, cwd=str(HERE),
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


def _same_losses(a, b):
    assert len(a["losses"]) == len(b["losses"]) >= 10
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert abs(x - y) <= 1e-5 * abs(x), (step, x, y)


def test_fit_matches_lightning_ddp(fits):
    assert fits["ddp"]["strategy"] == "DDPStrategy"
    assert fits["zeroshard"]["strategy"] == "ZeroShardStrategy"  # Trainer(strategy="zeroshard")
    _same_losses(fits["ddp"], fits["zeroshard"])
    assert fits["zeroshard"]["config_warnings"] == []
    # trainer.fit(torch.compile(module)) under the strategy: compiled, the same losses.
    assert fits["zeroshard_compiled"]["strategy"] == "ZeroShardStrategy"
    assert fits["zeroshard_compiled"]["partitioned_at_construction"] is True
    assert fits["zeroshard_compiled"]["graphs_compiled"] > 0 and fits["zeroshard"]["graphs_compiled"] == 0
    _same_losses(fits["zeroshard"], fits["zeroshard_compiled"])


def test_configure_model_partitions_at_construction(fits):
    assert fits["zeroshard"]["partitioned_at_construction"] is True
    assert fits["ddp"]["partitioned_at_construction"] is False


def test_gradient_clipping_is_acted_on(fits):
    # Clipping changes DDP's losses, and the engine's clipping follows them.
    assert fits["ddp_clip"]["losses"] != fits["ddp"]["losses"]
    _same_losses(fits["ddp_clip"], fits["zeroshard_clip"])
    cfg = fits["zeroshard_clip"]["effective_config"]
    assert cfg["gradient_clipping"] == 0.05
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 100
    assert cfg["zero_optimization"]["overlap_comm"] is False


def test_configure_optimizers_returning_a_torch_optimizer_steps_the_shards(fits):
    """RMSprop from configure_optimizers (no engine twin) steps the shards as
    it is, clipped by gradient_clip_val: Lightning DDP's losses."""
    assert fits["zeroshard_rmsprop"]["optimizer_class"] == "RMSprop"
    assert fits["zeroshard_rmsprop"]["partitioned_at_construction"] is True
    _same_losses(fits["ddp_rmsprop"], fits["zeroshard_rmsprop"])


def test_trainer_precisions_train_16_bit_params(fits):
    """bf16-mixed and bf16-true: bf16 params on fp32 masters, inputs cast,
    no autocast, losses within bf16's tolerance of DDP under bf16 autocast.
    16-true: fp16 params, the strategy's loss-scaling knobs in the fp16
    section, the dynamic scale driving Lightning's backward."""
    ref = fits["ddp_bf16_mixed"]["losses"]
    for precision in ("bf16-mixed", "bf16-true"):
        r = fits[f"zeroshard_{precision}"]
        assert r["param_dtypes"] == ["torch.bfloat16"], r
        assert r["config_warnings"] == [], r
        assert len(r["losses"]) == len(ref)
        for step, (a, b) in enumerate(zip(ref, r["losses"])):
            assert abs(a - b) <= 0.03 * abs(a) + 1e-3, (precision, step, a, b)
    r = fits["zeroshard_16-true"]
    assert r["param_dtypes"] == ["torch.float16"], r
    fp16 = r["effective_config"]["fp16"]
    assert fp16["enabled"] and fp16["initial_scale_power"] == 8 and fp16["loss_scale_window"] == 4, fp16
    # 12 clean steps with a window of 4 double the scale of 2**8 twice: at
    # the 5th and the 9th step (DeepSpeed's rule, loss_scaler.h).
    assert r["loss_scale"] == 2.0 ** 10, r
    for step, (a, b) in enumerate(zip(fits["ddp"]["losses"], r["losses"])):
        assert abs(a - b) <= 0.03 * abs(a) + 1e-3, (step, a, b)


def test_gradient_accumulation_matches_ddp(fits):
    # Losses per batch: 12 batches, 6 optimizer steps; the engine sums the
    # pushes between steps as DDP's no_sync does.
    _same_losses(fits["ddp_accumulate"], fits["zeroshard_accumulate"])
    assert fits["ddp_accumulate"]["losses"] != fits["ddp"]["losses"]


def test_offload_knobs_act(fits):
    # Parameter and optimizer offload to NVMe train as in memory, and the
    # engine warns about nothing in the config the knobs made.
    _same_losses(fits["ddp"], fits["zeroshard_nvme"])
    assert fits["zeroshard_nvme"]["config_warnings"] == []
    zero = fits["zeroshard_nvme"]["effective_config"]["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["max_in_cpu"] == 0
    assert zero["offload_optimizer"]["device"] == "nvme" and zero["sub_group_size"] == 1000


def test_steps_run_in_the_root_scope(fits):
    # Lightning calls training_step and validation_step, which reach the
    # model through self.net, never through the LightningModule's forward.
    # The strategy runs each step as the root's forward: gathered params
    # that autograd saves for backward are kept by reference, so each
    # layer's gathered weight goes after its forward. Saved by value, every
    # layer's weight (F.linear saves weight.t()) stayed gathered until its
    # backward: the whole model at the peak.
    ddp, ours = fits["ddp_wide"], fits["zeroshard_wide"]
    _same_losses(ddp, ours)
    assert len(ours["val_losses"]) == len(ddp["val_losses"]) >= 6
    for x, y in zip(ddp["val_losses"], ours["val_losses"]):
        assert abs(x - y) <= 1e-5 * abs(x), (ddp["val_losses"], ours["val_losses"])
    # After each training forward (before its backward): the gathered
    # buffers still alive. 6 of the 8 layers are 256x256 (1.59 MB of the
    # model's 1.59 MB unsharded); nothing persists, and the prefetch window
    # is one unit, so by reference about one layer's weight is alive; by
    # value every layer's was.
    memory, alive = ours["memory"], ours["alive_after_forward"]
    assert len(alive) == len(ours["losses"]), alive
    assert max(alive) <= 0.4 * memory["unsharded_bytes"], (alive, memory)
    # What the engine holds gathered itself stays one unit at its peak.
    assert 0 < memory["peak_gathered_bytes"] <= 0.4 * memory["unsharded_bytes"], memory


def test_a_scheduler_made_on_the_torch_optimizer_follows_the_engines_twin_quietly(fits):
    """configure_optimizers returns AdamW and a StepLR made on it; the
    strategy swaps the AdamW for the engine's twin. The scheduler steps the
    twin's lr (the losses above are DDP's, and so is the lr at the end), and
    torch's check that the optimizer stepped before the scheduler is
    satisfied: before, it warned that optimizer.step() had been overridden."""
    ddp, ours = fits["ddp_wide"], fits["zeroshard_wide"]
    assert ours["lr"] == ddp["lr"] == pytest.approx(1e-3 * 0.5 ** (len(ours["losses"]) // 3))
    assert ddp["scheduler_warnings"] == [] and ours["scheduler_warnings"] == []


def test_steps_get_the_root_forwards_step_work(fits):
    # Every param of the Regression model is persistent: every unit is
    # kept, so from the first step on its module runs without the engine's
    # forward hooks (decided at the root's forward, here the step's), and
    # every gradient goes to the engine as the backward ends (a hook on the
    # step's loss), none left in .grad for the optimizer step to take.
    ours = fits["zeroshard"]
    # Hooked still: the modules without params (the Sequential, the Tanhs).
    assert ours["hooked"] == ["", "1", "3"], ours["hooked"]
    assert ours["grads_after_backward"] == [[]] * len(ours["losses"]), ours["grads_after_backward"]


def test_validate_test_predict_without_fit_and_after_it(fits):
    # Lightning sets a strategy up for validate, test and predict without
    # its fit path (DDPStrategy wraps only to fit): a model built under
    # Init got no hooks there and failed in its first layer ("mat2 must
    # be a matrix"). After fit the same trainer evaluates the fitted
    # weights: the context outlives fit's teardown.
    ddp, ours = fits["ddp_eval"], fits["zeroshard_eval"]
    for phase, keys in (("before_fit", ("val", "test", "predict")), ("after_fit", ("losses", "val", "test"))):
        for key in keys:
            a, b = ddp[phase][key], ours[phase][key]
            assert len(a) == len(b) >= 3, (phase, key, a, b)
            for x, y in zip(a, b):
                assert abs(x - y) <= 1e-5 * abs(x), (phase, key, a, b)
    # Fitting changed what validation sees.
    assert ours["after_fit"]["val"] != ours["before_fit"]["val"]


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_checkpoint_saves_and_resumes_through_the_engine(lightning, tmp_path, async_checkpoint):
    # ModelCheckpoint after epoch 1 and fit(ckpt_path=...) into a
    # fresh model: epoch 2's losses are those of the fit that never stopped;
    # with async_checkpoint the save was written in the background.
    env = dict(os.environ)
    env["ZS_TEST_ASYNC_CHECKPOINT"] = "1" if async_checkpoint else "0"
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
              "ZS_LAUNCHER", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    env["ZS_TIMEOUT_MS"] = "60000"
    proc = subprocess.run([sys.executable, str(HERE / "lightning_ckpt.py"), str(tmp_path)], env=env,
                          cwd=str(HERE), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    per_epoch = len(r["first"])
    assert per_epoch >= 5 and len(r["whole"]) == 2 * per_epoch
    assert r["first"] == r["whole"][:per_epoch]
    assert len(r["resumed"]) == per_epoch  # only epoch 2 ran
    for x, y in zip(r["resumed"], r["whole"][per_epoch:]):
        assert abs(x - y) <= 1e-6 * abs(x), (r["resumed"], r["whole"])
    assert r["lr"] == pytest.approx(1e-2)
    # The engine's format: a manifest and per-rank safetensors, no pickle.
    assert r["files"] == ["manifest.json", "rank-00000-of-00002.safetensors",
                          "rank-00001-of-00002.safetensors"]


def test_checkpoint_state_goes_through_json_without_pickle():
    import math

    import torch
    from zeroshard.lightning import _from_json, _to_json
    state = {"score": torch.tensor([1.5, float("inf")]), "bf": torch.tensor([[1.0, -2.5]], dtype=torch.bfloat16),
             "scalar": torch.tensor(3), "best": float("-inf"), "pair": (1, "x"), "none": None}
    back = _from_json(json.loads(json.dumps(_to_json(state, "checkpoint"), allow_nan=False)))
    assert torch.equal(back["score"], state["score"]) and back["bf"].dtype == torch.bfloat16
    assert torch.equal(back["bf"], state["bf"]) and back["scalar"].shape == () and int(back["scalar"]) == 3
    assert math.isinf(back["best"]) and back["best"] < 0 and back["pair"] == [1, "x"] and back["none"] is None
    with pytest.raises(TypeError, match=r"checkpoint\['obj'\] is a object"):
        _to_json({"obj": object()}, "checkpoint")
