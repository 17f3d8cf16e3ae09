"""Automatic restart: a 3-rank job that saves every step loses a rank to
SIGKILL in the middle of a step; `zsrun --restarts` (or `torchrun
--max-restarts`) brings it back from `latest`, at the same world size or,
with `zsrun --min-nproc`, without the lost rank, and training finishes with
the losses of an uninterrupted run from the resume point on."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from launch_env import HERE, REPO, ranks_env, warm

ZSRUN = REPO / "build" / "bin" / "zsrun"
STEPS, KILL_AT = 8, 4
_reference = {}


def run(launcher, n, kill_at, *flags, timeout=300, extra_env=None):
    """(exit code, log lines, stderr) of the worker on n ranks."""
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    with tempfile.TemporaryDirectory(prefix="zs_restart_") as d:
        log = os.path.join(d, "log.jsonl")
        worker = [str(HERE / "restart_worker.py"), os.path.join(d, "ckpt"), log, str(STEPS), str(kill_at)]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   *flags, *worker]
        else:
            cmd = [str(ZSRUN), "-n", str(n), *warm(n), *flags, "--", sys.executable, *worker]
        proc = subprocess.run(cmd, env=ranks_env(ZS_HEARTBEAT_MS="200", **(extra_env or {})),
                              capture_output=True, text=True, timeout=timeout)
        return proc.returncode, mean_over_ranks(log), proc.stdout + proc.stderr


def mean_over_ranks(log):
    """One line per (attempt, step) that every rank of its attempt logged,
    with the loss averaged over them (equal shares of the global batch)."""
    by_key = {}
    for rank in range(3):
        if os.path.exists(f"{log}.{rank}"):
            for line in open(f"{log}.{rank}"):
                l = json.loads(line)
                by_key.setdefault((l["attempt"], l["step"]), []).append(l)
    lines = []
    for (attempt, step), ls in sorted(by_key.items()):
        if len(ls) == ls[0]["world"]:
            lines.append({**ls[0], "loss": sum(l["loss"] for l in ls) / len(ls)})
    return lines


def reference():
    if not _reference:
        code, lines, out = run("zsrun", 3, -1)
        assert code == 0, out
        assert [l["step"] for l in lines] == list(range(STEPS)), out
        _reference.update({l["step"]: l["loss"] for l in lines})
    return _reference


def check_resumed(lines, out, world_after):
    ref = reference()
    first = [l for l in lines if l["attempt"] == 0]
    second = [l for l in lines if l["attempt"] == 1]
    # Nothing lost but the killed step: the first attempt logged every step
    # before it (each saved), the second resumed at it.
    assert [l["step"] for l in first] == list(range(KILL_AT)), out
    assert [l["step"] for l in second] == list(range(KILL_AT, STEPS)), out
    assert {l["world"] for l in first} == {3} and {l["world"] for l in second} == {world_after}, out
    for l in lines:
        assert l["loss"] == pytest.approx(ref[l["step"]], rel=1e-5, abs=1e-6), (l, ref[l["step"]])
    return second


def test_zsrun_restarts_a_job_that_lost_a_rank_and_it_trains_on_from_latest():
    code, lines, out = run("zsrun", 3, KILL_AT, "--restarts", "1")
    assert code == 0, out
    assert "rank 1 killed by signal SIGKILL" in out, out
    assert "restart 1 of 1: starting the job again with 3 ranks" in out, out
    # zsrun's ZS_HEAL=auto: zeroshard.torch pays for no peer copies in a
    # program that did not ask for healing_loop's (enable_healing), and says so.
    assert "zeroshard.torch: no peer copies under ZS_HEAL=auto" in out, out
    second = check_resumed(lines, out, 3)
    ref = reference()
    # Same world size, same reduction order: the very same numbers.
    assert [l["loss"] for l in second] == [ref[l["step"]] for l in second]


def test_zsrun_restarts_a_job_that_initialized_torch_distributed_first():
    """As the HF Trainer does: torch.distributed first, then the engine.
    zsrun --restarts serves the store from zsstore (ZS_STORE_SERVER=external),
    so zeroshard.torch takes that store's port, not one of its own choosing
    (which nothing served: the job hung)."""
    code, lines, out = run("zsrun", 3, KILL_AT, "--restarts", "1", extra_env={"ZS_TEST_DIST_FIRST": "1"})
    assert code == 0, out
    assert "restart 1 of 1: starting the job again with 3 ranks" in out, out
    second = check_resumed(lines, out, 3)
    ref = reference()
    assert [l["loss"] for l in second] == [ref[l["step"]] for l in second]


def test_zsrun_min_nproc_brings_the_job_back_without_the_lost_rank():
    code, lines, out = run("zsrun", 3, KILL_AT, "--restarts", "1", "--min-nproc", "2")
    assert code == 0, out
    assert "restart 1 of 1: starting the job again with 2 ranks (a rank killed by SIGKILL is lost)" in out, out
    check_resumed(lines, out, 2)


def test_without_restarts_the_job_fails_with_the_rank_that_died():
    code, lines, out = run("zsrun", 3, KILL_AT)
    assert code == 128 + 9, out
    assert "zsrun: restart" not in out, out
    assert [l["step"] for l in lines] == list(range(KILL_AT)), out


def test_torchrun_max_restarts_resumes_the_engine_from_latest():
    code, lines, out = run("torchrun", 3, KILL_AT, "--max-restarts", "1")
    assert code == 0, out
    check_resumed(lines, out, 3)
