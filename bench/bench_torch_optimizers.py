"""Stock torch optimizers on zeroshard's shards against DDP and DeepSpeed:
torch.optim.RMSprop (elementwise: each rank steps its fp32 shard) and
Muon (torch.optim.Muon on the hidden matrices, whole tensors on owner
ranks, AdamW on the rest) through zeroshard.torch, the same optimizers
under torch DDP, and DeepSpeed ZeRO-3's own Muon, in one run, each in its
own zsrun launch so that peak RSS figures do not mix.

    .venv/bin/python bench/bench_torch_optimizers.py [--ranks 2] [--steps 3] [--warmup 1]
        [--gpt-dim 768] [--gpt-layers 12] [--gpt-heads 12] [--vocab 50257] [--seq 128] [--batch 4]
        [--optimizers rmsprop muon] [--no-deepspeed] [--ns-dtype bf16|fp32] [--run-timeout 1800]
    .venv/bin/python bench/bench_torch_optimizers.py --steps 3 --warmup 1 --batch 2 --ns-dtype fp32
                                                        # the 162M run of docs/benchmarks.md (~14 min here)
    .venv/bin/python bench/bench_torch_optimizers.py --gpt-dim 128 --gpt-layers 2 --gpt-heads 4 \\
        --vocab 8192 --seq 64 --steps 4 --warmup 1          # a quick small run

The model: a GPT (the blocks of examples/python/train_gpt.py; token and
position embeddings named embed_tokens / embed_positions, an untied
lm_head) of --gpt-dim x --gpt-layers and a --vocab vocabulary; 768 x 12
with 50257 tokens is 162.2M params (GPT-2 small with its head untied).
Its tokens: windows of examples/python/data/corpus.txt (characters as
token ids), one global batch per step drawn from one generator, each rank
its slice; every engine starts from the same weights (torch.manual_seed(0)
before the model is built) and sees the same batches.

Runs (--optimizers picks; each engine its own launch, 2 ranks by default):

  rmsprop  zeroshard  torch.optim.RMSprop(model.parameters()) over the
                      partitioned model: each rank steps the fp32 views of
                      its shards; square_avg becomes the engine's named state
           ddp        the same RMSprop under DistributedDataParallel
  muon     zeroshard  torch.optim.Muon over the hidden matrices (2-D params
                      outside the embeddings and the head) + torch.optim.AdamW
                      over the rest: Muon's params whole on one owner rank each
                      (owners balanced by size), AdamW on the shards
           ddp        the same two optimizers under DDP (every rank runs
                      Newton-Schulz on every matrix: torch's Muon is not
                      distributed)
           deepspeed  DeepSpeed ZeRO-3 with "optimizer": {"type": "Muon"} (below)
  dsmuon   zeroshard  the engine's own Muon (ZS_OPTIM_MUON, C++): DeepSpeed's Muon
                      with its AdamW (zt.Muon's groups, ZeroShardOptimizer.from_torch),
                      momentum on the shards, "gram" Newton-Schulz in fp32 on
                      OpenBLAS on owner ranks
  zeroshard_torch     zeroshard.torch.Muon as torch code: whole matrices on owner
                      ranks through the step hooks (zeroshard.torch.shard_optim)
           ddp        zeroshard.torch.Muon (DeepSpeed's update, torch code) under DDP
           deepspeed  DeepSpeed ZeRO-3 with "optimizer": {"type": "Muon"},
                      ns_method "gram" (fp32 on a CPU), otherwise as below
  (muon)   deepspeed  DeepSpeed ZeRO-3 with "optimizer": {"type": "Muon"}:
                      its MuonWithAuxAdam, use_muon tagged by deepspeed.initialize
                      (2-D and no "embed"/"lm_head" in the name: the same split),
                      ns_method "standard" (the Newton-Schulz torch's Muon runs),
                      "torch_adam": true (torch.optim.AdamW for the other half),
                      "reduce_scatter": false (ZeRO-3's Muon refuses it),
                      "gradient_clipping": 0.0 (this DeepSpeed's default is 1.0,
                      taken over the Muon update: without it every Muon step
                      is scaled down ~18x on the small model);
                      DS_ACCELERATOR=cpu, gloo. If it cannot run, the exception
                      is printed and the JSON says "unavailable" with it.

Hyper-parameters (alike in every engine): RMSprop lr --rmsprop-lr, alpha
0.99, eps 1e-8; Muon lr --muon-lr, momentum 0.95, nesterov, 5 Newton-Schulz
steps, weight decay --weight-decay, torch's lr adjustment sqrt(max(1, rows /
cols)) (DeepSpeed's is the same); AdamW lr --adam-lr, betas (0.9, 0.95), eps
1e-8, the same weight decay. --ns-dtype fp32 runs every engine's Newton-Schulz
in fp32 instead of bf16 (torch's Muon step with its _zeropower_via_newtonschulz
swapped for an fp32 one, DeepSpeed's ns_compute_dtype patched): bf16 matmuls
are slow on a CPU without native bf16.

Per run: the median over the steps after --warmup of the step (forward +
backward + every optimizer's step + zero_grad), of the forward + backward
and of the optimizer step alone (time around opt.step(); DeepSpeed: around
engine.step()); the slower rank's. Peak RSS per rank (ru_maxrss).
Optimizer state per rank, after the first step, with how it was counted:

  zeroshard  the engine ledger's optimizer_bytes (zt.get_context().memory():
             fp32 masters of 16-bit params + the external optimizers' named
             state, which elementwise torch state becomes after its first
             step) + the bytes of torch-held state tensors of this rank that
             are not views of the engine's named state (Muon's full-size
             momentum_buffer of the params this rank owns, step counters);
  ddp        the bytes of every tensor in opt.state (storages counted once);
  deepspeed  the bytes of every tensor in its basic optimizer's state (the
             Muon momentum and AdamW moments of this rank's flat fp32
             partitions); its fp32 master partitions
             (fp32_partitioned_groups_flat) are printed beside it, not in it.

Ratios: zeroshard / DDP (step time, optimizer step time, optimizer state per
rank, peak RSS) for each optimizer, zeroshard Muon / DeepSpeed Muon. Checks
(printed, in the JSON, never an exit status): zeroshard's per-step losses
against DDP's within 1e-5 relative (RMSprop) and 1e-3 (Muon, whose
Newton-Schulz runs in bf16); DeepSpeed's Muon against zeroshard's within
1e-3 (another Muon code, the same update: informative).

Where zeroshard's stock-optimizer step spends its time, per torch optimizer
and rank (ShardStepper's methods wrapped in the worker, medians after
--warmup): the engine's step_begin (gradients synced, norm) and the rest of
its begin (views, hooks), for Muon the all-gathers of the full fp32 gradient
and master of every param and the broadcast of each new master (bytes
counted from the params' sizes), torch's own update (what is left of
opt.step()), the engine's end; the owner path's collectives as a share of
opt.step() and of the step. A rank's broadcast time includes waiting for
the other owners' Newton-Schulz to finish: the smaller rank's figure is the
nearer to the collectives' own cost.
Nothing is asserted on time. The last line is one JSON object.
"""
import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from rss import peak_rss, rss_now

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
RUNS = (("rmsprop", "zeroshard"), ("rmsprop", "ddp"), ("muon", "zeroshard"), ("muon", "ddp"),
        ("muon", "deepspeed"), ("dsmuon", "zeroshard"), ("dsmuon", "zeroshard_torch"), ("dsmuon", "ddp"),
        ("dsmuon", "deepspeed"))
