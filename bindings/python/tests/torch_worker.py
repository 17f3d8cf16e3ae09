"""One rank of the zeroshard.torch tests, launched by zsrun.

    zsrun -n N -- python3 torch_worker.py MODE[,MODE...]

Rank 0 writes what the test checks as JSON to the file $ZS_TEST_RESULT names.
"""
import copy
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import zeroshard
import zeroshard.torch as zt
from launch_env import write_rank0_result

VOCAB, DIM, HEADS, LAYERS, SEQ = 37, 24, 3, 2, 12


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (c // HEADS) ** 0.5
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)  # the root's own param
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def batch(step, rank, per_rank=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (per_rank, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def mean_over_ranks(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(model, opt, steps, rank, sched=None):
    losses = []
    for s in range(steps):
        x, y = batch(s, rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def mode_ddp_vs_zeroshard(rank, world):
    steps = 20
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyGPT())
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ddp_losses = train(ddp, opt, steps, rank, sched)

    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000}}):
        model = TinyGPT()
    zt.partition_module(model)
    zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    zsched = torch.optim.lr_scheduler.StepLR(zopt, step_size=5, gamma=0.5)
    zs_losses = train(model, zopt, steps, rank, zsched)
    mem = zt.get_context().memory()
    unsharded = sum(p.numel() * 4 for p in ddp.parameters())
    persistent = sum(p.numel() * 4 for p in ddp.parameters() if p.numel() <= 100000)
    return {"ddp": ddp_losses, "zeroshard": zs_losses, "memory": mem, "unsharded_bytes": unsharded,
            "persistent_bytes": persistent,
            "coord": zt.get_context().coord_stats()}


def mode_gan_zero_grad(rank, world):
    """A DCGAN's loop against DDP: the discriminator zeroed by its module's
    zero_grad (as the DCGAN example does), the generator by its optimizer's,
    each between a backward that reached its params and its own step (the
    generator's loss reaches the discriminator, the discriminator's fake
    pass the generator's forward only): neither step may see them."""
    steps = 6
    bce = nn.BCEWithLogitsLoss()

    def nets():
        torch.manual_seed(0)
        return (nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)),
                nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8)))

    def run(D, G, optD, optG, module_form=True):
        losses = []
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + rank)
            real, z = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            (D if module_form else optD).zero_grad()  # drops the generator's loss's gradients
            bce(D(real), torch.ones(4, 1)).backward()
            fake = G(z)
            errD = bce(D(fake.detach()), torch.zeros(4, 1))
            errD.backward()
            optD.step()
            optG.zero_grad()
            errG = bce(D(fake), torch.ones(4, 1))
            errG.backward()  # into the discriminator's params too
            optG.step()
            losses.append([mean_over_ranks(errD.item()), mean_over_ranks(errG.item())])
        return losses

    D, G = nets()
    D, G = nn.parallel.DistributedDataParallel(D), nn.parallel.DistributedDataParallel(G)
    ddp = run(D, G, torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999)),
              torch.optim.SGD(G.parameters(), lr=1e-2, momentum=0.9))
    ddp_params = {f"{n}.{k}": v.detach().clone() for n, m in (("D", D.module), ("G", G.module))
                  for k, v in m.state_dict().items()}
    out = {"ddp": ddp}

    def engine(D, G):
        return (zt.ZeroShardOptimizer(D.parameters(), kind="adam", lr=2e-3, betas=(0.5, 0.999), weight_decay=0.0),
                zt.ZeroShardOptimizer(G.parameters(), kind="sgd", lr=1e-2, momentum=0.9, weight_decay=0.0))

    def stock(D, G):  # torch's own, stepped on the shards: torch.optim.Optimizer's zero_grad
        return (torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.SGD(G.parameters(), lr=1e-2, momentum=0.9))

    # The discriminator zeroed by its module's zero_grad, or its optimizer's.
    for name, make, module_form in (("zeroshard", engine, True), ("zeroshard_optimizer_form", engine, False),
                                    ("torch_optimizers", stock, False)):
        with zt.Init(config={"zero_optimization": {"stage": 3}}):
            D, G = nets()
        zt.partition_module(D)
        zt.partition_module(G)
        out[name] = run(D, G, *make(D, G), module_form=module_form)
        worst = 0.0
        for n, m in (("D", D), ("G", G)):
            for k, v in zt.consolidated_state_dict(m).items():
                worst = max(worst, (v - ddp_params[f"{n}.{k}"]).abs().max().item())
        out[f"{name}_worst_param_difference"] = worst
        optD, _ = make(D, G)
        with warnings.catch_warnings(record=True) as said:  # set_to_none=False is said to act as True
            warnings.simplefilter("always")
            D.zero_grad(set_to_none=False)
            optD.zero_grad(set_to_none=False)
            D.zero_grad()
        out[f"{name}_said"] = [str(w.message) for w in said]
        zt.shutdown()
    return out


def mode_lent_grads(rank, world):
    """Large gradients lent to the engine (reduced straight from autograd's
    tensors): no param persists, small buckets, so most weights take the
    direct route; two micro-batches per step (accumulation), SGD."""
    steps, micro = 8, 2

    def run(model, opt, accumulate):
        losses = []
        for s in range(steps):
            total = 0.0
            for m in range(micro):
                x, y = batch(s * micro + m, rank)
                loss = model(x, y)
                (loss / micro if accumulate else loss).backward()
                total += loss.item() / micro
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(total))
        return losses

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(TinyGPT())
    # SGD, not Adam: Adam would hide a gradient off by a constant factor.
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3, momentum=0.9, foreach=False)
    ddp_losses = run(ddp, opt, True)

    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 4000,
                                    "stage3_param_persistence_threshold": 0}}
    with zt.Init(config=config):
        model = TinyGPT()
    zt.partition_module(model)
    ctx = zt.get_context()
    ctx.set_accumulation_steps(micro)
    zopt = zt.ZeroShardOptimizer(model.parameters(), kind="sgd", lr=0.3, momentum=0.9, weight_decay=0.0)
    zs_losses = run(model, zopt, False)
    ticket = zeroshard.core.ffi.new("uint64_t*")  # the last ticket released (all, after a step)
    zeroshard.core.check(zeroshard.core.lib.zs_grad_released(ctx.handle, ticket))
    direct = [n for n, p in model.named_parameters()
              if math.prod(p.zs.shape) % world == 0 and math.prod(p.zs.shape) * 4 >= 4000]
    return {"ddp": ddp_losses, "zeroshard": zs_losses, "tickets": ticket[0], "direct_params": direct,
            "held_after_step": len(ctx._lent)}


