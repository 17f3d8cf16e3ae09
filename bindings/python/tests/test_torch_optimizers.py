"""Stock torch optimizers over a partitioned model (zeroshard.torch.shard_optim),
on real ranks: elementwise ones on the shards, Muon and Adafactor on whole
tensors, against the same optimizer under DDP; their state through torch's
state_dict and through checkpoints at another world size; the refusals."""
import shutil
import tempfile

import pytest

from launch_env import once, worker_result

torch = pytest.importorskip("torch")


def run_ranks(n, mode, extra_env=None, timeout=600):
    """Rank 0's result of optim_worker.py's `mode` on n ranks, a launch of
    its own (a mode that needs its own environment)."""
    return worker_result(n, "optim_worker.py", mode, timeout, extra_env)


# The modes each world size runs in one launch (torch and DeepSpeed import
# once per rank); the refusals last.
WORLDS = {2: ["stock_vs_ddp", "muon_vs_deepspeed", "state_dict_roundtrip", "bf16_stock_vs_engine", "bf16_states",
              "refused"],
          3: ["stock_vs_ddp", "muon_vs_deepspeed"]}


@once
def world(n):
    return run_ranks(n, ",".join(WORLDS[n]), timeout=1200)

ELEMENTWISE = ["adam", "adamw_clipped", "sgd_nesterov", "rmsprop_sched", "adagrad", "adadelta", "adamax", "nadam",
               "radam", "asgd", "rprop", "groups", "added_group"]
WHOLE = ["muon", "muon_clipped", "muon_fp32", "adafactor"]


def _check(name, r, ranks):
    losses_ddp, losses_zs = r["ddp"], r["zeroshard"]
    assert len(losses_ddp) == len(losses_zs) == 5, (name, r)
    tol = 1e-5
    if name == "muon" and ranks == 3:
        # torch's Muon orthogonalizes in bf16: an fp32 sum of 3 ranks' gradients
        # in another order than gloo's moves its update by bf16 roundings
        # (muon_fp32, the same with an fp32 Newton-Schulz, is held to 1e-5; a
        # clip's coefficient, rounded otherwise than torch's, would do the
        # same, so muon_clipped runs fp32 too).
        tol = 3e-3
    assert r["param_diff"] <= tol * max(1.0, r["param_scale"]), (name, r)
    for step, (a, b) in enumerate(zip(losses_ddp, losses_zs)):
        assert abs(a - b) <= max(tol, 1e-6) * abs(a), (name, step, a, b)
    assert r["least_moved"] > 1e-6, (name, r)  # every param trained (RAdam warms up slowly)


@pytest.mark.parametrize("ranks", [2, 3])
def test_stock_optimizers_equal_ddp(ranks):
    """Every optimizer, 5 steps on 2 and 3 ranks (padded shards), equal to
    DDP within 1e-5: a clip_grad_norm_ (the global norm), an LR scheduler,
    param groups with their own hyper-parameters, and Muon with AdamW as
    two optimizers over disjoint params, params that join by
    add_param_group after two steps. At 2 ranks the sums are the same
    as gloo's, so elementwise ones match bit for bit."""
    r = world(ranks)["stock_vs_ddp"]
    assert sorted(r) == sorted(ELEMENTWISE + WHOLE), r.keys()
    for name, res in r.items():
        _check(name, res, ranks)
    assert r["rmsprop_sched"]["lr"] == [1e-3 * 0.5 ** 2]  # StepLR stepped the groups the engine reads
    if ranks == 2:
        for name in ("adam", "sgd_nesterov", "rmsprop_sched", "adagrad", "muon", "adafactor"):
            assert r[name]["param_diff"] == 0.0, (name, r[name])


@pytest.mark.parametrize("kind", ["rmsprop", "adafactor"])
def test_stock_optimizer_state_through_a_checkpoint_at_another_world_size(kind):
    """Saved at 2 ranks after 3 steps, loaded at 3, 3 more steps: the params
    of one unsharded model that took all 6 (each step's batches those of
    the world that took it). RMSprop's state is per element (the engine's
    named state, resharded); Adafactor's is whole-tensor (row and column
    moments, step counts) on owner ranks that differ at 3."""
    ckpt = tempfile.mkdtemp(prefix="zs_stock_optim_")
    try:
        env = {"ZS_TEST_CKPT": ckpt, "ZS_TEST_OPT": kind}
        run_ranks(2, "ckpt_save", extra_env=env)
        r = run_ranks(3, "ckpt_load", extra_env=dict(env, ZS_TEST_SAVED_WORLD="2"))
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    assert r["client"] == {"world": 2}
    assert r["param_diff"] <= 1e-5, r
    want = {"rmsprop": ["grad_avg", "momentum_buffer", "square_avg", "step"],
            "adafactor": ["col_var", "row_var", "step", "variance"]}[kind]
    assert r["state_keys"] == want, r


