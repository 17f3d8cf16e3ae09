"""A plain zeroshard.torch loop under healing_loop follows the engine's
shrink in memory and its regrow (docs/healing.md, section 4): real
processes under the real `zsrun --restarts 1 --min-nproc 2 --shrink
--regrow-after 3`, loopback, shrink_worker.py's model with dropout and a
scheduler, its body under AdamW and its output layer under an SGD of its
own stepped after it (a GAN's shape: the regrow takes both where an
iteration ends). Rank 1 SIGKILLs itself in step 2's backward; ranks 0 and 2 go on
without it in their own processes (step 2 again, each keeping its own share
of the data) until zsrun's new rank 1 comes back at a step, then all three
run three more steps. Against the checkpoint route on the same batches
(3 ranks to step 1 and a save, 2 ranks with ranks 0 and 2's data to the
step before the regrow and a save, 3 ranks on): every loss, every rank's
optimizers' states and step counts, its shards after every step as the
program reads them (`param.ds_tensor`), and the consolidated params bit
for bit,
no checkpoint written by the healed run, the survivors' pids unchanged.
The same kill in a plain Hugging Face Trainer script and a Lightning fit.
Where the frontend refuses a shrink (torch optimizers stepped on shards)
it says so by name."""
import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest

from launch_env import HERE, ZSRUN, ranks_env, warm

ENV = dict(ZS_HEARTBEAT_MS="100", ZS_HEARTBEAT_TIMEOUT_MS="1500", ZS_TIMEOUT_MS="30000")
KILLED_AT = 2
# The rank left out is started again 3 s after its loss, twice the
# heartbeat limit above: forked from the warm start it asks to join at
# once, and the survivors must have noticed the loss and shrunk by then
# (before, they would take it in as a replacement: no shrink at all).
SHRINK_AND_REGROW = ["--restarts", "1", "--min-nproc", "2", "--shrink", "--regrow-after", "3"]


def launch(n, worker, args, flags=(), cwd=None, **env):
    """(return code, output) of `worker` (a file beside this one) on n
    ranks under zsrun `flags`, with the healing tests' heartbeat and `env`."""
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    cmd = [str(ZSRUN), "-n", str(n), *warm(n), *flags, "--", sys.executable, str(HERE / worker),
           *map(str, args)]
    proc = subprocess.run(cmd, env=ranks_env(**{**ENV, **env}), capture_output=True, text=True, timeout=300,
                          cwd=cwd)
    return proc.returncode, proc.stdout + proc.stderr


def run(n, args, flags=()):
    return launch(n, "shrink_worker.py", args, flags, ZS_TEST_TWO_OPTIMIZERS="1")


def read_logs(out):
    return {r: [json.loads(line) for line in open(f"{out}.{r}")] for r in range(3) if os.path.exists(f"{out}.{r}")}


def of(logs, event):
    return {r: [l for l in ls if l["event"] == event] for r, ls in logs.items()}


def test_a_plain_loop_shrinks_in_memory_and_grows_back_as_the_checkpoint_route():
    with tempfile.TemporaryDirectory(prefix="zs_shrink_") as d:
        job = os.path.join(d, "job")
        os.mkdir(job)
        code, out = run(3, [f"{job}/log", "heal", f"1:{KILLED_AT}:backward"], SHRINK_AND_REGROW)
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
            assert (got[r][0]["digest"], got[r][0]["steps"], got[r][0]["lr"], got[r][0]["head"]) == \
                (want[r][0]["digest"], want[r][0]["steps"], want[r][0]["lr"], want[r][0]["head"]), r
        # BatchNorm's statistics: rank 1 came back with rank 0's of the regrow's
        # step, as the route's checkpoint load gives it (rank 2, a survivor,
        # kept its own, where the route's loads gave it rank 0's).
        for r in (0, 1):
            assert got[r][0]["buffers"] == want[r][0]["buffers"], (r, "BatchNorm's statistics")
        assert [l["sha256"] for l in of(logs, "params")[0]] == [l["sha256"] for l in of(ref[2], "params")[0]], out


