"""Checkpoints from Python: the core API in one process (save, load, verify,
export, corruption named), and zeroshard.torch with a Hugging Face GPT-2 on
real ranks: saved at 2 ranks, exported to one safetensors file that
safetensors.torch.load_file and from_pretrained read with the same logits,
and resumed at 3 ranks with the losses of the run that never stopped."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch_env import zsrun

import zeroshard as zs

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def test_core_save_load_verify_export(tmp_path):
    with zs.Context(rank=0, world_size=1) as ctx:
        w = ctx.register("w", "float32", (3, 5), init="normal", seed=3)
        b = ctx.register("b", "bfloat16", (7,), init="uniform", seed=4)
        opt = ctx.optimizer("adamw")
        opt.add_group([w, b], lr=0.1)
        for p in (w, b):
            p.push_grad(torch.ones(p.numel, dtype=torch.float32).numpy(), "float32")
        opt.step()
        phases = []
        where = ctx.save_checkpoint(str(tmp_path), [w, b], optimizer=opt, user_json='{"k": [1, 2]}',
                                    progress=lambda ph, d, t: phases.append(ph))
        assert where == str(tmp_path / "step-1")
        assert "write" in phases and phases[-1] == "done"
        assert (tmp_path / "latest").read_text().strip() == "step-1"
        zs.checkpoint_verify(str(tmp_path))
        out = tmp_path / "full.safetensors"
        zs.checkpoint_export(str(tmp_path), str(out))
        full = safetensors_torch.load_file(str(out))
        assert full["w"].dtype == torch.float32 and tuple(full["w"].shape) == (3, 5)
        assert full["b"].dtype == torch.bfloat16 and tuple(full["b"].shape) == (7,)
        zs.checkpoint_export(str(tmp_path), str(tmp_path / "f32.safetensors"), fp32=True)
        assert safetensors_torch.load_file(str(tmp_path / "f32.safetensors"))["b"].dtype == torch.float32
        # the optimizer moves on, then the load brings everything back
        opt.set_hparams(0, lr=5.0)
        for p in (w, b):
            p.push_grad(torch.ones(p.numel, dtype=torch.float32).numpy(), "float32")
        opt.step()
        info = ctx.load_checkpoint(str(tmp_path), [w, b], optimizer=opt)
        assert info["step"] == 1 and json.loads(info["user_json"]) == {"k": [1, 2]}
        assert opt.steps == 1 and opt.hparams(0)["lr"] == pytest.approx(0.1)
        g = ctx.fetch([w, b])
        g.wait()
        got_w = torch.frombuffer(bytearray(w.copy_to()), dtype=torch.float32).reshape(3, 5)
        got_b = torch.frombuffer(bytearray(b.copy_to()), dtype=torch.bfloat16)
        ctx.release([w, b])
        assert torch.equal(got_w, full["w"]) and torch.equal(got_b, full["b"])
        # a flipped byte: verify and load name the file and the tensor
        f = tmp_path / "step-1" / "rank-00000-of-00001.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-2] ^= 0xFF
        f.write_bytes(bytes(raw))
        with pytest.raises(zs.ZsIOError, match=r"rank-00000-of-00001.safetensors': tensor '[a-z_]+/[wb]'"):
            zs.checkpoint_verify(str(tmp_path))
        with pytest.raises(zs.ZsIOError, match=r"rank-00000-of-00001.safetensors': tensor '"):
            ctx.load_checkpoint(str(tmp_path), [w, b], optimizer=opt)
        with pytest.raises(ValueError, match="2 names for 1 params"):
            ctx.save_checkpoint(str(tmp_path), [w], names=["a", "b"])


def run(n, *args, timeout=240):
    pytest.importorskip("transformers")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env["ZS_TIMEOUT_MS"] = "60000"
    env.setdefault("ZS_DEVICE", "cpu")
    proc = subprocess.run(zsrun(n, "ckpt_worker.py", *args), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


def test_gpt2_saved_exported_from_pretrained_and_resumed_at_another_world_size(tmp_path):
    from transformers import GPT2LMHeadModel
    sys.path.insert(0, str(HERE))
    import ckpt_worker

    d = str(tmp_path / "ckpt")
    saved = run(2, "save", d)
    assert saved["dir"].endswith("step-3")
    zs.checkpoint_verify(d)
    # One consolidated file under the model's own names, read by HF.
    hf = tmp_path / "hf"
    hf.mkdir()
    zs.checkpoint_export(d, str(hf / "model.safetensors"))
    # zt.export_safetensors from the live run wrote the very same bytes
    assert (hf / "model.safetensors").read_bytes() == Path(d, "live.safetensors").read_bytes()
    full = safetensors_torch.load_file(str(hf / "model.safetensors"))
    torch.manual_seed(0)
    names = {n for n, _ in GPT2LMHeadModel(ckpt_worker.gpt2_config()).named_parameters()}
    assert set(full) == names
    ckpt_worker.gpt2_config().save_pretrained(str(hf))
    model = GPT2LMHeadModel.from_pretrained(str(hf))
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ckpt_worker.PROMPT).logits
    want = safetensors_torch.load_file(os.path.join(d, "logits.safetensors"))["logits"]
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    # Resumed at 3 ranks: the same values, client state and lr, and the
    # losses of the run that went on at 2 ranks.
    resumed = run(3, "resume", d)
    assert resumed["client_state"] == {"epoch": 3, "note": "gpt2"}
    assert resumed["lr"] == pytest.approx(2e-3)
    assert resumed["logits_equal"]
    for a, b in zip(saved["after"], resumed["after"]):
        assert abs(a - b) <= 1e-5 * abs(a), (saved["after"], resumed["after"])


def test_hf_sharded_pretrained_weights_load_into_a_partitioned_gpt2(tmp_path):
    # A Hugging Face sharded set (index + several files), read by each of 3
    # ranks for its own shards only: the same logits as the model that wrote it.
    from transformers import GPT2LMHeadModel
    sys.path.insert(0, str(HERE))
    import ckpt_worker

    torch.manual_seed(5)
    ref = GPT2LMHeadModel(ckpt_worker.gpt2_config())
    ref.eval()
    ref.save_pretrained(str(tmp_path), max_shard_size="40KB", safe_serialization=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    with torch.no_grad():
        want = ref(input_ids=ckpt_worker.PROMPT).logits
    safetensors_torch.save_file({"logits": want}, str(tmp_path / "logits.safetensors"))
    r = run(3, "pretrained", str(tmp_path))
    assert r["logits_equal"]
    assert all(math.isfinite(x) for x in r["after"])  # and trains on from there


def test_core_async_save_holds_the_state_at_the_call(tmp_path):
    """save_checkpoint(async_save=True) returns with the state staged; a
    step after it does not reach the checkpoint; wait_checkpoint raises the
    background's error naming the checkpoint."""
    with zs.Context(rank=0, world_size=1) as ctx:
        w = ctx.register("w", "float32", (33, 7), init="normal", seed=5)
        opt = ctx.optimizer("adamw")
        opt.add_group([w], lr=0.1)

        def step():
            w.push_grad(torch.ones(w.numel, dtype=torch.float32).numpy(), "float32")
            opt.step()

        def values():
            g = ctx.fetch([w])
            g.wait()
            v = torch.frombuffer(bytearray(w.copy_to()), dtype=torch.float32).clone()
            ctx.release([w])
            return v

        step()
        at_call = values()
        where = ctx.save_checkpoint(str(tmp_path), [w], optimizer=opt, async_save=True)
        step()  # while the write may still run
        ctx.wait_checkpoint()
        assert where == str(tmp_path / "step-1")
        assert not torch.equal(values(), at_call)
        ctx.load_checkpoint(str(tmp_path), [w], optimizer=opt)
        assert torch.equal(values(), at_call) and opt.steps == 1
        # A background failure surfaces at the wait, naming the checkpoint.
        (tmp_path / "latest").unlink()
        (tmp_path / "latest").mkdir()  # latest cannot be written now
        ctx.save_checkpoint(str(tmp_path), [w], optimizer=opt, tag="third", async_save=True)
        with pytest.raises(zs.ZeroShardError, match=r"asynchronous checkpoint save of '.*third' failed"):
            ctx.wait_checkpoint()
        ctx.wait_checkpoint()  # collected once
