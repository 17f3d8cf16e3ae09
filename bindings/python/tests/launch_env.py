"""The environment a test gives the ranks it launches (zsrun, torchrun,
accelerate launch): a fresh job's, whatever the test process inherited."""
import json
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

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


def rank0_result(cmd, prefix, timeout):
    """Run the launch `cmd` with ranks_env() in a scratch directory
    ($ZS_TEST_DIR) and return (rank 0's JSON result, which it writes to
    $ZS_TEST_RESULT, and the launch's stderr); a launch that fails or writes
    no result fails the test with its output."""
    env = ranks_env()
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        env["ZS_TEST_DIR"] = scratch
        env["ZS_TEST_RESULT"] = result = os.path.join(scratch, "result.json")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        assert os.path.exists(result), "rank 0 wrote no result\n" + proc.stdout[-4000:] + proc.stderr[-8000:]
        with open(result) as f:
            return json.load(f), proc.stderr


def write_rank0_result(rank, result):
    """In a launched worker: rank 0 writes `result` as JSON to the file
    $ZS_TEST_RESULT names (rank0_result reads it)."""
    if rank == 0:
        with open(os.environ["ZS_TEST_RESULT"], "w") as f:
            json.dump(result, f)


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