def test_a_rank_that_comes_back_after_the_run_ended_exits_76_and_the_job_succeeds():
    """The survivors end right after the shrink (ZS_TEST_END_AT), before
    the process zsrun starts to grow the job back has built anything (it
    waits 4 s before its context: the survivors learn of the loss within
    the 1.5 s heartbeat limit and end two steps later): its context
    creation is told so (NotTakenError) and zeroshard.torch exits with
    ZS_EXIT_NOT_TAKEN (76), which zsrun counts as the rank leaving, not as
    a failure that restarts the job."""
    with tempfile.TemporaryDirectory(prefix="zs_shrink_") as d:
        code, out = launch(3, "shrink_worker.py", [f"{d}/log", "heal", f"1:{KILLED_AT}:backward"],
                           ["--restarts", "1", "--min-nproc", "2", "--shrink", "--regrow-after", "0"],
                           ZS_TEST_END_AT=str(KILLED_AT + 2), ZS_TEST_JOIN_DELAY_S="4")
        assert code == 0, out
        assert "the survivors finished their run before they could take this process back" in out, out
        assert "exiting with status 76" in out, out
        assert "zsrun: healing: rank 1, started again to grow the job back (--regrow-after), was not taken" in out, out
        assert "starting the job again" not in out, out


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
    loss."""
    code = REFUSE.format(what="torch.optim.RMSprop(model.parameters(), lr=0.1).step()")
    proc = subprocess.run([str(ZSRUN), "-n", "2", "--", sys.executable, "-c", code],
                          env=ranks_env(ZS_HEAL="1", ZS_HEAL_MIN_RANKS="1"), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("refused: zeroshard.torch: RMSprop stepped on shards: zeroshard.healing.min_ranks 1") == 2, out
    assert "use zeroshard.torch.ZeroShardOptimizer" in out, out


def shrunk_and_regrown(launcher, d, ref_flags, kill):
    """The uninterrupted run (zsrun `ref_flags`) and the run where `kill`
    happens under zsrun --shrink --regrow-after, each by
    launcher(folder, flags, *kills) -> (code, output, logs): both end 0,
    the job is never restarted, and ranks 0 and 2 shrink to [0, 2], grow
    back to [0, 1, 2] and keep their processes. Returns (the reference's
    logs, the output, the logs)."""
    code, ref_out, ref = launcher(f"{d}/ref", ref_flags)
    assert code == 0, ref_out
    code, out, logs = launcher(f"{d}/job", SHRINK_AND_REGROW, kill)
    assert code == 0, out
    assert "starting the job again" not in out, out
    for r in (0, 2):
        assert f"zeroshard.torch: rank {r}: the world shrank to 2 of 3 ranks [0, 2]" in out, out
        assert f"zeroshard.torch: rank {r}: the world grew back to 3 of 3 ranks [0, 1, 2]" in out, out
        assert len({l["pid"] for l in logs[r]}) == 1, logs[r]  # a survivor kept its process
    return ref, out, logs


HF_STEPS = 30


def hf_launch(d, flags, *kills):
    """(return code, output, {rank: [log lines]}) of hf_heal_worker.py (a
    plain Trainer script, GPT-2 with dropout, 2 micro-batches a step,
    logging every step) on 3 ranks."""
    os.makedirs(d)
    code, out = launch(3, "hf_heal_worker.py", [f"{d}/log", HF_STEPS, *kills], flags, cwd=d,
                       ZS_TEST_LOGGING_STEPS="1", ZS_TEST_SHRUNK_PAUSE_S="0.5", ZS_TEST_COUNT_FORWARDS="1")
    return code, out, read_logs(f"{d}/log")


def test_an_hf_trainer_script_shrinks_in_memory_and_grows_back():
    """The plain Trainer script of the healing tests under zsrun --shrink
    --regrow-after: rank 1 killed in step 4's second micro-batch's
    backward; ranks 0 and 2 redo the step on their own (its token count
    counted again over them: the Trainer's own, over 3 ranks, would scale
    its loss and gradients by 2/3), go on, and take rank 1 back at a step;
    Accelerate's process index and count and torch.distributed follow.
    Every step commits on every rank to the end, and each step's logged
    loss (the mean over the ranks that trained it: the rank that came back
    takes the others' mean of the loss summed before it came) stays within
    0.05 of the uninterrupted run's, which a step scaled by 2/3 does not.
    The data differs from the uninterrupted run's (rank 1's share is left
    out while it is), so nothing is compared bit for bit here; the plain
    loop's test above is."""
    with tempfile.TemporaryDirectory(prefix="zs_shrink_hf_") as d:
        ref, out, logs = shrunk_and_regrown(hf_launch, d, [], "1:4:backward")
        lives = [(l["step"], len(l["live"])) for l in logs[0] if l["event"] == "step"]
        regrown = next(s for s, n in lives if s > 4 and n == 3)  # the step the regrow came in
        assert lives == [(s, 3) for s in range(1, 4)] + [(s, 2) for s in range(4, regrown)] + \
            [(s, 3) for s in range(regrown, HF_STEPS + 1)], lives
        assert f"zeroshard.hf.Trainer: rank 1 joined at step {regrown}: training goes on at step {regrown + 1}" \
            in out, out
        for r in range(3):
            end = [l for l in logs[r] if l["event"] == "end"]
            assert len(end) == 1 and end[0]["global_step"] == HF_STEPS and end[0]["steps"] == HF_STEPS, (r, end)
            # A buffer counting the model's training forwards (as BatchNorm's
            # batch count): two a step, the redone step's once; the rank that
            # came back took the lowest survivor's (its own would start at 0).
            counts = [(l["step"], l["forwards"]) for l in logs[r] if l["event"] == "step"]
            assert all(n == 2 * s for s, n in counts), (r, counts)
        history = [l for l in logs[0] if l["event"] == "params"][0]["log_history"]
        want = {h["step"]: h["loss"] for l in ref[0] if l["event"] == "params" for h in l["log_history"]
                if "loss" in h}
        got = {h["step"]: h["loss"] for h in history if "loss" in h}
        assert sorted(got) == list(range(1, HF_STEPS + 1)), got
        assert all(got[s] == want[s] for s in range(1, 4)), (got, want)  # before the loss: the same run
        assert all(abs(got[s] - want[s]) < 0.05 for s in got), [(s, got[s], want[s]) for s in got]


