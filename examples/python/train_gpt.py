"""Train a small character-level GPT with zeroshard (or torch DDP, to compare).

    build/bin/zsrun -n 4 -- /usr/bin/python3 examples/python/train_gpt.py [--steps 60] [--ddp]
    build/bin/zsrun -n 1 -- /usr/bin/python3 examples/python/train_gpt.py --device cuda

Each rank trains on its own slice of every batch. Rank 0 prints loss and
tokens/s as it goes; the last line is one JSON object with the final loss,
every step's loss, and each rank's memory (engine shards, process peak RSS)
next to the unsharded size. Set PYTHONPATH=bindings/python and
ZEROSHARD_LIBRARY=build/lib/libzeroshard.so when running from a source checkout.

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
    def __init__(self, vocab, dim, heads, layers, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


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
    text = Path(args.corpus).read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    # Weights are drawn on the host (torch's CPU generator) for either
    # device, so a run on the GPU starts from the CPU run's weights.
    torch.manual_seed(0)
    make = lambda: GPT(len(chars), args.dim, args.heads, args.layers, args.ctx)  # noqa: E731
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
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        # The same global batch for any world size; this rank takes its slice.
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
        tokens += world * args.batch * args.ctx
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss_value:.4f}  {tokens / (time.perf_counter() - start):9.0f} tokens/s",
                  flush=True)

    if args.ddp:
        engine = {"shard_bytes": unsharded, "grad_bytes": unsharded, "optimizer_bytes": 2 * unsharded}
        backend = dist.get_backend()
    else:
        engine = zt.get_context().memory()
        backend = zt.get_context().backend
    mine = {"rank": rank,
            "param_bytes": engine["shard_bytes"], "grad_bytes": engine["grad_bytes"],
            "optimizer_bytes": engine["optimizer_bytes"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    steady = sorted(step_times[len(step_times) // 4:])
    if rank == 0:
        print(json.dumps({"example": "train_gpt", "engine": "ddp" if args.ddp else "zeroshard", "ranks": world,
                          "steps": args.steps, "device": str(device), "backend": backend,
                          "final_loss": loss_value, "losses": losses,
                          "median_step_s": steady[len(steady) // 2],
                          "unsharded_param_bytes": unsharded, "largest_param_bytes": largest,
                          "per_rank": everyone}), flush=True)
    # Drop the model before the process group: torch 1.13 can deadlock
    # destroying a gloo group that a live DDP reducer still references.
    del model, opt
    if not args.ddp:
        zt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
