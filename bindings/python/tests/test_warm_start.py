"""zsrun --warm-start (docs/launching.md): every rank, and a replacement,
forked from one interpreter that imported the script's modules, each one
what zsrun would have executed: its child, its own process group, its
environment and arguments, its exit status, its output prefixed, gone with
zsrun. Where the interpreter cannot serve, zsrun says so and executes the
ranks. Scripts here are tiny (no engine): what is checked is the launch."""
import os
import signal
import subprocess
import sys
import time

import pytest

from launch_env import ZSRUN, ranks_env

MODULE = """import os, threading
with open(os.environ["IMPORT_LOG"], "a") as f:
    f.write(f"{os.getpid()}\\n")
if os.environ.get("SLOW_IMPORT") and "RANK" not in os.environ:  # the interpreter's import only
    import time
    time.sleep(float(os.environ["SLOW_IMPORT"]))
if os.environ.get("START_THREAD"):
    threading.Thread(target=threading.Event().wait, name="poller", daemon=True).start()
"""

SCRIPT = """import json, os, signal, sys, time
import numpy
import imported_once
rank = os.environ["RANK"]
replacement = os.environ.get("ZS_HEAL_REPLACEMENT")
if rank == os.environ.get("KILL_RANK") and not replacement:
    os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: zsrun --restarts replaces it
print(json.dumps(dict(rank=rank, pid=os.getpid(), ppid=os.getppid(), pgid=os.getpgid(0), argv=sys.argv[1:],
                      replacement=replacement, draw=float(numpy.random.rand()), world=os.environ["WORLD_SIZE"])),
      flush=True)
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
sys.exit(int(os.environ.get("EXIT_" + rank, "0")))
"""


@pytest.fixture
def job(tmp_path):
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    (tmp_path / "imported_once.py").write_text(MODULE)
    (tmp_path / "train.py").write_text(SCRIPT)

    def start(n, *flags, **env):
        log = tmp_path / "imports.log"
        log.unlink(missing_ok=True)
        cmd = [str(ZSRUN), "-n", str(n), *flags, "--", sys.executable, str(tmp_path / "train.py"), "a", "b c"]
        return subprocess.Popen(cmd, env=ranks_env(IMPORT_LOG=str(log), **env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path), log

    def run(n, *flags, **env):
        proc, log = start(n, *flags, **env)
        out, err = proc.communicate(timeout=120)
        imports = [int(p) for p in log.read_text().split()] if log.exists() else []
        return proc, out, err, imports

    run.start = start
    return run


def ranks_said(out):
    import json
    said = {}
    for line in out.splitlines():
        prefix, _, body = line.partition("] ")
        if body.startswith("{"):
            said.setdefault(prefix + "]", []).append(json.loads(body))
    return said


def test_ranks_forked_from_one_import_are_zsruns_children_with_their_own_environment_group_and_status(job):
    proc, out, err, imports = job(3, "--warm-start", EXIT_1="3")
    assert proc.returncode == 3, (out, err)  # rank 1's status, as executed
    assert "zsrun: rank 1 exited with status 3" in err, err
    said = ranks_said(out)
    assert sorted(said) == ["[rank 0]", "[rank 1]", "[rank 2]"], out  # prefixed, one line each
    ranks = [said[f"[rank {k}]"][0] for k in range(3)]
    assert len(imports) == 1, imports  # the module ran once, in the interpreter
    for k, r in enumerate(ranks):
        assert r["rank"] == str(k) and r["world"] == "3" and r["argv"] == ["a", "b c"], r
        assert r["ppid"] == proc.pid, r  # adopted by zsrun
        assert r["pgid"] == r["pid"] != imports[0], r  # a group of its own, not the interpreter
        assert r["replacement"] is None
    assert len({r["draw"] for r in ranks}) == 3, ranks  # NumPy reseeded in each
    assert "warm-start is off" not in err, err


def test_without_the_option_each_rank_imports_for_itself(job):
    proc, out, err, imports = job(3)
    assert proc.returncode == 0, (out, err)
    assert sorted(imports) == sorted(r[0]["pid"] for r in ranks_said(out).values()), (imports, out)


def test_a_replacement_is_forked_warm_too(job):
    proc, out, err, imports = job(3, "--warm-start", "--restarts", "1", KILL_RANK="1")
    assert proc.returncode == 0, (out, err)
    assert "rank 1 killed by signal SIGKILL" in err and "starting a replacement of rank 1" in err, err
    replacement = ranks_said(out)["[rank 1]"]
    assert [r["replacement"] for r in replacement] == ["1"], out
    assert replacement[0]["ppid"] == proc.pid, replacement
    assert len(imports) == 1, imports


def test_a_script_whose_imports_start_a_thread_is_executed_and_says_why(job):
    proc, out, err, imports = job(2, "--warm-start", START_THREAD="1")
    assert proc.returncode == 0, (out, err)
    assert ("zsrun: --warm-start is off for this attempt (it could not fork rank 0: the script's imports started "
            "Python threads (poller), which a forked rank would not have): the ranks are started afresh") in err, err
    assert len(imports) == 3, imports  # the interpreter's, then each rank's own
    assert len(ranks_said(out)) == 2, out


def test_an_interpreter_that_cannot_read_the_script_leaves_the_ranks_executed_and_named(job, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT + "def broken(:\n")
    proc, out, err, imports = job(2, "--warm-start")
    assert proc.returncode == 1, (out, err)  # each rank's own SyntaxError, as without the option
    assert "[warm start] SyntaxError" in err or "[warm start]     def broken(:" in err, err
    assert ("zsrun: --warm-start is off for this attempt (its interpreter exited before it forked rank 0 (its "
            "output above says why)): the ranks are started afresh") in err, err
    assert "[rank 0] SyntaxError" in err or "[rank 1] SyntaxError" in err, err


def test_ranks_forked_warm_die_with_a_killed_zsrun(job):
    proc, log = job.start(2, "--warm-start", SLEEP="60")
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("[rank"):
            pids.append(ranks_said(line)[line.split("] ")[0] + "]"][0]["pid"])
    assert len(pids) == 2, pids
    proc.kill()  # SIGKILL: nothing forwarded, the parent-death signal alone
    proc.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        time.sleep(0.05)
    assert not alive, alive
    proc.stdout.close()
    proc.stderr.close()


def test_a_signal_to_zsrun_while_the_interpreter_imports_is_acted_on_at_once(job):
    proc, log = job.start(2, "--warm-start", SLOW_IMPORT="60")
    time.sleep(1.5)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 20, err  # not the import's 60 s
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert "--warm-start is off for this attempt (zsrun got SIGTERM while it imported)" in err, err


def test_warm_start_refuses_a_command_it_cannot_fork_by_name(job):
    for cmd in (["/bin/true"], [sys.executable, "-c", "pass"], [sys.executable]):
        proc = subprocess.run([str(ZSRUN), "-n", "2", "--warm-start", "--", *cmd], capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 2, proc
        assert "--warm-start forks the ranks from one Python that imported SCRIPT's modules: it needs the command " \
               "`python SCRIPT [ARGS...]`" in proc.stderr, proc.stderr