LIGHTNING_STEPS = 40


def lightning_launch(d, flags, *kills, manual=""):
    os.makedirs(d)
    code, out = launch(3, "lightning_heal_worker.py", [f"{d}/log", LIGHTNING_STEPS, *kills], flags, cwd=d,
                       ZS_TEST_SHRUNK_PAUSE_S="0.5", PYTHONWARNINGS="ignore", ZS_TEST_MANUAL=manual)
    return code, out, read_logs(f"{d}/log")


@pytest.mark.parametrize("optimizers", [1, 2])
def test_a_lightning_fit_shrinks_in_memory_and_grows_back(optimizers):
    """The plain Lightning script of the healing tests (2 epochs, a
    validation synced over the ranks every 4 steps) under zsrun --shrink
    --regrow-after: rank 1 killed in batch 3's backward; ranks 0 and 2 redo
    it and go on (each its own DistributedSampler share), then take rank 1
    back at a step. Every batch to the end, the uninterrupted run's losses
    up to the kill, and each validation's synced mean the mean of the live
    ranks' own means (Lightning divides by torch.distributed's world size,
    which follows: over 2 ranks while shrunk, 3 after). With 2 optimizers:
    manual optimization stepping the body's AdamW, then the output layer's
    SGD, in each training_step (a GAN's shape: Lightning counts both in
    global_step); the world grows back after the second's step, and the
    joiner runs that training_step hollow through both."""
    k = optimizers  # optimizer steps a batch, as global_step counts them
    with tempfile.TemporaryDirectory(prefix="zs_shrink_pl_") as d:
        launcher = functools.partial(lightning_launch, manual="2" if k == 2 else "")
        ref, out, logs = shrunk_and_regrown(launcher, d, ["--restarts", "1"], f"1:{3 * k}:backward")
        assert "zeroshard.lightning: rank 1 joined at step" in out, out
        if k == 2:
            assert "the state of 2 optimizer(s) laid out anew in memory" in out, out
        steps = [l for l in logs[0] if l["event"] == "step"]
        assert [l["step"] for l in steps] == [k * i + k - 1 for i in range(LIGHTNING_STEPS)], \
            [l["step"] for l in steps]
        lives = [len(l["live"]) for l in steps]
        regrown = lives.index(3, 3)
        assert lives == [3] * 3 + [2] * (regrown - 3) + [3] * (LIGHTNING_STEPS - regrown), lives
        ref_loss = [l["loss"] for l in ref[0] if l["event"] == "step"]
        assert [l["loss"] for l in steps[:3]] == ref_loss[:3]  # before the loss: the same run
        for r in range(3):
            end = [l for l in logs[r] if l["event"] == "end"]
            assert len(end) == 1 and end[0]["steps"] == LIGHTNING_STEPS, (r, end)
            if k == 2:
                assert end[0]["head_digest"][1] == LIGHTNING_STEPS, (r, end)
            # BatchNorm's batch count: one forward a batch, the redone one's
            # once; the rank that came back took the lowest survivor's
            # statistics with their count (its own would start at 0).
            counts = [(l["step"], l["norm_batches"]) for l in logs[r] if l["event"] == "step"]
            assert all(n * k == s + 1 for s, n in counts), (r, counts)
        vals = {}
        for r, ls in logs.items():
            for l in ls:
                if l["event"] == "val":
                    vals.setdefault(l["step"], {})[r] = l
        assert sorted(vals) == list(range(4 * k, k * LIGHTNING_STEPS + 1, 4 * k)), sorted(vals)
        for step, by_rank in vals.items():
            live = by_rank[0]["live"]
            assert sorted(by_rank) == live, (step, sorted(by_rank), live)  # every live rank validated
            mean = sum(by_rank[r]["local"] for r in live) / len(live)
            assert all(abs(by_rank[r]["loss"] - mean) < 1e-6 for r in live), (step, by_rank)
        assert {len(v[0]["live"]) for v in vals.values()} == {2, 3}, vals  # validations in both worlds



