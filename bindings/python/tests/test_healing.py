"""A plain zeroshard.torch loop under zeroshard.torch.healing_loop heals in
place (docs/healing.md, landing step 4): real processes under the real
`zsrun --restarts`, loopback, a small model with dropout. A rank SIGKILLs
itself in the middle of a step's backward (before the step commits: the
survivors redo it with the same batch and RNG) and another in the engine's
optimizer update (after the commit: the survivors go on); zsrun starts only
the lost rank again, which joins from its holder's copy, takes its RNG and
the loop's state from the survivors, and skips the loader to them. Each
world ends with every rank's optimizer state (masters, moments, step
count) and the consolidated params bitwise equal to an uninterrupted
run's on the same batches, the survivors' pids unchanged, no job restart
and no checkpoint written anywhere.

Heartbeat period 100 ms as in the C tests; limit 1.5 s rather than their
0.6 s: five Python processes on a 2-core machine (one importing torch)
starve a heartbeat thread past 0.6 s, and a live rank judged lost fails the
heal (the fencing of such a rank is not built yet)."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from launch_env import HERE, ZSRUN, ranks_env

STEPS = 8
ENV = dict(ZS_HEARTBEAT_MS="100", ZS_HEARTBEAT_TIMEOUT_MS="1500", ZS_TIMEOUT_MS="30000")


def launch(n, *kills, restarts=2, spare=False, worker="heal_worker.py", steps=STEPS, env=None, digests=None,
           warm=True):
    """(return code, output, {rank: [log lines]}, files left) of the worker
    on n ranks under zsrun --restarts; `digests`, a dict, gets the sha256
    of each checkpoint file left (safetensors and manifests, the job's
    folder in them as "<job>") by path."""
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    with tempfile.TemporaryDirectory(prefix="zs_heal_") as d:
        out = os.path.join(d, "log")
        flags = ["--restarts", str(restarts)] if restarts else []  # none: no ZS_HEAL, no peer copies
        # Forked from one interpreter that imported the worker's modules
        # (docs/launching.md), replacements too. Not with a spare (whose own
        # process imports them: those worlds measured 15-25% slower with
        # both) or warm=False: each process started afresh, its imports
        # reading its rank's environment.
        flags += ["--spare"] if spare else ["--warm-start"] if warm else []
        cmd = [str(ZSRUN), "-n", str(n), *flags, "--", sys.executable,
               str(HERE / worker), out, str(steps), *kills]
        proc = subprocess.run(cmd, env=ranks_env(**{**ENV, **(env or {})}), capture_output=True, text=True, timeout=240,
                              cwd=d)
        assert "--warm-start is off" not in proc.stderr, proc.stderr  # every rank it started was forked
        logs = {}
        for r in range(n):
            if os.path.exists(f"{out}.{r}"):
                logs[r] = [json.loads(line) for line in open(f"{out}.{r}")]
        # Everything written under the job's folder, folders with a "/".
        left = sorted(os.path.relpath(os.path.join(root, name), d) + ("/" if name in dirs else "")
                      for root, dirs, files in os.walk(d) for name in dirs + files)
        for f in left if digests is not None else ():
            if f.endswith((".safetensors", "manifest.json")):
                data = open(os.path.join(d, f), "rb").read().replace(os.fsencode(d), b"<job>")  # paths in it
                digests[f] = hashlib.sha256(data).hexdigest()
        return proc.returncode, proc.stdout + proc.stderr, logs, left


def ends(logs):
    return {r: [l for l in ls if l["event"] == "end"] for r, ls in logs.items()}


_references = {}


def reference(n, heals):
    """The uninterrupted run with the copies on (zsrun --restarts), or off
    (no --restarts: healing_loop then runs as a plain loop): the same
    numbers either way. Launched once per module and kind."""
    if (n, heals) not in _references:
        code, out, logs, _ = launch(n, restarts=1 if heals else 0)
        assert code == 0, out
        _references[(n, heals)] = logs
    return _references[(n, heals)]


def check_ends(n, logs, ref_logs, out):
    """Every rank's optimizer state, step count, steps run and lr, and the
    consolidated params, equal to the reference's bit for bit."""
    ref_end, end = ends(ref_logs), ends(logs)
    for r in range(n):
        # One end per rank: a victim's first process died before its own.
        assert len(end[r]) == 1, (r, out)
        got, want = end[r][0], ref_end[r][0]
        assert (got["digest"], got["steps"], got["ran"]) == (want["digest"], want["steps"], want["ran"]), (r, got,
                                                                                                           want)
        assert got["buffers"] == want["buffers"], (r, "BatchNorm's statistics")  # each rank's own
        assert got["lr"] == want["lr"]  # the scheduler's state went to the replacement
    sha = [l["sha256"] for l in logs[0] if l["event"] == "params"]
    ref_sha = [l["sha256"] for l in ref_logs[0] if l["event"] == "params"]
    assert sha == ref_sha and len(sha) == 1, out


def check_healed(n, kills, victims, reference_heals, spare=False):
    ref_logs = reference(n, reference_heals)
    code, out, logs, left = launch(n, *kills, spare=spare)
    assert code == 0, out
    assert left == [f"log.{r}" for r in range(n)], left  # no checkpoint directory, nothing else
    assert "starting the job again" not in out, out  # healed in place, no job restart
    for r in victims:
        assert f"rank {r} killed by signal SIGKILL" in out, out
        if spare:  # the warm spare took its place: the replacement's pid is the spare's
            m = re.search(rf"healing: the spare \(pid (\d+)\) takes rank {r}'s place", out)
            assert m, out
            assert int(m.group(1)) in {l["pid"] for l in logs[r]}, (m.group(1), out)
        else:
            assert f"starting a replacement of rank {r}" in out, out
        assert f"zeroshard.torch: rank {r} joined at step" in out, out
    check_ends(n, logs, ref_logs, out)
    # Every committed step logged once per process that ran it, with the
    # reference's loss wherever that process computed one.
    ref_loss = {(l["rank"], l["step"]): l["loss"] for ls in ref_logs.values() for l in ls if l["event"] == "step"}
    for r, ls in logs.items():
        for l in ls:
            if l["event"] == "step" and l["loss"] is not None:
                assert l["loss"] == ref_loss[(r, l["step"])], (r, l)
        pids = {l["pid"] for l in ls}
        if r not in victims:
            assert len(pids) == 1, (r, pids)  # a survivor kept its process
        else:
            assert len(pids) == 2, (r, pids)
    return logs


def kill_to_commit(logs, victim, step, committed):
    """Seconds from the start of the step the victim died in to the end of
    the next step committed after the heal (step `committed`: the redone
    step, or the one after a step that committed before the loss was
    noticed), on the survivors (the latest of them)."""
    begun = min(l["t"] for l in logs[victim] if l["event"] == "begin" and l["step"] == step)
    done = max(l["t"] for r, ls in logs.items() if r != victim for l in ls
               if l["event"] == "step" and l["step"] == committed)
    return done - begun