@pytest.mark.parametrize("bf16", [False, True])
def test_torch_state_dict_round_trip(bf16):
    """optimizer.state_dict() through torch.save into another optimizer's
    load_state_dict(): its lr and state come back, fp32 under bf16 params
    (torch casts state to the param's dtype: here the masters'), and the
    next step is the unsharded model's."""
    r = run_ranks(2, "state_dict_roundtrip", extra_env={"ZS_TEST_BF16": "1"}) if bf16 else \
        world(2)["state_dict_roundtrip"]
    assert r["lr"] == 3e-3 and r["steps"] == [3.0] and r["dtypes"] == ["torch.float32"], r
    # bf16 params hold values up to ~4: one bf16 step there is 2**-5.
    assert r["param_diff"] <= (2 ** -5 if bf16 else 1e-5), r


def test_bf16_stock_adamw_equals_the_engines_adamw():
    """With bf16 params torch's AdamW steps the engine's fp32 masters and
    the engine writes the bf16 shards from them, as the engine's own AdamW
    does: the same bf16 params, bit for bit."""
    r = world(2)["bf16_stock_vs_engine"]
    assert r["dtype"] == "torch.bfloat16" and r["differing"] == 0, r


def test_unsupported_optimizers_are_refused_by_name():
    """LBFGS (a closure run many times within a step) is refused at its
    first step, naming it and what to use, and nothing changes; a
    clip_grad_norm_ norm the engine does not take is refused by value."""
    r = world(2)["refused"]
    assert "LBFGS cannot step partitioned params" in r["lbfgs"] and "closure" in r["lbfgs"], r
    assert r["unchanged"], r
    assert r["plain_stepped"] == [0.0, 0.0, 0.0], r
    assert "norm_type=1.0" in r["norm_type"], r


@pytest.mark.parametrize("ranks", [2, 3])
def test_zeroshard_muon_equals_deepspeeds_muon(ranks):
    """zeroshard.torch.Muon (Muon groups whole on owner ranks, AdamW groups on
    shards) against DeepSpeed 0.19's MuonWithAuxAdam on one unsharded model
    fed every rank's batch, 5 steps: "gram" Newton-Schulz (fp32 on a CPU)
    within 1e-5, bit for bit on 2 ranks; "standard" (bf16) bit for bit on 2
    ranks, within bf16 roundings on 3 (the sum's order, as torch's Muon);
    and the engine's own Muon (ZeroShardOptimizer.from_torch of the same
    zt.Muon) within 1e-5."""
    r = world(ranks)["muon_vs_deepspeed"]
    assert r["gram"]["muon_params"] > 0 and r["gram"]["moved"] > 1e-3, r
    assert r["gram"]["param_diff"] <= (0.0 if ranks == 2 else 1e-5), r
    assert r["standard"]["param_diff"] <= (0.0 if ranks == 2 else 3e-3), r
    # The engine's Muon (C++: momentum on the shards, fp32 Newton-Schulz on
    # OpenBLAS on owner ranks): DeepSpeed's numbers within fp32 roundings.
    assert r["engine"]["muon_params"] > 0 and r["engine"]["moved"] > 1e-3, r
    assert r["engine"]["param_diff"] <= 1e-5, r


def test_deepspeed_bf16_master_and_state_keys_act_through_zeroshard_torch():
    """bf16.bf16_master_weights_and_grads + bf16_optimizer_states (DeepSpeed
    0.19 keys): the engine's AdamW keeps no fp32 master and bf16 moments,
    optimizer bytes a third of the fp32-master run's (4 of 12 bytes per
    shard element), the same losses within bf16 roundings; a torch
    optimizer on the shards, which steps fp32 masters, is refused naming the
    key."""
    r = world(2)["bf16_states"]
    fp32, bf16 = r["fp32_masters"], r["bf16_states"]
    assert bf16["optimizer_bytes"] * 3 == fp32["optimizer_bytes"], r
    assert fp32["optimizer_bytes"] == 12 * fp32["shard_bytes"] // 2, r  # bf16 shards: 2 bytes an element
    for a, b in zip(fp32["losses"], bf16["losses"]):
        assert abs(a - b) <= 2 ** -6 * abs(a), r
    assert "bf16_master_weights_and_grads" in r["stock"] and "NotSupportedError" in r["stock"], r