def mode_granular_units(rank, world):
    """module_granularity_threshold (unit_plan.py): TinyGPT trained with the
    default units, with each Attention one unit (800: its 2400 params over
    its 3 layers; a Block is 903, the model 828) and with the whole model
    one unit; blocks checkpointed (CheckpointedGPT: their recompute gathers
    again, inside the backward); then ForwardCheckpointedGPT with the
    default units and with each block one unit (950: the recompute runs
    inside the block's backward hold); every param gathered (no persistence). What each gathered,
    its units, its losses and a digest of its final params."""
    import hashlib
    out = {}
    for threshold, cls in ((0, CheckpointedGPT), (800, CheckpointedGPT), (10 ** 6, CheckpointedGPT),
                           (0, ForwardCheckpointedGPT), (950, ForwardCheckpointedGPT)):
        torch.manual_seed(0)
        config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000,
                                        "stage3_param_persistence_threshold": 0,
                                        "stage3_module_granularity_threshold": threshold}}
        with zt.Init(config=config):
            model = cls()
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
        losses = train(model, opt, 6, rank)
        digest = hashlib.sha256()
        for name, t in zt.full_weights(model):
            digest.update(name.encode())
            digest.update(t.detach().contiguous().numpy().tobytes())
        ctx = zt.get_context()
        units = sorted(n or "<root>" for n, m in model.named_modules()
                       if "_zs_unit" in m.__dict__ and m.__dict__["_zs_unit"].params)
        out[str(threshold) + ("" if cls is CheckpointedGPT else "/forward")] = {"losses": losses, "digest": digest.hexdigest(), "units": units,
                               "gathers": ctx.fetch_stats()["gathers"],
                               "gathered_after_step": ctx.memory()["gathered_bytes"],
                               "config": ctx.config["zero_optimization"]["module_granularity_threshold"]}
        zt.shutdown()
    return out


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.fc(x)