def test_three_ranks_heal_a_rank_lost_in_the_backward_and_one_lost_in_the_update_from_warm_spares():
    # Rank 1 in step 2's backward: not committed, redone (dropout's RNG
    # restored on every rank). Rank 2 in step 5's update: committed, the
    # others go on; its replacement runs after_step(5) itself. Under
    # zsrun --spare: each replacement is the warm spare of the moment (the
    # worker's modules imported), the second one started when the first
    # was taken. (The 4-rank test below starts replacements afresh.)
    logs = check_healed(3, ["1:2:backward", "2:5:update"], victims=(1, 2), reference_heals=False, spare=True)
    print(f"kill to next committed step: backward {kill_to_commit(logs, 1, 2, 2):.2f} s, "
          f"update {kill_to_commit(logs, 2, 5, 6):.2f} s")


def test_four_ranks_heal_rank_0_lost_with_the_store_in_zsstore_and_a_rank_lost_in_the_update():
    logs = check_healed(4, ["0:3:backward", "3:6:update"], victims=(0, 3), reference_heals=True)
    print(f"kill to next committed step: rank 0 backward {kill_to_commit(logs, 0, 3, 3):.2f} s, "
          f"update {kill_to_commit(logs, 3, 6, 7):.2f} s")


def healed_then_restarted_by_name(code, out, joined, named):
    """A launch whose first loss healed (`joined` said) and whose second
    was named (`named`, a regular expression) and restarted the job, which
    ended well."""
    assert code == 0, out
    assert joined in out, out
    assert re.search(named, out), out
    assert "starting the job again" in out, out


def check_two_optimizers_ends(n, logs, ref_logs, out):
    """One end per rank (a job restarted whole ended once), both optimizers'
    states, the step counts, the steps run and the lr the reference's."""
    keys = ("digest", "steps", "ran", "lr", "head_digest", "buffers")
    ref_end, end = ends(ref_logs), ends(logs)
    for r in range(n):
        assert len(end[r]) == 1, (r, out)
        got, want = end[r][0], ref_end[r][0]
        assert [got[k] for k in keys] == [want[k] for k in keys], (r, got, want)


def test_a_loop_stepping_two_optimizers_heals_before_their_steps_and_restarts_by_name_between_them():
    # The output layer under an SGD of its own, stepped after the body's
    # AdamW, the loop counting the SGD's steps. Rank 1 in step 2's backward:
    # neither committed, redone, healed in place. Rank 2 in step 5's first
    # update: the AdamW committed, the SGD did not; a redo would step the
    # AdamW twice, so every survivor names it and exits 75, and zsrun
    # restarts the job (no checkpoint: from the start), which ends as the
    # uninterrupted run, both optimizers' states bit for bit.
    two = {"ZS_TEST_TWO_OPTIMIZERS": "last"}
    code, out, ref_logs, _ = launch(3, restarts=0, env=two)
    assert code == 0, out
    code, out, logs, _ = launch(3, "1:2:backward", "2:5:update_first_of_two", env=two)
    healed_then_restarted_by_name(
        code, out, "zeroshard.torch: rank 1 joined at step",
        r"a rank was lost in batch 5 between two optimizer steps of its train_step: another ZeroShardOptimizer "
        r"committed its step 6 \(from 5\), the loop's did not \(at 5\)")
    check_two_optimizers_ends(3, logs, ref_logs, out)
    # The loop given the optimizer stepped first: refused at the first step.
    code, out, _, _ = launch(2, restarts=1, env={"ZS_TEST_TWO_OPTIMIZERS": "first"})
    assert code != 0
    assert "train_step stepped another ZeroShardOptimizer after the loop's" in out, out


def test_the_spare_reads_the_scripts_imports_and_its_assignment(tmp_path):
    import io

    from zeroshard import spare
    script = tmp_path / "train.py"
    script.write_text("import json, os.path\nfrom collections import OrderedDict as O, deque\n"
                      "def main():\n    import zlib\nfrom . import local\n")
    assert spare.imported_modules(str(script)) == [("json", ()), ("os.path", ()),
                                                   ("collections", ("OrderedDict", "deque")), ("zlib", ())]
    assert spare.read_assignment(io.BytesIO(b"RANK=1\nZS_HEAL_REPLACEMENT=2\n\nlater\n")) == {
        "RANK": "1", "ZS_HEAL_REPLACEMENT": "2"}
    assert spare.read_assignment(io.BytesIO(b"RANK=1\n")) is None  # the job ended first
    with pytest.raises(ValueError, match="expected NAME=value"):
        spare.read_assignment(io.BytesIO(b"RANK\n\n"))


def test_a_rank_and_its_holder_lost_together_end_in_a_named_restart_of_the_job():
    # Ranks 1 and 2 (2 holds 1's copy) in the same update: zsrun starts a
    # replacement of each, but rank 0's heal is impossible; healing_loop
    # says so and exits with 75, zsrun names it and restarts the job whole,
    # which runs clean (the kills are the first attempt's) from the start
    # (no checkpoint) to the uninterrupted run's state.
    code, out, logs, left = launch(3, "1:3:update", "2:3:update", restarts=3)
    assert code == 0, out
    assert left == [f"log.{r}" for r in range(3)], left
    assert "zeroshard.torch healing_loop: rank 0: healing is impossible" in out, out
    assert "zsrun: healing impossible: rank 0 exited with status 75 (ZS_ERR_STATE_LOST)" in out, out
    assert "restart 1 of 3: starting the job again with 3 ranks" in out, out
    check_ends(3, logs, reference(3, False), out)


def test_a_replacement_whose_holder_is_lost_in_the_join_ends_in_a_named_restart_of_the_job():
    # Rank 1 in step 3's update; rank 2, which holds its copy, dies in the
    # survivors' join (the engine's "join" fault point) before handing it
    # over. The replacement of rank 1 cannot get its state: its join fails
    # with StateLostError, and join_as_replacement says so and exits with
    # 75 as a survivor would; zsrun names it and restarts the job whole.
    code, out, logs, left = launch(3, "1:3:update", restarts=3, env={"ZS_FAULT_POINT": "join:2:1"})
    assert code == 0, out
    assert "rank 1's shard state is lost: rank 2, which held its copy, was lost while handing it over" in out, out
    assert "zeroshard.torch.healing_loop: rank 1: healing is impossible" in out, out
    assert "zsrun: healing impossible: rank 1 exited with status 75 (ZS_ERR_STATE_LOST)" in out, out
    assert "starting the job again with 3 ranks" in out, out
    check_ends(3, logs, reference(3, False), out)


