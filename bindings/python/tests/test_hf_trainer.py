"""Hugging Face's Trainer on real ranks: the same script and DeepSpeed JSON
through transformers.Trainer under DDP and through zeroshard.hf.Trainer
(hf_trainer_worker.py), compared step by step."""
import os

import pytest

from launch_env import REPO, once, rank0_result, torchrun, zsrun

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def run(n, mode, engine, directory=None, launcher="zsrun", timeout=600, extra_env=None):
    """Rank 0's result of `mode` through `engine` on n ranks."""
    cmd = (torchrun if launcher == "torchrun" else zsrun)(n, "hf_trainer_worker.py", mode, engine)
    return rank0_result(cmd, "zs_hf_", timeout, extra_env=extra_env, directory=directory)[0]


# The modes each engine runs on 2 ranks, in one launch per engine for the
# whole file (transformers, Accelerate and torch import once per rank).
# resize first: each rank saves its own base model before torch.distributed
# is up (once it is, save_pretrained writes on rank 0 only).
WORLDS = {
    "ddp": ["resize", "causal_lm", "classifier", "seq2seq", "pretrained", "lora", "sft", "bf16",
            "optim_adafactor", "compiled", "muon_config"],
    "zeroshard": ["resize", "causal_lm", "classifier", "seq2seq", "save", "pretrained", "lora", "sft", "bf16",
                  "optim_adafactor", "compiled", "muon_config"],
}


@once
def world(engine):
    return run(2, ",".join(WORLDS[engine]), engine, timeout=1200)


@once
def cached(n, mode, engine, launcher="zsrun"):
    """Rank 0's result of `mode`: from its engine's world, or a launch of its own."""
    if n == 2 and launcher == "zsrun" and mode in WORLDS.get(engine, ()):
        return world(engine)[mode]
    return run(n, mode, engine, launcher=launcher)


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


def test_fsdp2_trainer_arguments_train_as_ddp():
    """An FSDP2 Trainer script (fsdp="full_shard auto_wrap", fsdp_config
    version 2 wrapping GPT2Block) on zeroshard.hf.Trainer: each block and
    then the model fully_shard'd by zeroshard, the Trainer's torch AdamW
    stepping the shards, gradient checkpointing and evaluation as in the
    DeepSpeed run: DDP's losses, evaluation losses and norms."""
    ddp, ours = cached(2, "causal_lm", "ddp"), cached(2, "causal_lm", "zeroshard_fsdp2")
    assert ours["partitioned"]
    assert ours["fsdp_units"] == ["FSDPGPT2Block", "FSDPGPT2Block", "FSDPGPT2LMHeadModel"], ours
    same(ddp["losses"], ours["losses"])
    same(ddp["eval_losses"], ours["eval_losses"])
    same(ddp["grad_norms"], ours["grad_norms"], rel=1e-4)


def test_optim_argument_names_a_torch_optimizer_that_trains_as_ddp():
    """TrainingArguments(optim="adafactor"): the Trainer's own torch optimizer
    (transformers' Adafactor, a whole-tensor rule: each param on its owner
    rank) steps the engine's shards, with the Trainer's clipping
    (max_grad_norm) by the global norm: DDP's losses and norms. (Every
    optim= value takes this route but the AdamW ones and sgd, which map to
    the engine's fused C++ optimizer; test_torch_optimizers checks the
    elementwise ones.)"""
    ddp, ours = cached(2, "optim_adafactor", "ddp"), cached(2, "optim_adafactor", "zeroshard")
    assert ours["optimizer"] == ddp["optimizer"] == "Adafactor"
    same(ddp["losses"], ours["losses"])
    same(ddp["grad_norms"], ours["grad_norms"], rel=1e-4)