ZS_ENGINES = ("zeroshard", "zeroshard_torch")  # zeroshard_torch: zt.Muon as torch code on owner ranks
LOSS_TOLERANCE = {"rmsprop": 1e-5, "muon": 1e-3, "dsmuon": 1e-4}  # zeroshard vs DDP, relative, per step
DS_LOSS_TOLERANCE = 1e-3  # zeroshard's Muon vs DeepSpeed's (another Muon code), relative, per step


# ---------------------------------------------------------------------------
# worker: one optimizer, one engine, one rank (launched by zsrun)
# ---------------------------------------------------------------------------

def load_gpt_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "python" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(args):
    """The example's GPT blocks under names DeepSpeed's Muon tagging reads:
    its embeddings named *embed*, its head lm_head (both AdamW's)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    example = load_gpt_example()

    class GPT(nn.Module):
        def __init__(self, vocab, dim, heads, layers, seq):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, dim)
            self.embed_positions = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(example.Block(dim, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.embed_tokens(idx) + self.embed_positions(pos)
            for blk in self.blocks:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return GPT(args.vocab, args.gpt_dim, args.gpt_heads, args.gpt_layers, args.seq)


def batches(args, rank, world):
    """Every step's (x, y) for this rank: one global batch per step from
    one generator, this rank's slice of it."""
    import torch
    text = (REPO / "examples" / "python" / "data" / "corpus.txt").read_text()
    chars = sorted(set(text))
    index = {c: i % args.vocab for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (world * args.batch,), generator=gen)
        mine = starts[rank * args.batch:(rank + 1) * args.batch]
        out.append((torch.stack([data[s:s + args.seq] for s in mine]),
                    torch.stack([data[s + 1:s + args.seq + 1] for s in mine])))
    return out


def layer_shape(p):
    """A param's shape as a layer (partitioned ones report theirs elsewhere)."""
    if getattr(p, "ds_shape", None) is not None:
        return tuple(p.ds_shape)
    if getattr(p, "zs", None) is not None:
        return tuple(p.zs.shape)
    return tuple(p.shape)