def test_enable_healing_after_a_context_without_copies_is_refused_by_name(tmp_path):
    """The peer copies are made with the context: asking for them later is
    an error that says to call it first, never a loop that silently cannot
    heal. A world of one keeps none."""
    import zeroshard.torch as zt
    from zeroshard.torch import _context, heal
    zt.init_context(rank=0, world_size=1, file_store_path=str(tmp_path / "store"))
    try:
        assert not heal.heals()
        with pytest.raises(RuntimeError, match="call it before zeroshard.torch.Init / partition_module"):
            zt.enable_healing()
        assert not _context.heal_wanted[0]
    finally:
        zt.shutdown()


TRAINER_STEPS = 80


def test_a_plain_hf_trainer_script_heals_three_losses_in_place():
    """The issue's run: a plain Trainer script (hf_heal_worker.py: GPT-2
    with dropout, 2 micro-batches a step, logging every 5 steps, no
    checkpoint saving) on 3 ranks under zsrun --restarts, rank 1 SIGKILLed
    after step 60 (its bookkeeping done, before its logging: the survivors
    are in the logging's gather, which the replacement then runs with
    them), rank 0 in step 25's second backward (not committed: the
    survivors redo the step's token count and both micro-batches) and rank
    2 in step 71's update (committed: the survivors go on). Every rank's
    optimizer state, the consolidated params and rank 0's whole log history
    (every logged loss, norm, learning rate and epoch, and the run's train
    loss and FLOPs) equal the uninterrupted run's bit for bit; survivors
    keep their processes; no job restart; nothing written but the logs."""
    ref_code, ref_out, ref_logs, _ = launch(3, restarts=1, worker="hf_heal_worker.py", steps=TRAINER_STEPS)
    assert ref_code == 0, ref_out
    kills = ["0:25:backward", "1:60:after", "2:71:update"]
    # From warm spares (the script's imports, transformers' included, done):
    # each takes the routing of torch.distributed over the engine at its start.
    code, out, logs, left = launch(3, *kills, restarts=3, spare=True, worker="hf_heal_worker.py",
                                   steps=TRAINER_STEPS)
    assert code == 0, out
    # No checkpoint: the output folder the Trainer makes stays empty.
    assert left == [f"log.{r}" for r in range(3)] + ["out/"], left
    assert "starting the job again" not in out, out
    for r, (step, where) in enumerate([(25, "backward"), (60, "after"), (71, "update")]):
        assert f"rank {r} killed by signal SIGKILL" in out, out
        assert re.search(rf"healing: the spare \(pid \d+\) takes rank {r}'s place", out), out
        joined = step - 1 if where == "backward" else step
        assert f"zeroshard.hf.Trainer: rank {r} joined at step {joined}" in out, out
        # Its first process ran up to its kill, the replacement to the
        # end: no rank was started a third time, so every other process
        # outlived each heal.
        pids = list(dict.fromkeys(l["pid"] for l in logs[r]))
        assert len(pids) == 2, (r, pids)
        assert [l for l in logs[r] if l["pid"] == pids[0]][-1]["step"] == step, (r, logs[r])
    check_trainer_ends(3, logs, ref_logs, out)
    history = [l for l in logs[0] if l["event"] == "params"][0]["log_history"]
    assert len([e for e in history if "loss" in e]) == TRAINER_STEPS // 5
    print("kill to next committed step: " + ", ".join(
        f"rank {r} {where} {trainer_kill_to_commit(logs, r, step, where):.2f} s"
        for r, (step, where) in enumerate([(25, "backward"), (60, "after"), (71, "update")])))


def test_an_hf_trainer_on_four_ranks_heals_losses_in_an_update_an_optimizer_step_an_evaluation_and_a_save():
    """Four ranks, evaluating every 20 steps and saving a checkpoint every
    25: rank 0 (the store in zsstore) killed in step 15's update
    (committed), rank 1 in step 30's optimizer step before the norm's
    all-reduce (not committed: the survivors redo the step's forwards and
    backwards from inside their optimizer step, then step), rank 3 at the
    second batch of the evaluation after step 40 (the survivors run the
    logging and the evaluation again from their start, with the
    replacement), rank 2 in step 50's checkpoint save, its engine shard
    written but not yet reported (the survivors' save fails as the loss,
    they heal and save again with the replacement). The model comes
    from_pretrained, partitioned as it loads (the copies kept on for the
    Trainer that follows; a replacement reads no weights). Bitwise as
    above, the evaluation losses in the log history included, and every
    file of both checkpoints equal to the uninterrupted run's."""
    folder = saved_small_gpt2()
    env = {"ZS_TEST_EVAL_STEPS": "20", "ZS_TEST_SAVE_STEPS": "25", "ZS_TEST_PRETRAINED": folder}
    steps = 60
    ref_code, ref_out, ref_logs, _ = launch(4, restarts=1, worker="hf_heal_worker.py", steps=steps, env=env)
    assert ref_code == 0, ref_out
    code, out, logs, left = launch(4, "0:15:update", "1:30:norm_allreduce", "3:40:eval", "2:50:save",
                                   restarts=4, worker="hf_heal_worker.py", steps=steps, env=env)
    assert code == 0, out
    assert "starting the job again" not in out, out
    for r, joined in ((0, 15), (1, 29), (3, 40), (2, 50)):
        assert f"zeroshard.hf.Trainer: rank {r} joined at step {joined}" in out, out
    for r, step in ((0, 15), (1, 30), (3, 40), (2, 50)):
        pids = list(dict.fromkeys(l["pid"] for l in logs[r]))
        assert len(pids) == 2 and [l for l in logs[r] if l["pid"] == pids[0]][-1]["step"] == step, (r, logs[r])
    check_trainer_ends(4, logs, ref_logs, out)
    saved = [l for l in logs[0] if l["event"] == "params"][0]["saved"]
    assert {f.split("/")[0] for f in saved} == {"checkpoint-25", "checkpoint-50", "checkpoint-60"}, saved
    history = [l for l in logs[0] if l["event"] == "params"][0]["log_history"]
    assert len([e for e in history if "eval_loss" in e]) == steps // 20, history
    for r in (0, 1, 3):  # each replacement's from_pretrained read no weights
        assert f"zeroshard: rank {r} replaces a lost rank: load_pretrained(" in out, out
    shutil.rmtree(folder)


