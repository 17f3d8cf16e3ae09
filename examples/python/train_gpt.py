"""Train a small character-level GPT with zeroshard (or torch DDP, to compare).

    build/bin/zsrun -n 4 -- .venv/bin/python examples/python/train_gpt.py [--steps 60] [--ddp]
        [--log-every 10] [--plot build/demo/training.png]
    build/bin/zsrun -n 1 -- .venv/bin/python examples/python/train_gpt.py --device cuda

Each rank trains on its own slice of every batch. Rank 0 prints loss and
tokens/s as it goes, then each rank's memory: the engine's shards (params,
gradients, AdamW state) and the process's peak RSS, next to what DDP would
hold on every rank (params + gradients + AdamW state, unsharded: 16 bytes
per param). The last line is one JSON object with the final loss, every
step's loss and time, and each rank's memory. --plot writes a PNG (loss per
step, each rank's RSS per step, each rank's shards against DDP's) and prints
its path. Set PYTHONPATH=bindings/python and
ZEROSHARD_LIBRARY=build/lib/libzeroshard.so when running from a source checkout.

--offload-dir DIR keeps parameter shards and optimizer state on NVMe (one
swap file per rank and kind under DIR; offload_param and offload_optimizer
"nvme"), --max-in-cpu and --sub-group-size set their cache and sub-group
sizes, --checkpoint-activations recomputes each block's forward in backward
(torch.utils.checkpoint), and --config-json merges more DeepSpeed keys into
the config. scripts/big_model_demo.sh uses them to train a model whose
training state is twice this machine's RAM.

--device cuda trains on this rank's GPU (LOCAL_RANK modulo the GPUs): the
engine's shards, gathered params, gradients and optimizer state live there,
and forward and backward run on views of the engine's GPU memory. The
weights are initialised as on the CPU (the same seed, drawn on the host and
handed to the engine), and matmuls run in torch's default full fp32 (no
TF32), so the losses equal the CPU run's to fp32 rounding. Several ranks on one GPU need
--backend gloo (NCCL refuses two ranks on one device).
"""
import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        att = att.masked_fill(mask, float("-inf"))
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, heads, layers, ctx, checkpoint_activations=False, tie_head=False):
        super().__init__()
        self.checkpoint_activations = checkpoint_activations
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_head:  # GPT-2's own layout: the head is the token embedding
            self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                # Only the block's input is kept; its forward runs again
                # (gathering its params again) during backward.
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


MIB = 2 ** 20


