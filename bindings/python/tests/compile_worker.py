"""One rank of the parameter-type and torch.compile tests, launched by zsrun.

    zsrun -n N -- python3 compile_worker.py MODE

Rank 0 writes what the test checks as JSON to the file $ZS_TEST_RESULT names.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._dynamo.utils import counters

import zeroshard.torch as zt

import torch_worker as tw
from launch_env import exit_without_teardown

STEPS = 5


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=tw.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"

    class Llama(nn.Module):
        """The HF model with the test's (idx, targets) -> loss signature."""

        def __init__(self):
            super().__init__()
            self.lm = LlamaForCausalLM(cfg)

        def forward(self, idx, targets):
            logits = self.lm(input_ids=idx).logits
            return F.cross_entropy(logits.reshape(-1, tw.VOCAB), targets.reshape(-1))
    return Llama, lambda m: m.lm.model.layers


class CheckpointedGPT(tw.TinyGPT):
    """TinyGPT with each block recomputed in backward (non-reentrant)."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, tw.VOCAB), targets.reshape(-1))


class MoEGPT(nn.Module):
    """Embedding, an MoE block (a leaf module: each rank routes to another
    expert) and a head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(tw.VOCAB, tw.DIM)
        self.moe = tw.MoE()
        self.head = nn.Linear(tw.DIM, tw.VOCAB)

    def forward(self, idx, targets):
        x = self.tok(idx)
        x = x + F.gelu(self.moe(x))
        return F.cross_entropy(self.head(x).view(-1, tw.VOCAB), targets.reshape(-1))


MODELS = {
    "gpt": lambda: (tw.TinyGPT, lambda m: m.blocks),
    "gpt_checkpointed": lambda: (CheckpointedGPT, lambda m: m.blocks),
    "llama": llama,
    "moe": lambda: (MoEGPT, lambda m: [m.moe]),
}


def build(cls, threshold, compile_blocks=None):
    """`cls` built under Init and partitioned; compile_blocks(model): the
    blocks to compile before partitioning (torchtitan's order)."""
    torch.manual_seed(0)
    with zt.Init(config={"zero_optimization": {"stage": 3, "param_persistence_threshold": threshold}}):
        model = cls()
    for blk in compile_blocks(model) if compile_blocks else ():
        blk.compile()
    if cls is MoEGPT:
        zt.set_leaf_modules(model, [tw.MoE])
    zt.partition_module(model)
    return model


def train(model, run, rank, world, moe):
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=1e-2)
    losses, recompiles = [], []
    for s in range(STEPS):
        if moe:
            model.moe.route = (rank + s) % 3
        x, y = tw.batch(s, rank)
        loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(tw.mean_over_ranks(loss.item()))
        recompiles.append(sum(counters["recompiles"].values()))
    return losses, recompiles


def mode_compile(rank, world):
    """Each model trained STEPS steps eagerly, compiled whole
    (torch.compile(model)) and compiled per block (block.compile() before
    partitioning), from the same weights and data."""
    which = os.environ["ZS_TEST_MODELS"].split(",")
    out = {}
    for name in which:
        cls, blocks_of = MODELS[name]()
        threshold = int(os.environ.get("ZS_TEST_PERSISTENCE", "0"))
        moe = name == "moe"
        eager = build(cls, threshold)
        out[name] = {"eager": train(eager, eager, rank, world, moe)[0]}
        del eager
        torch._dynamo.reset()
        counters.clear()
        for how in ("whole", "block"):
            if how == "whole":
                model = build(cls, threshold)
                run = torch.compile(model)
            else:
                model = run = build(cls, threshold, compile_blocks=blocks_of)
                # Each compiled block is one gather unit: no hooks inside it.
                out[name]["hooks_inside_blocks"] = sum(1 for blk in blocks_of(model) for m in blk.modules()
                                                       if m is not blk and "_zs_unit" in m.__dict__)
            losses, recompiles = train(model, run, rank, world, moe)
            out[name][how] = losses
            out[name][f"{how}_recompiles"] = recompiles
            out[name][f"{how}_graphs"] = counters["stats"]["unique_graphs"]
            del model, run
            torch._dynamo.reset()
            counters.clear()
    return out


def mode_fullgraph(rank, world):
    """Blocks that are one gather unit each (leaf modules: no hooks inside,
    as a block under FSDP2's fully_shard), each block's forward compiled
    with fullgraph=True after partitioning: the unit's hooks stay outside
    the graph, which has no break."""
    def blocks_as_units():
        torch.manual_seed(0)
        with zt.Init(config={"zero_optimization": {"stage": 3, "param_persistence_threshold": 0}}):
            model = tw.TinyGPT()
        zt.set_leaf_modules(model, [tw.Block])
        zt.partition_module(model)
        return model
    eager = blocks_as_units()
    ref = train(eager, eager, rank, world, False)[0]
    del eager
    model = blocks_as_units()
    for blk in model.blocks:
        blk.forward = torch.compile(blk.forward, fullgraph=True)
    losses, recompiles = train(model, model, rank, world, False)
    return {"eager": ref, "fullgraph": losses, "recompiles": recompiles}


def mode_param_type(rank, world):
    """Every param's shape, ndim and dtype against the unpartitioned model,
    outside any gather; a read of a released param's values; ds_tensor."""
    cls, _ = llama()
    torch.manual_seed(0)
    reference = cls()
    model = build(cls, 0)
    ref = dict(reference.named_parameters())
    shapes_equal = all(tuple(p.shape) == tuple(ref[n].shape) and p.ndim == ref[n].ndim
                       and p.dtype == ref[n].dtype and p.numel() == ref[n].numel()
                       for n, p in model.named_parameters())
    w = model.lm.lm_head.weight
    out = {"shapes_equal": shapes_equal, "ndims": sorted({p.ndim for p in model.parameters()}),
           "ds_shape": list(w.ds_shape), "ds_numel": w.ds_numel, "shape": list(w.shape),
           "ds_tensor_numel": w.ds_tensor.numel(), "zeros_like": list(torch.zeros_like(w).shape),
           "t_shape": list(w.t().shape), "data_shape": list(w.data.shape), "repr": repr(w)}
    for name, read in [("sum", lambda: w.sum()), ("data_sum", lambda: w.data.sum()),
                       ("detach_tolist", lambda: w.detach().tolist()), ("add", lambda: w + 1),
                       ("to_bf16", lambda: w.to(torch.bfloat16)), ("linear", lambda: F.linear(torch.ones(2, 32), w))]:
        try:
            read()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    with zt.GatheredParameters([w]):
        gathered = w.detach().clone()
    out["gathered_equal"] = torch.equal(gathered, reference.lm.lm_head.weight.detach())
    out["module_to_noop"] = model.to(torch.float32) is model
    return out


if __name__ == "__main__":
    tw.run_mode({"compile": mode_compile, "fullgraph": mode_fullgraph, "param_type": mode_param_type})
    exit_without_teardown()