def test_deepspeed_muon_config_trains_as_deepspeeds_muon_under_ddp():
    """"optimizer": {"type": "Muon", ...} in the DeepSpeed JSON ("auto"s
    resolved from the arguments): the engine's Muon (ZS_OPTIM_MUON, "gram"
    Newton-Schulz in C++) over the Trainer's groups split as DeepSpeed
    splits them; the Trainer under DDP gets DeepSpeed's own MuonWithAuxAdam
    over the same groups: the same losses and gradient norms."""
    ddp, ours = cached(2, "muon_config", "ddp"), cached(2, "muon_config", "zeroshard")
    assert ddp["optimizer"] == "MuonWithAuxAdam", ddp
    assert ours["optimizer"] == "ZeroShardOptimizer" and ours["kind"] == "muon", ours
    assert ours["muon_groups"] == ddp["muon_groups"] == 1  # the hidden matrices (all decayed)
    same(ddp["losses"], ours["losses"])
    same(ddp["grad_norms"], ours["grad_norms"], rel=1e-4)


def test_trainer_on_three_ranks_under_torchrun():
    ddp = run(3, "causal_lm", "ddp", launcher="torchrun")
    ours = run(3, "causal_lm", "zeroshard", launcher="torchrun")
    same(ddp["losses"], ours["losses"])
    same(ddp["eval_losses"], ours["eval_losses"])


def test_torch_compile_trains_as_ddp_compiled():
    """TrainingArguments(torch_compile=True) is accepted and acts: the
    partitioned model is compiled and trains as DDP's compiled model."""
    ddp, ours = cached(2, "compiled", "ddp"), cached(2, "compiled", "zeroshard")
    assert ours["partitioned"] and ours["compiled"] and ddp["compiled"], (ours, ddp)
    same(ddp["losses"], ours["losses"])


def test_resize_token_embeddings_then_training_as_unsharded():
    """resize_token_embeddings on a model from_pretrained partitioned: the
    new shapes everywhere, and training equal to the same resize under DDP."""
    ddp, ours = cached(2, "resize", "ddp"), cached(2, "resize", "zeroshard")
    assert ours["partitioned"], ours
    assert ours["shapes"] == ddp["shapes"] and ours["vocab"] == ddp["vocab"] == 96 + 7, (ours, ddp)
    same(ddp["losses"], ours["losses"])
    # An untied head (a Llama): transformers replaces the head module; it
    # is partitioned with rank 0's values, and the model gives DDP's loss.
    assert ours["untied_partitioned"] and ours["untied_shapes"] == ddp["untied_shapes"], (ours, ddp)
    assert ours["untied_shapes"]["lm_head.weight"] == [96 + 5, 32], ours
    same([ddp["untied_loss"]], [ours["untied_loss"]])


def test_save_model_writes_what_from_pretrained_reads():
    r = cached(2, "save", "zeroshard")
    assert "model.safetensors" in r["files"] and "config.json" in r["files"], r
    assert r["equal"] and r["keys_missing"] == [], r


def test_resume_from_checkpoint_at_another_world_size(tmp_path):
    """save_strategy "steps" on 2 ranks writes the engine's sharded
    checkpoint at step 4 (zeroshard.hf.Trainer(async_checkpoint=True): in
    the background while training goes on); resume_from_checkpoint on 3
    ranks (the same global batch) goes on as DDP's run resumed likewise
    does. The synchronous save is the other tests' (checkpoint, Lightning)."""
    results = {}
    for engine in ("ddp", "zeroshard"):
        directory = str(tmp_path / engine)
        os.makedirs(directory)
        first = run(2, "resume_save", engine, directory, extra_env={"ZS_TEST_ASYNC_CHECKPOINT": "1"})
        resumed = run(3, "resume_load", engine, directory)
        assert first["steps"] == resumed["steps"] == 8
        results[engine] = (first, resumed)
        if engine == "zeroshard":
            assert os.path.isfile(os.path.join(directory, engine, "checkpoint-4", "zeroshard", "latest"))
    same(results["ddp"][0]["losses"], results["zeroshard"][0]["losses"])
    same(results["ddp"][1]["losses"], results["zeroshard"][1]["losses"])


