"""A plain zeroshard.torch loop under healing_loop follows the engine's
shrink in memory and its regrow (docs/healing.md, section 4): real
processes under the real `zsrun --restarts 1 --min-nproc 2 --shrink
--regrow-after 1`, loopback, shrink_worker.py's model with dropout and a
scheduler. Rank 1 SIGKILLs itself in step 2's backward; ranks 0 and 2 go on
without it in their own processes (step 2 again, each keeping its own share
of the data) until zsrun's new rank 1 comes back at a step, then all three
run three more steps. Against the checkpoint route on the same batches
(3 ranks to step 1 and a save, 2 ranks with ranks 0 and 2's data to the
step before the regrow and a save, 3 ranks on): every loss, every rank's
optimizer state and step count, its shards after every step as the
program reads them (`param.ds_tensor`), and the consolidated params bit
for bit,
no checkpoint written by the healed run, the survivors' pids unchanged.
Where the frontend refuses a shrink (the Trainer, Lightning, torch
optimizers stepped on shards) it says so by name."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from launch_env import HERE, ZSRUN, ranks_env

ENV = dict(ZS_HEARTBEAT_MS="100", ZS_HEARTBEAT_TIMEOUT_MS="1500", ZS_TIMEOUT_MS="30000")
KILLED_AT = 2


def run(n, args, flags=(), timeout=240):
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    cmd = [str(ZSRUN), "-n", str(n), *flags, "--", sys.executable, str(HERE / "shrink_worker.py"), *map(str, args)]
    proc = subprocess.run(cmd, env=ranks_env(**ENV), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def read_logs(out):
    return {r: [json.loads(line) for line in open(f"{out}.{r}")] for r in range(3) if os.path.exists(f"{out}.{r}")}


def of(logs, event):
    return {r: [l for l in ls if l["event"] == event] for r, ls in logs.items()}


def test_a_plain_loop_shrinks_in_memory_and_grows_back_as_the_checkpoint_route():
    with tempfile.TemporaryDirectory(prefix="zs_shrink_") as d:
        job = os.path.join(d, "job")
        os.mkdir(job)
        code, out = run(3, [f"{job}/log", "heal", f"1:{KILLED_AT}:backward"],
                        ["--restarts", "1", "--min-nproc", "2", "--shrink", "--regrow-after", "1"])
        assert code == 0, out
        assert sorted(os.listdir(job)) == ["log.0", "log.1", "log.2"], out  # no checkpoint anywhere
        logs = read_logs(f"{job}/log")
        steps = of(logs, "step")
        # Rank 0's steps: on 3 ranks to step 1, on ranks 0 and 2 from step 2
        # (the one the loss cut short, redone) to the regrow's, on 3 again.
        lives = [tuple(l["live"]) for l in steps[0]]
        assert [l["step"] for l in steps[0]] == list(range(len(lives))), out
        assert lives[:KILLED_AT] == [(0, 1, 2)] * KILLED_AT, lives
        regrown = lives.index((0, 1, 2), KILLED_AT)  # the step inside which rank 1 came back
        assert regrown > KILLED_AT and lives[KILLED_AT:regrown] == [(0, 2)] * (regrown - KILLED_AT), lives
        assert lives[regrown:] == [(0, 1, 2)] * (len(lives) - regrown) and len(lives) - regrown == 4, lives
        assert "rank 1 killed by signal SIGKILL" in out, out
        for r in (0, 2):
            assert f"zeroshard.torch: rank {r}: the world shrank to 2 of 3 ranks [0, 2]" in out, out
            assert f"zeroshard.torch: rank {r}: the world grew back to 3 of 3 ranks [0, 1, 2]" in out, out
            assert len({l["pid"] for l in logs[r]}) == 1, logs[r]  # a survivor kept its process
        assert f"zeroshard.torch: rank 1 joined at step {regrown + 1}" in out, out
        # The rank that came back took part from the step after the regrow.
        assert [l["step"] for l in steps[1] if l["loss"] is not None] == \
            list(range(KILLED_AT)) + list(range(regrown + 1, len(lives))), steps[1]

        # The checkpoint route on the same batches.
        ckpt = os.path.join(d, "ckpt")
        legs = [(3, 0, KILLED_AT - 1, ""), (2, KILLED_AT, regrown, "0,2"), (3, regrown + 1, len(lives) - 1, "")]
        ref = {}
        for i, (n, first, last, ids) in enumerate(legs):
            if i == 2:
                os.remove(f"{ckpt}/rng.1.pt")  # the rank that came back starts its RNG afresh, as the new process did
            code, leg_out = run(n, [f"{d}/ref{i}", "leg", first, last, ckpt, ids])
            assert code == 0, leg_out
            ref[i] = read_logs(f"{d}/ref{i}")
        want = {(r, l["step"]): l for leg in ref.values() for r, ls in leg.items() for l in ls if l["event"] == "step"}
        # The regrow comes inside step `regrown`: after it the shards are laid
        # out as the last leg loads them.
        loaded = {r: dict(ls[0], loss=want.get((r, regrown), {}).get("loss")) for r, ls in of(ref[2], "loaded").items()}
        want.update({(r, regrown): l for r, l in loaded.items()})
        for r, ls in steps.items():
            for l in ls:
                if l["loss"] is not None:
                    assert l["loss"] == want[(r, l["step"])]["loss"], (r, l)
                # Its shards after each step as the program reads them (ds_tensor).
                assert l["shards"] == want[(r, l["step"])]["shards"], (r, l)
        got, want = of(logs, "end"), of(ref[2], "end")
        for r in range(3):
            assert len(got[r]) == 1, (r, out)
            assert (got[r][0]["digest"], got[r][0]["steps"], got[r][0]["lr"]) == \
                (want[r][0]["digest"], want[r][0]["steps"], want[r][0]["lr"]), r
        assert [l["sha256"] for l in of(logs, "params")[0]] == [l["sha256"] for l in of(ref[2], "params")[0]], out


REFUSE = """
import torch, zeroshard.torch as zt
zt.enable_healing()
zt.init_context()
model = torch.nn.Linear(4, 4)
zt.partition_module(model)
try:
    {what}
except NotImplementedError as e:
    print("refused:", e)
zt.shutdown()
"""


def test_what_does_not_follow_a_shrink_says_so_by_name():
    """A torch optimizer stepped on shards holds its state as views of the
    engine's: refused under min_ranks by name on every rank, before any
    loss (the Trainer and the Lightning strategy refuse the same way where
    they set healing up: trainer_heal.after_context, lightning_heal.after_context)."""
    code = REFUSE.format(what="torch.optim.RMSprop(model.parameters(), lr=0.1).step()")
    proc = subprocess.run([str(ZSRUN), "-n", "2", "--", sys.executable, "-c", code],
                          env=ranks_env(ZS_HEAL="1", ZS_HEAL_MIN_RANKS="1"), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("refused: zeroshard.torch: RMSprop stepped on shards: zeroshard.healing.min_ranks 1") == 2, out
    assert "use zeroshard.torch.ZeroShardOptimizer" in out, out