class MoE(nn.Module):
    """Routes everything to one expert chosen per rank and step."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.route = 0

    def forward(self, x):
        return self.experts[self.route](x)


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.outp = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.outp(F.relu(self.moe(self.inp(x)))).pow(2).mean()


def mode_moe(rank, world):
    torch.manual_seed(0)
    reference = MoEModel()  # unsharded, trained on rank 0 over every rank's routing
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = MoEModel()
    zt.set_leaf_modules(model, [MoE])
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    route = lambda r, s: (r + s) % 3  # noqa: E731 -- expert 3 is never used; the others differ by rank
    data = lambda r, s: torch.randn(8, DIM, generator=torch.Generator().manual_seed(s * 10 + r))  # noqa: E731
    losses, ref_losses = [], []
    for s in range(6):
        model.moe.route = route(rank, s)
        loss = model(data(rank, s))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0:  # the same step unsharded: the mean of every rank's loss
            for r in range(world):
                reference.moe.route = route(r, s)
                ref = reference(data(r, s))
                if r == 0:
                    ref_losses.append(ref.item())
                (ref / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    sd = zt.consolidated_state_dict(model)
    return {"losses": losses, "reference": ref_losses, "keys": sorted(sd.keys()) if rank == 0 else None}


def mode_moe_without_leaf(rank, world):
    """The MoE model with no leaf module and nothing persistent: ranks that
    route to different experts fetch different params of one name and shape
    ("Linear.weight"). Each rank reports what stopped it and when."""
    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}):
        model = MoEModel()
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    t0 = time.monotonic()
    try:
        for s in range(4):
            model.moe.route = (rank + s) % 3
            model(torch.randn(8, DIM)).backward()
            opt.step()
        error = None
    except zeroshard.ZeroShardError as e:
        error = f"{type(e).__name__}: {e}"
    # Rank 0 writes the result: it carries the other rank's message too.
    errors = [None] * world
    dist.all_gather_object(errors, error)
    return {"errors": errors, "seconds": time.monotonic() - t0}


def mode_gathered_and_state(rank, world):
    torch.manual_seed(1)
    model = TinyGPT()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    zt.partition_module(model)
    out = {}
    # GatheredParameters: rank 0 modifies, everyone sees it afterwards.
    w = model.head.weight
    with zt.GatheredParameters([w], modifier_rank=0):
        if rank == 0:
            w.data.fill_(0.5)
    with zt.GatheredParameters([w]):
        out["seen_after_modify"] = bool(torch.all(w.data == 0.5).item())
    # Consolidated state dict round trip.
    sd = zt.consolidated_state_dict(model)
    if rank == 0:
        reference["head.weight"].fill_(0.5)
        out["state_dict_equal"] = all(torch.equal(sd[k], reference[k]) for k in reference)
        new = {k: v + 1.0 for k, v in sd.items()}
    else:
        new = None
    zt.load_consolidated_state_dict(model, new)
    sd2 = zt.consolidated_state_dict(model)
    if rank == 0:
        out["load_equal"] = all(torch.equal(sd2[k], new[k]) for k in new)
    # Optimizer state_dict round trip (sharded, same world): restoring the
    # state and weights after step 1 and replaying step 2 reproduces it.
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-3)
    x, y = batch(0, rank)
    model(x, y).backward()
    opt.step()
    state = opt.state_dict()
    weights1 = zt.consolidated_state_dict(model)
    x, y = batch(1, rank)
    model(x, y).backward()
    opt.step()
    weights2 = zt.consolidated_state_dict(model)
    opt.load_state_dict(state)
    zt.load_consolidated_state_dict(model, weights1 if rank == 0 else None)
    model(x, y).backward()
    opt.step()
    replay = zt.consolidated_state_dict(model)
    if rank == 0:
        out["replay_equal"] = all(torch.equal(replay[k], weights2[k]) for k in weights2)
    # torch's own state_dict(), on every rank: full values, equal to the
    # consolidated ones; torch.save of it loads into a plain model.
    full = model.state_dict()
    out["torch_state_dict_full"] = all(tuple(full[k].shape) == tuple(replay[k].shape) for k in replay) if rank == 0 \
        else all(full[k].numel() > 0 for k in full)
    if rank == 0:
        out["torch_state_dict_equal"] = all(torch.equal(full[k], replay[k]) for k in replay)
        plain = TinyGPT()
        plain.load_state_dict(full)
        out["plain_loads_it"] = all(torch.equal(plain.state_dict()[k], replay[k]) for k in replay)
    # load_state_dict of a full dict (the same on every rank) rewrites the
    # shards, strict, and the model computes with the new values.
    shifted = {k: v + 0.25 for k, v in full.items()}
    result = model.load_state_dict(shifted)
    out["load_keys"] = [list(result.missing_keys), list(result.unexpected_keys)]
    after = zt.consolidated_state_dict(model)
    if rank == 0:
        out["torch_load_equal"] = all(torch.equal(after[k], shifted[k]) for k in shifted)
    try:
        model.load_state_dict({**shifted, "head.weight": torch.zeros(3, 3)})
        out["mismatch_error"] = None
    except RuntimeError as e:
        out["mismatch_error"] = str(e)
    # Engine errors reach Python with their message.
    try:
        zeroshard.config_check({"zero_optimization": {"stage": "three"}})
        out["error"] = None
    except zeroshard.InvalidConfigError as e:
        out["error"] = str(e)
    # After shutdown the params' values are gone: partitioning the model
    # again (in a new context) is an error naming a param, not a model of
    # empty params.
    zt.shutdown()
    try:
        zt.partition_module(model)
        out["after_shutdown"] = None
    except RuntimeError as e:
        out["after_shutdown"] = str(e)
    return out


def mode_user_changes(rank, world):
    """What user code changes on the params between steps, against the same
    changes on an unsharded model trained on every rank's batches: a param
    frozen at partitioning and unfrozen later, `param.data = t` on a large
    param and on a persistent one, a param frozen later (skipped by the
    step, as torch skips a None grad). Then bf16: an assigned value is not
    undone by the optimizer's fp32 master."""
    torch.manual_seed(3)
    reference = TinyGPT()
    torch.manual_seed(3)
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = TinyGPT()
    for m in (reference, model):
        m.head.weight.requires_grad_(False)
    zt.partition_module(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)

    def ref_step(s):
        loss = sum(reference(*batch(s, r)) for r in range(world)) / world
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.item()

    def zs_step(s):
        loss = model(*batch(s, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return mean_over_ranks(loss.item())

    def change(m, what):
        if what == "unfreeze":
            m.head.weight.requires_grad_(True)
        elif what == "assign":
            g = torch.Generator().manual_seed(7)
            m.blocks[0].fc.weight.data = torch.randn(4 * DIM, DIM, generator=g) * 0.05
            m.ln.weight.data = torch.full((DIM,), 0.75)  # persistent: gathered across steps
        elif what == "freeze":
            m.blocks[1].out.weight.requires_grad_(False)

    ref_losses, zs_losses = [], []
    for s in range(12):
        if s % 3 == 0 and s:
            what = {3: "unfreeze", 6: "assign", 9: "freeze"}[s]
            change(reference, what)
            change(model, what)
        ref_losses.append(ref_step(s))
        zs_losses.append(zs_step(s))
    out = {"reference": ref_losses, "zeroshard": zs_losses, "step_stats": opt.step_stats(),
           "wire_stats": opt.wire_stats()}
    sd = zt.consolidated_state_dict(model)
    if rank == 0:
        ref_sd = reference.state_dict()
        out["max_weight_diff"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    # bf16: the assigned values survive a step that changes nothing (lr 0).
    zt.shutdown()
    torch.manual_seed(4)
    with zt.Init(config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}):
        small = nn.Linear(DIM, DIM, dtype=torch.bfloat16)
    zt.partition_module(small)
    bopt = zt.ZeroShardOptimizer(small.parameters(), lr=0.0, weight_decay=0.0)
    x = torch.randn(5, DIM, dtype=torch.bfloat16)
    small(x).float().pow(2).mean().backward()
    bopt.step()
    t = torch.linspace(-1, 1, DIM * DIM, dtype=torch.bfloat16).view(DIM, DIM)
    small.weight.data = t
    small(x).float().pow(2).mean().backward()
    bopt.step()
    small(x).float().pow(2).mean().backward()
    bopt.step()
    with zt.GatheredParameters([small.weight]):
        out["bf16_assigned_kept"] = bool(torch.equal(small.weight.data, t))
    try:
        small.weight.data = torch.zeros(3)
        small(x)
        out["shape_error"] = None
    except ValueError as e:
        out["shape_error"] = str(e)
    return out


def mode_frozen_quantized(rank, world):
    """LoRA-style: every block's params frozen (requires_grad=False) under
    zero_quantized_nontrainable_weights, the embeddings, final norm and
    head trained. The frozen weights are gathered once (their int8 codes,
    dequantized) and copied into an unsharded reference model trained on
    every rank's batches: the losses must agree as in fp32 DDP. The frozen
    weights are checked against their originals (within the block bound,
    not exact), unchanged by training, and the shards' memory against the
    same model with nothing frozen."""
    cfg = {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}

    def build(freeze):
        torch.manual_seed(5)
        original = TinyGPT()
        torch.manual_seed(5)
        with zt.Init(config=cfg):
            model = TinyGPT()
        if freeze:
            model.blocks.requires_grad_(False)
        zt.partition_module(model)
        return original, model

    _, unfrozen = build(False)
    unfrozen_opt = zt.ZeroShardOptimizer(unfrozen.parameters(), lr=3e-3)
    mem_unfrozen = zt.get_context().memory()
    del unfrozen_opt
    zt.shutdown()

    original, model = build(True)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    frozen = dict(model.blocks.named_parameters())
    with zt.GatheredParameters(list(frozen.values())):
        dequantized = {k: p.data.clone() for k, p in frozen.items()}
    out = {"bound_ratio": 0.0, "exact": 0}
    for k, v in dequantized.items():
        x = dict(original.blocks.named_parameters())[k].detach()
        # int8, blocks of 256 within each shard: every error is at most half
        # a step of its block's scale (itself at most max|x| / 127), plus
        # fp32 rounding (kernels/quant.h's bound).
        amax = x.abs().max().item()
        bound = amax / 127 * (0.5 + 2 ** -16) * (1 + 1e-6) + amax * 2 ** -23 + 1e-30
        out["bound_ratio"] = max(out["bound_ratio"], (v - x).abs().max().item() / bound)
        if x.dim() == 2:  # Linear weights (LayerNorms' ones and zeros quantize exactly)
            out["exact"] += int(torch.equal(v, x))
    reference = TinyGPT()
    reference.load_state_dict(original.state_dict())
    with torch.no_grad():
        for k, p in reference.blocks.named_parameters():
            p.copy_(dequantized[k])
    reference.blocks.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=3e-3,
                                weight_decay=0.01, foreach=False)
    ref_losses, zs_losses = [], []
    for s in range(10):
        loss = sum(reference(*batch(s, r)) for r in range(world)) / world
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        zl = model(*batch(s, rank))
        zl.backward()
        opt.step()
        opt.zero_grad()
        zs_losses.append(mean_over_ranks(zl.item()))
    with zt.GatheredParameters(list(frozen.values())):
        out["frozen_unchanged"] = all(torch.equal(p.data, dequantized[k]) for k, p in frozen.items())
    mem = zt.get_context().memory()
    out.update(reference=ref_losses, zeroshard=zs_losses, shard_bytes=mem["shard_bytes"],
               shard_bytes_unfrozen=mem_unfrozen["shard_bytes"],
               optimizer_bytes=mem["optimizer_bytes"],
               optimizer_bytes_unfrozen=mem_unfrozen["optimizer_bytes"])
    model.blocks[0].fc.weight.requires_grad_(True)
    try:
        model(*batch(0, rank))
        out["unfreeze_error"] = None
    except RuntimeError as e:
        out["unfreeze_error"] = str(e)
    return out


def mode_offload(rank, world):
    """For each place ZS_TEST_OFFLOAD names (";"-separated), in a context
    of its own: offload_one's result."""
    out = {}
    for where in os.environ["ZS_TEST_OFFLOAD"].split(";"):
        out[where] = offload_one(rank, where)
        zt.shutdown()
    return out


def offload_one(rank, where):
    """TinyGPT (fp32) with AdamW, the optimizer state `where` says ("none",
    "cpu" or an NVMe directory; "params:DIR" puts the parameter shards there
    too, with no cache): losses, the final weights' bytes (as hex) and the
    optimizer's state_dict tensors."""
    zero = {"stage": 3, "reduce_bucket_size": 5000}
    if where.startswith("params:"):
        where = where[len("params:"):]
        zero["offload_param"] = {"device": "nvme", "nvme_path": where, "max_in_cpu": 0}
    if where in ("none", "cpu"):
        zero["offload_optimizer"] = {"device": where}
    else:
        zero["sub_group_size"] = 1000
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": where, "buffer_count": 3,
                                     "pipeline_read": True, "pipeline_write": True}
    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": zero, "aio": {"block_size": 65536}}):
        model = TinyGPT()
    zt.partition_module(model)
    zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = train(model, zopt, 6, rank)
    sd = zt.consolidated_state_dict(model)
    shards = zopt.state_dict()["zeroshard"]["shards"]  # this rank's master and moments
    moments = {str(k): {str(slot): v.numpy().tobytes().hex() for slot, v in sorted(per.items())}
               for k, per in sorted(shards.items())}
    return {"losses": losses,
            "weights": {k: v.float().numpy().tobytes().hex() for k, v in sorted(sd.items())} if rank == 0 else {},
            "state": moments}

