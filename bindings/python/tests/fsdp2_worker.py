"""One rank of test_fsdp2.py, launched by zsrun:

    zsrun -n N -- python3 fsdp2_worker.py VARIANT [VARIANT ...]

Each VARIANT runs one FSDP2 script (torchtitan's shape: fully_shard each
block, then the root; a stock AdamW; torch's clip_grad_norm_; the full
state dict from torch.distributed.checkpoint.state_dict) twice, with
torch's fully_shard and with zeroshard's, on the same data; "stages" runs
DDP beside DeepSpeed configs of ZeRO stages 1, 2 and 3. Rank 0 writes
{variant: result} as JSON to $ZS_TEST_RESULT.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import zeroshard.torch as zt
from launch_env import exit_without_teardown, write_rank0_result

# Big enough that the fc/out/qkv weights (> 1e5 elements) are gathered and
# released per unit, not kept whole as the engine keeps small params.
VOCAB, DIM, HEADS, LAYERS, SEQ = 53, 192, 4, 2, 10
STEPS = 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def mean_over_ranks(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def fsdp_script(api, variant, rank, world):
    """The FSDP2 script; `api` is torch.distributed.fsdp or zeroshard.torch."""
    torch.manual_seed(0)
    model = TinyGPT()
    kwargs = {}
    if variant == "mesh2d":
        kwargs["mesh"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    elif variant == "keep_after_forward":
        kwargs["reshard_after_forward"] = False
    elif variant == "reshard_to_2":
        kwargs["reshard_after_forward"] = 2
    elif variant == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    api.fully_shard(model, **root_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        micro = 2 if variant == "accumulate" else 1
        for m in range(micro):
            if variant == "accumulate":
                model.set_requires_gradient_sync(m == micro - 1)
                model.set_reshard_after_backward(m == micro - 1)
            x, y = batch(m, rank)  # the same data each step: the loss must fall
            loss = model(x, y) / micro
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item() * micro))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"losses": losses, "norms": norms, "state": {k: v.float() for k, v in state.items()},
           "type": type(model).__name__}
    if api is zt:
        out["memory"] = zt.get_context().memory()
        zt.shutdown()
    return out


def stages(rank, world):
    """DDP, then the same model under DeepSpeed configs of ZeRO stages 1, 2
    and 3 with ZeroShardOptimizer."""
    out = {}
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyGPT())
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    out["ddp"] = _train(ddp, opt, rank)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = TinyGPT()
        zt.partition_module(model, config={"zero_optimization": {"stage": stage}})
        zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
        losses = _train(model, zopt, rank)
        coord = zt.get_context().coord_stats()
        out[f"stage{stage}"] = {"losses": losses, "coord": coord, "memory": zt.get_context().memory(),
                                "inactive": [k["key"] for k in zt.get_context().inactive_config_keys]}
        zt.shutdown()
    return out


def whisper_bf16(rank, world):
    """A Whisper model in bf16 fed float input_features, partitioned under
    bf16.enabled and fully_shard'd under a bf16 MixedPrecisionPolicy: each
    casts the features at the forward (FSDP2 does), where the conv would
    otherwise refuse float input against bf16 weights. Against the same
    model cast to bf16 whole, fed bf16 features."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    g = torch.Generator().manual_seed(rank)
    features = torch.randn(2, 8, 32, generator=g)  # (batch, mel bins, 2 x max_source_positions), float32
    labels = torch.randint(3, 64, (2, 5), generator=g)
    torch.manual_seed(0)
    ref = WhisperForConditionalGeneration(cfg).to(torch.bfloat16)
    out = {"reference": ref(input_features=features.to(torch.bfloat16), labels=labels).loss.item()}
    for how in ("uncast", "partition_module", "fully_shard"):
        torch.manual_seed(0)
        model = WhisperForConditionalGeneration(cfg)
        if how == "uncast":  # what the cast prevents
            zt.partition_module(model, config={"bf16": {"enabled": True}}, cast_forward_inputs=False)
            try:
                model(input_features=features, labels=labels)
                out[how] = "no error"
            except RuntimeError as e:
                out[how] = str(e)
            zt.shutdown()
            continue
        if how == "partition_module":
            zt.partition_module(model, config={"bf16": {"enabled": True}})
        else:
            mp = zt.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for layer in model.model.encoder.layers:
                zt.fully_shard(layer, mp_policy=mp)
            zt.fully_shard(model, mp_policy=mp)
        loss = model(input_features=features, labels=labels).loss
        loss.backward()
        out[how] = {"loss": loss.item(), "dtype": str(loss.dtype)}
        zt.shutdown()
    return out


def wrong_order(rank, world):
    """fully_shard on a block after its root: a named error, nothing changed."""
    model = TinyGPT()
    zt.fully_shard(model)
    try:
        zt.fully_shard(model.blocks[0])
        message = "no error"
    except ValueError as e:
        message = str(e)
    x, y = batch(0, rank)
    loss = model(x, y)  # the model still trains as it was
    loss.backward()
    zt.shutdown()
    return {"error": message, "loss": loss.item()}


def _train(model, opt, rank):
    losses = []
    for step in range(STEPS):
        x, y = batch(0, rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {}
    for variant in sys.argv[1:]:
        if variant in ("stages", "whisper_bf16", "wrong_order"):
            result[variant] = globals()[variant](rank, world)
        else:
            ours, theirs = fsdp_script(zt, variant, rank, world), fsdp_script(torch_fsdp, variant, rank, world)
            a, b = theirs.pop("state"), ours.pop("state")
            if rank == 0:  # FSDP2's full state dict with cpu_offload is rank 0's only
                ours["state_keys_equal"] = sorted(a) == sorted(b)
                # The largest elementwise difference over the full state dicts.
                ours["state_max_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a if k in b)
            result[variant] = {"torch": theirs, "zeroshard": ours}
    write_rank0_result(rank, result)
    dist.destroy_process_group()
    # torch's interpreter teardown after FSDP2 aborts now and then
    # ("terminate called without an active exception" after the result was
    # written: once in a full run here, as dcp_worker saw): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
