"""PyTorch step benchmark: the same model trained through zeroshard
(zeroshard.torch: Init, partition_module, ZeroShardOptimizer), torch DDP
(gloo), FSDP2 (torch's fully_shard on each block, then the root; a stock
AdamW), the same FSDP2 script with zeroshard.torch's fully_shard ("fully_shard":
one import changed) and DeepSpeed ZeRO-3 on the CPU (DS_ACCELERATOR=cpu,
gloo), in one run, each engine in its own zsrun launch so that peak RSS
figures do not mix.

    .venv/bin/python bench/bench_torch_step.py [--models wide fine] [--ranks 2]
        [--steps 8] [--warmup 2] [--ds-optimizer auto|cpuadam|torch] [--no-deepspeed]
        [--zs-config '{"reduce_bucket_size": 2e7}'] [--identity-ab [--ab-reps 5] [--ab-same]]
        [--dtype fp32|bf16 [--ds-own-init]]
    .venv/bin/python bench/bench_torch_step.py --side-by-side [--launches 5] [--steps 40 --warmup 8]
    .venv/bin/python bench/bench_torch_step.py --compile --models gpt [--gpt-dim 256 --gpt-layers 6]

Models (--models, any of):
  wide  a stack of --wide-depth nn.Linear(--wide-width, --wide-width) layers
        with residual GELUs (default 7 x 4096: 117.5M params), so params,
        grads and AdamW state (16 bytes/param unsharded) dominate memory;
  fine  200 nn.Linear(8, 8) with residual tanh (400 tiny params): the
        per-param cost of the engines' bookkeeping;
  gpt   the GPT example of examples/python/train_gpt.py (its defaults).

Per model and engine: step time (median of the steps after --warmup), peak
RSS per rank (ru_maxrss) and the RSS before the model was built, params +
grads + optimizer state bytes per rank, every step's loss (all-reduced mean
over ranks). Then ratios zeroshard/DDP and zeroshard/DeepSpeed and how
closely the losses agree. The last line is one JSON object. Nothing is
asserted on time; targets are printed for the record.

Every engine runs AdamW (lr, betas, eps, weight_decay alike) in fp32 on one
kernel thread per rank (OMP_NUM_THREADS = ZS_NUM_THREADS = cores / ranks,
unless set): DDP with torch.optim.AdamW(fused=True) and
gradient_as_bucket_view=True (its lowest-memory setting); DeepSpeed with its
DeepSpeedCPUAdam (JIT-built op, what its CPU offload runs) when it builds,
else torch.optim.AdamW(fused=True) as a client optimizer
("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer": false);
the bench says which. DeepSpeed is skipped, with the reason printed, when it
cannot start. --zs-config adds zero_optimization keys for zeroshard alone.
The environment reaches every
engine (e.g. ZS_HOST_CACHE_MB, MALLOC_MMAP_THRESHOLD_).

--dtype bf16 (default fp32, whose output and JSON line are unchanged):
mixed precision, as each engine does it. zeroshard with "bf16": {"enabled":
true} (params partitioned as bf16, fp32 master shards in the optimizer,
gradients reduced in bf16 unless communication_data_type says fp32);
DeepSpeed ZeRO-3 with the same key; both get their float inputs cast to
bf16 by the script, as DeepSpeed wants. DDP keeps fp32 params and runs its
forward under torch.autocast("cpu", dtype=torch.bfloat16). The models
compute their loss in fp32 from the bf16 activations (.float(): a no-op in
fp32), so that losses are compared at more than bf16's 8 bits. DeepSpeed's
zero.Init makes torch's tensor constructors return bf16, so its
initialisers draw in bf16: another random stream, and torch's CPU bf16
uniform_ is biased (about half a grid step negative); the bench has it
draw in fp32 and round, as zeroshard does, so that the engines start from
the same weights (--ds-own-init: its own draws). Printed besides the
figures above: bytes on the wire per step and rank (the median of the steps
after --warmup, the larger rank) -- zeroshard: counted,
optimizer.wire_stats() deltas (gathers, reduce-scatters, all-reduces,
others, sent and received); DDP: computed, not counted, a ring all-reduce
of its fp32 grads, P x 4 B x 2(N-1)/N; DeepSpeed: computed, not counted,
from the sizes and dtypes of the buffers it hands its comm backend in the
step (wrapped), as a ring sends them ((N-1)/N of a gather's or
reduce-scatter's buffer, 2(N-1)/N of an all-reduce's) -- each checked
against what fp32 and bf16 gradients' reduce-scatter would move; every
engine's loss curve; zeroshard's losses against DeepSpeed's, the relative
difference per step and its maximum, within bf16 tolerance or not (2%).
The JSON line gains "dtype", per model "wire_bytes_per_step" and
"zeroshard_vs_deepspeed_losses" (null without a DeepSpeed run). DeepSpeed
is skipped, with the reason printed, if its bf16 cannot run.

--identity-ab: what collective identities cost a training step (issue 13's
target: at most 2%), both sides in the same run. After the engines above,
each model runs zeroshard --ab-reps more times per side: identities on
(ZS_COLLECTIVE_CHECK_MS unset, its default) and off (ZS_COLLECTIVE_CHECK_MS=0,
the benchmarking switch), each side in its own launch, which side goes first
alternating rep by rep. Per rep the ratio of the two sides' median step
times (on/off); printed: each side's median, the median and quartiles
(nearest rank) of the per-rep ratios, and each rep's ratio; also in the
JSON line under "identity_ab". --ab-same makes both sides off: an A/A run
that shows the harness's own spread.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rss import peak_rss, rss_now

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
# fully_shard: the FSDP2 script with zeroshard.torch's fully_shard (one
# import changed), a stock torch AdamW stepping the engine's shards.
ENGINES = ("zeroshard", "ddp", "fsdp2", "fully_shard", "deepspeed")
WORKER_ENGINES = ENGINES


# ---------------------------------------------------------------------------
# worker: one engine, one model, one rank (launched by zsrun)
# ---------------------------------------------------------------------------

def steps_for(given, model):
    """(steps, warm-up) for `model`: the values given, else the defaults
    (the fine model's steps take about 15 ms: 40, so that the median is not
    six samples of a 2-core machine's noise)."""
    steps, warmup = (40, 8) if model == "fine" else (8, 2)
    return (steps if given[0] is None else given[0]), (warmup if given[1] is None else given[1])


def build_model(args):
    import torch.nn as nn
    import torch.nn.functional as F

    if args.model == "wide":
        class Wide(nn.Module):
            def __init__(self, width, depth):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

            def forward(self, x, y):
                for layer in self.layers:
                    x = x + F.gelu(layer(x))
                return F.mse_loss(x.float(), y.float())  # fp32: a no-op; bf16: the loss in fp32

        return Wide(args.wide_width, args.wide_depth)
    if args.model == "fine":
        class Fine(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

            def forward(self, x, y):
                for layer in self.layers:
                    x = x + 0.05 * layer(x).tanh()
                return F.mse_loss(x.float(), y.float())  # fp32: a no-op; bf16: the loss in fp32

        return Fine(args.fine_layers)
    gpt = load_gpt_example()
    return gpt.GPT(gpt_vocab(), args.gpt_dim, args.gpt_heads, args.gpt_layers, 64)


def blocks_of(model):
    """The repeated blocks --compile compiles one by one (torchtitan's recipe)."""
    return list(getattr(model, "blocks", None) or model.layers)


def load_gpt_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "python" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt_vocab():
    return len(set((REPO / "examples" / "python" / "data" / "corpus.txt").read_text()))


def batches(args, rank, world):
    """Every step's (x, y) for this rank: one global batch per step, drawn
    from the same generator for any engine, this rank's slice of it."""
    import torch
    gen = torch.Generator().manual_seed(1234)
    out = []
    if args.model == "gpt":
        text = (REPO / "examples" / "python" / "data" / "corpus.txt").read_text()
        chars = sorted(set(text))
        data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        ctx = 64
        for _ in range(args.steps):
            starts = torch.randint(0, len(data) - ctx - 1, (world * args.batch,), generator=gen)
            mine = starts[rank * args.batch:(rank + 1) * args.batch]
            out.append((torch.stack([data[s:s + ctx] for s in mine]),
                        torch.stack([data[s + 1:s + ctx + 1] for s in mine])))
        return out
    width = args.wide_width if args.model == "wide" else 8
    for _ in range(args.steps):
        x = torch.randn(world * args.batch, width, generator=gen)
        y = torch.randn(world * args.batch, width, generator=gen)
        out.append((x[rank * args.batch:(rank + 1) * args.batch].contiguous(),
                    y[rank * args.batch:(rank + 1) * args.batch].contiguous()))
    return out


def storage_bytes(tensors, seen):
    """Bytes of the storages behind `tensors` not already in `seen`."""
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_state_tensors(opt):
    import torch
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def torch_step(forward, opt):
    """One training step as DDP and zeroshard.torch run it: forward, backward, step."""
    def step(x, y):
        loss = forward(x, y)
        loss.backward()
        opt.step()
        return loss
    return step


WIRE_KINDS = ("gather", "reduce_scatter", "allreduce", "other")


class DeepSpeedTally:
    """The buffers DeepSpeed hands its comm backend (deepspeed.comm's cdb),
    by kind: the bytes of each all-gather's gathered buffer, each
    reduce-scatter's input, each all-reduce's tensor, in their dtypes, and
    what a ring would send per rank for them ((N-1)/N of the buffer for a
    gather or a reduce-scatter, 2(N-1)/N for an all-reduce; a broadcast:
    the tensor). Computed from sizes and dtypes, not counted on the wire
    (gloo's own algorithms may move other amounts)."""

    # Each wrapped method of the backend (deepspeed/comm/torch.py), its kind,
    # and the argument that holds the logical buffer, by name and position: a
    # gather's output, a reduce-scatter's input, an all-reduce's or a
    # broadcast's tensor(s).
    WRAPPED = {"all_gather_into_tensor": ("gather", "output_tensor", 0),
               "all_gather": ("gather", "tensor_list", 0),
               "all_gather_base": ("gather", "output_tensor", 0),
               "all_gather_coalesced": ("gather", "output_tensors", 0),
               "reduce_scatter_tensor": ("reduce_scatter", "input_tensor", 1),
               "reduce_scatter": ("reduce_scatter", "input_list", 1),
               "all_reduce": ("allreduce", "tensor", 0), "all_reduce_coalesced": ("allreduce", "tensors", 0),
               "broadcast": ("other", "tensor", 0), "reduce": ("other", "tensor", 0)}

    def __init__(self, world):
        from deepspeed.comm import comm
        self.world = world
        self.counts = {f"{k}_{what}": 0 for k in WIRE_KINDS for what in ("buffer_bytes", "bytes_sent", "calls")}
        self.dtypes = {k: set() for k in WIRE_KINDS}
        for name, spec in self.WRAPPED.items():
            original = getattr(comm.cdb, name, None)
            if original is not None:
                setattr(comm.cdb, name, self._wrap(original, *spec))

    def _wrap(self, original, kind, argument, position):
        def counted(*a, **kw):
            self._add(kind, kw[argument] if argument in kw else a[position] if len(a) > position else None)
            return original(*a, **kw)
        return counted

    def _add(self, kind, buffer):
        import torch
        buffer = [buffer] if torch.is_tensor(buffer) else [t for t in buffer or () if torch.is_tensor(t)]
        nbytes = sum(t.numel() * t.element_size() for t in buffer)
        share = (self.world - 1) / self.world
        sent = nbytes * (2 * share if kind == "allreduce" else share if kind != "other" else 1)
        self.counts[f"{kind}_buffer_bytes"] += nbytes
        self.counts[f"{kind}_bytes_sent"] += int(round(sent))
        self.counts[f"{kind}_calls"] += 1
        self.dtypes[kind].update(str(t.dtype).replace("torch.", "") for t in buffer)

    def snapshot(self):
        return dict(self.counts)


def fp32_draws_init(deepspeed):
    """deepspeed.zero.Init, but floating params drawn in fp32 and rounded to
    the config's dtype as each module's constructor returns, before they
    are partitioned: what zeroshard.torch.Init does. DeepSpeed's own makes
    its tensor constructors return bf16 tensors, so initialisers draw in
    bf16: another random stream (torch's bf16 uniform_ is not its fp32
    uniform_ rounded), and the engines would start from other weights."""
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    class Fp32DrawsInit(deepspeed.zero.Init):
        def __init__(self, **kw):
            super().__init__(tensor_overrides=[DeepSpeedTensorOverride.device], **kw)

        def _post_init_method(self, module):
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and not hasattr(p, "ds_id"):
                    p.data = p.data.to(self.dtype)
            super()._post_init_method(module)
    return Fp32DrawsInit


def autocast_bf16(forward):
    """DDP's bf16: its forward under torch.autocast, params and grads fp32."""
    import torch

    def run(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(x, y)
    return run


def fine_side_by_side(steps, warmup, fine_layers=200, batch=16):
    """In a launched worker: the fine model through torch DDP and through
    zeroshard.torch in one launch, step for step (which engine goes first
    alternates, a barrier starts each engine's step on both ranks), so
    both see the same moment of a shared machine's load, which separate
    launches do not (their ratio followed the load: 0.48-1.36x over five
    launches). Returns, alike on every rank, each step's time on the slower
    rank, the medians after `warmup` and their ratio, the losses, and the
    zeroshard step's collectives (reduce-scatters, gathers, bytes
    all-reduced). test_step_speed_guard runs it in CI; --side-by-side here."""
    import torch
    import torch.distributed as dist
    import zeroshard.torch as zt

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = argparse.Namespace(model="fine", fine_layers=fine_layers, steps=steps, batch=batch)
    data = batches(args, rank, world)
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    torch.manual_seed(0)
    plain = build_model(args)
    ddp = torch.nn.parallel.DistributedDataParallel(plain, gradient_as_bucket_view=True)
    ddp_opt = torch.optim.AdamW(plain.parameters(), fused=True, **hp)

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": batch}
    zt.init_context(config=config, device="cpu")
    torch.manual_seed(0)
    with zt.Init(config=config, device="cpu"):
        model = build_model(args)
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), kind="adamw", **hp)

    engines = {"ddp": (torch_step(ddp, ddp_opt), lambda: ddp_opt.zero_grad(set_to_none=True)),
               "zeroshard": (torch_step(model, opt), opt.zero_grad)}
    times = {e: [] for e in engines}
    losses = {e: [] for e in engines}
    reduce_scatters, gathers, allreduced = [], [], []
    for i, (x, y) in enumerate(data):
        for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
            step, zero_grad = engines[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = step(x, y)
            zero_grad()
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
        st = opt.step_stats()
        reduce_scatters.append(st["reduce_scatters"])
        gathers.append(st["gathers"])
        allreduced.append(st["allreduce_bytes"])
    slowest = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
    medians = {name: statistics.median(ts[warmup:]) for name, ts in slowest.items()}
    del model, opt
    zt.shutdown()
    return {"median_step_s": medians, "ratio": medians["zeroshard"] / medians["ddp"], "step_times_s": slowest,
            "losses": losses, "reduce_scatters": reduce_scatters[warmup:], "gathers": gathers[warmup:],
            "allreduce_bytes": allreduced[warmup:], "first_step_reduce_scatters": reduce_scatters[0],
            "steps": steps, "warmup": warmup}


def worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    hp = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    notes = {}
    bf16 = args.dtype == "bf16"
    wire_snapshot = None  # bf16 mode: the engine's wire counters (zeroshard) or DeepSpeedTally's
    if args.engine == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args, rank, world)
    if bf16 and args.engine != "ddp":
        # bf16.enabled casts the model, not its inputs: float inputs are the
        # script's to cast, under DeepSpeed as under zeroshard.
        data = [tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in xy) for xy in data]
    rss_before_model = rss_now()

    torch.manual_seed(0)
    if args.engine in ("fsdp2", "fully_shard"):
        from torch.distributed.device_mesh import init_device_mesh
        if args.engine == "fsdp2":
            import torch.distributed.fsdp as api
        else:
            import zeroshard.torch as api
        model = build_model(args)
        if args.compiled:
            for blk in blocks_of(model):
                blk.compile()  # before fully_shard: its hooks stay outside the graphs (torchtitan)
        mesh = init_device_mesh("cpu", (world,))
        mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        for blk in blocks_of(model):
            api.fully_shard(blk, mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), foreach=True, **hp)
        notes["optimizer"] = ("torch.optim.AdamW(foreach=True) on DTensor shards" if args.engine == "fsdp2" else
                              "torch.optim.AdamW(foreach=True) on the engine's shards")
        if bf16:
            notes["mixed_precision"] = "MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        step = torch_step(model, opt)

        def local(ts):
            return [t.to_local() if hasattr(t, "to_local") else t for t in ts if t is not None]

        def state_bytes():
            if args.engine == "fully_shard":
                m = api.get_context().memory()
                return m["shard_bytes"], m["grad_bytes"], m["optimizer_bytes"]
            seen = set()
            params = storage_bytes(local(model.parameters()), seen)
            grads = storage_bytes(local(p.grad for p in model.parameters()), seen)
            return params, grads, storage_bytes(local(optimizer_state_tensors(opt)), seen)

        def zero_grad():
            opt.zero_grad(set_to_none=True)
        step_breakdown = None
    elif args.engine == "ddp":
        model = build_model(args)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)
        notes["optimizer"] = "torch.optim.AdamW(fused=True)"

        step = torch_step(autocast_bf16(ddp) if bf16 else ddp, opt)
        if bf16:
            notes["mixed_precision"] = "torch.autocast('cpu', dtype=torch.bfloat16) over the forward"
            notes["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")

        def state_bytes():
            seen = set()
            params = storage_bytes(list(model.parameters()), seen)
            grads = storage_bytes([p.grad for p in model.parameters()], seen)
            return params, grads, storage_bytes(optimizer_state_tensors(opt), seen)

        def zero_grad():
            opt.zero_grad(set_to_none=True)
    elif args.engine == "zeroshard":
        import zeroshard.torch as zt
        config = {"zero_optimization": {"stage": 3, **json.loads(args.zs_config)},
                  "train_micro_batch_size_per_gpu": args.batch}
        if bf16:
            config["bf16"] = {"enabled": True}
        zt.init_context(config=config, device="cpu")
        with zt.Init(config=config, device="cpu"):
            model = build_model(args)
        if args.compiled:
            for blk in blocks_of(model):
                blk.compile()  # the same recipe as FSDP2's: the engine's hooks are graph breaks around them
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), kind="adamw", **hp)
        notes["optimizer"] = "ZeroShardOptimizer(kind='adamw')"
        notes["ZS_COLLECTIVE_CHECK_MS"] = os.environ.get("ZS_COLLECTIVE_CHECK_MS", "unset")
        if bf16:
            notes["mixed_precision"] = "bf16.enabled"
            notes["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
            wire_snapshot = lambda: {k: v for k, v in opt.wire_stats().items() if k != "size"}  # noqa: E731

        step = torch_step(model, opt)

        def state_bytes():
            m = zt.get_context().memory()
            notes["host_cache_bytes"] = m["host_cache_bytes"]
            notes["peak_gathered_bytes"] = m["peak_gathered_bytes"]
            return m["shard_bytes"], m["grad_bytes"], m["optimizer_bytes"]

        def step_breakdown():
            """Where the last step's time went (zs_context_step_stats)."""
            st = opt.step_stats()
            c = zt.get_context().coord_stats()  # counters since the run began
            notes["coordinator"] = {k: c[k] for k in ("steps", "demand_fetches", "prefetches",
                                                      "blocked_waits", "reuse_hits", "kept_for_reuse")}
            return {k: round(st[k], 4) for k in ("step_seconds", "gather_seconds", "reduce_scatter_seconds",
                                                  "allreduce_seconds", "wait_seconds", "optimizer_seconds")}

        def zero_grad():
            opt.zero_grad()
    else:
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 9,
                  "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
        if bf16:
            config["bf16"] = {"enabled": True}
        if bf16 and not args.ds_own_init:
            with fp32_draws_init(deepspeed)(config_dict_or_path=config):
                model = build_model(args)
            notes["initial_values"] = "drawn in fp32, rounded to bf16 (as zeroshard)"
        else:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = build_model(args)
            if bf16:
                notes["initial_values"] = "drawn in bf16 (DeepSpeed's zero.Init)"
        opt = None
        if args.ds_optimizer in ("auto", "cpuadam"):
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                opt = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **hp)
                notes["optimizer"] = "DeepSpeedCPUAdam(adamw_mode=True)"
            except Exception as e:  # the JIT build failed
                if args.ds_optimizer == "cpuadam":
                    raise
                notes["cpuadam_error"] = f"{type(e).__name__}: {e}"[:300]
        if opt is None:
            opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)
            notes["optimizer"] = "torch.optim.AdamW(fused=True)"
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        if bf16:
            notes["mixed_precision"] = "bf16.enabled"
            notes["param_dtype"] = str(next(model.parameters()).ds_tensor.dtype).replace("torch.", "")
            notes["communication_data_type"] = str(engine.communication_data_type).replace("torch.", "")
            # What its gathers have to fetch: the params above
            # stage3_param_persistence_threshold (the rest stay whole).
            notes["gathered_params"] = sum(p.ds_numel for p in model.parameters() if not p.ds_persist)
            tally = DeepSpeedTally(world)
            wire_snapshot = tally.snapshot

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

        def state_bytes():
            z = engine.optimizer
            seen = set()
            params = storage_bytes([p.ds_tensor for p in model.parameters()], seen)
            grads = storage_bytes([getattr(z, "grad_partitions_flat_buffer", None)], seen)
            state = storage_bytes(list(z.fp32_partitioned_groups_flat) + optimizer_state_tensors(z.optimizer),
                                  seen)
            return params, grads, state

        def zero_grad():
            pass  # engine.step() zeroes them

        step_breakdown = None

    rss_after_build = rss_now()
    nparams = sum(math.prod(p.ds_shape) if hasattr(p, "ds_shape") else
                  (math.prod(p.zs.shape) if getattr(p, "zs", None) is not None else p.numel())
                  for p in model.parameters())
    losses, times, state = [], [], None
    wire_steps, wire_prev = [], wire_snapshot() if wire_snapshot else None
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        loss = step(x, y)
        if state is None:
            state = state_bytes()  # after the first step: every grad and moment exists
        zero_grad()
        times.append(time.perf_counter() - t0)
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        if wire_snapshot:
            # Everything the engine moved from this step's start to the next
            # one's (a prefetch for the next step falls in this one).
            now = wire_snapshot()
            wire_steps.append({k: now[k] - wire_prev[k] for k in now})
            wire_prev = now
        if rank == 0:
            print(f"  {args.engine:9s} {args.model} step {i:3d}  loss {losses[-1]:.6f}  "
                  f"{times[-1] * 1e3:8.1f} ms", file=sys.stderr, flush=True)
    if args.engine == "zeroshard":
        notes["last_step"] = step_breakdown()
    mine = {"rank": rank, "param_bytes": state[0], "grad_bytes": state[1], "optimizer_bytes": state[2],
            "rss_before_model_bytes": rss_before_model, "rss_after_build_bytes": rss_after_build,
            "peak_rss_bytes": peak_rss(), "median_step_s": statistics.median(times[args.warmup:]),
            "first_step_s": times[0],
            "notes": notes}
    if bf16:
        mine["wire_per_step"] = wire_steps
        if args.engine == "deepspeed":
            notes["wire_dtypes"] = {k: sorted(v) for k, v in tally.dtypes.items() if v}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print(json.dumps({"engine": args.engine, "compiled": args.compiled, "model": args.model, "ranks": world,
                          "params": nparams, "first_step_s": max(r["first_step_s"] for r in everyone),
                          "losses": losses, "step_times_s": times,
                          "median_step_s": max(r["median_step_s"] for r in everyone),
                          "per_rank": everyone}), flush=True)
    dist.barrier()
    if args.engine == "deepspeed":
        # DeepSpeed's CPU engine can abort in its teardown ("terminate called
        # without an active exception") once everything is measured.
        sys.stdout.flush()
        os._exit(0)
    if args.engine == "zeroshard":
        del model, opt
        zt.shutdown()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def worker_env(ranks, threads=None):
    """The environment of a zsrun launch of this file's workers: the
    in-tree package and library, and `threads` kernel threads per rank
    (default: the cores shared out among the ranks) unless set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    env.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("ZS_NUM_THREADS", env["OMP_NUM_THREADS"])
    return env


def launch(args, model, engine, identities=None, compiled=False):
    """identities: None leaves ZS_COLLECTIVE_CHECK_MS as the environment has
    it; True unsets it (identities on, at the engine's default) unless it
    holds a non-zero value; False sets it to 0 (off)."""
    env = worker_env(args.ranks)
    if identities is True and env.get("ZS_COLLECTIVE_CHECK_MS", "").strip() in ("0", ""):
        env.pop("ZS_COLLECTIVE_CHECK_MS", None)
    elif identities is False:
        env["ZS_COLLECTIVE_CHECK_MS"] = "0"
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix", "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine, "--model", model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--lr", str(args.lr), "--wide-width", str(args.wide_width), "--wide-depth", str(args.wide_depth),
           "--fine-layers", str(args.fine_layers), "--ds-optimizer", args.ds_optimizer,
           "--zs-config", args.zs_config, "--dtype", args.dtype, "--gpt-dim", str(args.gpt_dim),
           "--gpt-layers", str(args.gpt_layers), "--gpt-heads", str(args.gpt_heads)]
    if compiled:
        cmd.append("--compiled")
    if args.ds_own_init:
        cmd.append("--ds-own-init")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - t0
    found = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not found:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-25:])
        return None, f"exit status {out.returncode}:\n{tail}"
    r = json.loads(found[-1])
    r["launch_wall_s"] = wall
    r["exit_status"] = out.returncode  # non-zero: it failed after reporting (at teardown)
    if out.returncode != 0:
        print(f"[{model}] {engine} exited {out.returncode} after reporting; its output ended:\n"
              + "\n".join(out.stderr.splitlines()[-3:]), flush=True)
    return r, None


def tree():
    """The commit measured, and the engine files changed in the work tree
    (others may be editing the checkout while the bench runs)."""
    def git(*a):
        out = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False)
        return out.stdout.rstrip("\n")  # not strip(): porcelain lines begin with a status column
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "bindings", "impl", "kernels", "capi",
                                      "examples").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "changed_files": dirty}


def state_of(r):
    return max(p["param_bytes"] + p["grad_bytes"] + p["optimizer_bytes"] for p in r["per_rank"])


def peak_of(r):
    return max(p["peak_rss_bytes"] for p in r["per_rank"])


def describe(r):
    pr = r["per_rank"]
    s = state_of(r)
    return (f"step {r['median_step_s'] * 1e3:9.1f} ms | params+grads+optim/rank {s / MIB:8.1f} MiB "
            f"({max(p['param_bytes'] for p in pr) / MIB:.1f} + {max(p['grad_bytes'] for p in pr) / MIB:.1f} + "
            f"{max(p['optimizer_bytes'] for p in pr) / MIB:.1f}) | peak RSS/rank "
            + " ".join(f"{p['peak_rss_bytes'] / MIB:.0f}" for p in pr)
            + f" MiB (before model {max(p['rss_before_model_bytes'] for p in pr) / MIB:.0f}) "
            f"| final loss {r['losses'][-1]:.6f}")


BF16_LOSS_TOLERANCE = 0.02  # relative, per step: zeroshard's bf16 losses against DeepSpeed's


def wire_medians(r, args):
    """Per kind, the median over the steps after --warmup of each rank's
    per-step wire figures (bf16 mode), the larger rank's."""
    out = {}
    for p in r["per_rank"]:
        steps = p["wire_per_step"][args.warmup:]
        for k in steps[0]:
            out[k] = max(out.get(k, 0), statistics.median(s[k] for s in steps))
    return out


def wire_of(engine, r, args):
    """bf16 mode: bytes on the wire per step and rank, how they were had,
    and the figures they are checked against (P = params, N = ranks)."""
    n, params = args.ranks, r["params"]
    share = (n - 1) / n
    notes = r["per_rank"][0]["notes"]
    if engine == "ddp":
        grad_bytes = 4 if notes.get("param_dtype") == "float32" else 2
        sent = params * grad_bytes * 2 * share
        return {"how": f"computed, not counted: the gradient all-reduce of a ring, P x {grad_bytes} B "
                       f"({notes.get('param_dtype')} grads: autocast leaves params and grads fp32) x 2(N-1)/N",
                "allreduce_bytes_sent": sent, "allreduce_bytes_received": sent,
                "total_bytes_sent": sent, "total_bytes_received": sent}
    m = wire_medians(r, args)
    rs_fp32 = params * 4 * share  # what fp32 gradients would send through a reduce-scatter
    if engine == "zeroshard":
        out = {"how": "counted: optimizer.wire_stats() deltas per step (sent and received by this rank)"}
        out.update({k: m[k] for k in sorted(m) if k.endswith(("_sent", "_received"))})
        out["total_bytes_sent"] = sum(v for k, v in m.items() if k.endswith("_bytes_sent"))
        out["total_bytes_received"] = sum(v for k, v in m.items() if k.endswith("_bytes_received"))
        out["full_bf16_gathers"] = m["gather_bytes_received"] / (params * 2 * share)
    else:
        out = {"how": "computed, not counted: the bytes of the buffers DeepSpeed hands its comm backend per "
                      "step, in their dtypes, as a ring sends them per rank ((N-1)/N of a gather's or a "
                      "reduce-scatter's buffer, 2(N-1)/N of an all-reduce's)",
               "dtypes": notes.get("wire_dtypes"), "communication_data_type": notes.get("communication_data_type")}
        out.update({k: m[k] for k in sorted(m)})
        out["total_bytes_sent"] = sum(v for k, v in m.items() if k.endswith("_bytes_sent"))
        gathered = notes.get("gathered_params") or params
        out["full_bf16_gathers"] = m["gather_buffer_bytes"] / (gathered * 2)
        out["gathered_params"] = gathered
    out["reduce_scatter_over_fp32_grads"] = m["reduce_scatter_bytes_sent"] / rs_fp32
    out["bf16_grads_reduce_scatter_bytes"] = params * 2 * share
    out["fp32_grads_reduce_scatter_bytes"] = rs_fp32
    return out


def describe_wire(engine, w):
    mib = lambda k: f"{w.get(k, 0) / MIB:.1f}"  # noqa: E731
    if engine == "ddp":
        return f"{w['how']} = {mib('allreduce_bytes_sent')} MiB"
    rs = (f"reduce-scatter {mib('reduce_scatter_bytes_sent')} MiB (x{w['reduce_scatter_over_fp32_grads']:.2f} "
          f"of fp32 grads' P x 4 B x (N-1)/N = {w['fp32_grads_reduce_scatter_bytes'] / MIB:.1f} MiB; bf16's: "
          f"{w['bf16_grads_reduce_scatter_bytes'] / MIB:.1f} MiB)")
    if engine == "zeroshard":
        quantized = sum(v for k, v in w.items() if k.startswith("quantized_") and k.endswith("_sent"))
        return (f"{w['how']}: gather {mib('gather_bytes_sent')} MiB sent, {mib('gather_bytes_received')} MiB "
                f"received ({w['full_bf16_gathers']:.2f} bf16 gathers of the whole model), {rs}, all-reduce "
                f"{mib('allreduce_bytes_sent')} MiB, other {mib('other_bytes_sent')} MiB"
                + (f", quantized {quantized / MIB:.1f} MiB" if quantized else "")
                + f"; total {mib('total_bytes_sent')} MiB sent, {mib('total_bytes_received')} MiB received")
    dtypes = w.get("dtypes") or {}
    return (f"{w['how']}: gather {mib('gather_bytes_sent')} MiB ({'/'.join(dtypes.get('gather', []))}, "
            f"{w['gather_calls']:.0f} calls, {w['full_bf16_gathers']:.2f} bf16 gathers of its "
            f"{w['gathered_params'] / 1e6:.1f}M gathered params), {rs} "
            f"[{'/'.join(dtypes.get('reduce_scatter', []))}, {w['reduce_scatter_calls']:.0f} calls], all-reduce "
            f"{mib('allreduce_bytes_sent')} MiB, other {mib('other_bytes_sent')} MiB; total "
            f"{mib('total_bytes_sent')} MiB sent")


def bf16_report(args, model, results, row):
    """bf16 mode: wire bytes, loss curves, zeroshard's losses against DeepSpeed's."""
    n = args.ranks
    print(f"[{model}] bytes on the wire per step, per rank, median of the steps after warm-up (the larger "
          f"rank; P = {results['zeroshard']['params'] / 1e6:.1f}M params, N = {n}):", flush=True)
    row["wire_bytes_per_step"] = {}
    for engine, r in results.items():
        w = wire_of(engine, r, args)
        row["wire_bytes_per_step"][engine] = w
        print(f"[{model}]   {engine:9s} {describe_wire(engine, w)}", flush=True)
    for engine, r in results.items():
        print(f"[{model}] loss curve {engine:9s} " + " ".join(f"{v:.5f}" for v in r["losses"]), flush=True)
    ds = results.get("deepspeed")
    if ds is None:
        print(f"[{model}] zeroshard vs deepspeed losses: no DeepSpeed run to compare with", flush=True)
        row["zeroshard_vs_deepspeed_losses"] = None
        return
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(results["zeroshard"]["losses"], ds["losses"])]
    worst = max(rel)
    within = worst <= BF16_LOSS_TOLERANCE
    row["zeroshard_vs_deepspeed_losses"] = {"rel_diff_per_step": rel, "max_rel_diff": worst,
                                            "tolerance": BF16_LOSS_TOLERANCE, "within_tolerance": within}
    print(f"[{model}] zeroshard vs deepspeed losses (both bf16): relative difference per step "
          + " ".join(f"{v:.2e}" for v in rel) + f"; max {worst:.2e}: "
          + (f"within bf16 tolerance ({BF16_LOSS_TOLERANCE:.0%})" if within
             else f"OUTSIDE bf16 tolerance ({BF16_LOSS_TOLERANCE:.0%})"), flush=True)