class CheckpointedGPT(TinyGPT):
    """TinyGPT with each block's forward recomputed in backward (torch's
    non-reentrant checkpoint, whose recompute stops early by raising inside
    the block's last module)."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


class ForwardCheckpointedBlock(Block):
    """A block whose forward is checkpointed inside its own __call__, as
    transformers' GradientCheckpointingLayer does: module hooks stay
    outside the checkpoint, so the recompute in backward runs the block's
    modules with no hook of the block around it."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class ForwardCheckpointedGPT(TinyGPT):
    """TinyGPT of ForwardCheckpointedBlocks, with a wide layer after them
    so that a threshold between a block's granularity (903) and the
    model's (about 5000) makes each block one unit and not the model."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ForwardCheckpointedBlock() for _ in range(LAYERS))
        self.wide, self.narrow = nn.Linear(DIM, 2000), nn.Linear(2000, DIM)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = x + self.narrow(F.gelu(self.wide(x)))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def mode_checkpoint_holds(rank, world):
    """After each backward of a checkpointed model no param is still held
    by a module (what backward gathered is released block by block), and
    the losses equal the model without checkpointing."""
    zero = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0}
    out = {}
    for name, cls in (("plain", TinyGPT), ("checkpointed", CheckpointedGPT)):
        torch.manual_seed(0)
        with zt.Init(config={"zero_optimization": zero}):
            model = cls()
        zt.partition_module(model)
        zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3)
        losses, held = [], []
        for step in range(4):
            x, y = batch(step, rank)
            loss = model(x, y)
            loss.backward()
            held.append(sorted(n for n, p in model.named_parameters() if p.zs.holds > 0))
            zopt.step()
            zopt.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
        out[name] = {"losses": losses, "held_after_backward": held}
        del model, zopt
    return out


def saved_view_edges(model, sd, rank):
    """The saved-by-reference edges: a view read back while its param is
    not gathered (gathered for the read; the view outlives the release),
    and a param changed in place between forward and backward (an error)."""
    from zeroshard.torch import saved

    w = model.blocks[0].fc.weight
    assert w.untyped_storage().nbytes() == 0  # released after the step
    view = saved._SavedView.__new__(saved._SavedView)
    view.param, view.offset, view.version = w, 0, w._version
    view.size, view.stride = torch.Size(w.zs.shape[::-1]), (1, w.zs.shape[1])
    read = saved._unpack(view)  # collective: every rank reads it
    edges = {"read_equals_weight_t": rank != 0 or torch.equal(read, sd["blocks.0.fc.weight"].t()),
             "released_after_read": w.untyped_storage().nbytes() == 0 and w.zs.holds == 0}
    x, y = batch(0, rank)
    loss = model(x, y)
    w1 = model.blocks[1].out.weight
    try:
        with torch.no_grad():
            w1.mul_(1.0)  # released: no values to change
        edges["released_in_place_error"] = ""
    except RuntimeError as e:
        edges["released_in_place_error"] = str(e)
    with zt.GatheredParameters([w1], modifier_rank=0), torch.no_grad():
        w1.mul_(1.0)  # bumps its version, as any in-place change
    try:
        loss.backward()
        edges["in_place_error"] = ""
    except RuntimeError as e:
        edges["in_place_error"] = str(e)
    return edges


def mode_saved_by_reference(rank, world):
    """Every param released after its forward (no persistence, no reuse
    distance, prefetch of the next unit only). Saved for backward by reference (the default) the gathered
    buffers are freed as the forward goes; saved by value (the hook turned
    off) autograd holds every one until its backward. The two train bit
    for bit alike; with hpZ as well."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from zeroshard.torch import saved

    by_reference = saved._pack
    out = {}
    for name, hpz in (("reference", 1), ("value", 1), ("reference_hpz", world)):
        saved._pack = by_reference if name.startswith("reference") else (lambda t: t)
        zero = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0,
                "prefetch_bucket_size": 1, "zero_hpz_partition_size": hpz}
        torch.manual_seed(0)
        with zt.Init(config={"zero_optimization": zero}):
            model = TinyGPT()
        zt.partition_module(model)
        buffers = []

        def watch(module, inputs):
            buffers.extend(StorageWeakRef(p.untyped_storage())
                           for p in module._parameters.values() if p is not None and p.numel())

        for m in model.modules():
            m.register_forward_pre_hook(watch)  # after the engine's: the params are gathered
        zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
        losses, alive = [], []
        for step in range(4):
            buffers.clear()
            x, y = batch(step, rank)
            loss = model(x, y)
            alive.append([sum(not b.expired() for b in buffers), len(buffers)])
            loss.backward()
            zopt.step()
            zopt.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
        sd = zt.consolidated_state_dict(model)
        if name == "reference":
            out["edges"] = saved_view_edges(model, sd, rank)
        out[name] = {"losses": losses, "alive_after_forward": alive,
                     "linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
                     "weights": {k: v.numpy().tobytes().hex() for k, v in sorted(sd.items())}
                     if rank == 0 else {}}
        del model, zopt
    saved._pack = by_reference
    return out


