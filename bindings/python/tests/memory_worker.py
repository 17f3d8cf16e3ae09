"""One rank of test_memory_report.py, launched by zsrun:

    zsrun -n N -- python3 memory_worker.py report|construction|copies

report: a partitioned model with bf16 params (fp32 masters) trained 2
steps with the engine's AdamW and saved: zt.memory_report() taken at each
point. construction: a model of CONSTRUCTION_LAYERS Linear layers built
under zt.Init while a thread samples the process's RSS: the most it rose
by, and the engine's construction peak. copies: fp32 OddGPT trained 4
steps with torch's AdamW on the shards: the bytes the engine copied in
each step (by kind), the params' sizes, and on one rank whether each
step's loss and gradients equal, bit for bit, an unsharded torch copy's.
Rank 0 writes JSON to $ZS_TEST_RESULT.
"""
import os
import threading
import time

import torch

import zeroshard.torch as zt
from optim_worker import CONFIG, OddGPT
from torch_worker import batch, run_mode
from launch_env import exit_without_teardown


def mode_report(rank, world):
    config = dict(CONFIG, bf16={"enabled": True})
    zt.init_context(config=config)
    zt.get_context().reset_memory_peaks()
    torch.manual_seed(0)
    with zt.Init(config=config):
        model = OddGPT()
    zt.partition_module(model)
    reports = {"built": zt.memory_report()}
    opt = zt.ZeroShardOptimizer(model.parameters(), kind="adamw", lr=1e-3)
    for s in range(2):
        model(*batch(s, rank)).backward()
        # The backward's last reductions may still run on the engine's
        # threads, allocating and freeing between the report's two reads
        # (kinds, then pools): the sum is checked once they are done.
        zt.get_context().grad_sync()
        reports[f"backward {s}"] = zt.memory_report()
        opt.step()
        opt.zero_grad()
        reports[f"step {s}"] = zt.memory_report()
    zt.save_checkpoint(os.path.join(os.environ["ZS_TEST_DIR"], "ckpt"), model, opt)
    reports["saved"] = zt.memory_report()
    ledger = zt.get_context().memory()
    return {"reports": reports, "text": zt.format_memory_report(reports["saved"]),
            "ledger": {k: ledger[k] for k in ("shard_bytes", "grad_bytes", "optimizer_bytes")}}



CONSTRUCTION_LAYERS, CONSTRUCTION_WIDTH = 12, 2048  # 16 MiB a layer, 192 MiB in all


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak(threading.Thread):
    """The highest RSS seen, polled every half millisecond."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = rss_bytes()
        self.running = True

    def run(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)


def mode_construction(rank, world):
    zt.init_context(config=CONFIG)
    ctx = zt.get_context()
    ctx.reset_memory_peaks()
    layer = torch.nn.Linear(8, 8)  # torch's first-layer set-up, outside the measure
    del layer
    before = rss_bytes()
    sampler = RssPeak()
    sampler.start()
    with zt.Init(config=CONFIG):
        model = torch.nn.Sequential(*[torch.nn.Linear(CONSTRUCTION_WIDTH, CONSTRUCTION_WIDTH, bias=False)
                                      for _ in range(CONSTRUCTION_LAYERS)])
    sampler.running = False
    sampler.join()
    shard_bytes = ctx.memory()["shard_bytes"]
    assert all(p.ds_numel == CONSTRUCTION_WIDTH ** 2 for p in model.parameters())
    return {"rss_rise": sampler.peak - before, "shard_bytes": shard_bytes,
            "engine_construction_peak": ctx.memory_by_kind("construction")["total"],
            "layer_bytes": CONSTRUCTION_WIDTH ** 2 * 4,
            "model_bytes": CONSTRUCTION_LAYERS * CONSTRUCTION_WIDTH ** 2 * 4}


COPIES_STEPS = 4


def mode_copies(rank, world):
    torch.manual_seed(0)
    reference = OddGPT()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(0)
    with zt.Init(config=CONFIG):
        model = OddGPT()
    zt.partition_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ctx = zt.get_context()
    steps, equal_losses, equal_grads = [], [], []
    for s in range(COPIES_STEPS):
        loss = model(*batch(s, rank))
        loss.backward()
        if world == 1:  # the whole batch is this rank's: the reference steps alike
            ref_loss = reference(*batch(s, rank))
            ref_loss.backward()
            equal_losses.append(torch.equal(loss.detach(), ref_loss.detach()))
            ctx.grad_sync()
            equal_grads.append(all(
                torch.equal(torch.utils.dlpack.from_dlpack(p.zs.zparam.grad_shard_dlpack()), q.grad.reshape(-1))
                for p, q in zip(model.parameters(), reference.parameters())))
            ref_opt.step()
            ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        steps.append(ctx.copied_bytes(last_step=True))
    report = zt.memory_report()
    return {"steps": steps, "report_copied": report["copied"], "text": zt.format_memory_report(report),
            "numels": [p.numel() for p in model.parameters()],
            "bucket": CONFIG["zero_optimization"]["reduce_bucket_size"],
            "equal_losses": equal_losses, "equal_grads": equal_grads}


if __name__ == "__main__":
    run_mode({"report": mode_report, "construction": mode_construction, "copies": mode_copies})
    exit_without_teardown()
