"""One rank of the checkpoint tests, launched by zsrun: a Hugging Face GPT-2
from a small config (no downloads) trained through zeroshard.torch, saved,
and resumed at another world size.

    zsrun -n N -- python ckpt_worker.py save DIR
    zsrun -n M -- python ckpt_worker.py resume DIR
    zsrun -n M -- python ckpt_worker.py pretrained HF_DIR   (zt.load_pretrained)

The global batch is fixed (6 rows per step, split across ranks), so the
losses do not depend on the world size. Rank 0 prints one JSON line.
"""
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard.torch as zt
from launch_env import exit_without_teardown

VOCAB, SEQ, ROWS = 64, 12, 6
CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def gpt2_config():
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(500 + step)
    rows = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    return rows[rank::world]


PROMPT = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def mean_over_ranks(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(model, opt, first_step, steps, rank, world):
    losses = []
    model.train()
    for s in range(first_step, first_step + steps):
        x = batch(s, rank, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROMPT).logits.clone()


def build(seed, lr):
    torch.manual_seed(seed)
    with zt.Init(config=CONFIG):
        model = GPT2LMHeadModel(gpt2_config())
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=lr, weight_decay=0.01)
    return model, opt


def main():
    mode, d = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    if mode == "save":
        model, opt = build(0, 2e-3)
        out["before"] = train(model, opt, 0, 3, rank, world)
        saved_logits = logits(model)
        where = zt.save_checkpoint(d, model, opt, client_state={"epoch": 3, "note": "gpt2"})
        zt.export_safetensors(model, d + "/live.safetensors")  # the same weights, from the live run
        out["dir"] = where
        if rank == 0:
            save_file({"logits": saved_logits}, d + "/logits.safetensors")
        out["after"] = train(model, opt, 3, 3, rank, world)
    elif mode == "pretrained":
        model, opt = build(1, 2e-3)
        zt.load_pretrained(model, d)
        want = load_file(d + "/logits.safetensors")["logits"]
        out["logits_equal"] = bool(torch.equal(logits(model), want))
        out["after"] = train(model, opt, 0, 2, rank, world)
    else:
        model, opt = build(1, 0.5)  # other weights and lr: the load replaces both
        client = zt.load_checkpoint(d, model, opt)
        out["client_state"] = client
        out["lr"] = opt.param_groups[0]["lr"]
        want = load_file(d + "/logits.safetensors")["logits"]
        out["logits_equal"] = bool(torch.equal(logits(model), want))
        out["after"] = train(model, opt, 3, 3, rank, world)
    zt.shutdown()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
