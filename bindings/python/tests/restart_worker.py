"""One rank of the automatic-restart tests: the loop users write, "load
latest, train, save every step", launched by `zsrun --restarts` or
`torchrun --max-restarts`.

    python3 restart_worker.py CKPT_DIR LOG STEPS KILL_AT

Every step trains on a fixed global batch of 12 sequences split evenly over
the ranks (2 or 3), so any world size takes the same steps. On the first
attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 SIGKILLs itself in the middle
of step KILL_AT (after its forward, while the others wait in the backward's
reduce-scatter). Each rank appends one JSON line per step to LOG.<rank>:
attempt, world size, step and its loss (the test averages over the ranks).
torch.distributed is not used: the engine needs none, and torch's own Gloo
group does not come back under torchrun's restarts here (its second
attempt's connectFullMesh is refused).
"""
import json
import os
import signal
import sys

import torch
import torch.distributed

import zeroshard.torch as zt
from torch_worker import SEQ, VOCAB, TinyGPT

CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000,
                                "stage3_param_persistence_threshold": 0}}
GLOBAL_BATCH = 12


def global_batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = data[rank * per:(rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def main():
    ckpt, log, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("ZS_TEST_DIST_FIRST") == "1":  # as the HF Trainer does before the engine
        torch.distributed.init_process_group("gloo")
    with zt.Init(config=CONFIG):
        torch.manual_seed(0)
        model = TinyGPT()
    zt.partition_module(model)
    opt = zt.ZeroShardOptimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    start = 0
    if os.path.exists(os.path.join(ckpt, "latest")):
        start = zt.load_checkpoint(ckpt, model, opt)["step"]
    for s in range(start, steps):
        x, y = global_batch(s, rank, world)
        loss = model(x, y)
        if attempt == 0 and rank == 1 and s == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with open(f"{log}.{rank}", "a") as f:
            f.write(json.dumps({"attempt": attempt, "world": world, "step": s, "loss": loss.item()}) + "\n")
        zt.save_checkpoint(ckpt, model, opt, client_state={"step": s + 1}, tag=f"step-{s + 1}")
    zt.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