def mode_backward_reads(rank, world):
    """A backward gathers only the params its nodes read (saved.py): the
    embedding's table is never gathered for its backward (its gradient
    comes from the indices), and a head tied to it lets the table go once
    the head's backward read it, not at the backward's end where the tied
    gradient comes. Against the same runs with params saved by value (no
    saved references: every unit fetched and held as before), bit for bit
    and with fewer gathers, untied and tied, nothing left gathered. Tied,
    the head's use reaches the engine as its backward computes it
    (repeated_use.py): against the unaliased path ("unaliased"), the
    table's gradient was pushed before the embedding's backward, losses and
    weights within rounding. The step lets go of every lent gradient before
    its update."""
    from zeroshard.context import Context
    from zeroshard.torch import repeated_use, saved

    by_reference = saved._pack
    out = {}
    release_lent = Context.release_lent
    waited = []  # lent gradients left when a step had waited for them

    def spy(self, wait=False):
        release_lent(self, wait)
        if wait:
            waited.append(len(self._lent))

    Context.release_lent = spy
    for tied in (False, True):
        for name in ("reads", "every") + (("unaliased",) if tied else ()):
            saved._pack = by_reference if name != "every" else (lambda t: t)
            repeated_use._enabled = name != "unaliased"
            zero = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0,
                    "prefetch_bucket_size": 1}
            torch.manual_seed(0)
            with zt.Init(config={"zero_optimization": zero}):
                model = TinyGPT()
                if tied:
                    model.head.weight = model.tok.weight
            zt.partition_module(model)
            table = model.tok.weight
            ctx = zt.get_context()
            seen = []  # (where, table gathered, gathered bytes) through each backward

            def note(where):
                def hook(grad):
                    seen.append([where, bool(table.zs.attached), ctx.memory()["gathered_bytes"],
                                 table.zs.zparam.grad_pushed])
                return hook

            def after_block(i):
                def hook(module, inputs, output):
                    if torch.is_grad_enabled():
                        output.register_hook(note(f"blocks.{i}"))
                return hook

            def after_tok(module, inputs, output):
                if torch.is_grad_enabled():
                    output.register_hook(note("tok"))  # before the embedding's backward runs

            for i, blk in enumerate(model.blocks):
                blk.register_forward_hook(after_block(i))
            model.tok.register_forward_hook(after_tok)
            zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
            losses, gathers, lent = [], [], []
            for step in range(4):
                seen.clear()
                before = ctx.coord_stats()
                x, y = batch(step, rank)
                loss = model(x, y)
                loss.backward()
                lent.append(len(ctx._lent))
                waited.clear()
                zopt.step()
                lent.append(waited[:])
                zopt.zero_grad()
                after = ctx.coord_stats()
                gathers.append(after["demand_fetches"] + after["prefetches"]
                               - before["demand_fetches"] - before["prefetches"])
                losses.append(mean_over_ranks(loss.item()))
            sd = zt.consolidated_state_dict(model)
            out[f"{'tied' if tied else 'untied'}_{name}"] = {
                "losses": losses, "gathers": gathers, "backward": list(seen), "lent": lent,
                "table_bytes": table.numel() * 4, "gathered_after": ctx.memory()["gathered_bytes"],
                "weights": {k: v.numpy().tobytes().hex() for k, v in sorted(sd.items())} if rank == 0 else {}}
            del model, zopt, table
    saved._pack = by_reference
    repeated_use._enabled = True
    # Layers large enough to be reduced straight from torch's gradient,
    # which the engine then borrows until its reduction is done.
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        wide = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    zt.partition_module(wide)
    zopt = zt.ZeroShardOptimizer(wide.parameters(), lr=1e-3)
    lent = []
    for step in range(2):
        wide(torch.randn(4, 512)).square().mean().backward()
        lent.append(len(zt.get_context()._lent))
        waited.clear()
        zopt.step()
        lent.append(waited[:])
        zopt.zero_grad()
    out["wide_lent"] = lent
    del wide, zopt
    Context.release_lent = release_lent
    return out