def trainer_heals(env, steps, joined_at, ranks=3, warm=True):
    """hf_heal_worker.py on `ranks` ranks with `env`, uninterrupted, then
    with the kills of `joined_at` (kill -> the step its replacement joins
    at): healed in place (no job restart, rank 0 a survivor all along),
    bitwise as check_trainer_ends says. Returns rank 0's log history."""
    ref_code, ref_out, ref_logs, _ = launch(ranks, restarts=1, worker="hf_heal_worker.py", steps=steps, env=env)
    assert ref_code == 0, ref_out
    code, out, logs, _ = launch(ranks, *joined_at, restarts=len(joined_at), worker="hf_heal_worker.py",
                                steps=steps, env=env, warm=warm)
    assert code == 0, out
    assert "starting the job again" not in out and "does not heal" not in out, out
    for kill, joined in joined_at.items():
        assert f"zeroshard.hf.Trainer: rank {kill.split(':')[0]} joined at step {joined}" in out, out
    assert len({l["pid"] for l in logs[0]}) == 1, logs[0]  # a survivor all along
    check_trainer_ends(ranks, logs, ref_logs, out)
    return [l for l in logs[0] if l["event"] == "params"][0]["log_history"]


def saved_small_gpt2(seed=0):
    """A folder holding a small GPT-2 (random weights from `seed`), for
    $ZS_TEST_PRETRAINED; the caller removes it."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32,
                                                                 n_layer=2, n_head=2))
    folder = tempfile.mkdtemp(prefix="zs_heal_pretrained_")
    model.save_pretrained(folder)
    return folder


def pretrained_trainer_heals(env, steps, joined_at, ranks=3):
    """trainer_heals with $ZS_TEST_PRETRAINED: saved_small_gpt2()'s folder,
    which the trainer loads from."""
    folder = saved_small_gpt2()
    try:
        return trainer_heals(dict(env, ZS_TEST_PRETRAINED=folder), steps, joined_at, ranks)
    finally:
        shutil.rmtree(folder)


def test_a_seq2seq_trainer_heals_a_loss_in_a_backward_and_one_in_its_generating_evaluation():
    """zeroshard.hf.Seq2SeqTrainer (a T5, its evaluation every 10 steps
    generating: predict_with_generate) on 3 ranks: rank 1 killed in step
    12's second backward (the survivors redo the step), rank 2 in the
    evaluation after step 20, between its generate() calls (the survivors,
    in the next one's gathers, heal and run the evaluation again with the
    replacement). Bitwise as the Trainer's, the evaluation losses included.
    Its replacements are started afresh (no --warm-start): zeroshard.hf's
    import routes their torch.distributed init by their environment."""
    steps = 30
    history = trainer_heals({"ZS_TEST_SEQ2SEQ": "1", "ZS_TEST_EVAL_STEPS": "10"}, steps,
                            {"1:12:backward": 11, "2:20:eval": 20}, warm=False)
    assert len([e for e in history if "eval_loss" in e]) == steps // 10, history


def test_trls_sft_trainer_heals_a_loss_in_a_backward_and_one_in_an_update():
    """TRL's SFTTrainer through zeroshard.hf.trainer_class on 3 ranks, its
    forwards gathering metrics (entropy, token accuracy, token count) that
    it logs every 5 steps: rank 1 killed in step 7's second backward (not
    committed: the survivors redo the step, its metrics taken back to the
    step's opening first, or the redone forwards would count twice), rank 2
    in step 13's update (committed: its replacement takes the survivors'
    metrics of step 13's forwards). Bitwise as the Trainer's, the logged
    metrics included."""
    pytest.importorskip("trl")
    steps = 20
    history = trainer_heals({"ZS_TEST_TRL_SFT": "1"}, steps, {"1:7:backward": 6, "2:13:update": 13})
    logged = [e for e in history if "mean_token_accuracy" in e]
    assert len(logged) == steps // 5 and all("num_tokens" in e and "entropy" in e for e in logged), history


def test_trls_dpo_trainer_heals_a_loss_in_a_backward_and_one_in_an_update():
    """TRL's DPOTrainer on 3 ranks, the policy and the reference model TRL
    loads from the same folder partitioned (the reference frozen, in no
    optimizer: its shards ride in the first optimizer's peer copy), its
    forwards gathering metrics (rewards, margins, log-probabilities) it
    logs every 5 steps: rank 1 killed in step 6's second backward, rank 2
    in step 9's update. Bitwise as the Trainer's, the logged metrics
    included: the replacement's reference model came with its join."""
    pytest.importorskip("trl")
    steps = 15
    history = pretrained_trainer_heals({"ZS_TEST_TRL_DPO": "1"}, steps, {"1:6:backward": 5, "2:9:update": 9})
    logged = [e for e in history if "rewards/margins" in e]
    assert len(logged) == steps // 5, history


@pytest.mark.parametrize("trainer", ["reward", "kto"])
def test_trls_reward_and_kto_trainers_heal_a_loss_in_a_backward_and_one_in_an_update(trainer):
    """TRL's RewardTrainer (a scalar head on a small GPT-2, preference
    pairs) and KTOTrainer (the policy and its frozen reference loaded from
    one folder, completions marked desirable or not) on 3 ranks, their
    forwards gathering metrics (accuracy and margins; KL, rewards and
    log-probabilities) logged every 5 steps: rank 1 killed in step 6's
    second backward, rank 2 in step 9's update. Bitwise as the Trainer's,
    the logged metrics included."""
    pytest.importorskip("trl")
    steps = 15
    heals = trainer_heals if trainer == "reward" else pretrained_trainer_heals
    history = heals({f"ZS_TEST_TRL_{trainer.upper()}": "1"}, steps, {"1:6:backward": 5, "2:9:update": 9})
    logged = [e for e in history if ("accuracy" if trainer == "reward" else "kl") in e]
    assert len(logged) == steps // 5, history


def test_trls_grpo_trainer_heals_losses_in_its_generation_a_backward_and_an_update_with_buffered_completions():
    """TRL's GRPOTrainer on 4 ranks, its completions sampled (the RNG
    matters) and scored, a reference model from the same folder, one
    generation serving two optimizer steps (steps_per_generation 4, two
    micro-batches a step):
    - rank 1 killed in step 3's second backward: the survivors redo the
      step, its first micro-batch generating, scoring and counting tokens
      again (the token count and the micro-batch count put back first);
    - rank 2 in step 5's generation, in generate()'s gathers: the survivors
      generate again, the replacement its own;
    - rank 3 in step 7's update (committed): step 8 trains on the
      completions step 7 generated, which the replacement has from its
      predecessor's blob.
    Bitwise as the Trainer's, the logged rewards, KL and token counts
    included."""
    pytest.importorskip("trl")
    steps = 10
    history = pretrained_trainer_heals({"ZS_TEST_TRL_GRPO": "1"}, steps,
                                       {"1:3:backward": 2, "2:5:generate": 4, "3:7:update": 7}, ranks=4)
    logged = [e for e in history if "reward" in e and "kl" in e]
    assert len(logged) == steps // 5 and all(e["num_tokens"] > 0 for e in logged), history


def test_trls_rloo_trainer_heals_losses_in_its_generation_and_an_update_with_buffered_completions():
    """TRL's RLOOTrainer (GRPO's generation and buffering, its own
    advantages) in GRPO's setting on 3 ranks: rank 1 killed in step 5's
    generation (the survivors generate again, the replacement its own),
    rank 2 in step 7's update (step 8 trains on the completions step 7
    generated, which the replacement has from its predecessor's blob).
    Bitwise as the Trainer's, the logged rewards and KL included."""
    pytest.importorskip("trl")
    steps = 10
    history = pretrained_trainer_heals({"ZS_TEST_TRL_RLOO": "1"}, steps, {"1:5:generate": 4, "2:7:update": 7})
    logged = [e for e in history if "reward" in e and "kl" in e]
    assert len(logged) == steps // 5 and all(e["num_tokens"] > 0 for e in logged), history


def test_trls_distillation_trainer_heals_losses_in_its_generation_and_an_update():
    """TRL's DistillationTrainer (on-policy: the student samples, a teacher
    other than it scores, a JSD loss; GRPO's generation and buffering) on 3
    ranks, the teacher (another model, from a folder of its own: TRL loads
    it partitioned frozen, its shards riding in the peer copy): rank 1 killed in step 5's generation (the survivors generate
    again, the replacement its own), rank 2 in step 7's update (committed).
    Bitwise as the Trainer's, the logged losses and token counts included."""
    pytest.importorskip("trl")
    steps = 10
    teacher = saved_small_gpt2(seed=1)
    try:
        history = pretrained_trainer_heals({"ZS_TEST_TRL_DISTILLATION": "1", "ZS_TEST_TEACHER": teacher}, steps,
                                           {"1:5:generate": 4, "2:7:update": 7})
    finally:
        shutil.rmtree(teacher)
    logged = [e for e in history if "loss" in e and "num_tokens" in e]
    assert len(logged) == steps // 5 and all(e["loss"] > 0 and e["num_tokens"] > 0 for e in logged), history


def test_a_grpo_trainer_says_why_it_does_not_heal_with_state_outside_its_steps():
    """What GRPO keeps outside the step it redoes is named, and only that;
    completions buffered across optimizer steps are what rides in the
    blob. DPO and KTO with precomputed reference log-probs are named too."""
    from types import SimpleNamespace
    from zeroshard.hf import trainer_heal
    plain = SimpleNamespace(use_vllm=False, use_adaptive_entropy=False)
    assert trainer_heal._grpo_why_not({"args": plain, "tools": [print]}) is None
    assert "use_vllm" in trainer_heal._grpo_why_not({"args": SimpleNamespace(use_vllm=True)})
    assert "use_adaptive_entropy" in trainer_heal._grpo_why_not(
        {"args": SimpleNamespace(use_vllm=False, use_adaptive_entropy=True)})
    for name in ("environment_factory", "rollout_func"):
        assert name in trainer_heal._grpo_why_not({"args": plain, name: object()})
    grpo = lambda spg, iterations, ga: SimpleNamespace(  # noqa: E731
        args=SimpleNamespace(steps_per_generation=spg, gradient_accumulation_steps=ga), num_iterations=iterations)
    assert not trainer_heal._buffered_across_steps(grpo(2, 1, 2))
    assert trainer_heal._buffered_across_steps(grpo(4, 1, 2)) and trainer_heal._buffered_across_steps(grpo(2, 2, 2))
    assert not trainer_heal._buffered_across_steps(SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=1)))
    # DPO's and KTO's reference log-probs scored in their construction: a
    # replacement would gather before its join.
    assert trainer_heal._precompute_why_not({"args": SimpleNamespace(precompute_ref_log_probs=False)}) is None
    assert "precompute_ref_log_probs" in trainer_heal._precompute_why_not(
        {"args": SimpleNamespace(precompute_ref_log_probs=True)})