def is_hidden_matrix(name, p):
    """Muon's params: 2-D, not an embedding or the head (DeepSpeed's rule)."""
    return len(layer_shape(p)) == 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz, in fp32 (--ns-dtype fp32)."""
    import torch
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def muon_class(args):
    import torch
    if args.ns_dtype == "bf16":
        return torch.optim.Muon

    class Fp32Muon(torch.optim.Muon):
        """torch.optim.Muon with its Newton-Schulz iteration in fp32."""

        def step(self, closure=None):
            import torch.optim._muon as muon
            bf16, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, _newton_schulz_fp32
            try:
                return super().step(closure)
            finally:
                muon._zeropower_via_newtonschulz = bf16
    return Fp32Muon


def make_optimizers(args, model):
    """name -> torch optimizer over the model's params (the same in DDP and zeroshard)."""
    import torch
    if args.optimizer == "rmsprop":
        return {"rmsprop": torch.optim.RMSprop(model.parameters(), lr=args.rmsprop_lr, alpha=0.99, eps=1e-8)}
    if args.optimizer == "dsmuon":
        import zeroshard.torch as zt
        opt = zt.Muon(zt.muon_param_groups(model, weight_decay=args.weight_decay), muon_lr=args.muon_lr,
                      adam_lr=args.adam_lr, momentum=0.95, betas=(0.9, 0.95), eps=1e-8, ns_method="gram")
        if args.engine == "zeroshard":
            opt = zt.ZeroShardOptimizer.from_torch(opt)  # the engine's Muon (zeroshard_torch keeps zt.Muon)
        return {"dsmuon": opt}
    named = list(model.named_parameters())
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return {"muon": muon_class(args)(hidden, lr=args.muon_lr, momentum=0.95, nesterov=True,
                                     weight_decay=args.weight_decay),
            "adamw": torch.optim.AdamW(rest, lr=args.adam_lr, betas=(0.9, 0.95), eps=1e-8,
                                       weight_decay=args.weight_decay)}


def tensors_bytes(tensors, seen):
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def state_tensors(opt):
    import torch
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def zs_torch_held_state(opts):
    """Bytes of torch-held optimizer state on this rank that is not a view
    of the engine's named state (that is in the ledger): Muon's full-size
    momentum of the params this rank owns, step counters. Per optimizer."""
    import torch
    from zeroshard.torch import shard_optim
    from zeroshard.torch._params import is_partitioned
    out = {}
    seen = set()
    for name, o in opts.items():
        s = shard_optim.stepper(o, create=False)
        held = []
        for p, st in o.state.items():
            for key, v in st.items():
                if not torch.is_tensor(v) or v.numel() == 0:
                    continue
                if s is not None and is_partitioned(p) and not stepper_whole(s, p):
                    try:
                        named = s.named_view(p, key, create=False)
                    except Exception:  # noqa: BLE001 (a key that cannot name engine state is torch's)
                        named = None
                    if named is not None and named.numel() and named.data_ptr() == v.data_ptr():
                        continue
                held.append(v)
        out[name] = tensors_bytes(held, seen)
    return out


def stepper_whole(stepper, p):
    """Whether a ShardStepper steps p whole (on an owner rank)."""
    w = getattr(stepper, "whole", None)
    return bool(w(p)) if callable(w) else bool(w)


class ZsProbe:
    """Times the stock-optimizer step's parts in this process, per torch
    optimizer: ShardStepper's begin (the engine's step_begin, then the
    whole-tensor params' gathers) and end (their masters' broadcast, then
    the engine's step_end), its _gather and _scatter_masters, and
    zeroshard.optimizer.Optimizer.step_begin / step_end (only steppers call
    them); and the bytes the owner path moves. Private names: what is
    missing is reported, not guessed."""

    PARTS = ("begin", "end", "_gather", "_scatter_masters")

    def __init__(self, opts):
        from zeroshard.torch import shard_optim
        import zeroshard.optimizer as zopt
        self.names = {id(o): name for name, o in opts.items()}
        self.current = "?"
        self.steps = []
        self.missing = []
        self.cur = {}
        self._wrap(shard_optim.ShardStepper, self.PARTS, stepper=True)
        self._wrap(zopt.Optimizer, ("step_begin", "step_end"), stepper=False)

    def _add(self, key, value):
        self.cur[key] = self.cur.get(key, 0) + value

    def _wrap(self, cls, names, stepper):
        probe = self
        for name in names:
            original = getattr(cls, name, None)
            if original is None:
                self.missing.append(f"{cls.__name__}.{name}")
                continue

            def timed(obj, *a, _original=original, _name=name, **kw):
                if stepper and _name in ("begin", "end") and a:
                    probe.current = probe.names.get(id(a[0]), "?")
                t0 = time.perf_counter()
                try:
                    return _original(obj, *a, **kw)
                finally:
                    probe._add(f"{probe.current}.{_name}", time.perf_counter() - t0)
                    if _name == "_gather":
                        probe._add(f"{probe.current}.gather_bytes", a[0].zs.zparam.padded_numel * 4)
                        probe._add(f"{probe.current}.gather_calls", 1)
                    elif _name == "_scatter_masters":
                        n = sum(p.zs.zparam.padded_numel for p in obj.params
                                if stepper_whole(obj, p) and p.requires_grad and p.zs.zparam.grad_pushed)
                        probe._add(f"{probe.current}.broadcast_bytes", n * 4)
            setattr(cls, name, timed)

    def next_step(self):
        self.steps.append(self.cur)
        self.cur = {}


