"""One rank of the torch-optimizer tests (test_torch_optimizers.py),
launched by zsrun:

    zsrun -n N -- python3 optim_worker.py MODE

Stock torch optimizers over a partitioned model against the same optimizer
under DDP (or, across a checkpoint at another world size, against one
unsharded model fed every rank's batch). Rank 0 writes JSON to
$ZS_TEST_RESULT.
"""
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard.torch as zt
from torch_worker import DIM, LAYERS, SEQ, VOCAB, Block, batch, mean_over_ranks, run_mode
from launch_env import exit_without_teardown

STEPS = 5
# No param persists (each is released between uses) and small buckets.
CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}}


class OddGPT(nn.Module):
    """TinyGPT with a head of 7 and one of 5 classes: params whose sizes
    no world size of 2 or 3 divides (padded shards)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        for b in self.blocks:
            # A key bias shifts each row of scores by a constant, which the
            # softmax ignores: its gradient is rounding noise, which Adam,
            # Adagrad or Rprop turn into +-lr steps that depend on the order
            # of the ranks' sum. Without it every gradient is signal.
            b.attn.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.aux = nn.Linear(DIM, 7)
        self.aux2 = nn.Linear(7, 5)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)
        loss = F.cross_entropy(self.head(x).view(-1, VOCAB), targets.reshape(-1))
        return loss + 0.1 * self.aux2(torch.tanh(self.aux(x))).pow(2).mean()


def matrices(model):
    return [p for p in model.parameters() if p.ndim == 2]


def others(model):
    return [p for p in model.parameters() if p.ndim != 2]


# name -> (optimizers over a model, clip_grad_norm_ max_norm or None, an LR scheduler factory or None)
OPTIMIZERS = {
    "adam": (lambda m: [torch.optim.Adam(m.parameters(), lr=3e-3)], None, None),
    "adamw_clipped": (lambda m: [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)], 0.05, None),
    "sgd_nesterov": (lambda m: [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, nesterov=True,
                                                weight_decay=1e-3)], None, None),
    "rmsprop_sched": (lambda m: [torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True)], None,
                      lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "adagrad": (lambda m: [torch.optim.Adagrad(m.parameters(), lr=3e-2)], None, None),
    "adadelta": (lambda m: [torch.optim.Adadelta(m.parameters(), lr=1.0)], None, None),
    "adamax": (lambda m: [torch.optim.Adamax(m.parameters(), lr=3e-3)], None, None),
    "nadam": (lambda m: [torch.optim.NAdam(m.parameters(), lr=3e-3)], None, None),
    "radam": (lambda m: [torch.optim.RAdam(m.parameters(), lr=3e-3)], None, None),
    "asgd": (lambda m: [torch.optim.ASGD(m.parameters(), lr=0.1, t0=2)], None, None),
    "rprop": (lambda m: [torch.optim.Rprop(m.parameters(), lr=1e-3)], None, None),
    "groups": (lambda m: [torch.optim.AdamW([{"params": matrices(m), "weight_decay": 0.1},
                                            {"params": others(m), "weight_decay": 0.0, "lr": 1e-2}], lr=3e-3)],
               None, None),
    # Params that join after two steps (add_param_group): they step from then on.
    "added_group": (lambda m: [torch.optim.AdamW(matrices(m), lr=3e-3)], None, None),
    # Whole-tensor update rules: Muon on the matrices (AdamW on the rest, the
    # usual recipe: two optimizers, each stepping its own params), Adafactor.
    "muon": (lambda m: [torch.optim.Muon(matrices(m), lr=2e-2, weight_decay=0.1),
                        torch.optim.AdamW(others(m), lr=3e-3)], None, None),
    "muon_clipped": (lambda m: [Fp32Muon(matrices(m), lr=2e-2, weight_decay=0.1),
                                torch.optim.AdamW(others(m), lr=3e-3)], 0.5, None),
    "adafactor": (lambda m: [torch.optim.Adafactor(m.parameters(), lr=1e-2)], None, None),
    # torch's Muon orthogonalizes in bf16, where the last-bit differences of
    # an fp32 sum over 3 ranks in another order become bf16 roundings of
    # the update: this one runs the same Newton-Schulz in fp32.
    "muon_fp32": (lambda m: [Fp32Muon(matrices(m), lr=2e-2, weight_decay=0.1),
                             torch.optim.AdamW(others(m), lr=3e-3)], None, None),
}


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class Fp32Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in fp32."""

    def step(self, closure=None):
        import torch.optim._muon as muon
        bf16, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, _newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            muon._zeropower_via_newtonschulz = bf16