def test_a_trainer_on_a_streamed_dataset_says_it_does_not_heal_and_a_loss_restarts_the_job():
    """Accelerate dispatches an IterableDataset's batches from rank 0 (a
    collective a batch), which a replacement cannot skip alone: the
    Trainer says so at the start, and a loss restarts the job (no
    checkpoint: from the start) rather than failing in a collective
    mismatch, as it did before it was named. Map-style data and an
    explicit dispatch_batches=False are not refused."""
    from types import SimpleNamespace
    import torch
    from zeroshard.hf import trainer_heal
    stream = type("Stream", (torch.utils.data.IterableDataset,), {"__iter__": lambda self: iter(())})()
    config = lambda dispatch: SimpleNamespace(accelerator_config=SimpleNamespace(dispatch_batches=dispatch))  # noqa
    assert "dispatch_batches" in trainer_heal._dispatch_why_not({"args": config(None), "train_dataset": stream})
    assert trainer_heal._dispatch_why_not({"args": config(False), "train_dataset": stream}) is None
    assert trainer_heal._dispatch_why_not({"args": config(None), "train_dataset": [1, 2]}) is None
    assert "dispatch_batches" in trainer_heal._dispatch_why_not({"args": config(True), "train_dataset": [1, 2]})
    code, out, logs, _ = launch(3, "1:3:backward", restarts=1, worker="hf_heal_worker.py", steps=6,
                                env={"ZS_TEST_ITERABLE": "1"})
    assert code == 0, out
    assert "this Trainer does not heal a lost rank in place (its training batches are dispatched from rank 0" in out, out
    assert "starting the job again" in out and "ranks disagree" not in out, out
    assert all(ends(logs)[r][-1]["global_step"] == 6 for r in range(3)), out


def test_a_trainer_on_a_streamed_dataset_that_each_rank_reads_heals_in_place():
    """The same stream with dispatch_batches=False (accelerator_config):
    each rank reads it and keeps its own slice (Accelerate's
    IterableDatasetShard), so a replacement reaches the survivors' batch
    by reading the stream up to it, as a resume does. Rank 1 killed in
    step 5's second backward (the survivors redo the step), rank 2 in
    step 9's update (committed): bitwise as the uninterrupted run."""
    trainer_heals({"ZS_TEST_ITERABLE": "own"}, 12, {"1:5:backward": 4, "2:9:update": 9})


