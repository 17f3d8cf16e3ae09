"""zeroshard.torch on real ranks (zsrun + torch.distributed gloo): the same
losses as torch DDP, MoE with leaf modules, GatheredParameters, state dicts."""
import json
import os
import subprocess
import sys

import pytest

from launch_env import HERE, REPO, ZSRUN, once, worker_result

torch = pytest.importorskip("torch")


def run_ranks(n, mode, timeout=240, extra_env=None):
    """Rank 0's result of torch_worker.py's `mode` on n ranks, a launch of
    its own (a mode that needs its own environment)."""
    return worker_result(n, "torch_worker.py", mode, timeout, extra_env)


# The modes each world size runs, one launch per world for the whole file:
# torch imports once per rank, and each mode ends with zt.shutdown() as a
# launch of its own would. The one that ends in an error goes last.
# inference_steps after dropped_models also checks that the back-off of the
# dropped params' agreement starts again in a new context and once settled:
# it once carried over and left the next dropped model uncollected.
WORLDS = {
    2: ["ddp_vs_zeroshard", "lent_grads", "checkpoint_holds", "saved_by_reference", "backward_reads",
        "submodule_scope",
        "gathered", "frozen_quantized", "user_changes", "kept_units", "dropped_models", "inference_steps",
        "gan_zero_grad", "moe_without_leaf"],
    3: ["ddp_vs_zeroshard", "lent_grads", "moe", "kept_units", "dropped_models", "inference_steps",
        "granular_units", "backward_reads", "gan_zero_grad"],
}


@once
def world(n):
    return worker_result(n, "torch_worker.py", ",".join(WORLDS[n]), 900)


def in_world(n, mode):
    """Rank 0's result of `mode` in the launched world of n ranks."""
    return world(n)[mode]


