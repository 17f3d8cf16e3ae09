"""How a test launches ranks (zsrun, torchrun, accelerate launch) and reads
their result: the environment of a fresh job, whatever the test process
inherited, and rank 0's JSON result."""
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ZSRUN = REPO / "build" / "bin" / "zsrun"

# Variables of an enclosing job or launch, which would mislead a new one.
_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
              "ZS_LAUNCHER", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION")


def ranks_env(**extra):
    """os.environ without an enclosing job's variables, with the test
    workers and the package importable, the in-tree library, a 60 s engine
    timeout, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["ZS_TIMEOUT_MS"] = "60000"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.update(extra)
    return env


def warm(n):
    """zsrun's flag for a world of n ranks: from 3 ranks on 2 cores, forking
    them from one interpreter that imported the worker's modules
    (docs/launching.md) saves more than a core's share of imports; 2 ranks
    import side by side in about the time one takes, and start afresh."""
    return ["--warm-start"] if n >= 3 else []


def zsrun(n, worker, *args):
    """The command that runs the test worker `worker` (a file beside this
    one) on n ranks under zsrun; skips the test where zsrun is not built."""
    if not ZSRUN.exists():
        import pytest
        pytest.skip(f"{ZSRUN} is not built")
    return [str(ZSRUN), "-n", str(n), *warm(n), "--no-prefix", "--", sys.executable, str(HERE / worker),
            *map(str, args)]


def torchrun(n, worker, *args):
    """The same under torchrun (torch.distributed.run, one host)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            str(HERE / worker), *map(str, args)]


def rank0_result(cmd, prefix, timeout, extra_env=None, directory=None, cwd=None):
    """Run the launch `cmd` with ranks_env(**extra_env) in a scratch
    directory ($ZS_TEST_DIR, or `directory`; the working directory when
    cwd="scratch") and return (rank 0's JSON result, which it writes to
    $ZS_TEST_RESULT, and the launch's stderr); a launch that fails or writes
    no result fails the test with its output."""
    env = ranks_env(**(extra_env or {}))
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        env["ZS_TEST_DIR"] = directory or scratch
        env["ZS_TEST_RESULT"] = result = os.path.join(scratch, "result.json")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=scratch if cwd == "scratch" else cwd)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        assert os.path.exists(result), "rank 0 wrote no result\n" + proc.stdout[-4000:] + proc.stderr[-8000:]
        with open(result) as f:
            return json.load(f), proc.stderr


def worker_result(n, worker, mode, timeout=600, extra_env=None):
    """Rank 0's result of test worker `worker`'s `mode` (or comma-separated
    modes) on n ranks under zsrun, a launch of its own."""
    return rank0_result(zsrun(n, worker, mode), f"zs_{Path(worker).stem}_", timeout, extra_env=extra_env)[0]


def once(launch):
    """`launch` run once per distinct arguments in this pytest process: the
    tests that check one launched world's result share it. A launch that
    fails is not kept, so each test that needs it shows its failure."""
    return functools.lru_cache(maxsize=None)(launch)


def write_rank0_result(rank, result):
    """In a launched worker: rank 0 writes `result` as JSON to the file
    $ZS_TEST_RESULT names (rank0_result reads it)."""
    if rank == 0:
        with open(os.environ["ZS_TEST_RESULT"], "w") as f:
            json.dump(result, f)


def exit_without_teardown(code=0):
    """End a launched test worker as the interpreter would, less its module
    teardown: what Python runs at exit (waiting for non-daemon threads, then
    the atexit callbacks: zeroshard's, torch's, multiprocessing's) runs, the
    streams are flushed, then the process leaves. The module teardown and
    final collections it skips took 1-5 s of CPU a rank once transformers,
    TRL or Lightning were imported (about 4.5 s of a 3-rank world's 22 on 2
    cores), which every launch paid for nothing the tests check. Workers
    that test the plain exit (torch_worker.py among them) leave as usual."""
    import atexit
    import threading
    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def deepspeed_gram_in_fp32():
    """DeepSpeed's "gram" Newton-Schulz runs in fp16 where mkldnn has fp16
    (a CPU with AVX512-FP16 or AMX: its ns_compute_dtype), in fp32
    elsewhere; zeroshard's runs in fp32 on a CPU. A reference that is to
    match it bit for bit is pinned to fp32 (4.8e-4 apart after 5 steps
    otherwise, on such a CPU)."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon
    own = original_muon.ns_compute_dtype
    original_muon.ns_compute_dtype = lambda ns_method="gram": (torch.float32 if ns_method == "gram"
                                                               else own(ns_method))