@pytest.mark.parametrize("engine", ["deepspeed", "ddp"])
def test_resume_a_checkpoint_transformers_trainer_wrote(engine, tmp_path):
    """transformers.Trainer under DeepSpeed itself (ZeRO-3 fp32 and bf16,
    ZeRO-2 bf16, ZeRO-1 fp32: its global_stepN/ layouts) or under DDP (fp32 and bf16 autocast:
    model.safetensors and optimizer.pt) saves checkpoint-4 of 8 steps; the
    same script through zeroshard.hf.Trainer (and DDP's fp32 one through
    the FSDP2 arguments: the torch AdamW stepping the shards) resumes it with
    resume_from_checkpoint at 2 and 3 ranks (the same global batch): the
    weights, Adam moments, step, schedule, trainer_state.json and RNG taken
    over, steps 5-8 equal the original engine's own uninterrupted run's
    (fp32 1e-5; bf16 1e-4, its rounding). Before (issue 59): "holds no
    zeroshard checkpoint". FSDP2's own layouts: the test below. Under
    DeepSpeed also a PEFT LoRA model, which the Trainer saves without its
    frozen base (exclude_frozen_parameters): the adapters, their moments
    and step load, the base stays as built (DDP's LoRA checkpoint: the
    LoRA test below)."""
    env = {"DS_ACCELERATOR": "cpu"} if engine == "deepspeed" else {}
    variants = [("", 1e-5), ("_s2bf16", 1e-4)] + (
        [("_bf16", 1e-4), ("_s1", 1e-5), ("_lora", 1e-5)] if engine == "deepspeed" else [])
    theirs = run(2, ",".join(f"resume_save{v}" for v, _ in variants), engine, str(tmp_path), extra_env=env)
    # DDP's checkpoint also through the FSDP2 arguments (the torch AdamW stepping the shards)
    loads = [(f"resume_load{v}", v, rel) for v, rel in variants] + (
        [("resume_load@zeroshard_fsdp2", "", 1e-5)] if engine == "ddp" else [])
    for n in (2, 3):
        ours = run(n, ",".join(mode for mode, _, _ in loads), "zeroshard",
                   extra_env={"ZS_TEST_RESUME_ROOT": str(tmp_path), "ZS_TEST_RESUME_ENGINE": engine})
        for mode, variant, rel in loads:
            saved = tmp_path / f"resume_save{variant}" / engine / "checkpoint-4"
            assert not (saved / "zeroshard").exists()
            assert (saved / "latest").is_file() if engine == "deepspeed" else (saved / "optimizer.pt").is_file()
            mine = ours[mode]
            assert mine["steps"] == 8, mine
            same(theirs[f"resume_save{variant}"]["losses"], mine["losses"], rel=rel)
    if engine == "deepspeed":  # a PEFT model of other target modules: named, before anything loads
        import peft
        from zeroshard.hf.trainer import _deepspeed_without_frozen
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        other = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(
            r=4, target_modules=["c_attn"], fan_in_fan_out=True))
        with pytest.raises(ValueError, match=r"in it but not in the model \['base_model.model.transformer.h.0.attn"
                                             r".c_proj.lora_A.default.weight'"):
            _deepspeed_without_frozen(str(tmp_path / "resume_save_lora" / engine / "checkpoint-4"), other)