def test_a_plain_accelerate_script_on_a_stream_that_each_rank_reads_heals_in_place():
    """accelerate_heal_worker.py's samples as an IterableDataset, each rank
    reading the stream for its own slice (dispatch_batches=False: no
    sampler, no generator to hand over): rank 1 lost in step 2's backward,
    rank 2 in step 5's forward (the second epoch's first), rank 0 in step
    7's update. Every rank's state, every step's loss and the consolidated
    params bitwise the uninterrupted run's; no job restart."""
    env = {"ZS_TEST_STREAM": "1"}
    kills = ["1:2:backward", "2:5:forward", "0:7:update"]
    code, out, ref_logs, _ = launch(3, restarts=1, worker="accelerate_heal_worker.py", steps=ACCELERATE_EPOCHS,
                                    env=env)
    assert code == 0, out
    code, out, logs, _ = launch(3, *kills, restarts=3, worker="accelerate_heal_worker.py", steps=ACCELERATE_EPOCHS,
                                env=env)
    assert code == 0, out
    assert "starting the job again" not in out and "does not heal" not in out, out
    for kill in kills:
        victim, step, where = kill.split(":")
        assert f"zeroshard.hf.Accelerator: rank {victim} joined at step {int(step) + (where == 'update')}" in out, out
    check_ends(3, logs, ref_logs, out)
    ref_loss = {(l["rank"], l["step"]): l["loss"] for ls in ref_logs.values() for l in ls if l["event"] == "step"}
    for r, ls in logs.items():
        steps = [l for l in ls if l["event"] == "step"]
        assert steps and all(l["loss"] == ref_loss[(r, l["step"])] for l in steps), (r, steps)


LIGHTNING_WORLDS = {
    "checkpoints": (("1:1:save", "0:6:backward", "2:10:val"), {"ZS_TEST_CHECKPOINTS": "1"}, True),
    "accumulate": (("1:4:backward1", "0:6:backward", "2:9:update"),
                   {"ZS_TEST_ACCUMULATE": "2", "ZS_TEST_PERSISTENT": "1"}, False),
    "manual": (("1:2:backward", "0:5:update", "2:10:val"), {"ZS_TEST_MANUAL": "1", "ZS_TEST_PERSISTENT": "1"}, False),
}


@pytest.mark.parametrize("world", list(LIGHTNING_WORLDS))
def test_a_lightning_fit_heals_losses_in_backwards_a_validation_and_an_update(world):
    """A plain Lightning script (lightning_heal_worker.py: ZeroShardStrategy,
    2 epochs of 6 optimizer steps from a shuffled DataLoader, dropout, a
    StepLR stepped every step, the loss logged per step and as the epoch's
    mean, a validation every 4 steps after a sanity check, its mean synced)
    on 3 ranks under zsrun --restarts, one world each (LIGHTNING_WORLDS):
    - checkpoints: with Lightning's default logger (CSV) and ModelCheckpoint (a save
      after each validation, the last one kept), from warm spares (zsrun
      --spare), rank 1 killed in the first save (the engine's fault point,
      its shards written: mid-epoch, at the end of the validation after
      step 4): the survivors run the validation and its save again from
      its start; the replacement resumes 4 batches into the epoch in that
      validation, through Lightning's own resume, the survivors' state in
      place of a file, with its predecessor's share of the epoch's mean;
    - rank 0 in step 6's backward (the second epoch's first batch; the
      store in zsstore);
    - rank 2 in the validation after step 10: the survivors run it again
      from its start with the replacement, which resumes in it;
      each checkpoint saved in the survivors' folder, its files the
      uninterrupted run's (a replacement resolves its folder anew from a
      logger version of its own: rank 0's logs go on in version_1, as
      after Lightning's own resume), Lightning's batch progress at each
      step's start the uninterrupted run's;
    - accumulate: no checkpoint and no logger, 2 micro-batches a step
      (accumulate_grad_batches=2) and every
      param persistent (each step ends in their gather, where the survivors
      learn of a loss after the step committed): rank 1 killed in step 4's
      first micro-batch (outside the optimizer step: the survivors redo it,
      the replacement answers locally until the closure they redo), rank 0
      in step 6's second (inside it: they redo both), rank 2 in step 9's
      update (its replacement runs that step's window hollow);
    - manual: manual optimization (the training_step steps the optimizer and
      the scheduler itself), every param persistent: rank 1 killed in step
      2's backward (the survivors run the training_step again), rank 0 in
      step 5's update (its replacement runs that training_step hollow up to
      its optimizer step and live after it: the scheduler's step), rank 2
      in the validation after step 10.
    Each world ends with every rank's optimizer state, the consolidated
    params, every loss and lr its processes logged, every epoch's and
    validation's mean equal to the uninterrupted run's (with the same
    accumulation) bit for bit; survivors keep their processes; no job
    restart; nothing written but the logs and checkpoints. Heartbeat limit 3 s: up to five
    processes importing or running Lightning share two cores."""
    pytest.importorskip("lightning")
    worker, steps = "lightning_heal_worker.py", 12
    times = []
    kills, env, spare = LIGHTNING_WORLDS[world]
    env = dict(env, ZS_HEARTBEAT_TIMEOUT_MS="3000")
    # The reference: persistence changes no number, accumulation does.
    ref_files, files = {}, {}
    ref_code, ref_out, ref_logs, ref_left = launch(3, restarts=1, worker=worker, steps=steps, digests=ref_files,
                                                   env={k: v for k, v in env.items() if k != "ZS_TEST_PERSISTENT"})
    assert ref_code == 0, ref_out
    batch = lambda l: (l["rank"], l["epoch"], l["batch"])  # noqa: E731
    ref_loss = {batch(l): (l["loss"], l["lr"]) for ls in ref_logs.values() for l in ls if l["event"] == "step"}
    ref_epoch = {(l["rank"], l["epoch"]): l["loss"] for ls in ref_logs.values() for l in ls
                 if l["event"] == "epoch"}
    ref_val = {(l["rank"], l["step"]): l["loss"] for ls in ref_logs.values() for l in ls if l["event"] == "val"}
    # Lightning's batch progress (training and validation, `total`) at
    # each step's start: a replacement's too (the last process's).
    progress = lambda logs: {(l["rank"], l["step"]): l["progress"] for ls in logs.values()  # noqa: E731
                             for l in ls if l["event"] == "begin"}
    code, out, logs, left = launch(3, *kills, restarts=len(kills), spare=spare, worker=worker, steps=steps,
                                   env=env, digests=files)
    assert code == 0, out
    if "ZS_TEST_CHECKPOINTS" in env:
        logs_1 = ["lightning_logs/version_1/", "lightning_logs/version_1/metrics.csv"]  # rank 0's replacement's
        assert left == sorted(ref_left + logs_1), left
        assert len(files) == 4 and files == ref_files, (files, ref_files)  # 3 shards and the manifest
    else:
        assert left == [f"log.{r}" for r in range(3)], left  # no checkpoint, nothing else
    assert "starting the job again" not in out and "does not heal" not in out, out
    check_ends(3, logs, ref_logs, out)
    assert progress(logs) == progress(ref_logs)
    victims = {int(k.split(":")[0]): (int(k.split(":")[1]), k.split(":")[2]) for k in kills}
    for r, (step, where) in victims.items():
        if spare:  # the warm spare of the moment took its place: the script's imports done
            assert re.search(rf"healing: the spare \(pid \d+\) takes rank {r}'s place", out), out
        if where == "save":
            assert step == 1
            step = 4  # the first save: ModelCheckpoint's at the end of the validation after 4 steps
        # C: the steps before the victim's; after a loss in its update, that step too.
        joined = step + 1 if where == "update" else step
        assert f"zeroshard.lightning: rank {r} joined at step {joined}" in out, out
        times.append((r, where, trainer_kill_to_commit(logs, r, step, "update" if where == "update" else
                                                       "backward")))
    hollow = []
    for r, ls in logs.items():
        pids = list(dict.fromkeys(l["pid"] for l in ls))
        assert len(pids) == (2 if r in victims else 1), (r, pids)  # a survivor kept its process
        for l in ls:
            if l["event"] == "step":
                if l["loss"] is None:
                    hollow.append((r, l["step"]))
                assert (l["loss"], l["lr"]) in ((None, ref_loss[batch(l)][1]), ref_loss[batch(l)]), (r, l)
            if l["event"] == "epoch":  # a replacement's with its predecessor's share of the epoch
                assert l["loss"] == ref_epoch[(r, l["epoch"])], (r, l)
        # Each validation once per rank (the one a loss cut short by
        # the replacement), its synced mean the reference's; twice where
        # the loss came in the save after its end hook (the victim's
        # first process and the survivors noted it, then ran it again).
        vals = [(l["step"], l["loss"]) for l in ls if l["event"] == "val"]
        again = [4] if "1:1:save" in kills else []
        assert vals == sorted([(s, v) for (q, s), v in ref_val.items() if q == r]
                              + [(s, ref_val[(r, s)]) for s in again]), (r, vals)
    # Only the replacement after a committed step ran it hollow: each
    # batch of that step's window, the first logged before the step
    # counts (Lightning's global_step - 1).
    assert hollow == ([(2, 8), (2, 9)] if "2:9:update" in kills else
                      [(0, 5)] if "0:5:update" in kills else []), hollow
    print("kill to next committed step: " + ", ".join(f"rank {r} ({where}) {t:.2f} s" for r, where, t in times))