def rss_bytes():
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plot(path, report, per_rank):
    """Loss per step, each rank's RSS per step, and each rank's shards
    (params, grads, AdamW state) next to DDP's per-rank footprint."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = len(per_rank)
    fig, (ax_loss, ax_rss, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.8))
    steps = list(range(len(report["losses"])))
    ax_loss.plot(steps, report["losses"], color="tab:blue")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title(f"loss: {report['losses'][0]:.3f} -> {report['final_loss']:.3f}, "
                      f"{report['tokens_per_s']:.0f} tokens/s")
    ax_loss.grid(alpha=0.3)

    for r in per_rank:
        ax_rss.plot(steps, [b / MIB for b in r["rss_per_step"]], label=f"rank {r['rank']}")
    before = max(r["rss_before_model_bytes"] for r in per_rank) / MIB
    ax_rss.axhline(before, color="gray", linestyle="--", linewidth=1,
                   label=f"before the model ({before:.0f})")
    ax_rss.set_xlabel("step")
    ax_rss.set_ylabel("MiB")
    ax_rss.set_title("RSS per rank after each step")
    ax_rss.legend(fontsize="small")
    ax_rss.grid(alpha=0.3)

    unsharded = report["unsharded_param_bytes"]
    ddp = (unsharded, unsharded, 2 * unsharded)
    labels = [f"rank {r['rank']}" for r in per_rank] + ["DDP\n(each rank)"]
    parts = [[r["param_bytes"] for r in per_rank] + [ddp[0]],
             [r["grad_bytes"] for r in per_rank] + [ddp[1]],
             [r["optimizer_bytes"] for r in per_rank] + [ddp[2]]]
    bottom = [0.0] * (world + 1)
    for name, values, color in zip(("params", "gradients", "AdamW state"), parts,
                                    ("tab:blue", "tab:orange", "tab:green")):
        mib = [v / MIB for v in values]
        ax_mem.bar(labels, mib, bottom=bottom, label=name, color=color)
        bottom = [b + m for b, m in zip(bottom, mib)]
    for i, r in enumerate(per_rank):
        ax_mem.annotate(f"{bottom[i]:.2f}", (i, bottom[i]), ha="center", va="bottom", fontsize="small")
    ax_mem.annotate(f"{bottom[-1]:.2f}", (world, bottom[-1]), ha="center", va="bottom", fontsize="small")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title(f"{report['engine']}: params + grads + AdamW state per rank")
    ax_mem.legend(fontsize="small")
    fig.suptitle(f"{report['engine']} on {world} ranks ({report['device']}): GPT of "
                 f"{report['num_params'] / 1e6:.2f}M params, peak RSS per rank "
                 + ", ".join(f"{r['peak_rss_bytes'] / MIB:.0f}" for r in per_rank) + " MiB; "
                 f"{os.cpu_count()} cores, load average {report['load_average']:.1f} at the start")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ddp", action="store_true", help="train with torch DDP instead, for comparison")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where params, gradients, optimizer state and compute live")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                    help="the engine's collectives (default: nccl on a GPU when it loads, else gloo)")
    ap.add_argument("--corpus", default=str(Path(__file__).parent / "data" / "corpus.txt"))
    ap.add_argument("--log-every", type=int, default=10, help="print loss and tokens/s every N steps")
    ap.add_argument("--plot", default=None, help="write a PNG of loss and per-rank memory here (rank 0)")
    ap.add_argument("--offload-dir", default=None,
                    help="keep parameter shards and optimizer state on NVMe under this directory")
    ap.add_argument("--max-in-cpu", type=float, default=1e9,
                    help="with --offload-dir: elements of unused parameter shards cached in memory")
    ap.add_argument("--sub-group-size", type=float, default=1e9,
                    help="with --offload-dir: elements of optimizer state stepped per sub-group")
    ap.add_argument("--checkpoint-activations", action="store_true",
                    help="recompute each block's forward during backward (torch.utils.checkpoint)")
    ap.add_argument("--fixed-batch", action="store_true",
                    help="train on the same batch every step (shows a big model's loss falling in a few steps)")
    ap.add_argument("--config-json", default="{}",
                    help="more DeepSpeed config, merged into the engine's (e.g. zero_optimization keys)")
    args = ap.parse_args()

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_gpt: --device cuda, but torch sees no CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        # torch's default fp32 matmul precision is full fp32 (no TF32),
        # which keeps the losses those of the CPU run; it is left as it is.
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    load_average = os.getloadavg()[0]  # shows whether the machine was busy with other work
    text = Path(args.corpus).read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    # Weights are drawn on the host (torch's CPU generator) for either
    # device, so a run on the GPU starts from the CPU run's weights.
    rss_before_model = rss_bytes()
    torch.manual_seed(0)
    make = lambda: GPT(len(chars), args.dim, args.heads, args.layers, args.ctx,  # noqa: E731
                       args.checkpoint_activations)
    if args.ddp:
        module = make().to(device)
        model = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
        unsharded = sum(p.numel() * 4 for p in model.parameters())
        largest = max(p.numel() * 4 for p in model.parameters())
    else:
        import zeroshard.torch as zt
        config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": args.batch}
        if args.offload_dir:
            config["zero_optimization"].update({
                "offload_param": {"device": "nvme", "nvme_path": args.offload_dir,
                                  "max_in_cpu": int(args.max_in_cpu)},
                "offload_optimizer": {"device": "nvme", "nvme_path": args.offload_dir,
                                      "buffer_count": 2, "pipeline_read": True, "pipeline_write": True},
                "sub_group_size": int(args.sub_group_size)})
        for key, value in json.loads(args.config_json).items():
            if isinstance(value, dict):
                config.setdefault(key, {}).update(value)
            else:
                config[key] = value
        # The context on the chosen device: built on the host, the params
        # are registered from host memory and live on `device` from then on.
        zt.init_context(config=config, device=str(device), backend=args.backend)
        with zt.Init(config=config, device=str(device)):
            model = make()
        zt.partition_module(model)
        opt = zt.ZeroShardOptimizer(model.parameters(), lr=args.lr, weight_decay=0.01)
        unsharded = zt.get_context().memory()["unsharded_bytes"]
        largest = max(math.prod(p.zs.shape) * 4 for p in model.parameters())

    gen = torch.Generator().manual_seed(1234)
    tokens, start, step_times = 0, time.perf_counter(), []
    loss_value = float("nan")
    losses, rss_per_step = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        # The same global batch for any world size; this rank takes its slice.
        if args.fixed_batch:
            gen.manual_seed(1234)
        starts = torch.randint(0, len(data) - args.ctx - 1, (world * args.batch,), generator=gen)
        mine = starts[rank * args.batch:(rank + 1) * args.batch]
        x = torch.stack([data[s:s + args.ctx] for s in mine]).to(device)
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in mine]).to(device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        loss_value = t.item() / world
        losses.append(loss_value)
        rss_per_step.append(rss_bytes())
        tokens += world * args.batch * args.ctx
        if rank == 0 and (step % max(1, args.log_every) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss_value:.4f}  {tokens / (time.perf_counter() - start):9.0f} tokens/s"
                  f"  ({step_times[-1] * 1e3:.0f} ms)", flush=True)
    tokens_per_s = tokens / (time.perf_counter() - start)

    if args.ddp:
        engine = {"shard_bytes": unsharded, "grad_bytes": unsharded, "optimizer_bytes": 2 * unsharded}
        backend = dist.get_backend()
    else:
        engine = zt.get_context().memory()
        backend = zt.get_context().backend
    mine = {"rank": rank,
            "param_bytes": engine["shard_bytes"], "grad_bytes": engine["grad_bytes"],
            "optimizer_bytes": engine["optimizer_bytes"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_before_model_bytes": rss_before_model, "rss_per_step": rss_per_step}
    if not args.ddp:
        mine["nvme_bytes"] = engine["nvme_bytes"]
        mine["peak_gathered_bytes"] = engine["peak_gathered_bytes"]
        mine["host_cache_bytes"] = engine["host_cache_bytes"]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    steady = sorted(step_times[len(step_times) // 4:])
    if rank == 0:
        name = "ddp" if args.ddp else "zeroshard"
        ddp_state = 4 * unsharded  # params + grads + exp_avg + exp_avg_sq, fp32, on every rank
        print(f"memory per rank ({name}, {world} ranks; DDP would hold {ddp_state / MIB:.2f} MiB of params + "
              f"grads + AdamW state on every rank):", flush=True)
        for r in everyone:
            state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
            print(f"  rank {r['rank']}: params {r['param_bytes'] / MIB:.2f} + grads {r['grad_bytes'] / MIB:.2f} + "
                  f"AdamW state {r['optimizer_bytes'] / MIB:.2f} = {state / MIB:.2f} MiB "
                  f"({state / ddp_state:.2f}x DDP's), peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB"
                  + (f", on NVMe {r['nvme_bytes'] / MIB:.0f} MiB" if r.get("nvme_bytes") else ""), flush=True)
        report = {"example": "train_gpt", "engine": name, "ranks": world,
                  "steps": args.steps, "device": str(device), "backend": backend,
                  "final_loss": loss_value, "losses": losses, "step_times_s": step_times,
                  "median_step_s": steady[len(steady) // 2], "tokens_per_s": tokens_per_s,
                  "load_average": load_average,
                  "num_params": unsharded // 4,
                  "unsharded_param_bytes": unsharded, "largest_param_bytes": largest,
                  "ddp_state_bytes_per_rank": ddp_state, "per_rank": everyone}
        if args.plot:
            plot(args.plot, report, everyone)
            print(f"plot: {args.plot}", flush=True)
        print(json.dumps(report), flush=True)
    # Drop the model before the process group: torch 1.13 can deadlock
    # destroying a gloo group that a live DDP reducer still references.
    del model, opt
    if not args.ddp:
        zt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
