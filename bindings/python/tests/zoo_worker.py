"""One rank of the model-zoo tests, launched by zsrun: models nobody here
wrote, trained unchanged through zeroshard.torch and through torch DDP.

    zsrun -n N -- python zoo_worker.py MODEL [MODEL ...]

For each model: the same weights (seeded construction), the same batches
(seeded per step and rank), 10 AdamW steps through DDP (gloo, torch's
AdamW without foreach) and through zt.Init + partition_module +
ZeroShardOptimizer. Rank 0 prints one JSON line: per model the mean loss
over ranks per step for both, and what else the test checks.
"""
import copy
import dataclasses
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import zeroshard.torch as zt
from launch_env import exit_without_teardown

STEPS = 10
LR = 2e-3
CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 20000,
                                "stage3_param_persistence_threshold": 0}}
# The same with the default persistence threshold (1e5 elements): every
# param of these small models stays gathered across steps.
PERSISTENT = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 20000}}
VOCAB, SEQ, BATCH = 64, 12, 2


# -- models ---------------------------------------------------------------
def hf_gpt2(**extra):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra))


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64))


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def hf_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=64, router_aux_loss_coef=0.01))


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                               num_labels=5))


class TorchTransformer(nn.Module):
    """nn.Transformer: deep-copied layers, MultiheadAttention reading
    out_proj's params without calling it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.tf = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                                 dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.tf(h, h, tgt_mask=mask, tgt_is_causal=True))


class TorchMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True, kdim=8, vdim=8)
        self.kv = nn.Linear(16, 8)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        kv = self.kv(h)
        y, _ = self.attn(h, kv, kv, need_weights=True)
        return self.head(y)


class TorchRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.gru = nn.GRU(24, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        h, _ = self.gru(h)
        return self.head(h)


class LoRALinear(nn.Module):
    """A frozen base with a trainable low-rank adapter."""

    def __init__(self, n_in, n_out, r=4):
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, n_in) * 0.1)
        self.b = nn.Parameter(torch.zeros(n_out, r))

    keyword = False  # call the base with its input as a keyword argument

    def forward(self, x):
        base = self.base(input=x) if self.keyword else self.base(x)
        return base + x @ self.a.t() @ self.b.t()


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "dataclass"


class Frozen(nn.Module):
    """Frozen embedding and LoRA adapters, a buffer, a dataclass output,
    activation checkpointing (reentrant and not) re-running forwards in
    backward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.emb.weight.requires_grad_(False)
        self.l1 = LoRALinear(16, 32)
        self.l2 = LoRALinear(32, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)
        self.register_buffer("scale", torch.tensor(0.5))

    def block(self, h):
        return self.l2(F.gelu(self.l1(h)))

    def forward(self, x):
        h = self.emb(x) * self.scale
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        h = self.ln(h)
        return Out(logits=self.head(h), hidden=h)