def test_a_lightning_manual_training_step_after_one_that_took_no_step_is_not_healed_but_named():
    """Manual optimization stepping every second batch (gradients
    accumulated by hand): a loss in the second batch's backward cannot be
    healed by running that training_step again (the first batch's gradients
    went with the step cut short). The survivors say so and end; zsrun
    restarts the job, which runs to its end."""
    pytest.importorskip("lightning")
    code, out, logs, _ = launch(3, "1:0:backward", restarts=2, worker="lightning_heal_worker.py", steps=8,
                                env={"ZS_TEST_MANUAL": "1", "ZS_TEST_ACCUMULATE": "2",
                                     "ZS_HEARTBEAT_TIMEOUT_MS": "3000"})
    assert code == 0, out
    assert "it came in a manual training_step after one that took no optimizer step" in out, out
    assert "starting the job again" in out, out
    assert all(ends(logs)[r][-1]["ran"] == 8 for r in range(3)), out


def test_a_lightning_manual_training_step_of_two_optimizers_heals_before_their_steps_and_is_named_after():
    """Manual optimization stepping two optimizers in each training_step
    (the output layer's SGD after the body's AdamW, as a GAN steps its
    discriminator and generator): rank 1 lost in the second batch's
    backward, before either steps, heals in place (the survivors run the training_step
    again, the replacement joins both optimizers); rank 2 lost in the sixth
    batch's AdamW update, which commits: the rest of that training_step cannot be
    run again nor by a replacement, so the survivors say so and end, and
    zsrun restarts the job, which ends as the uninterrupted run (both
    optimizers' states bit for bit)."""
    pytest.importorskip("lightning")
    worker, env = "lightning_heal_worker.py", {"ZS_TEST_MANUAL": "2", "ZS_HEARTBEAT_TIMEOUT_MS": "3000"}
    code, out, ref_logs, _ = launch(3, restarts=1, worker=worker, steps=8, env=env)
    assert code == 0, out
    code, out, logs, _ = launch(3, "1:2:backward", "2:5:update_first_of_two", restarts=3, worker=worker, steps=8,
                                env=env)
    # Lightning counts every optimizer's step (global_step 2 is the second
    # batch's start), the engine's count is the first optimizer's.
    healed_then_restarted_by_name(
        code, out, "zeroshard.lightning: rank 1 joined at step 1",
        r"it came in or after the first optimizer step of this manual training_step, which steps 2 optimizers: "
        r".*: not healed")
    check_two_optimizers_ends(3, logs, ref_logs, out)


def k_where(kills, rank):
    return next(k.split(":")[2] for k in kills if int(k.split(":")[0]) == rank)


def check_trainer_ends(n, logs, ref_logs, out):
    """Every rank's optimizer state, steps and lr, the consolidated params
    and rank 0's log history (timings aside: every logged loss, gradient
    norm, learning rate and epoch) equal the reference's."""
    ref_end, end = ends(ref_logs), ends(logs)
    for r in range(n):
        assert len(end[r]) == 1, (r, out)
        got, want = end[r][0], ref_end[r][0]
        assert (got["digest"], got["steps"], got["global_step"], got["lr"]) == \
            (want["digest"], want["steps"], want["global_step"], want["lr"]), (r, got, want)
    params = [l for l in logs[0] if l["event"] == "params"]
    ref_params = [l for l in ref_logs[0] if l["event"] == "params"]
    assert len(params) == 1 and params[0]["sha256"] == ref_params[0]["sha256"], out
    timing = ("runtime", "samples_per_second", "steps_per_second", "step_time")  # step_time: GRPO's
    strip = lambda h: [{k: v for k, v in e.items() if not k.endswith(timing)} for e in h]  # noqa: E731
    got, want = params[0]["log_history"], ref_params[0]["log_history"]
    diff = [(i, k, e.get(k), w.get(k)) for i, (e, w) in enumerate(zip(strip(got), strip(want)))
            for k in sorted(set(e) | set(w)) if e.get(k) != w.get(k)]
    assert strip(got) == strip(want), diff
    # Every file the Trainer's saves wrote, bit for bit, but the engine's
    # directory lock (which names its holder's pid) and the timings in
    # trainer_state.json.
    files = lambda saved: {f: h for f, h in saved.items() if not f.endswith(".zeroshard.lock")}  # noqa: E731
    assert files(params[0]["saved"]) == files(ref_params[0]["saved"]), (params[0]["saved"], ref_params[0]["saved"])


def trainer_kill_to_commit(logs, victim, step, where):
    """Seconds from the kill (the victim's last note: its kill, or the
    start of the step whose update killed it) to the survivors' end of the
    next step that commits after it (the redone step, or the one after)."""
    first = logs[victim][0]["pid"]
    killed = [l["t"] for l in logs[victim] if l["pid"] == first][-1]
    committed = step if where == "backward" else step + 1
    return max(l["t"] for r, ls in logs.items() if r != victim for l in ls
               if l["event"] == "step" and l["step"] == committed) - killed