# name -> what joins the first optimizer after two steps
GROWN = {"added_group": lambda m: {"params": others(m), "lr": 1e-2, "weight_decay": 0.0}}


def run(model, opts, clip, sched, rank, grow=None):
    losses = []
    for s in range(STEPS):
        if grow is not None and s == 2:
            opts[0].add_param_group(grow(model.module if hasattr(model, "module") else model))
        x, y = batch(s, rank)
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        for sc in sched:
            sc.step()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def full_params(model):
    """Every param's full values (rank 0), the partitioned ones gathered."""
    return {n: p.detach().clone() for n, p in zt.consolidated_state_dict(model).items()}


def mode_stock_vs_ddp(rank, world):
    """Each optimizer of OPTIMIZERS over a partitioned model, and under DDP,
    STEPS steps each: losses and the final params."""
    out = {}
    only = os.environ.get("ZS_TEST_OPTIMIZERS")
    for name, (make, clip, sched) in OPTIMIZERS.items():
        if only and name not in only.split(","):
            continue
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(OddGPT())
        opts = make(ddp.module)
        ddp_losses = run(ddp, opts, clip, [sched(o) for o in opts] if sched else [], rank, GROWN.get(name))
        reference = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}

        torch.manual_seed(0)
        with zt.Init(config=CONFIG):
            model = OddGPT()
        zt.partition_module(model)
        opts = make(model)
        initial = full_params(model)
        zs_losses = run(model, opts, clip, [sched(o) for o in opts] if sched else [], rank, GROWN.get(name))
        full = full_params(model)
        if rank == 0:
            diff = max(float((full[n] - reference[n]).abs().max()) for n in reference)
            moved = min(float((full[n] - initial[n]).abs().max()) for n in reference)
            scale = max(float(reference[n].abs().max()) for n in reference)
            out[name] = {"ddp": ddp_losses, "zeroshard": zs_losses, "param_diff": diff, "param_scale": scale,
                         "least_moved": moved,
                         "lr": [o.param_groups[0]["lr"] for o in opts]}
        del model, opts
    return out


def _ckpt_dir():
    return os.environ["ZS_TEST_CKPT"]


def make_ckpt_optimizer(kind, model):
    if kind == "rmsprop":
        return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5, centered=True)
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


def mode_ckpt_save(rank, world):
    """Three steps with a stock optimizer, then save (params and its state)."""
    kind = os.environ["ZS_TEST_OPT"]
    torch.manual_seed(0)
    with zt.Init(config=CONFIG):
        model = OddGPT()
    zt.partition_module(model)
    opt = make_ckpt_optimizer(kind, model)
    for s in range(3):
        x, y = batch(s, rank)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    zt.save_checkpoint(_ckpt_dir(), model, opt, client_state={"world": world})
    return {"saved": True}