class Wrapper(nn.Module):
    """The partitioned root around a model that the loop calls directly."""

    def __init__(self, cls):
        super().__init__()
        self.gpt = cls()

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def mode_submodule_scope(rank, world):
    """A partitioned model trained through a submodule, its root's forward
    never called (model.gpt(x, y)), against the same model trained through
    its root: the outermost hooked module opens the forward's scope. What
    the forward saves for backward holds gathered params by reference (a
    non-persistent param's buffer is gone after its forward), the swept
    (persistent LayerNorm) gradients go to the engine when the backward
    ends, not at the step, and the scope closes after the forward, also
    when it raises. Also with torch's non-reentrant checkpoint inside the
    submodule, and around it (the scope opens under checkpoint's
    saved-tensor hooks and leaves them in force)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from zeroshard.torch import saved
    from zeroshard.torch.hook_state import hook_state

    def no_scope():
        return (not saved._active and not hook_state().opened
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)

    out = {}
    for name, cls in (("root", TinyGPT), ("submodule", TinyGPT), ("checkpointed", CheckpointedGPT),
                      ("inside_checkpoint", TinyGPT)):
        zero = {"stage": 3, "param_persistence_threshold": 100, "max_reuse_distance": 0,
                "prefetch_bucket_size": 1}
        torch.manual_seed(0)
        with zt.Init(config={"zero_optimization": zero}):
            model = Wrapper(cls)
        zt.partition_module(model)
        buffers = []

        def watch(module, inputs):
            buffers.extend(StorageWeakRef(p.untyped_storage()) for p in module._parameters.values()
                           if p is not None and p.numel() and not p.zs.persistent)

        for m in model.modules():
            m.register_forward_pre_hook(watch)
        zopt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
        run = model if name == "root" else model.gpt
        if name == "inside_checkpoint":  # the scope opens under checkpoint's saved-tensor hooks
            def run(x, y, gpt=model.gpt):
                return torch.utils.checkpoint.checkpoint(gpt, x, y, use_reentrant=False)
        r = {"losses": [], "alive_after_forward": [], "grads_after_backward": [], "held_after_backward": [],
             "closed": [], "recomputed": []}
        for step in range(4):
            buffers.clear()
            x, y = batch(step, rank)
            loss = run(x, y)
            r["alive_after_forward"].append([sum(not b.expired() for b in buffers), len(buffers)])
            r["closed"].append(no_scope())
            seen = len(buffers)
            loss.backward()
            r["recomputed"].append(len(buffers) > seen)  # forwards re-run in backward (checkpointing)
            r["grads_after_backward"].append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
            r["held_after_backward"].append(sorted(n for n, p in model.named_parameters() if p.zs.holds > 0))
            zopt.step()
            zopt.zero_grad()
            r["losses"].append(mean_over_ranks(loss.item()))
        x, y = batch(0, rank)
        try:
            run(torch.full_like(x, VOCAB), y)  # out of the embedding's range: raises inside the forward
            r["raised"] = ""
        except IndexError as e:
            r["raised"] = type(e).__name__
        r["closed_after_raise"] = no_scope()
        out[name] = r
        del model, zopt
    return out


class FineModel(nn.Module):
    """Many small Linears (persistent under a threshold of 100 elements), a
    param-less module between them, and a wide layer that is not."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))
        self.act = nn.Tanh()
        self.wide = nn.Linear(8, 40)  # 320 elements: gathered and released each time
        self.head = nn.Linear(40, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + 0.1 * self.act(layer(x))
        return self.head(torch.relu(self.wide(x))).pow(2).mean()


def mode_kept_units(rank, world):
    """Kept units run without hooks and swept gradients reach the engine
    whichever way the backward went, against an unsharded model trained on
    every rank's batches: plain steps, two backwards before a step, and a
    step whose loss comes from a submodule called on its own (the root's
    hooks never run, so its gradients are swept by the optimizer step).
    Only layers 0-7 fit the model persistence threshold (72 elements a
    layer): layers 8-11 and the head are dropped by every optimizer step,
    so their hooks come back at the next step."""
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                 "stage3_model_persistence_threshold": 8 * 72}}
    torch.manual_seed(5)
    reference = FineModel()
    torch.manual_seed(5)
    with zt.Init(config=cfg):
        model = FineModel()
    zt.partition_module(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01)

    def inputs(step, r, micro=0):
        g = torch.Generator().manual_seed(100 * step + 10 * r + micro)
        return torch.randn(6, 8, generator=g)

    def losses_of(m, step, r):
        if step == 4:  # two backwards before the step
            return [m(inputs(step, r, 0)), m(inputs(step, r, 1))]
        if step == 6:  # a submodule on its own
            return [m.layers[0](inputs(step, r)).pow(2).mean()]
        return [m(inputs(step, r))]

    ref_losses, zs_losses, grads_left = [], [], []
    for step in range(10):
        ref_total = 0.0
        for r in range(world):
            for loss in losses_of(reference, step, r):
                (loss / world).backward()
                ref_total += loss.item() / world
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_total)
        total = 0.0
        for loss in losses_of(model, step, rank):
            loss.backward()
            total += loss.item()
        if step != 6:  # the root ran: its backward swept every gradient
            grads_left.append([n for n, p in model.named_parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        zs_losses.append(mean_over_ranks(total))
    out = {"reference": ref_losses, "zeroshard": zs_losses, "grads_left": grads_left}
    sd = zt.consolidated_state_dict(model)
    if rank == 0:
        ref_sd = reference.state_dict()
        out["max_weight_diff"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    model(inputs(99, rank)).backward()  # the hooks as this step's begin left them
    opt.step()

    def armed(m):
        return any(fn is zt.gather_unit._unit_pre_forward for fn in m._forward_pre_hooks.values())

    out["armed"] = {n or "root": armed(m) for n, m in model.named_modules() if n != "layers"}
    # A copy of the model with its kept units unhooked: its params are new,
    # not gathered, so its first forward hooks them again; it trains on its
    # own and the original stays as it was.
    x = inputs(98, rank)
    with torch.no_grad():
        before = model(x)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out["copy_equal"] = bool(torch.equal(twin(x), before))
        twin_opt = zt.ZeroShardOptimizer(twin.parameters(), lr=1e-2)
        twin(x).backward()
        twin_opt.step()
        with torch.no_grad():
            out["copy_trained"] = not torch.equal(twin(x), before)
            out["original_unchanged"] = bool(torch.equal(model(x), before))
    out["copy_warnings"] = [str(w.message) for w in caught]
    out["copy_armed"] = all(armed(m) for n, m in twin.named_modules() if n.startswith("layers."))
    return out


def mode_dropped_models(rank, world):
    """Models dropped while the context lives give their shards back, on
    every rank at the same optimizer step, whichever rank's garbage
    collector found them first: rank 0 collects each dropped model at
    once, the last rank's collector is off (a cycle it has not reached
    yet), so only the step end's agreement makes it collect. Each next
    model trains as DDP; the engine then holds only that model's params.
    Small params stay gathered across steps (the persistence threshold),
    so the coordinator's kept list holds the dropped ones too."""
    import gc
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                 "reduce_bucket_size": 5000}}
    if rank == world - 1:
        gc.disable()
    rounds = []
    try:
        for round_ in range(4):
            torch.manual_seed(round_)
            ddp = nn.parallel.DistributedDataParallel(TinyGPT())
            ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, foreach=False)
            ddp_losses = train(ddp, ddp_opt, 4, rank)
            torch.manual_seed(round_)
            with zt.Init(config=cfg):
                model = TinyGPT()
            zt.partition_module(model)
            opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3)
            # The most any rank still had registered: the last rank's
            # collector has not run, so it holds the previous model too.
            registered_before = torch.tensor([len(zt._params.registered_params())])
            dist.all_reduce(registered_before, op=dist.ReduceOp.MAX)
            zs_losses = train(model, opt, 4, rank)
            mem = zt.get_context().memory()
            rounds.append({"ddp": ddp_losses, "zeroshard": zs_losses, "num_params": mem["num_params"],
                           "shard_bytes": mem["shard_bytes"], "gathered_bytes": mem["gathered_bytes"],
                           "model_params": len(list(model.parameters())),
                           "registered_before_training": int(registered_before.item()),
                           "dropped_left": len(zt._params._dropped),
                           "persistent": zt.get_context().coord_stats()["persistent_params"]})
            del model, opt, ddp, ddp_opt
            if rank == 0:
                gc.collect()
    finally:
        gc.enable()
    return {"rounds": rounds}