def median_after(values, warmup):
    rest = values[warmup:] or values
    return statistics.median(rest)


def worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    notes = {}
    t_start = time.perf_counter()
    if args.engine == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args, rank, world)
    rss_before_model = rss_now()
    probe = None
    torch.manual_seed(0)
    try:
        if args.engine in ZS_ENGINES:
            import zeroshard.torch as zt
            config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": args.batch}
            zt.init_context(config=config, device="cpu")
            with zt.Init(config=config, device="cpu"):
                model = build_model(args)
            zt.partition_module(model)
            opts = make_optimizers(args, model)
            probe = ZsProbe(opts)
            notes["ledger_before_first_step"] = zt.get_context().memory()
            forward, backward = model, (lambda loss: loss.backward())

            def zero_grad():
                for o in opts.values():
                    o.zero_grad()
        elif args.engine == "ddp":
            model = build_model(args)
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            opts = make_optimizers(args, model)
            forward, backward = ddp, (lambda loss: loss.backward())

            def zero_grad():
                for o in opts.values():
                    o.zero_grad(set_to_none=True)
        else:
            import deepspeed
            if args.ns_dtype == "fp32":
                import deepspeed.runtime.zero.muon.original_muon as om
                om.ns_compute_dtype = lambda ns_method="gram": torch.float32
                notes["ns_dtype"] = "fp32 (ns_compute_dtype patched)"
            config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                      "zero_optimization": {"stage": 3, "reduce_scatter": False}, "steps_per_print": 10 ** 9,
                      "gradient_clipping": 0.0,  # this DeepSpeed clips at 1.0 unless told: over Muon's update
                      "optimizer": {"type": "Muon", "params": {
                          "muon_lr": args.muon_lr, "adam_lr": args.adam_lr, "lr": args.adam_lr, "momentum": 0.95,
                          "weight_decay": args.weight_decay, "betas": [0.9, 0.95], "eps": 1e-8,
                          "ns_method": "gram" if args.optimizer == "dsmuon" else "standard",
                          "torch_adam": True}}}
            notes["config"] = config
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = build_model(args)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            tagged = sorted(n for n, p in model.named_parameters() if getattr(p, "use_muon", False))
            ours = sorted(n for n, p in model.named_parameters() if is_hidden_matrix(n, p))
            notes["use_muon_params"] = len(tagged)
            notes["use_muon_same_split_as_ours"] = tagged == ours
            basic = engine.optimizer.optimizer
            notes["optimizer"] = f"{type(engine.optimizer).__name__} over {type(basic).__name__}" + (
                f" (aux {type(basic.aux_optimizer).__name__})" if getattr(basic, "aux_optimizer", None) else "")
            opts = {"deepspeed": engine}
            forward, backward = engine, engine.backward

            def zero_grad():
                pass  # engine.step() zeroes them
    except Exception as e:  # noqa: BLE001
        return worker_failed(args, rank, world, "setup", e)

    rss_after_build = rss_now()
    setup_s = time.perf_counter() - t_start
    nparams = sum(math.prod(layer_shape(p)) for p in model.parameters())
    losses, times, fb_times, opt_times, per_opt = [], [], [], [], []
    state = None
    try:
        for i, (x, y) in enumerate(data):
            t0 = time.perf_counter()
            loss = forward(x, y)
            backward(loss)
            t1 = time.perf_counter()
            each = {}
            for name, o in opts.items():
                ta = time.perf_counter()
                o.step()
                each[name] = time.perf_counter() - ta
            t2 = time.perf_counter()
            measuring = 0.0
            if state is None:  # after the first step: every moment exists (not in the step's time)
                state = measure_state(args, model, opts, notes)
                measuring = time.perf_counter() - t2
            zero_grad()
            times.append(time.perf_counter() - t0 - measuring)
            fb_times.append(t1 - t0)
            opt_times.append(t2 - t1)
            per_opt.append(each)
            if probe is not None:
                probe.next_step()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            if rank == 0:
                print(f"  {args.optimizer:7s} {args.engine:9s} step {i:3d}  loss {losses[-1]:.6f}  "
                      f"{times[-1]:8.2f} s (fwd+bwd {fb_times[-1]:.2f}, opt.step {opt_times[-1]:.2f})",
                      file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
        return worker_failed(args, rank, world, f"step {len(losses)}", e)

    if args.engine in ZS_ENGINES:
        notes["ledger_end"] = zt.get_context().memory()
    mine = {"rank": rank, "setup_s": setup_s, "first_step_s": times[0], "rss_before_model_bytes": rss_before_model,
            "rss_after_build_bytes": rss_after_build,
            "peak_rss_bytes": peak_rss(), "step_times_s": times, "fwd_bwd_times_s": fb_times,
            "opt_step_times_s": opt_times, "per_optimizer_step_s": per_opt,
            "median_step_s": median_after(times, args.warmup),
            "median_fwd_bwd_s": median_after(fb_times, args.warmup),
            "median_opt_step_s": median_after(opt_times, args.warmup),
            "median_per_optimizer_step_s": {k: median_after([s[k] for s in per_opt], args.warmup)
                                            for k in per_opt[0]},
            **state, "notes": notes}
    if probe is not None:
        mine["zs_parts_per_step"] = probe.steps
        mine["zs_probe_missing"] = probe.missing
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(json.dumps({"optimizer": args.optimizer, "engine": args.engine, "ranks": world, "params": nparams,
                          "losses": losses, "median_step_s": max(r["median_step_s"] for r in everyone),
                          "median_fwd_bwd_s": max(r["median_fwd_bwd_s"] for r in everyone),
                          "median_opt_step_s": max(r["median_opt_step_s"] for r in everyone),
                          "per_rank": everyone}), flush=True)
    dist.barrier()
    if args.engine == "deepspeed":
        sys.stdout.flush()
        os._exit(0)  # DeepSpeed's CPU engine can abort in its teardown once everything is measured
    if args.engine in ZS_ENGINES:
        del model, opts
        zt.shutdown()
    dist.destroy_process_group()


def worker_failed(args, rank, world, where, e):
    """A run that cannot go on: the exception, exactly, on stdout as JSON
    (rank 0; every rank prints its traceback to stderr)."""
    reason = f"{type(e).__name__}: {e}"
    traceback.print_exc()
    print(json.dumps({"optimizer": args.optimizer, "engine": args.engine, "ranks": world, "rank": rank,
                      "unavailable": True, "where": where, "reason": reason}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def measure_state(args, model, opts, notes):
    """Optimizer state bytes of this rank, after the first step, and how."""
    import torch
    out = {}
    if args.engine in ZS_ENGINES:
        import zeroshard.torch as zt
        ledger = zt.get_context().memory()
        held = zs_torch_held_state(opts)
        out["ledger_after_first_step"] = {k: ledger[k] for k in ("shard_bytes", "grad_bytes", "optimizer_bytes",
                                                                 "gathered_bytes", "host_cache_bytes")}
        out["torch_held_state_bytes"] = held
        out["optimizer_state_bytes"] = ledger["optimizer_bytes"] + sum(held.values())
        out["master_bytes"] = None  # fp32 params: the shard is the master (the ledger counts 16-bit params' only)
        out["how"] = "ledger optimizer_bytes + torch-held state not in engine named state"
    elif args.engine == "ddp":
        seen = set()
        per = {k: tensors_bytes(state_tensors(o), seen) for k, o in opts.items()}
        out["torch_held_state_bytes"] = per
        out["optimizer_state_bytes"] = sum(per.values())
        out["master_bytes"] = None
        out["how"] = "opt.state tensors"
    else:
        engine = opts["deepspeed"]
        z = engine.optimizer
        seen = set()
        out["master_bytes"] = tensors_bytes(list(getattr(z, "fp32_partitioned_groups_flat", [])), seen)
        tensors = state_tensors(z.optimizer)
        aux = getattr(z.optimizer, "aux_optimizer", None)
        if aux is not None and aux.state is not z.optimizer.state:
            tensors += state_tensors(aux)
        extra = getattr(z, "muon_momentum_buffer_partitioned_groups_flat", None) or {}
        tensors += list(extra.values())
        by_key = {}
        for st in z.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    by_key[k] = by_key.get(k, 0) + v.numel() * v.element_size()
        out["optimizer_state_bytes"] = tensors_bytes(tensors, seen)
        out["torch_held_state_bytes"] = by_key
        out["how"] = ("tensors of its basic optimizer's state (keyed by flat fp32 partitions); fp32 master "
                      "partitions apart")
    return out


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def launch(args, optimizer, engine):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    threads = str(max(1, (os.cpu_count() or 1) // args.ranks))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("ZS_NUM_THREADS", env["OMP_NUM_THREADS"])
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix",
           "--timeout-s", str(args.run_timeout), "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine, "--optimizer", optimizer]
    for flag in ("steps", "warmup", "batch", "seq", "vocab", "gpt_dim", "gpt_layers", "gpt_heads", "rmsprop_lr",
                 "muon_lr", "adam_lr", "weight_decay", "ns_dtype"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.run_timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launch this bench started, its own session
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    found = [line for line in stdout.splitlines() if line.startswith("{")]
    tail = "\n".join((stdout + stderr).splitlines()[-30:])
    if not found:
        return None, {"reason": f"exit status {proc.returncode} with no result", "where": "launch",
                      "output_tail": tail}, wall
    r = json.loads(found[-1])
    r["launch_wall_s"] = wall
    r["exit_status"] = proc.returncode
    if r.get("unavailable"):
        return None, {"reason": r["reason"], "where": f"{r['where']} (rank {r['rank']})", "output_tail": tail}, wall
    if proc.returncode != 0:
        print(f"[{optimizer} {engine}] exited {proc.returncode} after reporting; its output ended:\n"
              + "\n".join(stderr.splitlines()[-3:]), flush=True)
    return r, None, wall


def tree():
    def git(*a):
        out = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False)
        return out.stdout.rstrip("\n")
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "bindings", "impl", "kernels", "capi",
                                      "examples").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "changed_files": dirty}


def peak_of(r):
    return max(p["peak_rss_bytes"] for p in r["per_rank"])


def state_of(r):
    return max(p["optimizer_state_bytes"] for p in r["per_rank"])


def fmt_mib(b):
    return f"{b / MIB:.1f}"


def step_parts(r, args):
    """zeroshard: per rank and torch optimizer, the medians after --warmup
    of each part of its opt.step(); torch's own update is what is left of
    the optimizer's step after the engine's begin and end. For a
    whole-tensor optimizer (Muon) the owner path's collectives (gathers +
    broadcast) and their share of the whole training step."""
    out = []
    for p in r["per_rank"]:
        steps = p.get("zs_parts_per_step") or []
        keys = sorted({k for s in steps for k in s})
        med = {k: median_after([s.get(k, 0.0) for s in steps], args.warmup) for k in keys}
        step = p["median_step_s"]
        row = {"rank": p["rank"], "median_step_s": step, "optimizers": {}}
        for name, opt_s in p["median_per_optimizer_step_s"].items():
            if f"{name}.begin" not in med:
                continue
            part = {"opt_step_s": opt_s,
                    "engine_step_begin_s": med.get(f"{name}.step_begin", 0.0),
                    "begin_s": med[f"{name}.begin"], "end_s": med.get(f"{name}.end", 0.0),
                    "engine_step_end_s": med.get(f"{name}.step_end", 0.0),
                    "gathers_s": med.get(f"{name}._gather", 0.0),
                    "broadcast_s": med.get(f"{name}._scatter_masters", 0.0),
                    "gather_bytes": med.get(f"{name}.gather_bytes", 0),
                    "broadcast_bytes": med.get(f"{name}.broadcast_bytes", 0)}
            part["torch_update_s"] = opt_s - part["begin_s"] - part["end_s"]
            if part["gather_bytes"]:
                part["owner_collectives_s"] = part["gathers_s"] + part["broadcast_s"]
                part["owner_collectives_share_of_step"] = part["owner_collectives_s"] / step if step else None
                part["owner_collectives_share_of_opt_step"] = part["owner_collectives_s"] / opt_s if opt_s else None
            row["optimizers"][name] = part
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=["zeroshard", "zeroshard_torch", "ddp", "deepspeed"], help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", choices=["rmsprop", "muon", "dsmuon"], help=argparse.SUPPRESS)
    ap.add_argument("--optimizers", nargs="+", choices=["rmsprop", "muon", "dsmuon"],
                    default=["rmsprop", "muon", "dsmuon"])
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per run, --warmup of them first")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--gpt-dim", type=int, default=768)
    ap.add_argument("--gpt-layers", type=int, default=12)
    ap.add_argument("--gpt-heads", type=int, default=12)
    ap.add_argument("--rmsprop-lr", type=float, default=1e-4)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adam-lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--ns-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="Newton-Schulz dtype of every engine's Muon (bf16: torch's and DeepSpeed's own)")
    ap.add_argument("--run-timeout", type=int, default=1800, help="seconds per launch before it is killed")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if args.gpt_dim % args.gpt_heads:
        ap.error("--gpt-dim must be a multiple of --gpt-heads")

    where = tree()
    threads = os.environ.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // args.ranks))
    print(f"bench_torch_optimizers: GPT {args.gpt_dim} x {args.gpt_layers} ({args.gpt_heads} heads), vocab "
          f"{args.vocab}, seq {args.seq}, batch {args.batch}/rank, {args.ranks} ranks, {args.steps} steps "
          f"({args.warmup} warm-up), {threads} kernel thread(s) per rank, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; Newton-Schulz in {args.ns_dtype}; commit {where['commit']}"
          + (f" with {len(where['changed_files'])} engine/binding files changed" if where["changed_files"] else "")
          + ". Each run is its own launch.", flush=True)
    results, unavailable = {}, {}
    for optimizer, engine in RUNS:
        if optimizer not in args.optimizers:
            continue
        key = f"{optimizer} {engine}"
        if engine == "deepspeed" and args.no_deepspeed:
            unavailable[key] = {"reason": "--no-deepspeed", "where": "not run"}
            continue
        r, why, wall = launch(args, optimizer, engine)
        if r is None:
            if engine != "deepspeed":
                sys.exit(f"bench_torch_optimizers: {key} failed in {why['where']}: {why['reason']}; its output "
                         f"ended:\n{why['output_tail']}")
            unavailable[key] = {"reason": why["reason"], "where": why["where"]}
            print(f"[{key}] UNAVAILABLE, in {why['where']}: {why['reason']}\n  its output ended:\n"
                  + "\n".join("    " + line for line in why["output_tail"].splitlines()), flush=True)
            continue
        results[key] = r
        pr = r["per_rank"]
        print(f"[{key:17s}] step {r['median_step_s']:7.2f} s (fwd+bwd {r['median_fwd_bwd_s']:.2f}, opt.step "
              f"{r['median_opt_step_s']:.2f}) | optimizer state/rank "
              + " ".join(fmt_mib(p["optimizer_state_bytes"]) for p in pr) + " MiB | peak RSS/rank "
              + " ".join(f"{p['peak_rss_bytes'] / MIB:.0f}" for p in pr) + f" MiB | final loss {r['losses'][-1]:.6f}"
              f" | launch {wall:.0f} s (setup {max(p['setup_s'] for p in pr):.0f} s, first step "
              f"{max(p['first_step_s'] for p in pr):.1f} s)", flush=True)

    print_table(args, results, unavailable)
    ratios, checks = compare(args, results)
    paths = {}
    for key in ("muon zeroshard", "rmsprop zeroshard"):
        if key in results:
            paths[key] = step_parts(results[key], args)
    print_paths(paths, results)

    summary = {}
    for key, r in results.items():
        pr = r["per_rank"]
        summary[key] = {
            "params": r["params"], "median_step_s": r["median_step_s"], "launch_wall_s": r["launch_wall_s"],
            "setup_s": max(p["setup_s"] for p in pr), "first_step_s": max(p["first_step_s"] for p in pr),
            "median_fwd_bwd_s": r["median_fwd_bwd_s"],
            "median_opt_step_s": r["median_opt_step_s"],
            "median_per_optimizer_step_s": [p["median_per_optimizer_step_s"] for p in pr],
            "peak_rss_bytes_per_rank": [p["peak_rss_bytes"] for p in pr],
            "rss_before_model_bytes_per_rank": [p["rss_before_model_bytes"] for p in pr],
            "optimizer_state_bytes_per_rank": [p["optimizer_state_bytes"] for p in pr],
            "optimizer_state_parts_per_rank": [p["torch_held_state_bytes"] for p in pr],
            "master_bytes_per_rank": [p["master_bytes"] for p in pr],
            "ledger_after_first_step_per_rank": [p.get("ledger_after_first_step") for p in pr],
            "how_state_counted": pr[0]["how"], "losses": r["losses"],
            "step_times_s_per_rank": [p["step_times_s"] for p in pr],
            "notes": {k: v for k, v in pr[0]["notes"].items() if not k.startswith("ledger")}}
    print("Nothing asserted on time; figures are from whatever else the machine was running.", flush=True)
    print(json.dumps({"bench": "torch_optimizers", "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
                      "gpt": {"dim": args.gpt_dim, "layers": args.gpt_layers, "heads": args.gpt_heads,
                              "vocab": args.vocab, "seq": args.seq, "batch_per_rank": args.batch},
                      "ns_dtype": args.ns_dtype,
                      "hparams": {"rmsprop_lr": args.rmsprop_lr, "muon_lr": args.muon_lr, "adam_lr": args.adam_lr,
                                  "weight_decay": args.weight_decay},
                      "cores": os.cpu_count(), "load_average_end": os.getloadavg()[0], "tree": where,
                      "results": summary, "unavailable": unavailable, "ratios": ratios, "loss_checks": checks,
                      "zeroshard_step_parts": paths}))


def print_table(args, results, unavailable):
    print(f"\n{'run':18s} {'step s':>8s} {'fwd+bwd s':>9s} {'opt.step s':>10s} {'opt state/rank MiB':>19s} "
          f"{'peak RSS/rank MiB':>18s} {'final loss':>10s}", flush=True)
    for key, r in results.items():
        pr = r["per_rank"]
        print(f"{key:18s} {r['median_step_s']:8.2f} {r['median_fwd_bwd_s']:9.2f} {r['median_opt_step_s']:10.2f} "
              f"{'/'.join(fmt_mib(p['optimizer_state_bytes']) for p in pr):>19s} "
              f"{'/'.join(str(round(p['peak_rss_bytes'] / MIB)) for p in pr):>18s} {r['losses'][-1]:10.5f}",
              flush=True)
    for key, why in unavailable.items():
        print(f"{key:18s} unavailable ({why['where']}): {why['reason']}", flush=True)
    for key, r in results.items():
        pr = r["per_rank"]
        parts = "; ".join(f"rank {p['rank']}: " + ", ".join(f"{k} {fmt_mib(v)}" for k, v in
                                                             p["torch_held_state_bytes"].items())
                          for p in pr)
        extra = ""
        if pr[0].get("ledger_after_first_step"):
            extra = " | ledger optimizer_bytes " + "/".join(fmt_mib(p["ledger_after_first_step"]["optimizer_bytes"])
                                                             for p in pr)
        if pr[0].get("master_bytes"):
            extra += " | fp32 master partitions (not counted above) " + "/".join(fmt_mib(p["master_bytes"])
                                                                                  for p in pr)
        print(f"  state of {key}: {pr[0]['how']}: {parts} MiB{extra}", flush=True)


def compare(args, results):
    ratios, checks = {}, {}

    def ratio(a, b):
        ra, rb = results[a], results[b]
        out = {"step_time": ra["median_step_s"] / rb["median_step_s"],
               "opt_step_time": ra["median_opt_step_s"] / rb["median_opt_step_s"],
               "fwd_bwd_time": ra["median_fwd_bwd_s"] / rb["median_fwd_bwd_s"],
               "optimizer_state_bytes_per_rank": state_of(ra) / state_of(rb) if state_of(rb) else None,
               "peak_rss": peak_of(ra) / peak_of(rb)}
        ratios[f"{a} / {b}"] = out
        st = out["optimizer_state_bytes_per_rank"]
        print(f"{a} / {b}: step time x{out['step_time']:.2f}, opt.step x{out['opt_step_time']:.2f}, fwd+bwd "
              f"x{out['fwd_bwd_time']:.2f}, optimizer state/rank " + (f"x{st:.3f}" if st is not None else "n/a")
              + f" (max over ranks), peak RSS x{out['peak_rss']:.2f}", flush=True)

    def losses(a, b, tol, binding):
        la, lb = results[a]["losses"], results[b]["losses"]
        rel = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(la, lb)]
        worst = max(rel)
        moved = la[0] - la[-1]
        checks[f"{a} vs {b}"] = {"rel_diff_per_step": rel, "max_rel_diff": worst, "tolerance": tol,
                                 "within_tolerance": worst <= tol, "binding": binding,
                                 "loss_first_last": [la[0], la[-1]]}
        print(f"losses {a} vs {b}: max relative difference {worst:.2e} over {len(rel)} steps: "
              + ("within" if worst <= tol else "OUTSIDE") + f" {tol:.0e}" + ("" if binding else " (informative)")
              + f"; {a} loss {la[0]:.4f} -> {la[-1]:.4f}" + (" (it trained)" if moved > 0 else " (did NOT fall)"),
              flush=True)

    print("", flush=True)
    for opt in ("rmsprop", "muon", "dsmuon"):
        a, b = f"{opt} zeroshard", f"{opt} ddp"
        if a in results and b in results:
            ratio(a, b)
            losses(a, b, LOSS_TOLERANCE[opt], True)
    for opt in ("muon", "dsmuon"):
        if f"{opt} zeroshard" in results and f"{opt} deepspeed" in results:
            ratio(f"{opt} zeroshard", f"{opt} deepspeed")
            losses(f"{opt} zeroshard", f"{opt} deepspeed", DS_LOSS_TOLERANCE, False)
    if "dsmuon zeroshard" in results and "dsmuon zeroshard_torch" in results:
        ratio("dsmuon zeroshard", "dsmuon zeroshard_torch")  # the engine's Muon / the same update as torch code
        losses("dsmuon zeroshard", "dsmuon zeroshard_torch", DS_LOSS_TOLERANCE, False)
    return ratios, checks