class Mixed(nn.Module):
    """Params of mixed dtypes: a frozen bfloat16 embedding and float16
    buffer next to float32 layers (frozen, so the optimizers, which keep
    fp32 masters for 16-bit params here and not in torch, agree)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, dtype=torch.bfloat16)
        self.emb.weight.requires_grad_(False)
        self.proj = nn.Linear(16, 16, dtype=torch.float16)
        self.proj.requires_grad_(False)
        self.register_buffer("shift", torch.full((16,), 0.25, dtype=torch.float16))
        self.fc = nn.Linear(16, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x):
        h = self.proj(self.emb(x).to(torch.float16) + self.shift).float()
        return self.head(F.gelu(self.fc(h)))


def gpt2_checkpointed():
    model = hf_gpt2()
    model.gradient_checkpointing_enable()
    return model


# Two batches per rank, alternating: small enough to learn in 10 steps.
def lm_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)


def causal_lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


def t5_loss(model, x):
    return model(input_ids=x, labels=x.flip(1)).loss


def mixtral_loss(model, x):
    out = model(input_ids=x, labels=x, output_router_logits=True)
    return out.loss


def vit_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def vit_loss(model, batch):
    return model(pixel_values=batch[0], labels=batch[1]).loss


def logits_loss(model, x):
    out = model(x)
    logits = out.logits if isinstance(out, Out) else out
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def mixtral_leaves(model):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    zt.set_leaf_modules(model, [MixtralSparseMoeBlock])


# Compared with an unsharded model in one process instead of DDP: DDP's
# gradients are wrong when a param is used inside a reentrant checkpoint and
# again outside it (its reducer counts the param ready twice); zeroshard's
# equal the single-process ones.
SINGLE_PROCESS_REFERENCE = {"frozen", "frozen_persistent"}

MODELS = {
    # name: (build, batch, loss, before partitioning)
    "gpt2": (hf_gpt2, lm_batch, causal_lm_loss, None),
    "gpt2_checkpointed": (gpt2_checkpointed, lm_batch, causal_lm_loss, None),
    "llama": (hf_llama, lm_batch, causal_lm_loss, None),
    "bert": (hf_bert, lm_batch, causal_lm_loss, None),
    "t5": (hf_t5, lm_batch, t5_loss, None),
    "mixtral": (hf_mixtral, lm_batch, mixtral_loss, mixtral_leaves),
    "vit": (hf_vit, vit_batch, vit_loss, None),
    "transformer": (TorchTransformer, lm_batch, logits_loss, None),
    "mha": (TorchMHA, lm_batch, logits_loss, None),
    "rnn": (TorchRNN, lm_batch, logits_loss, None),
    "frozen": (Frozen, lm_batch, logits_loss, None),
    "mixed": (Mixed, lm_batch, logits_loss, None),
    "gpt2_persistent": (hf_gpt2, lm_batch, causal_lm_loss, None),
    "frozen_persistent": (Frozen, lm_batch, logits_loss, None),
}


def build(fn):
    torch.manual_seed(0)
    return fn()


def mean_over_ranks(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(model, opt, batch, loss_fn, rank):
    losses = []
    for s in range(STEPS):
        loss = loss_fn(model, batch(s, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def train_single_process(model, opt, batch, loss_fn, world):
    """Every rank's batch in one process: the mean loss, as data parallel
    training over `world` ranks computes it."""
    losses = []
    for s in range(STEPS):
        per_rank = [loss_fn(model, batch(s, r)) for r in range(world)]
        (sum(per_rank) / world).backward()
        opt.step()
        opt.zero_grad()
        losses.append(sum(l.item() for l in per_rank) / world)
    return losses


def run_model(name, rank):
    make, batch, loss_fn, prepare = MODELS[name]
    if name in SINGLE_PROCESS_REFERENCE:
        ref = build(make)
        ddp = None
    else:
        ref = ddp = nn.parallel.DistributedDataParallel(build(make))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01,
                            foreach=False)
    if ddp is None:
        ref_losses = train_single_process(ref, opt, batch, loss_fn, dist.get_world_size())
    else:
        ref_losses = train(ddp, opt, batch, loss_fn, rank)
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with zt.Init(config=PERSISTENT if name.endswith("_persistent") else CONFIG):
            model = build(make)
        if prepare is not None:
            prepare(model)
        zt.partition_module(model)
        zopt = zt.ZeroShardOptimizer([p for p in model.parameters() if p.requires_grad], lr=LR,
                                     weight_decay=0.01)
        zs_losses = train(model, zopt, batch, loss_fn, rank)
    notes = sorted({str(w.message) for w in caught if "zeroshard" in str(w.message)})
    # The frozen params kept their values, and nothing was left gathered.
    frozen_equal = True
    sd = zt.consolidated_state_dict(model)
    if rank == 0:
        for k, p in (ref if ddp is None else ddp.module).named_parameters():
            if not p.requires_grad and not torch.equal(sd[k], p.detach()):
                frozen_equal = False
    # Persistent params stay gathered across steps by design; no other does.
    gathered = sum(1 for p in model.parameters()
                   if zt.is_partitioned(p) and p.untyped_storage().nbytes() > 0 and not p.zs.persistent)
    return {"reference": "single process" if ddp is None else "ddp", "ddp": ref_losses, "zeroshard": zs_losses,
            "trainable": trainable, "warnings": notes,
            "frozen_equal": frozen_equal, "left_gathered": gathered}


BF16 = {"bf16": {"enabled": True}}


def to_bf16(batch):
    """A batch's float tensors in bf16 (integer ids stay): the inputs of a
    bf16 model, as Hugging Face's Trainer casts them under DeepSpeed."""
    if torch.is_tensor(batch):
        return batch.bfloat16() if batch.is_floating_point() else batch
    return type(batch)(to_bf16(b) for b in batch)


