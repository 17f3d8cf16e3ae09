"""zt.memory_report(): the engine's bytes by kind add up to what its pools
hand out, nothing is untagged, the kinds match the ledger, and each phase of
a training step (construction, forward, backward, step, checkpoint) shows
its own peak; on 1, 2 and 3 ranks with bf16 params."""
import pytest

from launch_env import once, worker_result

torch = pytest.importorskip("torch")

# One launch per world size for both tests: construction first, so that
# its RSS rise is measured in a fresh process as in a launch of its own.
WORLDS = {1: ["report"], 2: ["construction", "report"], 3: ["construction", "report"]}


@once
def world(n):
    r = worker_result(n, "memory_worker.py", ",".join(WORLDS[n]))
    return r if len(WORLDS[n]) > 1 else {WORLDS[n][0]: r}


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_memory_report_accounts_for_every_engine_byte(ranks):
    r = world(ranks)["report"]
    for when, rep in r["reports"].items():
        engine = rep["engine"]
        pooled = engine["total"] - engine["io_staging"]
        assert abs(pooled - rep["pools_in_use"]) <= rep["pools_in_use"] / 100, (when, rep)
        assert engine["untagged"] == 0, (when, engine)
        assert rep["torch_and_rest"] is not None and rep["process_rss"] > engine["total"], (when, rep)
    built, saved = r["reports"]["built"], r["reports"]["saved"]
    assert built["phase"] == "construction" and built["engine"]["shards"] > 0, built
    assert r["reports"]["backward 0"]["phase"] == "backward", r["reports"]["backward 0"]
    assert r["reports"]["step 1"]["phase"] == "step", r["reports"]["step 1"]
    # The kinds are the ledger's logical bytes rounded up to pool size classes.
    ledger = r["ledger"]
    assert ledger["shard_bytes"] <= saved["engine"]["shards"] <= ledger["shard_bytes"] * 1.15, (ledger, saved)
    # Gradient shards live from the backward's pushes to the optimizer step,
    # which frees them (the ledger counts them as the step's state).
    grads = r["reports"]["backward 1"]["engine"]["grads"]
    assert ledger["grad_bytes"] <= grads <= ledger["grad_bytes"] * 1.15, (ledger, grads)
    assert saved["engine"]["grads"] == 0 and r["reports"]["step 1"]["engine"]["grads"] == 0, saved
    state = saved["engine"]["masters"] + saved["engine"]["optimizer_state"]
    assert ledger["optimizer_bytes"] <= state <= ledger["optimizer_bytes"] * 1.15, (ledger, saved)
    peaks = saved["peaks"]
    if ranks > 1:
        assert peaks["forward"]["gathered"] > 0 and peaks["backward"]["reduce_buckets"] > 0, peaks
    assert peaks["backward"]["grads"] > 0 and peaks["step"]["masters"] > 0, peaks
    assert peaks["checkpoint"]["io_staging"] > 0 and saved["engine"]["io_staging"] == 0, peaks
    for phase, p in peaks.items():
        assert p["total"] >= max(v for k, v in p.items() if k != "total"), (phase, p)
    assert "shards" in r["text"] and "checkpoint" in r["text"] and "process RSS" in r["text"], r["text"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_construction_under_init_never_holds_the_model(ranks):
    """zt.Init partitions each module as its constructor returns: a rank's
    RSS rises by its share of the model and a layer or two in flight, never
    by the whole model (192 MiB here, built as 12 layers of 16 MiB)."""
    r = world(ranks)["construction"]
    share = r["model_bytes"] // ranks
    assert share <= r["shard_bytes"] <= share * 1.05, r
    # Materialising the model first would rise by the model and the shards.
    bound = share + 3 * r["layer_bytes"] + 24 * 2**20
    assert bound < r["model_bytes"], r
    assert r["rss_rise"] <= bound, (r, bound)
    # The engine itself holds the shards and no full layer at any point.
    assert r["engine_construction_peak"] <= r["shard_bytes"] * 1.1 + r["layer_bytes"], r
