"""torch.distributed and zeroshard.torch come up in either order, on two
real ranks, under zsrun, torchrun and Slurm-style variables: the engine's
store never takes MASTER_PORT, which stays torch's.

Each run trains a few steps with zeroshard (losses equal DDP's over the same
steps, in the same process group) and all_reduces through torch; only rank
0 warns about the config key the engine does not act on."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ZSRUN = REPO / "build" / "bin" / "zsrun"
WORKER = HERE / "launch_order_worker.py"
ORDERS = ["context_first", "torch_first"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "ZS_STORE_PORT", "ZS_LAUNCHER", "TORCHELASTIC_RUN_ID",
               "GROUP_RANK", "ROLE_RANK")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env["ZS_TIMEOUT_MS"] = "60000"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _result(returncode, out, err):
    assert returncode == 0, out + err
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert lines, out + err
    return json.loads(lines[-1])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_pair():
    """A port P with P + 1 free as well (the engine takes MASTER_PORT + 1),
    below Linux's ephemeral range (32768+), where the many connections the
    other tests open take their local ports, so P + 1 stays free."""
    import random
    for _ in range(200):
        port = random.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports in 20000-32000")


def _check(r):
    assert r["world"] == 2
    assert r["all_reduce"] == 3.0  # 1 + 2, through torch's process group
    assert len(r["zeroshard"]) == len(r["ddp"]) == 4
    for step, (a, b) in enumerate(zip(r["zeroshard"], r["ddp"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b, r)
    rank0, rank1 = r["config_warnings"]
    assert len(rank0) == 1 and "zero_optimization.sub_group_size" in rank0[0], r
    assert rank1 == [], r


@pytest.mark.parametrize("order", ORDERS)
def test_zsrun(order):
    if not ZSRUN.exists():
        pytest.skip(f"{ZSRUN} is not built")
    proc = subprocess.run([str(ZSRUN), "-n", "2", "--no-prefix", "--", sys.executable, str(WORKER),
                           order], env=_env(), capture_output=True, text=True, timeout=180)
    r = _result(proc.returncode, proc.stdout, proc.stderr)
    _check(r)
    assert r["zs_store_port"] and r["zs_store_port"] != r["master_port"]


@pytest.mark.parametrize("order", ORDERS)
def test_slurm_variables(order):
    """Plain processes with what srun sets (no RANK, no WORLD_SIZE) and a
    MASTER_ADDR / MASTER_PORT of the user's: the engine takes MASTER_PORT + 1
    unless torch.distributed came first."""
    env = _env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port_pair()), SLURM_NTASKS="2",
               SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242")
    procs = []
    for rank in range(2):
        env_r = dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), order], env=env_r,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs[1:], outs[1:]):
        assert p.returncode == 0, out + err + "\nrank 0:\n" + "".join(outs[0])
    r = _result(procs[0].returncode, *outs[0])
    _check(r)
    assert r["zs_store_port"] is None


def test_torchrun_context_first():
    """torchrun's agent store holds MASTER_PORT; the engine's port is agreed
    through it, and init_process_group afterwards joins torchrun's store."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(WORKER),
           "context_first"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    r = _result(proc.returncode, proc.stdout, proc.stderr)
    _check(r)