ACCELERATE_EPOCHS = 2  # 5 steps an epoch


def accelerate_launch(d, flags, *kills):
    os.makedirs(d)
    code, out = launch(3, "accelerate_heal_worker.py", [f"{d}/log", ACCELERATE_EPOCHS, *kills], flags, cwd=d,
                       ZS_TEST_GROW_MARK=f"{d}/asking")
    return code, out, read_logs(f"{d}/log")


def test_an_accelerate_script_shrinks_in_memory_and_grows_back():
    """The plain Accelerate script of the healing tests (a shuffled
    DataLoader, dropout, a StepLR every step, an evaluation gathering a
    held-out loss after each epoch) under zsrun --shrink --regrow-after:
    rank 1 killed in step 2's backward; ranks 0 and 2 run the rest of the
    step hollow, shrink at its optimizer step, redo it on their own (each
    its own share of the data) and go on; rank 1 comes back in the first
    epoch's last step (the survivors wait for it before) and joins at the
    window after it: the epoch's end, so it takes part in the evaluation
    there, live. Every step taken once on every rank, the script's own
    count right; the steps before the loss and the redone one bitwise the
    uninterrupted run's (its params at the commit are); the scheduler's lr
    every step the uninterrupted run's (Accelerate steps it once a process:
    at the count it was prepared with, as an epoch still takes as many
    steps); Accelerate's process index and count the position among the
    live ranks and their count; the rank that comes back trains on the
    batches its id has in the uninterrupted run from there, and its
    evaluation of that epoch is the survivors'. Nothing else is compared
    bit for bit: the shrunk steps average two ranks' gradients."""
    with tempfile.TemporaryDirectory(prefix="zs_shrink_acc_") as d:
        ref, out, logs = shrunk_and_regrown(accelerate_launch, d, ["--restarts", "1"], "1:2:backward")
        assert "does not heal" not in out, out
        total = 5 * ACCELERATE_EPOCHS
        steps = {r: [l for l in ls if l["event"] == "step"] for r, ls in logs.items()}
        ref_steps = {r: {l["step"]: l for l in ls if l["event"] == "step"} for r, ls in ref.items()}
        for r in (0, 2):
            assert [l["step"] for l in steps[r]] == list(range(total)), [l["step"] for l in steps[r]]
            assert [l["completed"] for l in steps[r]] == list(range(1, total + 1)), steps[r]
            for l in steps[r]:
                want = ref_steps[r][l["step"]]
                assert l["lr"] == want["lr"] and l["batch"] == want["batch"], (r, l, want)
                here = l["live"].index(r)
                assert l["processes"] == [here, len(l["live"])], (r, l)
            # Before the loss and the redone step: the same params, batches and RNG.
            assert [l["loss"] for l in steps[r][:3]] == [ref_steps[r][s]["loss"] for s in range(3)], r
            assert [len(l["live"]) for l in steps[r]] == [3, 3, 2, 2] + [3] * (total - 4), steps[r]
        # The regrow came in step 4, the first epoch's last: rank 1 joins at
        # its end, before the evaluation.
        assert "zeroshard.hf.Accelerator: rank 1 joined at step 5: it goes on at epoch 0, batch 5" in out, out
        came_back = [l for l in logs[1] if l["pid"] != logs[1][0]["pid"]]
        assert [l["step"] for l in came_back if l["event"] == "step"] == list(range(5, total)), came_back
        # BatchNorm's batch count: one forward a step on every rank, the
        # redone step's once; the rank that came back took the lowest
        # survivor's statistics, its count with them, over what its hollow
        # catching up wrote (its own count would be 1 at step 5).
        for r, ls in steps.items():
            assert all(l["norm_batches"] == l["step"] + 1 for l in ls), (r, [(l["step"], l["norm_batches"]) for l in ls])
        for l in came_back:
            if l["event"] == "step":  # its own share, from where the survivors were
                want = ref_steps[1][l["step"]]
                assert (l["batch"], l["lr"], l["processes"]) == (want["batch"], want["lr"], [1, 3]), (l, want)
        evals = {r: {l["epoch"]: l["value"] for l in ls if l["event"] == "eval" and l["pid"] == ls[-1]["pid"]}
                 for r, ls in logs.items()}
        assert evals[0] == evals[1] == evals[2] and sorted(evals[0]) == list(range(ACCELERATE_EPOCHS)), evals
        for r in range(3):
            end = [l for l in logs[r] if l["event"] == "end"]
            assert len(end) == 1 and end[0]["steps"] == total, (r, end)