def mode_inference_steps(rank, world):
    """Forwards under no_grad each end their own step: an evaluation loop
    gathers ahead after its first forward, keeps the model gathered across
    steps after its second (within max_reuse_distance) with no collective
    at a step end, and its order does not grow; a reference model's no_grad
    forward taking turns with the policy's training step gathers ahead in
    both and trains as DDP; a forward that raised leaves its step to the
    next; a model dropped with no optimizer step anywhere gives its shards
    back."""
    import gc
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 2000, "reduce_bucket_size": 5000}}
    ctx = zt.get_context(cfg)
    out = {}

    # An evaluation loop, checked against the same model unsharded.
    torch.manual_seed(0)
    plain = TinyGPT()
    torch.manual_seed(0)
    with zt.Init(config=cfg):
        model = TinyGPT()
    zt.partition_module(model)
    before = ctx.coord_stats()
    evals, diffs = [], []
    with torch.no_grad():
        for s in range(12):
            x, y = batch(100 + s, rank)
            loss = model(x, y)
            diffs.append(abs(loss.item() - plain(x, y).item()))
            evals.append(dict(ctx.coord_stats(), allreduce=ctx.fetch_stats()["allreduce_bytes_sent"]))
    out["eval"] = {"max_diff": max(diffs), "steps": [c["steps"] - before["steps"] for c in evals],
                   "demand": [c["demand_fetches"] for c in evals], "trace": [c["trace_length"] for c in evals],
                   "gathers": [c["demand_fetches"] + c["prefetches"] for c in evals],
                   "allreduce": [c["allreduce"] for c in evals]}
    # inference_mode too (Lightning's evaluation loop).
    with torch.inference_mode():
        x, y = batch(200, rank)
        model(x, y)
    out["eval"]["inference_mode_demand"] = ctx.coord_stats()["demand_fetches"] - evals[-1]["demand_fetches"]

    # A forward that raises under no_grad (an index past the vocabulary on
    # every rank), then the loop goes on.
    with torch.no_grad():
        steps_before = ctx.coord_stats()["steps"]
        try:
            model(torch.full((2, SEQ), VOCAB + 5), torch.zeros(2, SEQ, dtype=torch.long))
            out["raised"] = None
        except IndexError as e:
            out["raised"] = str(e)
        after_raise = ctx.coord_stats()["steps"]
        x, y = batch(300, rank)
        loss = model(x, y)
        out["after_raise"] = {"steps_while_raised": after_raise - steps_before,
                              "steps_after_next": ctx.coord_stats()["steps"] - steps_before,
                              "diff": abs(loss.item() - plain(x, y).item())}

    # A frozen reference model's no_grad forward, then the policy's
    # training step, against DDP with the same reference.
    def dpo(policy, reference, opt):
        losses = []
        for s in range(8):
            x, y = batch(s, rank)
            with torch.no_grad():
                ref = reference(x, y)
            loss = policy(x, y) + 0.5 * (policy(x, y) - ref) ** 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
            if s == 2:
                warm = ctx.coord_stats()
        return losses, warm

    torch.manual_seed(1)
    ddp = nn.parallel.DistributedDataParallel(TinyGPT())
    ddp_ref = TinyGPT().requires_grad_(False)
    ddp_losses, _ = dpo(ddp, ddp_ref, torch.optim.AdamW(ddp.parameters(), lr=3e-3, foreach=False))
    torch.manual_seed(1)
    with zt.Init(config=cfg):
        policy = TinyGPT()
        reference = TinyGPT().requires_grad_(False)
    zt.partition_module(policy)
    zt.partition_module(reference)
    zs_losses, warm = dpo(policy, reference, zt.ZeroShardOptimizer(policy.parameters(), lr=3e-3))
    end = ctx.coord_stats()
    out["dpo"] = {"ddp": ddp_losses, "zeroshard": zs_losses,
                  "demand_after_warmup": end["demand_fetches"] - warm["demand_fetches"],
                  "prefetches_after_warmup": end["prefetches"] - warm["prefetches"],
                  "invalidations_after_warmup": end["trace_invalidations"] - warm["trace_invalidations"]}
    del policy, reference, ddp, ddp_ref

    # Models dropped with no optimizer step: the last rank's collector is
    # off, so only the step ends' agreement (and the collection it asks
    # for) lets them go.
    if rank == world - 1:
        gc.disable()
    try:
        gc.collect() if rank != world - 1 else None
        with zt.Init(config=cfg):
            dropped = TinyGPT()
        zt.partition_module(dropped)
        with torch.no_grad():
            dropped(*batch(0, rank))
        del dropped, model, plain
        if rank == 0:
            gc.collect()
        with zt.Init(config=cfg):
            kept = TinyGPT()
        zt.partition_module(kept)
        registered_before = torch.tensor([len(zt._params.registered_params())])
        dist.all_reduce(registered_before, op=dist.ReduceOp.MAX)
        with torch.no_grad():
            for s in range(6):
                kept(*batch(s, rank))
        out["dropped"] = {"registered_before": int(registered_before.item()),
                          "model_params": len(list(kept.parameters())),
                          "num_params": ctx.memory()["num_params"], "dropped_left": len(zt._params._dropped)}
    finally:
        gc.enable()
    return out