def run_model_bf16(name, rank):
    """The model under "bf16": {"enabled": true}: params partitioned as
    bf16, fp32 masters in the optimizer; the test compares its losses with
    the fp32 DDP run's of the same model."""
    from zeroshard.torch._params import optimizer_state_view
    make, batch, loss_fn, prepare = MODELS[name]
    with zt.Init(config={**CONFIG, **BF16}):
        model = build(make)
    if prepare is not None:
        prepare(model)
    zt.partition_module(model)
    zopt = zt.ZeroShardOptimizer([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = train(model, zopt, lambda s, r: to_bf16(batch(s, r)), lambda m, x: loss_fn(m, x).float(), rank)
    trained = [p for g in zopt.param_groups for p in g["params"]]
    return {"zeroshard": losses,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()}),
            "master_dtypes": sorted({str(optimizer_state_view(zopt._engine, p.zs.zparam, 0).dtype)
                                     for p in trained}),
            "buffer_dtypes": sorted({str(b.dtype) for b in model.buffers() if b.is_floating_point()})}


# -- a frozen base with LoRA adapters: gathered memory during backward ---
WIDE, RANK_R, LAYERS = 256, 4, 6
# No prefetch and no reuse window: what is gathered is what a unit holds.
LORA_CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 20000,
                                     "stage3_param_persistence_threshold": 0,
                                     "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}


class FrozenMix(nn.Module):
    """A frozen weight of its own after a trainable child: its output needs
    a gradient, its input (the batch) does not."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.proj = nn.Linear(n_in, n_out)
        self.mix = nn.Parameter(torch.randn(n_out, n_out) / n_out ** 0.5, requires_grad=False)

    def forward(self, x):
        return self.proj(x) @ self.mix


class WideLoRA(nn.Module):
    """A frozen base of LAYERS largish Linear layers, each with a small
    trainable adapter (B non-zero, so every adapter gets a gradient), a
    trainable input projection (so the first base's input needs a gradient
    too) and head. `mode`: "plain"; "checkpoint" / "reentrant" (each pair
    of layers under activation checkpointing); "shared" (the third base is
    called a second time after the last layer: weight sharing); "keyword"
    (the bases get their input as a keyword argument); "mix" (the input
    projection is a FrozenMix: a frozen unit no input of which needs a
    gradient)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.inp = FrozenMix(32, WIDE) if mode == "mix" else nn.Linear(32, WIDE)
        self.layers = nn.ModuleList(LoRALinear(WIDE, WIDE, RANK_R) for _ in range(LAYERS))
        for layer in self.layers:
            nn.init.normal_(layer.b, std=0.1)
            layer.keyword = mode == "keyword"
        self.head = nn.Linear(WIDE, 8)
        self.samples = []  # (gathered bytes, frozen weights gathered), sampled during backward

    def pair(self, h, i):
        for layer in self.layers[i:i + 2]:
            h = F.gelu(layer(h))
        return h

    def forward(self, x):
        h = self.inp(x)
        for i in range(0, LAYERS, 2):
            if self.mode in ("checkpoint", "reentrant"):
                h = torch.utils.checkpoint.checkpoint(self.pair, h, i, use_reentrant=self.mode == "reentrant")
            else:
                h = self.pair(h, i)
            if h.requires_grad:
                h.register_hook(self._sample)
        if self.mode == "shared":
            h = h + self.layers[2].base(h)
        return self.head(h)

    def _sample(self, grad):
        if hasattr(self.layers[0].base.weight, "zs"):
            gathered = zt.get_context().memory()["gathered_bytes"]
            frozen = sum(1 for layer in self.layers if layer.base.weight.untyped_storage().nbytes() > 0)
            self.samples.append((gathered, frozen))


def wide_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)
    return torch.randn(BATCH * 4, 32, generator=g), torch.randn(BATCH * 4, 8, generator=g)