ACCELERATE_EPOCHS = 2


def test_a_plain_accelerate_script_heals_losses_in_a_forward_a_backward_and_an_update_with_and_without_accumulation():
    """A plain Accelerate script (accelerate_heal_worker.py: a shuffled
    DataLoader over 3 ranks, 5 batches a rank an epoch, dropout, a StepLR
    stepped every step, 2 epochs, an evaluation after each gathering a
    held-out loss, its own step count under `sync_gradients`), its
    Accelerator zeroshard.hf's, under
    zsrun --restarts: the survivors run the rest of a step a loss cut short
    hollow, heal at its optimizer step, skip it and take its window's
    batches again; the replacement joins in prepare() and starts where
    they are. One step a micro-batch: rank 1 lost in step 2's backward,
    rank 2 in step 5's forward (the second epoch's first), rank 0 in step
    7's update (committed: the survivors go on; its replacement starts at
    the next window, its scheduler stepped once), the loop without
    `accelerate.accumulate`. Two micro-batches a step
    (windows of 2, 2 and the epoch's last batch alone), from warm spares:
    rank 1 in step 1's forward, rank 2 in the epoch's last window's
    backward, rank 0 in step 4's update. Each world ends with every rank's
    optimizer state, step count and lr, the consolidated params, every
    step's loss and every evaluation bitwise the uninterrupted run's (a
    replacement's of the epochs it skipped aside: it runs them hollow), a
    survivor's own step count never counting a healed step twice;
    survivors keep their processes; no job restart; nothing written."""
    cases = [("1", ["1:2:backward", "2:5:forward", "0:7:update"], False),
             ("2", ["1:1:forward", "2:2:backward", "0:4:update"], True)]
    for accumulation, kills, spare in cases:
        env = {"ACCUMULATION": accumulation}
        code, out, ref_logs, _ = launch(3, restarts=1, worker="accelerate_heal_worker.py", steps=ACCELERATE_EPOCHS,
                                        env=env)
        assert code == 0, out
        code, out, logs, left = launch(3, *kills, restarts=3, spare=spare, worker="accelerate_heal_worker.py",
                                       steps=ACCELERATE_EPOCHS, env=env)
        assert code == 0, out
        assert left == [f"log.{r}" for r in range(3)], left
        assert "starting the job again" not in out, out
        assert out.count("the rest of this step runs hollow") >= 2, out  # said once a survivor
        for kill in kills:
            victim, step, where = kill.split(":")
            joined = int(step) + (1 if where == "update" else 0)
            assert f"rank {victim} killed by signal SIGKILL" in out, out
            assert f"zeroshard.hf.Accelerator: rank {victim} joined at step {joined}" in out, out
        check_ends(3, logs, ref_logs, out)
        ref_loss = {(l["rank"], l["step"]): l["loss"] for ls in ref_logs.values() for l in ls if l["event"] == "step"}
        for r, ls in logs.items():
            steps = [l for l in ls if l["event"] == "step"]
            assert all(l["loss"] == ref_loss[(r, l["step"])] for l in steps), (r, steps)
            pids = list(dict.fromkeys(l["pid"] for l in ls))
            assert len(pids) == 2, (r, pids)  # killed once, replaced once; alive through the other heals
            # Every step taken once by the processes of a rank (none skipped
            # for good, none twice), but the one its first process died in
            # the update of (committed, logged by neither).
            lost = {int(k.split(":")[1]) for k in kills if k.startswith(f"{r}:") and k.endswith(":update")}
            assert sorted(l["step"] for l in steps) == sorted(set(l["step"] for l in steps)), (r, steps)
            assert {l["step"] for l in steps} | lost == {l["step"] for l in ref_logs[r] if l["event"] == "step"}, r
            # The script's own step count, in a rank's first process (a
            # survivor of the heals before its own loss): a healed step
            # counted once.
            first = [l for l in steps if l["pid"] == pids[0]]
            assert [l["completed"] for l in first] == [l["step"] + 1 for l in first], (r, first)
            # Each epoch's evaluation, by every process that trained before it
            # (a replacement's of the epochs it skipped ran hollow).
            ref_eval = {l["epoch"]: l["value"] for l in ref_logs[r] if l["event"] == "eval"}
            trained = set()
            for l in ls:
                if l["event"] == "step":
                    trained.add(l["pid"])
                elif l["event"] == "eval" and l["pid"] in trained:
                    assert l["value"] == ref_eval[l["epoch"]], (r, l, ref_eval)


def test_torch_distributed_over_the_engine_carries_a_trainers_collectives_and_refuses_the_rest(tmp_path):
    """heal_dist's group in a world of one (its use on 3 ranks is the
    Trainer test's: every count and logged loss gathered through it): the
    Gloo group replaced, all_reduce by every op, both all_gathers,
    broadcast, barrier and all_gather_object answered; what it does not
    carry refused by name; the default group back to Gloo after."""
    import torch
    import torch.distributed as dist

    import zeroshard.torch as zt
    from zeroshard.torch import heal_dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    zt.init_context(rank=0, world_size=1, file_store_path=str(tmp_path / "store"))
    try:
        assert heal_dist.use_engine_process_group() and dist.get_backend() == "zeroshard"
        assert heal_dist.use_engine_process_group()  # once is enough
        for op, want in ((dist.ReduceOp.SUM, [3.0, -1.5]), (dist.ReduceOp.MAX, [3.0, -1.5]),
                         (dist.ReduceOp.AVG, [3.0, -1.5]), (dist.ReduceOp.PRODUCT, [3.0, -1.5])):
            t = torch.tensor([3.0, -1.5])
            dist.all_reduce(t, op=op)
            assert t.tolist() == want, op
        n = torch.tensor(7, dtype=torch.int64)
        outs = [torch.zeros_like(n)]
        dist.all_gather(outs, n)
        assert outs[0].item() == 7
        flat = torch.zeros(3, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(flat, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
        assert flat.tolist() == [1.0, 2.0, 3.0]
        b = torch.arange(4.0)
        dist.broadcast(b, src=0)
        dist.barrier()
        objects = [None]
        dist.all_gather_object(objects, {"step": 3})
        assert b.tolist() == [0.0, 1.0, 2.0, 3.0] and objects == [{"step": 3}]
        with pytest.raises(NotImplementedError, match="reduce_scatter_tensor is not carried"):
            dist.reduce_scatter_tensor(torch.zeros(1), torch.zeros(1))
        with pytest.raises(NotImplementedError, match="BAND"):
            dist.all_reduce(torch.zeros(1, dtype=torch.int32), op=dist.ReduceOp.BAND)
    finally:
        zt.shutdown()
        dist.destroy_process_group()
