"""The engine on a GPU through the Python binding and zeroshard.torch.

Tests marked `gpu` skip (saying why) unless torch sees a CUDA device and the
engine can use one (zeroshard.cuda_device_count()). They compare a context
on cuda:0 with the same work on the CPU: DLPack tensors on the GPU sharing
the engine's memory, gradients pushed from CUDA tensors, optimizer steps,
zeroshard.torch training (a small MLP and the GPT example), and two ranks on
one GPU over Gloo staged through host memory. The other tests run anywhere:
device and backend choice, and the errors without CUDA.
"""
import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.utils.dlpack  # noqa: E402

import zeroshard as zs  # noqa: E402
from zeroshard import core  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
WORKER = HERE / "cuda_worker.py"

CUDA_COUNT, CUDA_REASON = zs.cuda_device_count()


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    if CUDA_COUNT == 0:
        return f"no CUDA device for the engine: {CUDA_REASON or 'zeroshard.cuda_device_count() is 0'}"
    return None


gpu = pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")
no_gpu = pytest.mark.skipif(CUDA_COUNT > 0, reason="a CUDA device is usable here")


def worker_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    # The workers name their devices; conftest's ZS_DEVICE=cpu would
    # otherwise pin the contexts that follow the model to the host.
    env.pop("ZS_DEVICE", None)
    env.pop("ZS_BACKEND", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def last_json(text):
    lines = [l for l in text.splitlines() if l.startswith("{")]
    assert lines, text
    return json.loads(lines[-1])


def run_worker(*args, timeout=300):
    proc = subprocess.run([sys.executable, str(WORKER)] + [str(a) for a in args], env=worker_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return last_json(proc.stdout)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_close_lists(a, b, rel, abs_=0.0, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, what
    bad = np.abs(a - b) > rel * np.abs(b) + abs_
    assert not bad.any(), f"{what}: {a[bad][:5]} vs {b[bad][:5]}"


# ---------------------------------------------------------------------------
# anywhere: device and backend choice, errors without CUDA
# ---------------------------------------------------------------------------

def test_cuda_device_count_says_why_when_none():
    count, reason = zs.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    assert isinstance(reason, str)
    if count == 0:
        assert reason.strip(), "no CUDA device, and no reason given"
    else:
        assert reason == ""


@no_gpu
def test_cuda_context_without_cuda_raises_why():
    with pytest.raises(zs.ZeroShardError) as e:
        zs.Context(rank=0, world_size=1, device="cuda:0")
    message = str(e.value)
    assert "cuda" in message.lower(), message
    assert CUDA_REASON in message, (message, CUDA_REASON)
    with pytest.raises(zs.ZeroShardError):
        zs.Context(rank=0, world_size=1, device="cuda")


def test_bad_device_name_raises_naming_it():
    with pytest.raises(zs.InvalidArgumentError) as e:
        zs.Context(rank=0, world_size=1, device="gpu")
    assert '"gpu"' in str(e.value) or "'gpu'" in str(e.value), str(e.value)
    assert "cuda" in str(e.value)


def test_bad_backend_name_raises_naming_it():
    with pytest.raises(zs.InvalidArgumentError) as e:
        zs.Context(rank=0, world_size=1, device="cpu", backend="mpi")
    assert "mpi" in str(e.value)


def test_cpu_context_device_and_backend():
    with zs.Context(rank=0, world_size=1, device="cpu") as ctx:
        assert ctx.device == "cpu" and ctx.backend == "gloo"
        assert (ctx.device_type, ctx.device_id) == (zs.DEVICE_CPU, 0)
        assert "on cpu" in repr(ctx)
        p = ctx.register("w", "fp32", (3,), init="uniform", seed=1)
        assert p.device == "cpu" and not p.is_cuda
        assert p.__dlpack_device__() == (1, 0)
        ctx.fetch([p]).wait()
        t = torch.utils.dlpack.from_dlpack(p)  # the protocol, as torch drives it
        assert t.data_ptr() == p.data_ptr() and t.numel() == 3
        assert type(p.__dlpack__(max_version=(1, 0), stream=None)).__name__ == "PyCapsule"
        with pytest.raises(BufferError):
            p.__dlpack__(copy=True)
        with pytest.raises(BufferError):
            p.__dlpack__(dl_device=(2, 0))
        del t
        ctx.release([p])
        mem = ctx.memory()
        for key in ("device_cache_bytes", "device_system_allocs", "device_reuses"):
            assert key in mem and mem[key] >= 0
    with zs.Context(rank=0, world_size=1, device=torch.device("cpu")) as ctx:
        assert ctx.device == "cpu"


def test_nccl_needs_cuda():
    with pytest.raises(zs.ZeroShardError) as e:
        zs.Context(rank=0, world_size=1, device="cpu", backend="nccl")
    message = str(e.value)
    assert "nccl" in message and ("CUDA" in message or "cuda" in message), message


def test_device_strings():
    assert zs.parse_device("cpu") == (1, 0)
    assert zs.parse_device("cuda") == (2, 0)
    assert zs.parse_device("cuda:3") == (2, 3)
    assert zs.parse_device(torch.device("cuda", 1)) == (2, 1)
    assert zs.device_string(2, 1) == "cuda:1" and zs.device_string(1, 0) == "cpu"
    with pytest.raises(zs.InvalidArgumentError):
        zs.parse_device("gpu")


def test_cuda_tensor_buffers_are_accepted_other_devices_refused():
    # A CUDA tensor passes its pointer; a tensor on another device is refused.
    meta = torch.empty(4, device="meta")
    with pytest.raises(zs.NotSupportedError):
        core._buffer(meta, False, "data")
    with pytest.raises(ValueError):
        core._buffer(torch.zeros(4, 4).t(), False, "data")


def test_borrowed_dlpack_tensors_on_the_host():
    """dlpack_from_pointer: views of shards and optimizer state without a
    copy, freed (the Python side) when the consumer drops them."""
    with zs.Context(rank=0, world_size=1, device="cpu") as ctx:
        p = ctx.register("w", "fp32", (10,), init="from_all", data=np.arange(10, dtype=np.float32))
        before = len(core._borrowed)
        t = torch.utils.dlpack.from_dlpack(p.shard_dlpack())
        assert t.data_ptr() == p.shard_ptr() and t.dtype == torch.float32 and tuple(t.shape) == (10,)
        assert torch.equal(t, torch.arange(10, dtype=torch.float32))
        assert len(core._borrowed) == before + 1
        t.fill_(3.0)  # writes the shard: the next fetch sees it
        ctx.fetch([p]).wait()
        assert np.all(np.frombuffer(p.copy_to(), np.float32) == 3.0)
        ctx.release([p])
        del t
        gc.collect()
        assert len(core._borrowed) == before
        cap = p.shard_dlpack()  # never consumed: the capsule frees it
        del cap
        gc.collect()
        assert len(core._borrowed) == before
        h = ctx.register("h", "bf16", (4, 2), init="zeros")
        v = torch.utils.dlpack.from_dlpack(h.shard_dlpack())
        assert v.dtype == torch.bfloat16 and v.numel() == 8
        del v
        opt = ctx.optimizer("sgd")
        opt.add_group([p], lr=0.5, momentum=0.9, weight_decay=0.0)
        p.push_grad(np.ones(10, np.float32), "fp32")
        ctx.grad_sync()
        g = torch.utils.dlpack.from_dlpack(p.grad_shard_dlpack())
        assert torch.equal(g, torch.ones(10))
        del g
        opt.step()
        master = torch.utils.dlpack.from_dlpack(opt.state_dlpack(p, 0))
        momentum = torch.utils.dlpack.from_dlpack(opt.state_dlpack(p, 1))
        assert torch.allclose(master, torch.full((10,), 2.5))
        assert torch.allclose(momentum, torch.ones(10))
        del master, momentum
        gc.collect()
        assert len(core._borrowed) == before


def test_torch_training_on_the_host_through_the_worker():
    # The worker's host run: what the GPU runs are compared with.
    r = run_worker("mlp", "cpu")
    assert r["device"] == "cpu" and r["placeholder_device"] == "cpu"
    assert r["state_dict_devices"] == ["cpu"] and r["optimizer_state_devices"] == ["cpu"]
    assert r["losses"][-1] < r["losses"][0]
    assert r["replay_max_diff"] == 0.0


@no_gpu
def test_torch_init_on_cuda_without_cuda_raises():
    import torch.nn as nn

    import zeroshard.torch as zt
    zt.shutdown()
    with pytest.raises(zs.ZeroShardError) as e:
        with zt.Init(config={"zero_optimization": {"stage": 3}}, device="cuda:0"):
            nn.Linear(2, 2)
    assert "cuda" in str(e.value).lower()
    assert zt._context._context is None


def test_torch_init_defers_the_context_to_the_first_params(monkeypatch):
    """Where torch could build the model on a GPU (faked here) and nothing
    names the device, Init creates the context on the device of the first
    params it partitions: a model built on the host gets a host context."""
    import torch.nn as nn

    import zeroshard.torch as zt
    zt.shutdown()
    monkeypatch.delenv("ZS_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1234}}
    try:
        with zt.Init(config=cfg):
            assert zt._context._context is None
            model = nn.Linear(3, 2)
            ctx = zt.get_context()
            assert ctx.device == "cpu"
            assert ctx.config["zero_optimization"]["reduce_bucket_size"] == 1234
        assert model.weight.zs.device == torch.device("cpu")
        # Its shape, with no values held outside a gather.
        assert model.weight.data.device.type == "cpu" and model.weight.shape == (2, 3)
        assert model.weight.untyped_storage().nbytes() == 0
        zt.shutdown()
        assert model.weight.zs is None  # forgotten with the context
        with zt.Init(config=cfg):  # before any params, the block's config
            assert zt.get_context().config["zero_optimization"]["reduce_bucket_size"] == 1234
        with zt.Init(config=cfg):  # a context exists: used as it is
            nn.Linear(2, 2)
        assert zt._context._pending == []
    finally:
        zt.shutdown()


def test_torch_device_configured_reads_config_and_env(tmp_path, monkeypatch):
    from zeroshard.torch import _context as c
    monkeypatch.delenv("ZS_DEVICE", raising=False)
    assert not c.device_configured(None)
    assert not c.device_configured({"zero_optimization": {"stage": 3}})
    assert c.device_configured({"device": "cuda:1"})
    assert c.device_configured('{"device": "cpu"}')
    path = tmp_path / "ds.json"
    path.write_text('{"device": "cpu"}')
    assert c.device_configured(str(path))
    monkeypatch.setenv("ZS_DEVICE", "cpu")
    assert c.device_configured(None)
    assert c.torch_device_string("cpu") == "cpu"
    assert c.torch_device_string(torch.device("cuda", 2)) == "cuda:2"


# ---------------------------------------------------------------------------
# with a GPU
# ---------------------------------------------------------------------------

@gpu
def test_cuda_context_params_are_cuda_tensors_without_copies():
    with zs.Context(rank=0, world_size=1, device="cuda:0") as ctx:
        assert ctx.device == "cuda:0" and ctx.device_type == zs.DEVICE_CUDA and ctx.device_id == 0
        assert ctx.backend in ("gloo", "nccl")
        data = torch.arange(12, dtype=torch.float32, device="cuda:0")
        p = ctx.register("w", "fp32", (3, 4), init="from_all", data=data)  # CUDA input
        q = ctx.register("h", "bf16", (7,), init="from_rank",
                         data=torch.arange(7, dtype=torch.bfloat16))  # host input
        assert p.device == "cuda:0" and p.is_cuda and p.__dlpack_device__() == (2, 0)
        ctx.fetch([p, q]).wait()
        t = torch.utils.dlpack.from_dlpack(p.to_dlpack())
        assert t.is_cuda and t.device == torch.device("cuda:0")
        assert t.data_ptr() == p.data_ptr()  # the engine's memory, no copy
        assert torch.equal(t.reshape(-1), data)
        u = torch.from_dlpack(p)  # through __dlpack__ / __dlpack_device__
        assert u.is_cuda and u.data_ptr() == p.data_ptr()
        h = torch.utils.dlpack.from_dlpack(q.to_dlpack())
        assert h.is_cuda and h.dtype == torch.bfloat16
        assert torch.equal(h.cpu(), torch.arange(7, dtype=torch.bfloat16))
        # Copies out to host and to CUDA memory.
        assert torch.equal(torch.frombuffer(p.copy_to(), dtype=torch.float32), data.cpu())
        dst = torch.empty(12, device="cuda:0")
        p.copy_to(dst)
        assert torch.equal(dst, data)
        # Writes through the view stick once the update re-partitions them.
        t.mul_(2)
        ctx.update([p], 0)
        ctx.release([p, q])
        del t, u, h
        ctx.fetch([p]).wait()
        again = torch.utils.dlpack.from_dlpack(p.to_dlpack())
        assert torch.equal(again.reshape(-1), 2 * data)
        del again
        ctx.release([p])
        shard = torch.utils.dlpack.from_dlpack(p.shard_dlpack())  # world of one: the whole param
        assert shard.is_cuda and shard.data_ptr() == p.shard_ptr()
        assert torch.equal(shard, 2 * data)
        del shard
        mem = ctx.memory()
        assert mem["device_system_allocs"] >= 1, mem
        assert mem["shard_bytes"] >= 12 * 4 + 7 * 2, mem


def _adamw_run(device):
    with zs.Context(rank=0, world_size=1, device=device) as ctx:
        dev = torch.device(ctx.device)
        w0 = torch.linspace(-1, 1, 1000)
        p = ctx.register("w", "fp32", (10, 100), init="from_all", data=w0.to(dev))
        opt = ctx.optimizer("adamw")
        opt.add_group([p], lr=1e-2, weight_decay=0.1)
        grads, result = [], None
        for step in range(3):
            g = torch.sin(torch.arange(1000, dtype=torch.float32) * 0.37 * (step + 1)).to(dev)
            p.push_grad(g, "fp32")  # from device memory on a GPU context
            if step == 0:
                ctx.grad_sync()
                shard = torch.utils.dlpack.from_dlpack(p.grad_shard_dlpack())
                assert shard.device == dev
                grads.append(shard.cpu().clone())
                del shard
            result = opt.step()
        ctx.fetch([p]).wait()
        w = torch.utils.dlpack.from_dlpack(p.to_dlpack())
        assert w.device == dev
        w = w.cpu().clone()
        ctx.release([p])
        state = []
        for slot in (0, 1, 2):
            s = torch.utils.dlpack.from_dlpack(opt.state_dlpack(p, slot))
            assert s.device == dev
            state.append(s.cpu().clone())
            del s
        opt.close()
        return w.reshape(-1), state, grads, result


@gpu
def test_grad_push_and_optimizer_step_equal_the_cpu():
    w_gpu, s_gpu, g_gpu, r_gpu = _adamw_run("cuda:0")
    w_cpu, s_cpu, g_cpu, r_cpu = _adamw_run("cpu")
    assert torch.equal(g_gpu[0], g_cpu[0])  # the pushed gradient, exactly
    torch.testing.assert_close(w_gpu, w_cpu, rtol=1e-6, atol=1e-6)
    for a, b in zip(s_gpu, s_cpu):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert r_gpu["step"] == r_cpu["step"] == 3
    assert r_gpu["grad_norm"] == pytest.approx(r_cpu["grad_norm"], rel=1e-5)  # summation order


@gpu
def test_torch_mlp_on_cuda_equals_the_cpu():
    cpu = run_worker("mlp", "cpu")
    cuda = run_worker("mlp", "cuda:0")
    assert cuda["device"] == "cuda:0" and cuda["placeholder_device"] == "cuda:0"
    assert cuda["state_dict_devices"] == ["cuda:0"]
    assert cuda["optimizer_state_devices"] == ["cuda:0"]
    assert_close_lists(cuda["losses"], cpu["losses"], 1e-5, what="losses")
    for k in cpu["weights"]:
        assert_close_lists(cuda["weights"][k], cpu["weights"][k], 1e-4, 1e-6, what=k)
    assert cuda["replay_max_diff"] <= 1e-6
    assert cuda["memory"]["device_system_allocs"] >= 1
    # A steady step reuses the device pool instead of allocating.
    assert cuda["memory"]["device_reuses"] > 0, cuda["memory"]


@gpu
def test_torch_contexts_follow_the_model_device():
    r = run_worker("devices")
    assert r["built_on_cuda"] == "cuda:0" and r["placeholder"] == "cuda:0"
    assert r["output_device"] == "cuda:0"
    assert r["partitioned_on_cuda"] == "cuda:0"
    assert r["host_model"] == "cpu"
    err = r["mismatch_error"]
    assert err is not None and "cuda:0" in err and "cpu" in err, err


def run_example(device, steps=5):
    env = worker_env()
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "python" / "train_gpt.py"),
                           "--steps", str(steps), "--device", device, "--dim", "64", "--layers", "2",
                           "--batch", "8", "--ctx", "32"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return last_json(proc.stdout)


@gpu
def test_gpt_example_on_cuda_equals_the_cpu():
    cpu = run_example("cpu")
    cuda = run_example("cuda")
    assert cuda["device"] == "cuda:0" and cpu["device"] == "cpu"
    assert len(cuda["losses"]) == len(cpu["losses"]) == 5
    assert_close_lists(cuda["losses"], cpu["losses"], 1e-5, what="GPT losses")


def run_ranks(world, device, timeout=300):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "ranks", str(r), str(world), str(port), device],
                              env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    reports = []
    try:
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {r} ({device}) exited {proc.returncode}:\n{out}\n{err}"
            reports.append(last_json(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


@gpu
def test_two_ranks_on_one_gpu_over_staged_gloo_equal_the_cpu():
    cuda = run_ranks(2, "cuda:0")
    cpu = run_ranks(2, "cpu")
    for r, (g, c) in enumerate(zip(cuda, cpu)):
        assert g["device"] == "cuda:0" and g["backend"] == "gloo", g
        assert g["dlpack_device"] == "cuda:0" and g["gathered_equal"] is True, g
        assert c["device"] == "cpu" and c["gathered_equal"] is True, c
        assert_close_lists(g["w"], c["w"], 1e-6, 1e-6, what=f"rank {r} fp32 AdamW")
        assert_close_lists(g["c_master"], c["c_master"], 1e-6, 1e-6, what=f"rank {r} bf16 masters")
        assert_close_lists(g["c"], c["c"], 1e-2, 1e-2, what=f"rank {r} bf16 values")
        assert_close_lists(g["losses"], c["losses"], 1e-5, what=f"rank {r} losses")
    # Both ranks hold the same full values after the steps.
    assert cuda[0]["w"] == cuda[1]["w"]
    for k in cuda[0]["weights"]:
        assert_close_lists(cuda[0]["weights"][k], cpu[0]["weights"][k], 1e-4, 1e-6, what=k)