@pytest.mark.parametrize("ranks", [2, 3])
def test_losses_equal_torch_ddp(ranks):
    r = in_world(ranks, "ddp_vs_zeroshard")
    assert len(r["ddp"]) == len(r["zeroshard"]) == 20
    for step, (a, b) in enumerate(zip(r["ddp"], r["zeroshard"])):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b, r)
    assert r["zeroshard"][-1] < r["zeroshard"][0]
    # Params + grads + optimizer state per rank: 1/N of DDP's plus padding.
    mem = r["memory"]
    ddp_total = r["unsharded_bytes"] * 4  # params, grads, exp_avg, exp_avg_sq
    ours = mem["shard_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
    assert ours <= ddp_total / ranks + 4 * 4 * 64, mem  # padding: < 1 element per param per copy
    # What stays gathered between steps: the params under the persistence
    # threshold (1e5 elements by default; every param of this tiny model),
    # gathered again after each optimizer step.
    assert mem["gathered_bytes"] <= r["persistent_bytes"], mem
    # After the first step the coordinator prefetched along the trace.
    assert r["coord"]["prefetches"] > 0, r["coord"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_gans_zero_grad_between_a_backward_and_the_step_drops_those_gradients_as_ddp(ranks):
    """torch_worker's DCGAN loop: zero_grad (the module's, the optimizer's:
    the engine's and torch's own stepped on shards) drops what a backward
    pushed to the engine since the step, so each optimizer steps on its own
    loss's gradients only, as under DDP. Before
    zs_grad_discard the discriminator's step took the generator's loss's
    gradients too: 0.07 apart in its params after 3 steps, no word."""
    r = in_world(ranks, "gan_zero_grad")
    for name in ("zeroshard", "zeroshard_optimizer_form", "torch_optimizers"):
        assert len(r["ddp"]) == len(r[name]) == 6
        for step, (a, b) in enumerate(zip(r["ddp"], r[name])):
            for x, y in zip(a, b):
                assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (name, step, a, b)
        assert r[f"{name}_worst_param_difference"] <= 1e-5, (name, r)
        said = r[f"{name}_said"]
        assert len(said) == 2 and all("zero_grad(set_to_none=False) acts as set_to_none=True" in w for w in said), said


@pytest.mark.parametrize("ranks", [2, 3])
def test_lent_gradients_train_as_ddp_with_accumulation(ranks):
    """Large gradients reduced straight from autograd's tensors
    (zs_grad_push_borrowed): the same losses as DDP over two micro-batches
    per step, every lent tensor let go by the step."""
    r = in_world(ranks, "lent_grads")
    assert len(r["ddp"]) == len(r["zeroshard"]) == 8
    for step, (a, b) in enumerate(zip(r["ddp"], r["zeroshard"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b, r)
    assert r["direct_params"], r
    # Each direct param lends its gradient twice a step (two micro-batches).
    assert r["tickets"] == 2 * 8 * len(r["direct_params"]), r
    assert r["held_after_step"] == 0, r


def test_optimizer_offload_trains_bitwise_as_in_memory(tmp_path):
    """offload_optimizer "cpu" and "nvme" (sub-groups of 1000 elements,
    pipelined), and both optimizer state and parameter shards on NVMe, give
    the losses, weights and optimizer state_dict of the in-memory run bit for
    bit, and the swap files are gone after."""
    places = ("none", "cpu", str(tmp_path), "params:" + str(tmp_path))
    runs = run_ranks(2, "offload", extra_env={"ZS_TEST_OFFLOAD": ";".join(places)})
    assert list(runs) == list(places), runs.keys()
    base = runs["none"]
    assert base["losses"][-1] < base["losses"][0]
    for where, r in runs.items():
        assert r["losses"] == base["losses"], where
        assert r["weights"] == base["weights"], where
        assert r["state"] == base["state"], where
    assert base["state"], "the optimizer state_dict holds no tensors"
    assert list(tmp_path.iterdir()) == []


def test_activation_checkpointing_releases_each_block_in_backward():
    """torch's non-reentrant checkpoint stops its recompute early by raising
    inside a block's last module; that module's params used to stay held
    (gathered) until the step, a whole model's worth of them by the end of
    backward. Now nothing is held after backward, and the losses are those
    of the same model without checkpointing."""
    r = in_world(2, "checkpoint_holds")
    assert r["checkpointed"]["held_after_backward"] == [[]] * 4, r["checkpointed"]["held_after_backward"]
    assert r["plain"]["held_after_backward"] == [[]] * 4
    for a, b in zip(r["plain"]["losses"], r["checkpointed"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), r


def test_params_saved_for_backward_by_reference_free_their_buffers():
    """F.linear and friends save a gathered weight (or its view) for
    backward. Kept by reference, a layer's gathered buffer is freed after
    its forward, where autograd holding it by value kept the whole model
    gathered until backward; gradients are bit for bit the same."""
    r = in_world(2, "saved_by_reference")
    ref, val = r["reference"], r["value"]
    assert ref["losses"] == val["losses"], r
    assert ref["weights"] == val["weights"]
    for (alive_ref, seen), (alive_val, _) in zip(ref["alive_after_forward"], val["alive_after_forward"]):
        # By value: at least every nn.Linear's weight (F.linear saves it).
        assert alive_val >= val["linears"], val
        # By reference: at most the unit the backward prefetches first.
        assert alive_ref <= 1, ref
    # hpZ: backward gathers come from the secondary shards, the same values.
    assert r["reference_hpz"]["losses"] == ref["losses"], r
    edges = r["edges"]
    assert edges["read_equals_weight_t"] and edges["released_after_read"], edges
    assert "blocks.1.out.weight was modified in place" in edges["in_place_error"], edges
    assert "is partitioned and not gathered now, so mul_" in edges["released_in_place_error"], edges


@pytest.mark.parametrize("ranks", [2, 3])
def test_backward_gathers_only_the_params_it_reads(ranks):
    """An embedding's backward reads the indices, not its table: the table
    is no longer gathered for it (a gather fewer a step, and none at the
    backward's end, where the gradients peak). Tied to the head, the table
    goes once the head's backward has read it instead of staying gathered
    until the tied gradient comes at the end. Bit for bit the runs that
    fetch every unit for its backward (params saved by value)."""
    r = in_world(ranks, "backward_reads")
    for kind in ("untied", "tied"):
        reads, every = r[f"{kind}_reads"], r[f"{kind}_every"]
        assert reads["losses"] == every["losses"], (kind, r)
        assert reads["weights"] == every["weights"], kind
        assert reads["gathered_after"] == every["gathered_after"] == 0, (kind, r)
        # Gathers a step: untied, two are gone (the table's for the
        # embedding's backward, the root's for its `pos`: a slice's backward
        # reads no values either); tied, where the old hold made the
        # embedding's fetch free, at least one a step, counted over the
        # steps: a prefetch the coordinator issues as a step ends may land in
        # either step's count or between them (one run's [31, 29, 29, 29],
        # another's [31, 30, 29, 29]), in either run.
        fewer = [b - a for a, b in zip(reads["gathers"][1:], every["gathers"][1:])]
        assert all(f == 2 for f in fewer) if kind == "untied" else \
            all(f >= 0 for f in fewer) and sum(fewer) >= len(fewer) - 1, (kind, reads["gathers"], every["gathers"])
        # Through the last step's backward: the table is not gathered from
        # the first block's backward on (the head read it before the last
        # block's backward; an untied head's is another param).
        table_gathered = {where: gathered for where, gathered, _, _ in reads["backward"]}
        assert not any(table_gathered.values()), (kind, reads["backward"])
        # At the embedding's backward, the last, nothing is gathered at all
        # (the root's `pos` is not either); before, the table was.
        assert reads["backward"][-1][:3] == ["tok", False, 0], (kind, reads["backward"])
        assert every["backward"][-1][2] >= every["table_bytes"], (kind, every["backward"])
        # Saved by value, the old way: gathered for the embedding's backward,
        # and (tied) held from the head's backward on.
        old = {where: gathered for where, gathered, _, _ in every["backward"]}
        assert old["tok"] and (kind == "untied" or all(old.values())), (kind, every["backward"])
        # The step lets go of every lent gradient before its update.
        assert all(w == [0] for w in reads["lent"][1::2]), (kind, reads["lent"])
    # Gradients the engine borrows (reduced straight from torch's tensor;
    # how many are still lent when the backward returns depends on timing)
    # are let go before the update rather than after it.
    assert all(w == [0] for w in r["wide_lent"][1::2]), r["wide_lent"]
    # Tied, the head's gradient of the table went to the engine in the
    # head's backward: pushed before the embedding's backward, where it was
    # not without the alias (autograd summed both uses first).
    tied, unaliased = r["tied_reads"], r["tied_unaliased"]
    assert tied["backward"][-1][3] and not unaliased["backward"][-1][3], (tied["backward"], unaliased["backward"])
    # Reduced per use rather than summed first: the same up to rounding.
    assert tied["losses"][0] == unaliased["losses"][0], (tied["losses"], unaliased["losses"])
    assert tied["losses"] == pytest.approx(unaliased["losses"], rel=1e-5), (tied["losses"], unaliased["losses"])


def test_submodule_called_without_the_root_opens_the_forward_scope():
    """A loop that calls a partitioned model's submodule (model.gpt(x, y)),
    never the root, trains as through the root: saved by reference, swept
    gradients at the backward's end, the scope closed after the forward
    (and after a forward that raised); with non-reentrant checkpointing too."""
    r = in_world(2, "submodule_scope")
    root = r["root"]
    for name in ("submodule", "checkpointed", "inside_checkpoint"):
        run = r[name]
        assert run["losses"] == root["losses"], (name, run["losses"], root["losses"])
        # By reference: at most the unit the backward prefetches first is
        # still gathered after the forward; by value every Linear's weight was.
        for alive, seen in run["alive_after_forward"]:
            assert seen >= 10 and alive <= 1, (name, run["alive_after_forward"])
        # The swept LayerNorm gradients went to the engine as the backward
        # ended: none is left in .grad for the step to take.
        assert run["grads_after_backward"] == [[]] * 4, (name, run["grads_after_backward"])
        assert run["held_after_backward"] == [[]] * 4, (name, run["held_after_backward"])
        assert run["closed"] == [True] * 4 and run["closed_after_raise"], (name, run)
        assert run["raised"] == "IndexError"
        # Checkpointing still recomputes: the scope did not replace its hooks.
        assert run["recomputed"] == [name != "submodule"] * 4, (name, run["recomputed"])
    assert root["grads_after_backward"] == [[]] * 4 and root["closed"] == [True] * 4


def test_moe_with_leaf_modules_trains_without_a_hang():
    r = in_world(3, "moe")
    assert len(r["losses"]) == 6
    assert "moe.experts.3.fc.weight" in r["keys"]
    # Rank 0's losses equal an unsharded model trained on every rank's
    # routing: leaf gradients were reduced param for param, unused ones as 0.
    for ours, ref in zip(r["losses"], r["reference"]):
        assert abs(ours - ref) <= 1e-4 * abs(ref), r


def test_moe_without_leaf_modules_is_an_error_naming_the_fix():
    # DeepSpeed hangs here (DS#4966); before the engine numbered params in
    # collective labels, every expert's "Linear.weight" looked alike and
    # the ranks silently trained on each other's expert bytes.
    r = in_world(2, "moe_without_leaf")
    assert r["seconds"] < 20, r
    for error in r["errors"]:
        assert error is not None and error.startswith("CommError"), r
        assert "ranks disagree on collective" in error, error
        assert "set_leaf_modules" in error, error
        assert "moe.experts." in error, error


def test_gathered_parameters_state_dicts_and_errors():
    r = in_world(2, "gathered")
    assert r["seen_after_modify"] is True
    assert r["state_dict_equal"] is True
    assert r["load_equal"] is True
    assert r["replay_equal"] is True
    assert r["error"] is not None and "zero_optimization.stage" in r["error"]
    # torch's state_dict() holds full values, not empty placeholders (what
    # DeepSpeed's ZeRO-3 hands torch.save), and load_state_dict() of a full
    # dict rewrites the shards.
    assert r["torch_state_dict_full"] is True
    assert r["torch_state_dict_equal"] is True
    assert r["plain_loads_it"] is True
    assert r["load_keys"] == [[], []]
    assert r["torch_load_equal"] is True
    assert r["mismatch_error"] is not None and "size mismatch for head.weight" in r["mismatch_error"], r
    assert "partitioned by zeroshard" in r["mismatch_error"], r["mismatch_error"]
    assert r["after_shutdown"] is not None and "shut down" in r["after_shutdown"], r["after_shutdown"]
    assert "param 'TinyGPT.pos'" in r["after_shutdown"], r["after_shutdown"]  # the first one met


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_torch_distributed(dtype):
    """Launched by zsrun with no process group: the engine bootstraps from
    the environment; bf16 params train through fp32 masters."""
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    proc = subprocess.run([str(ZSRUN), "-n", "2", "--no-prefix", "--", sys.executable,
                           str(HERE / "nodist_worker.py"), dtype], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert r["world"] == 2
    assert r["dtype"] == ("torch.bfloat16" if dtype == "bf16" else "torch.float32")
    # Loss of step k+1 (before its update) equals the reference's loss after
    # k+1 updates on the whole batch: the engine averaged both ranks' grads.
    tol = 1e-4 if dtype == "fp32" else 3e-2
    for ours, ref in zip(r["losses"][1:], r["reference_after"]):
        assert abs(ours - ref) <= tol * abs(ref), r


def test_under_torchrun_environment_without_process_group():
    """torchrun's variables, with torchrun's store holding MASTER_PORT: the
    engine agrees its own store port through that store. (Debian's torchrun
    itself fails on Python 3.11, so the test plays the agent's part.)"""
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent_store = dist.TCPStore("127.0.0.1", port, 3, True, timeout=datetime.timedelta(seconds=60),
                                wait_for_workers=False)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.pop("ZS_LAUNCHER", None)
    procs = []
    for rank in range(2):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test-run",
                 TORCHELASTIC_RESTART_COUNT="0")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "nodist_worker.py"), "fp32"], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    r = json.loads([l for l in outs[0].splitlines() if l.startswith("{")][-1])
    for ours, ref in zip(r["losses"][1:], r["reference_after"]):
        assert abs(ours - ref) <= 1e-4 * abs(ref), r
    del agent_store


def test_frozen_params_kept_quantized_train_as_the_dequantized_reference():
    """zero_quantized_nontrainable_weights on a LoRA-style model (frozen
    blocks): the frozen weights are kept as int8 codes (about a quarter of
    their fp32 shard memory, no optimizer state), gathered within the
    block bound of their originals and unchanged by training; the losses
    equal an unsharded model holding those dequantized weights; setting
    requires_grad back is a clear error."""
    r = in_world(2, "frozen_quantized")
    for step, (a, b) in enumerate(zip(r["reference"], r["zeroshard"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b, r)
    assert 0 < r["bound_ratio"] <= 1.0, r
    assert r["exact"] == 0, r  # every frozen Linear weight was quantized
    assert r["frozen_unchanged"] is True, r
    # Blocks hold 87% of TinyGPT's params: their Linear weights' shards at
    # ~1/4 of fp32 (the norms' and biases' shards, smaller than a block of
    # codes, stay exact), and no masters or moments for any of them.
    assert r["shard_bytes"] < 0.45 * r["shard_bytes_unfrozen"], r
    assert r["optimizer_bytes"] < 0.5 * r["optimizer_bytes_unfrozen"], r
    assert "cannot be trained again" in r["unfreeze_error"], r


def test_params_changed_by_user_code_between_steps():
    """Unfrozen later, param.data = t, frozen later: as an unsharded model
    trained on every rank's batches does; a bf16 assignment is not undone
    by the optimizer's fp32 master; a wrong shape is named."""
    r = in_world(2, "user_changes")
    for step, (a, b) in enumerate(zip(r["reference"], r["zeroshard"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b, r)
    # A third of one AdamW step (lr 3e-3): summation order moves near-zero
    # gradients, which Adam scales up; a param stepped when it should not
    # be moves by about lr per step.
    assert r["max_weight_diff"] <= 1e-3, r
    assert r["bf16_assigned_kept"] is True, r
    # The last step's summary: every gather and reduction of that step, on 2 ranks.
    st = r["step_stats"]
    assert st["step"] == 12 and st["gathers"] > 0 and st["gather_bytes"] > 0, st
    assert st["reduce_scatters"] > 0 and st["reduce_scatter_bytes"] > 0, st
    assert 0 < st["optimizer_seconds"] < st["step_seconds"], st
    # Every step's bytes so far, by kind: full precision only (no qwZ/qgZ).
    w = r["wire_stats"]
    assert w["gather_bytes_sent"] == w["gather_bytes_received"] > 0, w
    assert w["reduce_scatter_bytes_sent"] == w["reduce_scatter_bytes_received"] > 0, w
    assert w["quantized_gather_bytes_sent"] == w["quantized_reduce_bytes_sent"] == 0, w
    assert "param.data was set to a tensor of shape (3,), expected its full shape (24, 24)" in r["shape_error"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_kept_units_run_without_hooks_and_train_as_the_reference(ranks):
    """A fine-grained model: units whose params stay gathered across steps
    lose their forward hooks, the others keep them or get them back, and
    gradients taken from .grad when the backward ends (or at the step, for
    a backward that never went through the root) train as an unsharded
    model on every rank's batches."""
    r = in_world(ranks, "kept_units")
    for step, (a, b) in enumerate(zip(r["reference"], r["zeroshard"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b, r)
    assert all(not left for left in r["grads_left"]), r["grads_left"]
    # A gradient lost or pushed twice moves a weight by about lr (1e-2).
    assert r["max_weight_diff"] <= 1e-5, r["max_weight_diff"]
    armed = r["armed"]
    assert not any(armed[f"layers.{i}"] for i in range(8)), armed   # kept across steps
    assert all(armed[f"layers.{i}"] for i in range(8, 12)), armed   # over the model threshold
    assert armed["wide"] and armed["head"] and armed["act"] and armed["root"], armed
    assert r["copy_equal"] and r["copy_trained"] and r["original_unchanged"], r
    assert r["copy_armed"] and not r["copy_warnings"], r["copy_warnings"]


def test_module_granularity_threshold_gathers_small_modules_whole_with_the_same_bits():
    """DeepSpeed's module_granularity_threshold, 3 ranks, checkpointed
    blocks, no param persistent: each Attention (800) or the whole model
    (1e6) one unit; blocks whose forward is checkpointed, each one unit (950). Losses and final params are the default units' bit
    for bit; fewer gathers; nothing left gathered after the step."""
    r = in_world(3, "granular_units")
    default, attention, whole = r["0"], r["800"], r["1000000"]
    assert [x["config"] for x in (default, attention, whole)] == [0, 800, 10 ** 6]
    for other in (attention, whole):
        assert other["losses"] == default["losses"], (other["losses"], default["losses"])
        assert other["digest"] == default["digest"]
        assert other["gathered_after_step"] == 0, other
    assert default["losses"][-1] < default["losses"][0], default["losses"]
    assert "blocks.0.attn.qkv" in default["units"] and "blocks.0.attn" not in default["units"], default["units"]
    assert [u for u in attention["units"] if u.startswith("blocks.0.attn")] == ["blocks.0.attn"], attention["units"]
    assert "blocks.0.fc" in attention["units"], attention["units"]
    assert whole["units"] == ["<root>"], whole["units"]
    assert whole["gathers"] < attention["gathers"] < default["gathers"], (whole, attention, default)
    # Blocks checkpointed as transformers does (the forward, inside the
    # block's hooks): a whole block's backward fetches its params for the
    # recompute, which runs its modules with no hooks of theirs.
    default, blocks = r["0/forward"], r["950/forward"]
    assert blocks["losses"] == default["losses"], (blocks["losses"], default["losses"])
    assert blocks["digest"] == default["digest"]
    assert blocks["gathered_after_step"] == 0, blocks
    assert "blocks.0" in blocks["units"] and "blocks.0.fc" not in blocks["units"], blocks["units"]
    assert blocks["gathers"] < default["gathers"], (blocks, default)


def _deepspeeds_whole_modules(model, threshold, monkeypatch):
    """The modules DeepSpeed 0.19 makes z3 leaf modules for
    stage3_module_granularity_threshold, by its own code on `model` (its
    rank-0 prints, which ask for a process group, silenced)."""
    import types
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    monkeypatch.setattr(parameter_offload, "print_rank_0", lambda *a, **k: None)
    for p in model.parameters():
        p.ds_numel = p.numel()
    for m in model.modules():
        m._z3_leaf = False  # a call before, at another threshold, set some
    me = types.SimpleNamespace(min_granularity_value=sys.maxsize, min_granularity_layer=None,
                               granularity_info=set(), z3_leaf_layers=[])
    for name in ("_get_granularity_recursively", "_set_leaf_by_threshold_preorder"):
        setattr(me, name, types.MethodType(getattr(DeepSpeedZeRoOffload, name), me))
    DeepSpeedZeRoOffload._set_z3_leaf_modules_by_threshold(me, model, threshold)
    return {m for m in model.modules() if getattr(m, "_z3_leaf", False)}


def test_module_granularity_threshold_chooses_the_modules_deepspeed_chooses(monkeypatch):
    """unit_plan.whole_modules against DeepSpeed's own selection, on a
    Hugging Face Llama (containers, norms, rotary embedding without params)
    and the tests' TinyGPT, over thresholds from none chosen to the root."""
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from zeroshard.torch.unit_plan import whole_modules
    sys.path.insert(0, str(HERE))
    import torch_worker
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2))
    seen = set()
    for model in (llama, torch_worker.TinyGPT()):
        for threshold in (1, 800, 903, 3000, 4000, 10 ** 5, 10 ** 7):
            ours = whole_modules(model, threshold)
            theirs = _deepspeeds_whole_modules(model, threshold, monkeypatch)
            names = {m: n or "<root>" for n, m in model.named_modules()}
            assert {names[m] for m in ours} == {names[m] for m in theirs}, (type(model).__name__, threshold)
            seen.add(frozenset(type(m).__name__ for m in ours))
    # The thresholds chose nothing, attention blocks, decoder layers, whole models.
    assert {frozenset(), frozenset({"Attention"}), frozenset({"LlamaDecoderLayer"})} <= seen, seen
    assert any("LlamaForCausalLM" in s for s in seen) and any("TinyGPT" in s for s in seen), seen


@pytest.mark.parametrize("ranks", [2, 3])
def test_dropped_models_give_their_shards_back_on_every_rank(ranks):
    """Four models trained one after another in one context, each dropped
    before the next: rank 0's garbage collector finds each at once, the
    last rank's not at all until the step end's agreement makes every rank
    collect. Each model trains as DDP (no hang, no gather of a param that
    one rank has destroyed), and once it has trained the engine holds its
    params alone: the shards of the dropped ones are back."""
    r = in_world(ranks, "dropped_models")
    rounds = r["rounds"]
    assert len(rounds) == 4
    for k, rd in enumerate(rounds):
        for step, (a, b) in enumerate(zip(rd["ddp"], rd["zeroshard"])):
            assert abs(a - b) <= 1e-5 * abs(a), (k, step, a, b)
        assert rd["num_params"] == rd["model_params"], (k, {x: y for x, y in rd.items() if x not in ("ddp", "zeroshard")})
        assert rd["dropped_left"] == 0, (k, rd)
        assert rd["shard_bytes"] == rounds[0]["shard_bytes"], (k, rd, rounds[0])
        assert rd["gathered_bytes"] <= rounds[0]["gathered_bytes"], (k, rd, rounds[0])
        assert rd["persistent"] == rounds[0]["persistent"] > 0, (k, rd)
    # The previous model was still registered when the next one was built
    # (on the last rank its collector had not run): the agreement, not
    # construction, let it go.
    assert all(rd["registered_before_training"] == 2 * rd["model_params"] for rd in rounds[1:]), rounds


@pytest.mark.parametrize("ranks", [2, 3])
def test_forwards_under_no_grad_end_their_own_steps(ranks):
    """A forward under no_grad (or inference_mode) that begins the step ends
    it: an evaluation loop with no optimizer gathers ahead at its second
    forward, then nothing (the model stays gathered across its steps, whose
    ends run no collective), and its recorded order stays one forward long
    (before, the step never ended: every gather was on demand, and the
    order grew by a forward's units each time); a frozen reference model's
    no_grad forward taking turns with the policy's training step gathers
    ahead in both and trains as DDP; a forward that raises leaves its step
    to the next forward; models dropped with no optimizer step anywhere
    give their shards back."""
    r = in_world(ranks, "inference_steps")
    ev = r["eval"]
    assert ev["max_diff"] <= 1e-5, ev
    assert ev["steps"] == list(range(1, 13)), ev["steps"]
    assert len(set(ev["demand"][1:])) == 1, ("a later forward gathered on demand", ev["demand"])
    # The model is within max_reuse_distance: what the second forward
    # gathered stays for the third and later ones, whose steps change
    # nothing and end without a collective.
    assert len(set(ev["gathers"][1:])) == 1, ("a later forward gathered", ev["gathers"])
    assert len(set(ev["allreduce"][1:])) == 1, ("a later step end compared", ev["allreduce"])
    assert len(set(ev["trace"])) == 1 and ev["trace"][0] > 0, ev["trace"]
    assert ev["inference_mode_demand"] == 0, ev
    assert r["raised"] and "index out of range" in r["raised"], r["raised"]
    ar = r["after_raise"]
    assert ar["steps_while_raised"] == 0 and ar["steps_after_next"] == 1 and ar["diff"] <= 1e-5, ar
    dpo = r["dpo"]
    for step, (a, b) in enumerate(zip(dpo["ddp"], dpo["zeroshard"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b, dpo)
    assert dpo["demand_after_warmup"] == 0 and dpo["prefetches_after_warmup"] > 0, dpo
    assert dpo["invalidations_after_warmup"] == 0, dpo
    dr = r["dropped"]
    assert dr["registered_before"] > dr["model_params"], dr  # the last rank still held the dropped models
    assert dr["num_params"] == dr["model_params"] and dr["dropped_left"] == 0, dr


def test_state_dict_on_one_rank_is_an_error_naming_the_fix():
    """model.state_dict() under `if rank == 0:` (how a save is often
    guarded) cannot gather: within the collective timeout rank 0 gets a
    timeout error that names the module, the param and how to save,
    where before arming state_dict it wrote empty tensors silently."""
    r = run_ranks(2, "state_dict_on_one_rank", extra_env={"ZS_TIMEOUT_MS": "2000"})
    assert r["type"] == "ZsTimeoutError", r
    assert "state_dict() of a partitioned model gathers its params' full values (here tok.weight, of a " \
           "Embedding)" in r["error"], r["error"]
    assert "call state_dict() (or save_pretrained) on every rank" in r["error"], r["error"]
    assert "consolidated_state_dict" in r["error"] and "failed after 2000 ms" in r["error"], r["error"]
    assert r["seconds"] < 30, r