def run_lora_memory(rank, mode, steps=4):
    """WideLoRA trained through zeroshard and through DDP; what is gathered
    during the backward (sampled as each pair's gradient arrives) and right
    after it, before the optimizer step."""
    ref = nn.parallel.DistributedDataParallel(build(lambda: WideLoRA(mode)))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01,
                            foreach=False)
    ref_losses = []
    for s in range(steps):
        x, y = wide_batch(s, rank)
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(mean_over_ranks(loss.item()))

    with zt.Init(config=LORA_CONFIG):
        model = build(lambda: WideLoRA(mode))
    zt.partition_module(model)
    zopt = zt.ZeroShardOptimizer([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    ctx = zt.get_context()
    losses, during, after = [], [], []
    for s in range(steps):
        x, y = wide_batch(s, rank)
        model.samples = []
        loss = F.mse_loss(model(x), y)
        loss.backward()
        after.append((ctx.memory()["gathered_bytes"],
                      sum(1 for layer in model.layers if layer.base.weight.untyped_storage().nbytes() > 0)))
        during.append(max(model.samples))
        zopt.step()
        zopt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    base = model.layers[0].base
    layer_bytes = (base.weight.zs.zparam.numel + base.bias.zs.zparam.numel) * 4
    return {"ddp": ref_losses, "zeroshard": losses, "during": during, "after": after,
            "layer_bytes": layer_bytes, "peak_gathered_bytes": ctx.memory()["peak_gathered_bytes"],
            "left_gathered": sum(1 for p in model.parameters() if p.untyped_storage().nbytes() > 0)}


def run_deepcopy(rank):
    """copy.deepcopy of a partitioned, hooked model: an independent copy
    with equal values that trains on its own."""
    with zt.Init(config=CONFIG):
        model = build(TorchTransformer)
    zt.partition_module(model)
    x = lm_batch(0, rank)
    with torch.no_grad():
        before = model(x).clone()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin_out = twin(x)
    opt = zt.ZeroShardOptimizer(twin.parameters(), lr=1e-2)
    logits_loss(twin, x).backward()
    opt.step()
    with torch.no_grad():
        after_original = model(x)
        after_twin = twin(x)
    shared = any(a is b for a, b in zip(model.parameters(), twin.parameters()))
    # A layer copied out of the model has no root to install its hooks:
    # a clear error until it is partitioned as a model of its own.
    layer = copy.deepcopy(model.tf.encoder.layers[0])
    h = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            layer(h)
        layer_error = None
    except RuntimeError as e:
        layer_error = str(e)
    zt.partition_module(layer)
    with torch.no_grad():
        layer_ok = tuple(layer(h).shape) == (2, 5, 16)
    return {"copy_equal": bool(torch.equal(before, twin_out)),
            "layer_error": layer_error is not None and "partition_module(copy)" in layer_error,
            "layer_after_partition_module": layer_ok,
            "original_unchanged": bool(torch.equal(before, after_original)),
            "copy_trained": not bool(torch.equal(after_twin, twin_out)),
            "shares_params": shared}


def run_convert(rank):
    """module.to(dtype) after partitioning is a clear error, never a silent
    no-op; .to() of the same dtype and device is fine."""
    with zt.Init(config=CONFIG):
        model = build(TorchMHA)
    model.to(torch.float32).to("cpu")
    try:
        model.head.half()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def run_save_pretrained(rank, directory):
    """Hugging Face's save_pretrained of a partitioned, trained GPT-2 (tied
    embeddings) on every rank, rank 0 writing: from_pretrained into a plain
    model gives bitwise the partitioned model's logits."""
    from transformers import GPT2LMHeadModel
    with zt.Init(config=CONFIG):
        model = build(hf_gpt2)
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    x = lm_batch(0, rank)
    model(x, labels=x).loss.backward()  # one step: the saved values are not the initial ones
    opt.step()
    model.eval()
    with torch.no_grad():
        ours = model(x).logits
    model.save_pretrained(directory, is_main_process=rank == 0)
    dist.barrier()
    plain = GPT2LMHeadModel.from_pretrained(directory).eval()
    with torch.no_grad():
        ref = plain(x).logits
    fresh = build(hf_gpt2)
    return {"equal": bool(torch.equal(ours, ref)),
            "trained": not torch.equal(plain.transformer.h[0].mlp.c_fc.weight, fresh.transformer.h[0].mlp.c_fc.weight),
            "tied": plain.lm_head.weight.data_ptr() == plain.transformer.wte.weight.data_ptr()}


def run_generate(rank):
    """HF generate() with a KV cache under no_grad; ranks stop at different
    lengths (max_new_tokens differs) without a hang, and every rank's tokens
    equal the unsharded model's: gathered whole for the call (the default
    when the params fit; also with synced_gpus=True, with no all-reduce per
    token) and gathered per forward (zs_gather=False), and with a LoRA
    adapter on it."""
    reference = build(hf_gpt2)
    with zt.Init(config=CONFIG):
        model = build(hf_gpt2)
    zt.partition_module(model)
    model.eval()
    reference.eval()
    prompt = lm_batch(rank, 7)[:, :4]
    new = 3 + 4 * rank
    kw = dict(max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
    def allreduced(call):  # (its result, the all-reduce bytes this rank sent during it)
        before = zt.get_context().fetch_stats()["allreduce_bytes_sent"]
        out = call()
        return out, zt.get_context().fetch_stats()["allreduce_bytes_sent"] - before

    with torch.no_grad():
        ours, agreement_bytes = allreduced(lambda: model.generate(prompt, **kw))
        released_after = not any(p.zs.attached for p in model.parameters())
        # synced_gpus=True as ZeRO-3 users and TRL pass it: gathered whole
        # there is nothing to pair, so the same tokens and lengths with no
        # all-reduce per token (only the one agreeing that the params fit).
        synced, synced_bytes = allreduced(lambda: model.generate(prompt, synced_gpus=True, **kw))
        per_forward = model.generate(prompt, zs_gather=False, **kw)
        ref = reference.generate(prompt, **kw)
    # A LoRA adapter on a model loaded partitioned, then partition_module
    # of the PEFT model (TRL's order with a peft_config): PEFT's generate()
    # calls the base model's, which is the one that gathers (both ways).
    import peft
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"])
    with zt.Init(config=CONFIG):
        base = build(hf_gpt2)
    with torch.no_grad():
        adapted = peft.get_peft_model(base, lora)
        zt.partition_module(adapted)
        adapted.eval()
        plain_adapted = peft.get_peft_model(reference, lora)
        adapted_ref = plain_adapted.generate(input_ids=prompt, **kw)
        peft_equal = all(torch.equal(adapted.generate(input_ids=prompt, zs_gather=mode, **kw), adapted_ref)
                         for mode in ("auto", False))
    mine = {"equal": bool(torch.equal(ours, ref)), "length": int(ours.shape[1]),
            "per_forward_equal": bool(torch.equal(per_forward, ref)), "released_after": released_after,
            "peft_equal": peft_equal, "synced_equal": bool(torch.equal(synced, ref)),
            "synced_allreduce_bytes": synced_bytes, "agreement_allreduce_bytes": agreement_bytes,
            "rl": run_generate_then_train(rank)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every}


def run_generate_then_train(rank):
    """An online RL loop's shape (GRPO's): generate(), then a training step
    on the same weights, three times, ranks decoding to different lengths;
    once with the whole gather kept after each generate() (the default) and
    once released at its end (keep=False), on twin models. Returns per
    mode: the tokens, losses and final weights (equal across modes), the
    bytes each training step gathered and one generate()'s whole gather,
    whether each generate() left every param gathered without a view and
    each optimizer step left none gathered; for the kept model also a
    second generate() back to back (gathers nothing) and
    set_generation_gather(keep=False) afterwards (lets go)."""
    ctx = zt.get_context()
    received = lambda: ctx.fetch_stats()["gather_bytes_received"]

    def gathered(model):
        return [p.zs.zparam.status == "AVAILABLE" for p in model.parameters()]

    def loop(keep):
        with zt.Init(config=CONFIG):
            model = build(hf_llama)
        zt.partition_module(model)
        zt.set_generation_gather(model, keep=keep)
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
        r = {"tokens": [], "losses": [], "step_bytes": [], "generate_bytes": [], "kept_after_generate": [],
             "none_after_step": []}
        for it in range(3):
            model.eval()
            before = received()
            with torch.no_grad():
                tokens = model.generate(lm_batch(it, rank)[:, :4], max_new_tokens=2 + 2 * rank, do_sample=False,
                                        use_cache=True, pad_token_id=0)
            r["generate_bytes"].append(received() - before)
            r["kept_after_generate"].append(all(gathered(model)) and not any(p.zs.attached for p in model.parameters()))
            r["tokens"].append(tokens.tolist())
            model.train()
            before = received()
            loss = causal_lm_loss(model, lm_batch(10 + it, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            r["step_bytes"].append(received() - before)
            r["none_after_step"].append(not any(gathered(model)))
            r["losses"].append(loss.item())
        if keep == "auto":
            with torch.no_grad():
                prompt = lm_batch(0, rank)[:, :4]
                model.generate(prompt, max_new_tokens=2, do_sample=False, use_cache=True, pad_token_id=0)
                before = received()
                model.generate(prompt, max_new_tokens=2, do_sample=False, use_cache=True, pad_token_id=0)
                r["again_bytes"] = received() - before
            zt.set_generation_gather(model, keep=False)
            r["let_go"] = not any(gathered(model))
        with zt.GatheredParameters(list(model.parameters())):
            r["weights"] = [p.detach().clone() for p in model.parameters()]
        return r

    kept, released = loop("auto"), loop(False)
    same_weights = all(torch.equal(a, b) for a, b in zip(kept.pop("weights"), released.pop("weights")))
    return {"kept": kept, "released": released, "same_weights": same_weights}


def run_checkpointed(rank):
    """A Llama of 4 layers x 512 (big enough that a layer's units do not
    all fit the coordinator's windows) with and without activation
    checkpointing (non-reentrant, as TRL and the HF Trainer enable it,
    reentrant, and one checkpoint around the whole model), three steps
    each: the losses, the bytes the last step's backward gathered, and
    (the whole-model kind) the most elements gathered at once."""
    from transformers import LlamaConfig, LlamaForCausalLM
    ctx = zt.get_context()
    out = {}
    # "whole" first: the coordinator's peak of gathered elements is the
    # context's, and it is read after that kind alone.
    for name, kwargs in (("whole", None), ("plain", None), ("checkpointed", {"use_reentrant": False}),
                         ("reentrant", {"use_reentrant": True})):
        with zt.Init(config=CONFIG):
            model = build(lambda: LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)))
        if kwargs is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        zt.partition_module(model)
        model.train()
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-3)
        recomputed = []  # a layer's forwards run inside a backward
        model.model.layers[0].mlp.register_forward_pre_hook(
            lambda m, a: recomputed.append(1) if torch._C._current_graph_task_id() != -1 else None)
        losses = []
        for step in range(3):
            x = lm_batch(step, rank)
            if name == "whole":  # one checkpoint around the whole model: its recompute runs every layer
                loss = torch.utils.checkpoint.checkpoint(causal_lm_loss, model, x, use_reentrant=False)
            else:
                loss = causal_lm_loss(model, x)
            before = ctx.fetch_stats()["gather_bytes_received"]
            loss.backward()
            backward_bytes = ctx.fetch_stats()["gather_bytes_received"] - before
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        left = sum(1 for p in model.parameters() if p.zs.zparam.status == "AVAILABLE" and not p.zs.persistent)
        out[name] = {"losses": losses, "backward_bytes": backward_bytes, "left_gathered": left,
                     "peak_live_elements": ctx.coord_stats()["peak_live_elements"], "recomputed": len(recomputed),
                     "elements": sum(p.numel() for p in model.parameters())}
    return out


def run_inference_gather(rank):
    """A frozen model's calls under no_grad with set_inference_gather:
    one gather the first call (module by module before), kept for the
    next calls (no gather), also across a policy's optimizer step, logits
    equal to the unsharded model's; gathered again after an update under
    GatheredParameters(modifier_rank=0) (TRL's sync_ref_model) and after a
    `param.data = t`, with the new values; with gradients on, with a param
    trainable again (also while kept) or with mode False, let go and
    module by module as before, the same logits; keep=False released after each call;
    generate() on it the same tokens; a deep copy gathering whole too, with
    nothing kept from the original; its class's name and isinstance
    unchanged; a bad mode refused by name."""
    reference = build(hf_llama)
    with zt.Init(config=CONFIG):
        model = build(hf_llama)
        policy = build(hf_llama)
    zt.partition_module(model)
    zt.partition_module(policy)
    model.requires_grad_(False)
    model.eval()
    reference.eval()
    cls = type(model)
    zt.set_inference_gather(model)
    x = lm_batch(0, rank)
    ctx = zt.get_context()
    out = {}

    def call(name, grad=False):  # logits equal to the reference's, gathers this rank issued, kept after
        before = ctx.fetch_stats()["gathers"]
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=x).logits
            ref = reference(input_ids=x).logits
        out[name] = {"equal": bool(torch.equal(logits, ref)), "gathers": ctx.fetch_stats()["gathers"] - before,
                     "kept": all(p.zs.attached for p in model.parameters())}

    call("first")
    call("again")
    opt = zt.ZeroShardOptimizer(policy.parameters(), lr=1e-2)  # the policy trains between the scoring calls
    policy(input_ids=x).logits.float().pow(2).mean().backward()
    opt.step()
    call("after_policy_step")
    head = model.lm_head.weight
    with zt.GatheredParameters([head], modifier_rank=0):  # as TRL's sync_ref_model mixes the policy in
        if rank == 0:
            head.mul_(0.5)
    reference.lm_head.weight.data.mul_(0.5)
    call("after_update")
    new_norm = torch.randn_like(reference.model.norm.weight)
    reference.model.norm.weight.data = new_norm.clone()
    model.model.norm.weight.data = new_norm.clone()  # every rank alike (same seed)
    call("after_data_assign")
    with torch.no_grad():
        tokens = model.generate(x[:, :4], max_new_tokens=3 + rank, do_sample=False, use_cache=True, pad_token_id=0)
        ref_tokens = reference.generate(x[:, :4], max_new_tokens=3 + rank, do_sample=False, use_cache=True,
                                        pad_token_id=0)
    call("with_grad", grad=True)
    zt.set_inference_gather(model, False)
    call("off")
    zt.set_inference_gather(model, True)
    call("kept_again")
    model.lm_head.weight.requires_grad_(True)  # it may train now: the kept copy goes
    call("trainable")
    model.lm_head.weight.requires_grad_(False)
    zt.set_inference_gather(model, True, keep=False)
    call("not_kept")
    copied = copy.deepcopy(model)  # keeps the subclass and its modes (True, keep False)
    zt.set_inference_gather(copied, True)  # keep "auto" for the copy
    model = copied
    call("copy")
    refused = []
    for bad in ({"mode": "always"}, {"keep": "forever"}):
        try:
            zt.set_inference_gather(model, **bad)
        except ValueError as e:
            refused.append(str(e))
    mine = {"calls": out, "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
            "same_name": type(model).__name__ == cls.__name__, "isinstance": isinstance(model, cls),
            "refused": refused}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every}