def nearest_rank(values, q):
    """The q-quantile by nearest rank, as bench_collective_identity reports."""
    v = sorted(values)
    return v[int(q * (len(v) - 1) + 0.5)]


def identity_ab(args, model):
    """zeroshard with identities on and off (or off and off, --ab-same), each
    side in its own launch, --ab-reps times, which side goes first
    alternating; returns the summary for the JSON line."""
    sides = ("on", "off")
    setting = {"on": not args.ab_same, "off": False}
    times = {side: [] for side in sides}
    ratios, orders, losses_agree, ran_with = [], [], [], {}
    for rep in range(args.ab_reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        got = {}
        for side in order:
            r, why = launch(args, model, "zeroshard", identities=setting[side])
            if r is None:
                sys.exit(f"bench_torch_step: zeroshard ({side} side of --identity-ab) on the {model} "
                         f"model failed: {why}")
            ran = r["per_rank"][0]["notes"].get("ZS_COLLECTIVE_CHECK_MS")
            if (ran == "0") != (not setting[side]):
                sys.exit(f"bench_torch_step: the {side} side of --identity-ab ran with "
                         f"ZS_COLLECTIVE_CHECK_MS={ran}")
            got[side] = r
            ran_with[side] = ran
        for side in sides:
            times[side].append(got[side]["median_step_s"])
        ratio = got["on"]["median_step_s"] / got["off"]["median_step_s"]
        ratios.append(ratio)
        orders.append("/".join(order))
        losses_agree.append(got["on"]["losses"] == got["off"]["losses"])
        print(f"[{model}] identity {'A/A' if args.ab_same else 'A/B'} rep {rep}: {orders[-1]} first; step on "
              f"{got['on']['median_step_s'] * 1e3:.1f} ms, off {got['off']['median_step_s'] * 1e3:.1f} ms, "
              f"on/off {ratio:.4f}; losses {'bitwise equal' if losses_agree[-1] else 'DIFFER'}",
              flush=True)
    out = {"reps": args.ab_reps, "same": args.ab_same,
           "ZS_COLLECTIVE_CHECK_MS": ran_with,
           "on_median_step_s": statistics.median(times["on"]),
           "off_median_step_s": statistics.median(times["off"]),
           "on_step_s": times["on"], "off_step_s": times["off"], "order": orders,
           "ratios": ratios, "median_ratio": statistics.median(ratios),
           "ratio_q1": nearest_rank(ratios, 0.25), "ratio_q3": nearest_rank(ratios, 0.75),
           "losses_bitwise_equal": all(losses_agree)}
    print(f"[{model}] identities {'off/off (A/A)' if args.ab_same else 'on/off'}: step "
          f"{out['on_median_step_s'] * 1e3:.1f} vs {out['off_median_step_s'] * 1e3:.1f} ms (medians); per-rep "
          f"ratio median {out['median_ratio']:.4f}, quartiles {out['ratio_q1']:.4f} {out['ratio_q3']:.4f} "
          f"over {args.ab_reps} reps; each: " + " ".join(f"{x:.3f}" for x in ratios), flush=True)
    return out


def side_by_side(args, given):
    """--side-by-side: fine_side_by_side in --launches launches; each
    launch's median step of both engines and their ratio, then min, median
    and max of the ratios, and one JSON line."""
    steps, warmup = steps_for(given, "fine")
    where = tree()
    print(f"bench_torch_step --side-by-side: the fine model ({args.fine_layers} x nn.Linear(8, 8)), {args.ranks} "
          f"ranks, DDP and zeroshard step for step in one launch, {steps} steps ({warmup} warm-up) each, "
          f"{args.launches} launches; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; commit "
          f"{where['commit']}", flush=True)
    env = worker_env(args.ranks, threads=1)
    runs = []
    for i in range(args.launches):
        cmd = [str(REPO / "build" / "bin" / "zsrun"), "-n", str(args.ranks), "--no-prefix", "--", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--side-by-side", "--models", "fine", "--steps",
               str(steps), "--warmup", str(warmup), "--fine-layers", str(args.fine_layers), "--batch",
               str(args.batch)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = [line for line in out.stdout.splitlines() if line.startswith("SIDE_BY_SIDE ")]
        if not found:
            sys.exit(f"bench_torch_step --side-by-side: launch {i} failed (exit {out.returncode}):\n"
                     + (out.stdout + out.stderr)[-3000:])
        r = json.loads(found[-1][len("SIDE_BY_SIDE "):])
        runs.append(r)
        worst = max(abs(a - b) for a, b in zip(r["losses"]["ddp"], r["losses"]["zeroshard"]))
        print(f"[fine] launch {i}: zeroshard {r['median_step_s']['zeroshard'] * 1e3:.1f} ms, DDP "
              f"{r['median_step_s']['ddp'] * 1e3:.1f} ms (medians over the slower rank): x{r['ratio']:.2f}; "
              f"reduce-scatters a step {max(r['reduce_scatters'])}, bytes all-reduced {max(r['allreduce_bytes'])}; "
              f"losses agree to {worst:.2e}", flush=True)
    ratios = sorted(r["ratio"] for r in runs)
    print(f"[fine] zeroshard/ddp over {len(runs)} launches: min x{ratios[0]:.2f}, median "
          f"x{statistics.median(ratios):.2f}, max x{ratios[-1]:.2f} (target <= 1.1 in every launch)", flush=True)
    print(json.dumps({"bench": "torch_step_side_by_side", "ranks": args.ranks, "steps": steps, "warmup": warmup,
                      "fine_layers": args.fine_layers, "launches": args.launches, "tree": where,
                      "load_average_end": os.getloadavg()[0], "ratios": [r["ratio"] for r in runs],
                      "median_step_s": [r["median_step_s"] for r in runs],
                      "ratio_min": ratios[0], "ratio_median": statistics.median(ratios), "ratio_max": ratios[-1]}))
    return 0


def compile_side_by_side(args, where):
    """--compile: zeroshard and FSDP2, eager and compiled, one launch each."""
    summary = []
    for model in args.models:
        runs = {}
        for engine in ("zeroshard", "fsdp2"):
            for compiled in (False, True):
                r, why = launch(args, model, engine, compiled=compiled)
                name = f"{engine}{' compiled' if compiled else ''}"
                if r is None:
                    sys.exit(f"bench_torch_step: {name} on the {model} model failed: {why}")
                runs[name] = r
                # The first step's time beyond a steady step: compilation
                # (and, eager, first-touch allocation).
                print(f"[{model}] {name:18s} {describe(r)}  first step {r['first_step_s']:.2f} s "
                      f"(compile and warm-up {r['first_step_s'] - r['median_step_s']:.2f} s)", flush=True)
        ref = runs["zeroshard"]["losses"]
        row = {"model": model, "params": runs["zeroshard"]["params"], "ranks": args.ranks,
               "runs": {k: {"median_step_s": r["median_step_s"], "first_step_s": r["first_step_s"],
                            "peak_rss_bytes_per_rank": [p["peak_rss_bytes"] for p in r["per_rank"]],
                            "max_loss_rel_diff_vs_zeroshard_eager":
                                max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ref)),
                            "losses": r["losses"]} for k, r in runs.items()}}
        ratios = {}
        for a, b in (("zeroshard compiled", "zeroshard"), ("fsdp2 compiled", "fsdp2"),
                     ("zeroshard compiled", "fsdp2 compiled"), ("zeroshard", "fsdp2")):
            ratios[f"{a} / {b}"] = {"step_time": runs[a]["median_step_s"] / runs[b]["median_step_s"],
                                    "peak_rss": peak_of(runs[a]) / peak_of(runs[b])}
            print(f"[{model}] {a} / {b}: step time x{ratios[f'{a} / {b}']['step_time']:.2f}, "
                  f"peak RSS x{ratios[f'{a} / {b}']['peak_rss']:.2f}", flush=True)
        for k, r in row["runs"].items():
            print(f"[{model}] {k:18s} losses agree with zeroshard eager to "
                  f"{r['max_loss_rel_diff_vs_zeroshard_eager']:.2e} rel", flush=True)
        row["ratios"] = ratios
        summary.append(row)
    print("targets (not asserted): zeroshard compiled <= 0.9x zeroshard eager, and faster than FSDP2 "
          "compiled. Figures are from whatever else the machine was running.", flush=True)
    print(json.dumps({"bench": "torch_step_compile", "ranks": args.ranks, "steps": args.steps,
                      "warmup": args.warmup, "gpt": {"dim": args.gpt_dim, "layers": args.gpt_layers,
                                                     "heads": args.gpt_heads},
                      "cores": os.cpu_count(), "load_average_end": os.getloadavg()[0], "tree": where,
                      "targets": {"zeroshard_compiled_over_eager": 0.9,
                                  "zeroshard_compiled_over_fsdp2_compiled": 1.0},
                      "results": summary}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=WORKER_ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=["wide", "fine", "gpt"], help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=["wide", "fine", "gpt"], default=["wide", "fine"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per engine (default 8; the fine model 40, whose 15 ms steps need more than six "
                         "to give a median steadier than the machine's noise)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 2; fine 8)")
    ap.add_argument("--batch", type=int, default=16, help="rows (sequences for gpt) per rank")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--wide-width", type=int, default=4096)
    ap.add_argument("--wide-depth", type=int, default=7)
    ap.add_argument("--fine-layers", type=int, default=200)
    ap.add_argument("--ds-optimizer", choices=["auto", "cpuadam", "torch"], default="auto")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: zeroshard and DeepSpeed with bf16.enabled, DDP under torch.autocast")
    ap.add_argument("--ds-own-init", action="store_true",
                    help="--dtype bf16: leave DeepSpeed's zero.Init drawing initial values in bf16 "
                         "(default: drawn in fp32 and rounded, as zeroshard, so the engines start alike)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="zeroshard and FSDP2, each eager and with every block compiled (block.compile() before "
                         "partitioning / fully_shard), instead of the engines side by side")
    ap.add_argument("--gpt-dim", type=int, default=128)
    ap.add_argument("--gpt-layers", type=int, default=4)
    ap.add_argument("--gpt-heads", type=int, default=4)
    ap.add_argument("--zs-config", default="{}",
                    help='more zero_optimization keys for zeroshard only, as JSON: \'{"reduce_bucket_size": 2e7}\'')
    ap.add_argument("--side-by-side", action="store_true",
                    help="the fine model through DDP and zeroshard in one launch, step for step (fine_side_by_side), "
                         "--launches times, instead of each engine in its own launch")
    ap.add_argument("--launches", type=int, default=5, help="launches of --side-by-side")
    ap.add_argument("--identity-ab", action="store_true",
                    help="also run zeroshard with collective identities on and off, --ab-reps times each")
    ap.add_argument("--ab-reps", type=int, default=5, help="reps per side of --identity-ab")
    ap.add_argument("--ab-same", action="store_true",
                    help="--identity-ab with both sides off: the A/A control")
    args = ap.parse_args()
    given = (args.steps, args.warmup)
    args.steps, args.warmup = steps_for(given, args.models[0] if len(args.models) == 1 else None)
    if args.worker and args.side_by_side:
        r = fine_side_by_side(args.steps, args.warmup, args.fine_layers, args.batch)
        if int(os.environ.get("RANK", "0")) == 0:
            print("SIDE_BY_SIDE " + json.dumps(r), flush=True)
        return 0
    if args.worker:
        return worker(args)
    if args.side_by_side:
        return side_by_side(args, given)
    for model in args.models:
        steps, warmup = steps_for(given, model)
        if steps <= warmup:
            ap.error(f"--steps must exceed --warmup ({steps} <= {warmup} for the {model} model)")
    if args.ab_reps < 1:
        ap.error("--ab-reps must be at least 1")
    if args.ab_same and not args.identity_ab:
        ap.error("--ab-same goes with --identity-ab")
    if args.ds_own_init and args.dtype != "bf16":
        ap.error("--ds-own-init goes with --dtype bf16")

    where = tree()
    plan = {m: steps_for(given, m) for m in args.models}
    print(f"bench_torch_step: {args.ranks} ranks, "
          f"{'; '.join(f'{m} {s} steps ({w} warm-up)' for m, (s, w) in plan.items())}, "
          f"{os.environ.get('OMP_NUM_THREADS', max(1, (os.cpu_count() or 1) // args.ranks))} kernel thread(s) "
          f"per rank, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; commit {where['commit']}"
          f"{' with ' + str(len(where['changed_files'])) + ' engine/binding files changed' if where['changed_files'] else ''}"
          ". Each engine runs in its own launch.", flush=True)
    if args.dtype == "bf16":
        print("dtype bf16: zeroshard and DeepSpeed with \"bf16\": {\"enabled\": true} (bf16 params, fp32 "
              "masters, inputs cast to bf16), DDP with torch.autocast(\"cpu\", dtype=torch.bfloat16) over the "
              "forward (fp32 params). Initial values: drawn in fp32 by every engine, rounded to bf16 by "
              "zeroshard and DeepSpeed" + (" (DeepSpeed: --ds-own-init, its zero.Init's own bf16 draws)"
                                           if args.ds_own_init else "")
              + "; losses computed in fp32 from the bf16 activations.", flush=True)
    if args.compile:
        return compile_side_by_side(args, where)
    summary = []
    for model in args.models:
        args.steps, args.warmup = steps_for(given, model)
        results, skipped = {}, {}
        for engine in ENGINES:
            if engine == "deepspeed" and args.no_deepspeed:
                skipped[engine] = "--no-deepspeed"
                continue
            r, why = launch(args, model, engine)
            if r is None:
                if engine != "deepspeed":
                    sys.exit(f"bench_torch_step: {engine} on the {model} model failed: {why}")
                skipped[engine] = why
                print(f"[{model}] deepspeed skipped{' (bf16)' if args.dtype == 'bf16' else ''}: it could not start "
                      f"({why.splitlines()[0]}); its output "
                      f"ended:\n{why}", flush=True)
                continue
            results[engine] = r
            note = r["per_rank"][0]["notes"].get("optimizer", "")
            print(f"[{model}] {engine:9s} {describe(r)}  [{note}]", flush=True)
        zs, ddp, ds = results["zeroshard"], results["ddp"], results.get("deepspeed")
        if "fully_shard" in results and "fsdp2" in results:
            a, b = results["fully_shard"], results["fsdp2"]
            row_fs = {"step_time": a["median_step_s"] / b["median_step_s"], "peak_rss": peak_of(a) / peak_of(b),
                      "max_loss_rel_diff": max(abs(x - y) / max(abs(y), 1e-30)
                                               for x, y in zip(a["losses"], b["losses"]))}
            print(f"[{model}] fully_shard/fsdp2 (the same script, one import changed): step time "
                  f"x{row_fs['step_time']:.2f}, peak RSS x{row_fs['peak_rss']:.2f}; losses agree to "
                  f"{row_fs['max_loss_rel_diff']:.2e} rel", flush=True)
        row = {"model": model, "params": zs["params"], "ranks": args.ranks,
               "engines": {e: {"median_step_s": r["median_step_s"], "state_bytes_per_rank": state_of(r),
                               "peak_rss_bytes_per_rank": [p["peak_rss_bytes"] for p in r["per_rank"]],
                               "rss_before_model_bytes": [p["rss_before_model_bytes"] for p in r["per_rank"]],
                               "param_bytes": max(p["param_bytes"] for p in r["per_rank"]),
                               "grad_bytes": max(p["grad_bytes"] for p in r["per_rank"]),
                               "optimizer_bytes": max(p["optimizer_bytes"] for p in r["per_rank"]),
                               "optimizer": r["per_rank"][0]["notes"].get("optimizer"),
                               "notes": r["per_rank"][0]["notes"],
                               "losses": r["losses"], "final_loss": r["losses"][-1]}
                           for e, r in results.items()},
               "skipped": skipped}
        if "fully_shard" in results and "fsdp2" in results:
            row["fully_shard_over_fsdp2"] = row_fs
        for other_name, other in (("ddp", ddp), ("fsdp2", results.get("fsdp2")), ("deepspeed", ds)):
            if other is None:
                continue
            diff = max(abs(a - b) for a, b in zip(zs["losses"], other["losses"]))
            rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(zs["losses"], other["losses"]))
            ratios = {"step_time": zs["median_step_s"] / other["median_step_s"],
                      "state_bytes": state_of(zs) / state_of(other),
                      "peak_rss": peak_of(zs) / peak_of(other),
                      "max_loss_abs_diff": diff, "max_loss_rel_diff": rel}
            row[f"zeroshard_over_{other_name}"] = ratios
            print(f"[{model}] zeroshard/{other_name}: step time x{ratios['step_time']:.2f}, "
                  f"params+grads+optim x{ratios['state_bytes']:.3f}, peak RSS x{ratios['peak_rss']:.2f}; "
                  f"losses agree to {diff:.2e} abs ({rel:.2e} rel, worst of {len(zs['losses'])} steps)",
                  flush=True)
        if args.dtype == "bf16":
            bf16_report(args, model, results, row)
        if args.identity_ab:
            row["identity_ab"] = identity_ab(args, model)
        summary.append(row)
    print("targets (not asserted): step <= 1.1x DDP, <= DeepSpeed and <= 0.8x FSDP2; peak RSS <= 0.6x DDP on the "
          "wide model and <= 0.7x FSDP2"
          + ("; identities on/off <= 1.02" if args.identity_ab else "")
          + ". Figures are from whatever else the machine was running.", flush=True)
    targets = {"step_over_ddp": 1.1, "step_over_deepspeed": 1.0, "peak_rss_over_ddp_wide": 0.6,
               "step_over_fsdp2": 0.8, "peak_rss_over_fsdp2": 0.7}
    if args.identity_ab:
        targets["identities_on_over_off"] = 1.02
    head = {"bench": "torch_step", "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
            "steps_per_model": {m: {"steps": s, "warmup": w} for m, (s, w) in plan.items()}}
    if args.dtype == "bf16":
        head["dtype"] = "bf16"  # fp32 runs keep the JSON they always had
        targets["zeroshard_vs_deepspeed_loss_rel_diff"] = BF16_LOSS_TOLERANCE
    print(json.dumps({**head, "zs_config": json.loads(args.zs_config),
                      "cores": os.cpu_count(), "load_average_end": os.getloadavg()[0], "tree": where,
                      "targets": targets, "results": summary}))


if __name__ == "__main__":
    sys.exit(main())