def mode_ckpt_load(rank, world):
    """At another world size: load, three more steps; against one unsharded
    model fed every rank's batches (those of the world that took each step)."""
    kind, saved_world = os.environ["ZS_TEST_OPT"], int(os.environ["ZS_TEST_SAVED_WORLD"])
    torch.manual_seed(0)
    with zt.Init(config=CONFIG):
        model = OddGPT()
    zt.partition_module(model)
    opt = make_ckpt_optimizer(kind, model)
    client = zt.load_checkpoint(_ckpt_dir(), model, opt)
    for s in range(3, 6):
        x, y = batch(s, rank)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    full = full_params(model)

    torch.manual_seed(0)
    ref = OddGPT()
    ropt = make_ckpt_optimizer(kind, ref)
    for s in range(6):
        n = saved_world if s < 3 else world
        loss = sum(ref(*batch(s, r)) for r in range(n)) / n  # DDP's averaged gradient
        loss.backward()
        ropt.step()
        ropt.zero_grad()
    if rank != 0:
        return {}
    diff = max(float((full[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    return {"client": client, "param_diff": diff, "state_keys": sorted({k for st in opt.state.values() for k in st})}


def mode_state_dict_roundtrip(rank, world):
    """torch's own optimizer.state_dict() / load_state_dict() at one world
    size, through torch.save: a second optimizer loaded with the first's
    state after two steps takes the third as an unsharded model does.
    Under bf16 (ZS_TEST_BF16) the loaded state stays fp32 (the masters')."""
    import io
    bf16 = bool(os.environ.get("ZS_TEST_BF16"))
    config = dict(CONFIG, bf16={"enabled": True}) if bf16 else CONFIG
    torch.manual_seed(0)
    with zt.Init(config=config):
        model = OddGPT()
    zt.partition_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for s in range(2):
        model(*batch(s, rank)).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = torch.optim.Adam(model.parameters(), lr=1.0)
    opt2.load_state_dict(torch.load(buf))
    dtypes = sorted({str(v.dtype) for st in opt2.state.values() for k, v in st.items() if k != "step"})
    model(*batch(2, rank)).backward()
    opt2.step()
    opt2.zero_grad()
    full = full_params(model)
    torch.manual_seed(0)
    ref = OddGPT()
    ropt = torch.optim.Adam(ref.parameters(), lr=3e-3)
    for s in range(3):
        (sum(ref(*batch(s, r)) for r in range(world)) / world).backward()
        ropt.step()
        ropt.zero_grad()
    if rank != 0:
        return {}
    diff = max(float((full[n].float() - p.detach()).abs().max()) for n, p in ref.named_parameters())
    return {"lr": opt2.param_groups[0]["lr"], "dtypes": dtypes, "param_diff": diff,
            "steps": sorted({float(st["step"]) for st in opt2.state.values()})}


def mode_bf16_stock_vs_engine(rank, world):
    """bf16 params: torch's AdamW steps the engine's fp32 masters, as the
    engine's own AdamW (ZeroShardOptimizer) does: the same bf16 params."""
    config = dict(CONFIG, bf16={"enabled": True})
    finals = []
    for stock in (True, False):
        torch.manual_seed(0)
        with zt.Init(config=config):
            model = OddGPT()
        zt.partition_module(model)
        if stock:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
        else:
            opt = zt.ZeroShardOptimizer(model.parameters(), kind="adamw", lr=3e-3, weight_decay=0.01)
        for s in range(STEPS):
            model(*batch(s, rank)).backward()
            opt.step()
            opt.zero_grad()
        finals.append(full_params(model))
        del model, opt
    if rank != 0:
        return {}
    a, b = finals
    return {"dtype": str(a["head.weight"].dtype),
            "differing": sum(int((a[n] != b[n]).sum()) for n in a), "elements": sum(a[n].numel() for n in a),
            "max_diff": max(float((a[n].float() - b[n].float()).abs().max()) for n in a)}


def mode_muon_vs_deepspeed(rank, world):
    """zeroshard.torch.Muon (DeepSpeed's Muon with its AdamW, Muon groups on
    owner ranks, AdamW groups on shards) over a partitioned model, against
    DeepSpeed 0.19's own MuonWithAuxAdam on one unsharded model fed every
    rank's batch, for both Newton-Schulz methods."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from launch_env import deepspeed_gram_in_fp32
    deepspeed_gram_in_fp32()
    torch.compiler.set_stance("force_eager")  # DeepSpeed compiles its Muon update; eager here (the same math)
    out = {}
    for method, engine in (("gram", False), ("standard", False), ("gram", True)):
        settings = dict(weight_decay=0.1)
        torch.manual_seed(0)
        with zt.Init(config=CONFIG):
            model = OddGPT()
        zt.partition_module(model)
        opt = zt.Muon(zt.muon_param_groups(model, **settings), muon_lr=0.02, adam_lr=3e-3, ns_method=method)
        if engine:  # the engine's Muon (ZS_OPTIM_MUON), the fast path
            opt = zt.ZeroShardOptimizer.from_torch(opt)
            assert opt.kind == "muon", opt.kind
        for s in range(STEPS):
            model(*batch(s, rank)).backward()
            opt.step()
            opt.zero_grad()
        full = full_params(model)
        muon_params = sorted(n for n, p in model.named_parameters() if zt.is_partitioned(p) and p.dim() >= 2
                             and not any(k in n for k in ("embed", "lm_head")))

        torch.manual_seed(0)
        ref = OddGPT()
        groups = zt.muon_param_groups(ref, **settings)
        for g in groups:
            g.update(dict(lr=0.02, momentum=0.95, ns_method=method) if g["use_muon"]
                     else dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-10))
        ropt = MuonWithAuxAdam(groups)
        for s in range(STEPS):
            (sum(ref(*batch(s, r)) for r in range(world)) / world).backward()
            ropt.step()
            ropt.zero_grad()
        if rank == 0:
            out["engine" if engine else method] = {"param_diff": max(float((full[n] - p.detach()).abs().max())
                                             for n, p in ref.named_parameters()),
                           "moved": min(float((p.detach() - q).abs().max()) for (n, p), q in
                                        zip(ref.named_parameters(), OddGPTInit())),
                           "muon_params": len(muon_params)}
        del model, opt
    return out


def OddGPTInit():
    torch.manual_seed(0)
    return [p.detach() for p in OddGPT().parameters()]


def mode_bf16_states(rank, world):
    """DeepSpeed's bf16.bf16_master_weights_and_grads and bf16_optimizer_states
    through zeroshard.torch: the engine's AdamW steps bf16 masters with bf16
    moments (optimizer bytes per shard element 12 -> 4) and trains as the
    fp32-master run within bf16 roundings; a torch optimizer on the shards
    (which steps fp32 masters) is refused naming the key."""
    out = {}
    for name, extra in (("fp32_masters", {}),
                        ("bf16_states", {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})):
        config = dict(CONFIG, bf16=dict({"enabled": True}, **extra))
        torch.manual_seed(0)
        with zt.Init(config=config):
            model = OddGPT()
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), kind="adamw", lr=3e-3)
        losses = []
        for s in range(STEPS):
            loss = model(*batch(s, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
        mem = zt.get_context().memory()
        out[name] = {"losses": losses, "optimizer_bytes": mem["optimizer_bytes"], "shard_bytes": mem["shard_bytes"]}
        if extra:
            try:
                torch.optim.RMSprop(model.parameters(), lr=1e-3).step()
                out["stock"] = ""
            except Exception as e:  # the engine's NotSupportedError
                out["stock"] = f"{type(e).__name__}: {e}"
        del model, opt
        zt.shutdown()  # the next config makes a new context
    return out


def mode_refused(rank, world):
    """Optimizers that cannot run on shards are refused at their first
    step, by name; nothing changes."""
    torch.manual_seed(0)
    with zt.Init(config=CONFIG):
        model = OddGPT()
    zt.partition_module(model)
    out = {}
    before = full_params(model)
    opt = torch.optim.LBFGS(model.parameters())

    def closure():
        opt.zero_grad()
        loss = model(*batch(0, rank))
        loss.backward()
        return loss
    try:
        opt.step(closure)
        out["lbfgs"] = ""
    except RuntimeError as e:
        out["lbfgs"] = str(e)
    after = full_params(model)
    if rank == 0:
        out["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    extra = nn.Parameter(torch.ones(3))  # not partitioned: a torch optimizer over it alone is torch's
    plain = torch.optim.SGD([extra], lr=0.5)
    (extra * 2).sum().backward()
    plain.step()
    out["plain_stepped"] = extra.tolist()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)
        out["norm_type"] = ""
    except NotImplementedError as e:
        out["norm_type"] = str(e)
    return out


def main():
    run_mode({"stock_vs_ddp": mode_stock_vs_ddp, "ckpt_save": mode_ckpt_save, "ckpt_load": mode_ckpt_load,
              "state_dict_roundtrip": mode_state_dict_roundtrip, "refused": mode_refused,
              "bf16_stock_vs_engine": mode_bf16_stock_vs_engine, "muon_vs_deepspeed": mode_muon_vs_deepspeed,
              "bf16_states": mode_bf16_states})


if __name__ == "__main__":
    main()
    exit_without_teardown()