def mode_state_dict_on_one_rank(rank, world):
    """state_dict() on rank 0 alone (a save under `if rank == 0`): the
    gather of the full values it needs cannot complete, and rank 0 gets an
    error naming the module and the fix once the collective timeout
    (ZS_TIMEOUT_MS) passes, never an empty checkpoint or a hang."""
    with zt.Init(config={"zero_optimization": {"stage": 3}}):
        model = TinyGPT()
    zt.partition_module(model)
    out = {}
    if rank == 0:
        began = time.monotonic()
        try:
            model.state_dict()
            out["error"] = None
        except zeroshard.ZeroShardError as e:
            out["error"] = str(e)
            out["type"] = type(e).__name__
        out["seconds"] = time.monotonic() - began
    dist.barrier()
    return out


def run_mode(modes):
    """Run modes[argv[1]] on this rank; rank 0 writes its result. argv[1]
    may name several modes, comma-separated: they run one after another in
    this launched world (torch and the engine import once per rank), each
    ending with zt.shutdown() as a launch of its own would, and the result
    is {mode: its result}."""
    names = sys.argv[1].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for mode in names:
        results[mode] = modes[mode](rank, world)
        zt.shutdown()
        dist.barrier()
    # To a file: a result line of tens of KiB on the ranks' shared stdout
    # can be split by the other rank's output.
    write_rank0_result(rank, results if len(names) > 1 else results[names[0]])
    dist.destroy_process_group()


def main():
    run_mode({"ddp_vs_zeroshard": mode_ddp_vs_zeroshard, "gan_zero_grad": mode_gan_zero_grad, "moe": mode_moe,
              "moe_without_leaf": mode_moe_without_leaf,
              "gathered": mode_gathered_and_state, "user_changes": mode_user_changes,
              "offload": mode_offload, "checkpoint_holds": mode_checkpoint_holds,
              "frozen_quantized": mode_frozen_quantized,
              "saved_by_reference": mode_saved_by_reference, "kept_units": mode_kept_units,
              "backward_reads": mode_backward_reads,
              "lent_grads": mode_lent_grads, "submodule_scope": mode_submodule_scope,
              "granular_units": mode_granular_units,
              "dropped_models": mode_dropped_models, "inference_steps": mode_inference_steps,
              "state_dict_on_one_rank": mode_state_dict_on_one_rank})


if __name__ == "__main__":
    main()
