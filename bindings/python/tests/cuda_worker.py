"""Processes of test_cuda.py: zeroshard on a GPU next to the same on the CPU.

    python3 cuda_worker.py mlp DEVICE              # world of one, zeroshard.torch
    python3 cuda_worker.py devices                 # where contexts go (needs a GPU)
    python3 cuda_worker.py ranks RANK WORLD PORT DEVICE   # one rank, staged gloo

Each prints one JSON line last (values as lists, so that the parent compares
a CUDA run with a CPU run).
"""
import json
import sys

import torch
import torch.nn as nn

import zeroshard.torch as zt

IN, HIDDEN = 16, 64


def make_mlp():
    # Drawn on the host (torch's CPU generator) whatever the device, so a
    # GPU run starts from the CPU run's weights.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, 1))


def batch(step, rank, device):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, IN, generator=g)
    return x.to(device), x.sum(1, keepdim=True).sin().to(device)


def train_mlp(device, rank, steps=5):
    """zeroshard.torch on `device`: the model built inside Init, trained
    `steps` AdamW steps. Returns the losses and the model and optimizer."""
    with zt.Init(config={"zero_optimization": {"stage": 3}}, device=device):
        model = make_mlp()
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step, rank, device)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


def flat(state_dict):
    return {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in state_dict.items()}


def mode_mlp(device):
    zt.init_context(rank=0, world_size=1, device=device)
    ctx = zt.get_context()
    losses, model, opt = train_mlp(device, 0)
    out = {"device": ctx.device, "losses": losses}
    p = next(iter(model.parameters()))
    out["placeholder_device"] = str(p.data.device)
    # Consolidated weights (on the model's device), and an optimizer state
    # round trip: take one more step, restore the state and weights from
    # before it, take it again: the same weights.
    sd = zt.consolidated_state_dict(model)
    out["state_dict_devices"] = sorted({str(v.device) for v in sd.values()})
    out["weights"] = flat(sd)
    state = opt.state_dict()
    shards = state["zeroshard"]["shards"]
    out["optimizer_state_devices"] = sorted({str(t.device) for per in shards.values() for t in per.values()})
    x, y = batch(5, 0, device)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    after = zt.consolidated_state_dict(model)
    opt.load_state_dict(state)
    zt.load_consolidated_state_dict(model, sd)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    replay = zt.consolidated_state_dict(model)
    out["replay_max_diff"] = max(float((replay[k] - after[k]).abs().max()) for k in after)
    out["memory"] = ctx.memory()
    zt.shutdown()
    print(json.dumps(out), flush=True)


def mode_devices():
    """Where zeroshard.torch puts the context, and the errors when the
    model and the context disagree (needs a GPU)."""
    out = {}
    # A model built on the GPU, no device named: the context follows it.
    with torch.device("cuda:0"):
        with zt.Init(config={"zero_optimization": {"stage": 3}}):
            model = nn.Linear(4, 3)
    out["built_on_cuda"] = zt.get_context().device
    out["placeholder"] = str(model.weight.data.device)
    zt.partition_module(model)
    y = model(torch.ones(2, 4, device="cuda:0"))
    out["output_device"] = str(y.device)
    y.sum().backward()
    zt.shutdown()
    # partition_module of a model on cuda:0 with no context: the same.
    model = nn.Linear(4, 3).to("cuda:0")
    zt.partition_module(model)
    out["partitioned_on_cuda"] = zt.get_context().device
    zt.shutdown()
    # A model on the host with no device named: the context stays on the
    # host, even with a GPU present.
    model = nn.Linear(4, 3)
    zt.partition_module(model)
    out["host_model"] = zt.get_context().device
    # ... and then params on the GPU for that host context: a clear error.
    try:
        zt.partition_module(nn.Linear(4, 3).to("cuda:0"))
        out["mismatch_error"] = None
    except RuntimeError as e:
        out["mismatch_error"] = str(e)
    zt.shutdown()
    print(json.dumps(out), flush=True)


def mode_ranks(rank, world, port, device):
    ctx = zt.init_context(rank=rank, world_size=world, store_host="127.0.0.1", store_port=port,
                          timeout_ms=60000, device=device, backend="gloo")
    dev = torch.device(ctx.device)
    out = {"rank": rank, "device": ctx.device, "backend": ctx.backend}
    # Rank 0's values (in the context's device memory) scattered to shards.
    full = torch.linspace(-2, 2, 30)
    p = ctx.register("w", "fp32", (5, 6), init="from_rank", src_rank=0,
                     data=full.to(dev) if rank == 0 else None)
    ctx.fetch([p]).wait()
    t = torch.utils.dlpack.from_dlpack(p.to_dlpack())
    out["dlpack_device"] = str(t.device)
    out["gathered_equal"] = bool(torch.equal(t.reshape(-1).cpu(), full))
    del t
    ctx.release([p])
    c = ctx.register("c", "bf16", (33,), init="normal", seed=11, b=0.5)
    opt = ctx.optimizer("adamw")
    opt.add_group([p, c], lr=1e-2)
    for step in range(3):
        # Gradients computed on the host (the same bits for either device),
        # pushed from the context's device memory.
        g = (torch.linspace(-1, 1, 30) * (rank + 1) * (step + 1)).to(dev)
        p.push_grad(g, "fp32")
        h = (torch.linspace(-1, 1, 33).to(torch.bfloat16) * (rank + 1)).to(dev)
        c.push_grad(h, "bf16")
        opt.step()
    ctx.fetch([p, c]).wait()
    out["w"] = torch.frombuffer(p.copy_to(), dtype=torch.float32).tolist()
    out["c"] = torch.frombuffer(c.copy_to(), dtype=torch.bfloat16).float().tolist()
    master = torch.utils.dlpack.from_dlpack(opt.state_dlpack(c, 0))
    out["c_master"] = master.cpu().tolist()
    del master
    ctx.release([p, c])
    opt.close()
    p.close()
    c.close()
    # zeroshard.torch over the same context: each rank its own batch.
    losses, model, _ = train_mlp(ctx.device, rank)
    out["losses"] = losses
    out["weights"] = flat(zt.consolidated_state_dict(model))
    ctx.check_async_error()
    zt.shutdown()
    print(json.dumps(out), flush=True)


def main():
    mode = sys.argv[1]
    if mode == "mlp":
        mode_mlp(sys.argv[2])
    elif mode == "devices":
        mode_devices()
    elif mode == "ranks":
        mode_ranks(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"cuda_worker: unknown mode {mode!r}")


if __name__ == "__main__":
    main()