def run_resize(rank):
    """resize_token_embeddings on a Hugging Face model partitioned through
    zeroshard.torch alone (zeroshard.hf never imported; issue 59): tied
    (GPT-2) and untied (Llama: transformers builds a new head, which is
    partitioned), then the logits equal the same resize of the unsharded
    model with the same seed (rank 0's new rows)."""
    out = {"hf_imported": "zeroshard.hf" in sys.modules}
    for name, fn in (("gpt2", hf_gpt2), ("llama", hf_llama)):  # the Llama's head is untied
        reference = build(fn)
        with zt.Init(config=CONFIG):
            model = build(fn)
        torch.manual_seed(5)
        reference.resize_token_embeddings(VOCAB + 7)
        torch.manual_seed(5)
        model.resize_token_embeddings(VOCAB + 7)
        zt.partition_module(model)
        x = lm_batch(0, rank)
        with torch.no_grad():
            ours, ref = model(input_ids=x).logits, reference(input_ids=x).logits
        out[name] = {"equal": bool(torch.equal(ours, ref)), "vocab": model.config.vocab_size,
                     "logits": list(ours.shape), "partitioned": all(zt.is_partitioned(p) for p in model.parameters())}
    return out


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}
    for name in sys.argv[1:]:
        if name == "deepcopy":
            result[name] = run_deepcopy(rank)
        elif name == "generate":
            result[name] = run_generate(rank)
        elif name == "checkpointed":
            result[name] = run_checkpointed(rank)
        elif name == "inference_gather":
            result[name] = run_inference_gather(rank)
        elif name == "resize":
            result[name] = run_resize(rank)
        elif name == "convert":
            result[name] = run_convert(rank)
        elif name == "save_pretrained":
            result[name] = run_save_pretrained(rank, os.environ["ZS_ZOO_DIR"])
        elif name.endswith("@bf16"):
            result[name] = run_model_bf16(name[:-len("@bf16")], rank)
        elif name.startswith("lora_memory_"):
            result[name] = run_lora_memory(rank, name[len("lora_memory_"):])
        else:
            result[name] = run_model(name, rank)
        zt.shutdown()
        if rank == 0:
            print(f"zoo: {name} done", file=sys.stderr, flush=True)
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