def print_paths(paths, results):
    for key, rows in paths.items():
        for row in rows:
            for name, part in row["optimizers"].items():
                line = (f"[{key}] rank {row['rank']}: {name}.step() {part['opt_step_s']:.3f} s = engine begin "
                        f"{part['begin_s'] - part['gathers_s']:.3f} s (step_begin: gradients synced, norm "
                        f"{part['engine_step_begin_s']:.3f} s)")
                if part["gather_bytes"]:
                    line += (f" + all-gathers of full grad and master {part['gathers_s']:.3f} s "
                             f"({part['gather_bytes'] / MIB:.0f} MiB gathered)")
                line += f" + torch's update {part['torch_update_s']:.3f} s"
                if part["gather_bytes"]:
                    line += (f" + broadcast of new masters {part['broadcast_s']:.3f} s "
                             f"({part['broadcast_bytes'] / MIB:.0f} MiB)")
                line += (f" + engine end {part['end_s'] - part['broadcast_s']:.3f} s (step_end "
                         f"{part['engine_step_end_s']:.3f} s)")
                if part["gather_bytes"]:
                    line += (f"; owner-path collectives {part['owner_collectives_s']:.3f} s = "
                             f"{part['owner_collectives_share_of_opt_step']:.1%} of {name}.step(), "
                             f"{part['owner_collectives_share_of_step']:.1%} of the training step "
                             f"({row['median_step_s']:.2f} s)")
                print(line, flush=True)
        missing = results[key]["per_rank"][0].get("zs_probe_missing")
        if missing:
            print(f"[{key}] step parts not timed (names not found): {', '.join(missing)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