def test_resume_a_checkpoint_transformers_trainer_wrote_under_fsdp2(tmp_path):
    """transformers.Trainer under FSDP2 itself (fsdp_config version 2;
    Accelerate's FSDP2 code on a CPU world: hf_trainer_worker.FSDP2Trainer)
    saves checkpoint-4 of 8 steps as Accelerate writes it, with
    state_dict_type SHARDED_STATE_DICT (pytorch_model_fsdp_0/ and
    optimizer_0/, torch DCP) and FULL_STATE_DICT (pytorch_model_fsdp.bin and
    optimizer.bin, keyed by name), beside the Trainer's scheduler.pt,
    trainer_state.json and RNG files, and resumes each itself.
    zeroshard.hf.Trainer resumes each at 2 ranks through the same FSDP2
    arguments (the torch AdamW stepping the shards) and through a DeepSpeed
    JSON (the engine's AdamW), and at 3 ranks (the same global batch) the
    sharded one through the first, the full one through the second: steps
    5-8 equal FSDP2's own resumed run's within 1e-5 (fp32). Before: the
    sharded folder was "holds no zeroshard checkpoint", the full one
    refused (only DDP's optimizer.pt was read)."""
    env = {"ZS_TEST_RESUME_ROOT": str(tmp_path), "ZS_TEST_RESUME_ENGINE": "fsdp2"}
    theirs = run(2, "resume_save,resume_load,resume_save_full,resume_load_full", "fsdp2", str(tmp_path),
                 extra_env=env)
    sharded = tmp_path / "resume_save" / "fsdp2" / "checkpoint-4"
    assert {"pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= {f.name for f in sharded.iterdir()}, sorted(sharded.iterdir())
    assert not (sharded / "model.safetensors").exists() and not (sharded / "zeroshard").exists()
    full = tmp_path / "resume_save_full" / "fsdp2" / "checkpoint-4"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.pt"} <= {f.name for f in full.iterdir()}
    assert not (full / "optimizer.pt").exists()  # not DDP's layout
    for variant in ("", "_full"):
        own = theirs[f"resume_load{variant}"]
        assert theirs[f"resume_save{variant}"]["model_type"] == own["model_type"] == "FSDPGPT2LMHeadModel"
        assert own["steps"] == 8 and own["losses"] == theirs[f"resume_save{variant}"]["losses"]  # its own resume
    every = [f"resume_load{v}{e}" for v in ("", "_full") for e in ("@zeroshard_fsdp2", "")]
    for n, modes in ((2, every), (3, every[0::3])):  # at 3 ranks: sharded by the FSDP2 script, full by the JSON's
        ours = run(n, ",".join(modes), "zeroshard", str(tmp_path / f"ours{n}"), extra_env=env)
        for mode in modes:
            assert ours[mode]["steps"] == 8, (n, mode, ours[mode])
            same(theirs[mode.partition("@")[0]]["losses"], ours[mode]["losses"])


def test_resume_a_lora_checkpoint_transformers_trainer_wrote(tmp_path):
    """A PEFT LoRA model (adapters on c_attn and c_proj, the base frozen)
    under transformers.Trainer with DDP saves checkpoint-4 of 8 steps: the
    adapters alone (adapter_model.safetensors), optimizer.pt over them (its
    no-decay group empty), the scheduler, state and RNG; it resumes itself.
    The same script through zeroshard.hf.Trainer (a DeepSpeed JSON) resumes
    it at 2 and 3 ranks (the same global batch): the adapter weights by PEFT's own key names, their Adam moments and
    step, the schedule (the empty group's entries left out, as the engine's
    optimizer leaves the group out): steps 5-8 equal DDP's own resume
    within 1e-5. A PEFT model of other target modules and a plain model
    are ValueErrors naming what differs, before anything loads."""
    pytest.importorskip("peft")
    env = {"ZS_TEST_RESUME_ROOT": str(tmp_path), "ZS_TEST_RESUME_ENGINE": "ddp"}
    theirs = run(2, "resume_save_lora,resume_load_lora", "ddp", str(tmp_path), extra_env=env)
    saved = tmp_path / "resume_save_lora" / "ddp" / "checkpoint-4"
    files = {f.name for f in saved.iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= files, files
    assert "model.safetensors" not in files
    groups = torch.load(saved / "optimizer.pt", weights_only=True)["param_groups"]
    assert [len(g["params"]) for g in groups] == [12, 0]
    own = theirs["resume_load_lora"]
    assert own["steps"] == 8 and own["losses"] == theirs["resume_save_lora"]["losses"]
    for n in (2, 3):
        ours = run(n, "resume_load_lora", "zeroshard", str(tmp_path / f"ours{n}"), extra_env=env)
        assert ours["steps"] == 8 and ours["model_type"] == "PeftModel", ours
        same(own["losses"], ours["losses"])
    # Bad input, named before anything loads (no engine needed for it).
    import peft
    from zeroshard.torch import trainer_checkpoint

    def lora(targets):
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        return peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(
            r=4, target_modules=targets, fan_in_fan_out=True))
    with pytest.raises(ValueError, match=r"in the file but not trainable here \['base_model.model.transformer.h.0.attn"
                                         r".c_proj.lora_A.weight'"):
        trainer_checkpoint.load_adapters(str(saved), lora(["c_attn"]), None)
    with pytest.raises(ValueError, match="the model is a GPT2LMHeadModel, not a peft.PeftModel"):
        trainer_checkpoint.load_adapters(str(saved), lora(["c_attn"]).get_base_model(), None)


def _zero_to_fp32(folder, out):
    """DeepSpeed's zero_to_fp32.py, as copied into `folder`, run there: the
    consolidated fp32 state dict it writes (pytorch_model.bin)."""
    import subprocess
    import sys
    from launch_env import ranks_env
    proc = subprocess.run([sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(out)],
                          env=ranks_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out / "pytorch_model.bin", weights_only=True)


def _zeroshard_fp32(checkpoint, out):
    """zsckpt export --fp32 of the engine's checkpoint in `checkpoint`: the
    full fp32 masters under their names."""
    import subprocess
    from safetensors.torch import load_file
    proc = subprocess.run([str(REPO / "build" / "bin" / "zsckpt"), "export", str(checkpoint / "zeroshard"), str(out),
                           "--fp32"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load_file(out)


def test_transformers_trainer_under_deepspeed_resumes_a_checkpoint_zeroshard_wrote(tmp_path):
    """Leaving (issue 59 item 4): zeroshard.hf.Trainer(deepspeed_checkpoint=True,
    async_checkpoint=True: the layout is written once the engine's save is
    durable) on 2 ranks saves checkpoint-4 of 8 steps, DeepSpeed ZeRO-3's
    layout (global_step4/, latest, zero_to_fp32.py) beside the engine's; the same
    script through plain transformers.Trainer under DeepSpeed 0.19.8 ZeRO-3
    on 2 ranks resumes it (DeepSpeed's load_checkpoint: fp32 partitions, Adam
    moments and step; the Trainer's own schedule, state and RNG): steps 5-8
    equal zeroshard's uninterrupted run's (fp32 1e-5, bf16 1e-4). DeepSpeed's
    zero_to_fp32.py in the folder consolidates weights equal bit for bit to
    zsckpt export --fp32. zsckpt export-deepspeed --world 3 writes the layout
    for 3 ranks (DeepSpeed ZeRO-3 loads only at the world size written):
    zero_to_fp32 gives the same weights from it, and its Adam moments, read
    back, are the engine's."""
    ours = run(2, "resume_save,resume_save_bf16", "zeroshard", str(tmp_path),
               extra_env={"ZS_TEST_DEEPSPEED_CHECKPOINT": "1", "ZS_TEST_ASYNC_CHECKPOINT": "1"})
    theirs = run(2, "resume_load,resume_load_bf16", "deepspeed",
                 extra_env={"DS_ACCELERATOR": "cpu", "ZS_TEST_RESUME_ROOT": str(tmp_path),
                            "ZS_TEST_RESUME_ENGINE": "zeroshard"})
    for variant, rel, prefix in (("", 1e-5, ""), ("_bf16", 1e-4, "bf16_")):
        folder = tmp_path / f"resume_save{variant}" / "zeroshard" / "checkpoint-4"
        assert (folder / "latest").read_text() == "global_step4"
        assert sorted(f.name for f in (folder / "global_step4").iterdir()) == sorted(
            [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
            + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
        resumed = theirs[f"resume_load{variant}"]
        assert resumed["steps"] == 8 and len(resumed["load_s"]) == 1, resumed  # through DeepSpeed's load_checkpoint
        same(ours[f"resume_save{variant}"]["losses"], resumed["losses"], rel=rel)
        consolidated = _zero_to_fp32(folder, tmp_path / f"fp32{variant}")
        exported = _zeroshard_fp32(folder, tmp_path / f"zs{variant}.safetensors")
        assert set(consolidated) == set(exported) | {"lm_head.weight"}  # the tied alias, as DeepSpeed lists it
        for name, value in exported.items():
            assert value.dtype == consolidated[name].dtype == torch.float32, name
            assert torch.equal(value, consolidated[name]), name
    # Offline, for another world size: zsckpt export-deepspeed.
    import subprocess
    import sys
    from zeroshard.torch import deepspeed_checkpoint, deepspeed_export
    folder = tmp_path / "resume_save" / "zeroshard" / "checkpoint-4"
    three = tmp_path / "three"
    env = dict(os.environ, ZS_PYTHON=sys.executable, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([str(REPO / "build" / "bin" / "zsckpt"), "export-deepspeed", str(folder), str(three),
                           "--world", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith(str(three / "global_step4")), proc.stdout
    assert len(list((three / "global_step4").glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))) == 3
    consolidated = _zero_to_fp32(three, tmp_path / "fp32_three")
    exported = _zeroshard_fp32(folder, tmp_path / "zs.safetensors")
    assert all(torch.equal(v, consolidated[n]) for n, v in exported.items())
    back = deepspeed_checkpoint.DeepSpeedCheckpoint(three / "global_step4")
    engine = deepspeed_export.ZeroshardCheckpoint(deepspeed_export.find(folder))
    assert back.world == 3 and back.step() == 4
    for name, p in engine.params.items():
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.read(name, state, 0, p["numel"]), engine.read(name, state, 0, p["numel"])), name


def test_transformers_trainer_under_fsdp2_resumes_a_checkpoint_zeroshard_wrote(tmp_path):
    """Leaving for FSDP2 (issue 59 item 4): zeroshard.hf.Trainer(fsdp_checkpoint=True,
    async_checkpoint=True) on 2 ranks, through the FSDP2 arguments (the
    torch AdamW stepping the shards) and through a DeepSpeed JSON (the
    engine's AdamW), saves checkpoint-4 of 8 steps with Accelerate's FSDP
    layout (pytorch_model_fsdp_0/ and optimizer_0/, torch DCP) beside the
    engine's; the same script through plain transformers.Trainer under
    FSDP2 (Accelerate's load_fsdp_model / load_fsdp_optimizer, the
    Trainer's own schedule, state and RNG) resumes the first at 2 ranks
    and the second at 3: steps 5-8 equal zeroshard's uninterrupted run's
    within 1e-5."""
    ours = run(2, "resume_save@zeroshard_fsdp2,resume_save", "zeroshard", str(tmp_path),
               extra_env={"ZS_TEST_FSDP_CHECKPOINT": "1", "ZS_TEST_ASYNC_CHECKPOINT": "1"})
    for n, source, mode in ((2, "zeroshard_fsdp2", "resume_save@zeroshard_fsdp2"), (3, "zeroshard", "resume_save")):
        folder = tmp_path / "resume_save" / source / "checkpoint-4"
        assert {"zeroshard", "pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt", "trainer_state.json"} <= {
            f.name for f in folder.iterdir()}, sorted(folder.iterdir())
        theirs = run(n, "resume_load", "fsdp2", str(tmp_path / f"fsdp2_{n}"),
                     extra_env={"ZS_TEST_RESUME_ROOT": str(tmp_path), "ZS_TEST_RESUME_ENGINE": source})
        assert theirs["model_type"] == "FSDPGPT2LMHeadModel" and theirs["steps"] == 8, theirs
        assert len(theirs["load_weights_s"]) == len(theirs["load_optimizer_s"]) == 1, theirs
        same(ours[mode]["losses"], theirs["losses"])


def test_resume_from_a_folder_no_engine_wrote_names_what_it_holds(tmp_path):
    from zeroshard.hf.trainer import _resumable
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds \[.model.safetensors.\]: expected a Trainer checkpoint folder"):
        _resumable(str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        _resumable(str(tmp_path / "missing"))
    # FSDP's sharded model without its optimizer's folder; FSDP's full state dict files
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    (tmp_path / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"FSDP's sharded model \(pytorch_model_fsdp_0/\) but no optimizer_0/"):
        _resumable(str(tmp_path))
    per_rank = tmp_path / "per_rank"  # a sharded state dict saved without DCP
    per_rank.mkdir()
    (per_rank / "pytorch_model_fsdp_0_rank0.bin").write_bytes(b"")
    (per_rank / "optimizer_0_rank0.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds \['optimizer_0_rank0.bin', 'pytorch_model_fsdp_0_rank0.bin'\].*"
                                         r"per rank \(_rankN.bin"):
        _resumable(str(per_rank))


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


# ---- in one process ---------------------------------------------------------

@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "ZS_LAUNCHER"):
        monkeypatch.delenv(k, raising=False)


def test_auto_values_resolve_and_mismatches_are_named(one_rank, tmp_path):
    import zeroshard.hf
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                                          gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-4,
                                          use_cpu=True, report_to=[])
    cfg = zeroshard.hf.resolve_config(
        {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
         "bf16": {"enabled": "auto"}}, args, num_training_steps=100)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["train_batch_size"] == 6
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 0.5
    assert cfg["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg["scheduler"]["params"]["total_num_steps"] == 100 and cfg["bf16"]["enabled"] is False
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=3"):
        zeroshard.hf.resolve_config({"train_micro_batch_size_per_gpu": 8}, args)


def test_arguments_and_keys_that_cannot_act_are_named(one_rank, tmp_path):
    import zeroshard
    import zeroshard.hf
    from zeroshard.hf.config import not_acted_on
    found = {k for k, _, _ in not_acted_on({"wall_clock_breakdown": True, "tensorboard": {"enabled": True},
                                             "wandb": {"enabled": False}, "steps_per_print": 10,
                                             "data_types": {"grad_accum_dtype": "bf16"}})}
    assert found == {"wall_clock_breakdown", "tensorboard", "data_types"}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          deepspeed={"zero_optimization": {"stage": 3}, "wall_clock_breakdown": True})
    with pytest.warns(zeroshard.ZeroShardConfigWarning, match="wall_clock_breakdown = true"):
        zeroshard.hf.Trainer(model=torch.nn.Linear(2, 2), args=args)
    zeroshard.torch.shutdown()
    with pytest.raises(ValueError, match="fsdp_checkpoint='yes': True or False"):
        zeroshard.hf.Trainer(model=torch.nn.Linear(2, 2), args=args, fsdp_checkpoint="yes")
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2)), peft.LoraConfig(r=2, fan_in_fan_out=True))
    with pytest.raises(ValueError, match="fsdp_checkpoint=True with a PEFT model is not written yet"):
        zeroshard.hf.Trainer(model=lora, args=args, fsdp_checkpoint=True)


def test_from_pretrained_draws_no_initial_values_for_what_it_loads(one_rank, tmp_path, monkeypatch):
    """Every param of the model in the checkpoint: from_pretrained builds it
    without drawing initial values (every rank drew the whole model's
    before), ties kept, values the file's. A head the checkpoint lacks is
    still initialised, as transformers does, and named."""
    import zeroshard.hf
    import zeroshard.torch as zt
    from safetensors.torch import load_file
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    drawn = []
    for name in ("normal_", "uniform_"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=original, **k: (drawn.append(t.numel()), _o(t, *a, **k))[1])
    keep = zeroshard.hf.HfZeroShardConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert drawn == [] and model.lm_head.weight is model.transformer.wte.weight
    full, saved = zt.consolidated_state_dict(model), load_file(tmp_path / "model.safetensors")
    assert set(full) >= set(saved) and all(torch.equal(full[k], saved[k]) for k in saved)
    head = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert sum(drawn) >= head.score.weight.ds_numel
    score = zt.consolidated_state_dict(head)["score.weight"]
    assert 0.01 < float(score.std()) < 0.03  # GPT-2's initializer_range, 0.02
    del keep
    zt.shutdown()


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_deepspeed_schedulers_step_as_deepspeed(warmup_type):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from zeroshard.hf import WarmupDecayLR, WarmupLR
    for ours_cls, ds_cls, extra in ((WarmupLR, lr_schedules.WarmupLR, {}),
                                    (WarmupDecayLR, lr_schedules.WarmupDecayLR, {"total_num_steps": 12})):
        opts = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2)]
        kw = dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type=warmup_type, **extra)
        ours, ref = ours_cls(opts[0], **kw), ds_cls(opts[1], **kw)
        for _ in range(14):
            assert opts[0].param_groups[0]["lr"] == pytest.approx(opts[1].param_groups[0]["lr"], rel=1e-12)
            ours.step()
            ref.step()
