"""One rank of test_memory_report.py, launched by zsrun:

    zsrun -n N -- python3 memory_worker.py report

A partitioned model with bf16 params (fp32 masters) trained 2 steps with the
engine's AdamW and saved: zt.memory_report() taken at each point. Rank 0
writes JSON to $ZS_TEST_RESULT.
"""
import os

import torch

import zeroshard.torch as zt
from optim_worker import CONFIG, OddGPT
from torch_worker import batch, run_mode


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
        reports[f"backward {s}"] = zt.memory_report()
        opt.step()
        opt.zero_grad()
        reports[f"step {s}"] = zt.memory_report()
    zt.save_checkpoint(os.path.join(os.environ["ZS_TEST_DIR"], "ckpt"), model, opt)
    reports["saved"] = zt.memory_report()
    ledger = zt.get_context().memory()
    return {"reports": reports, "text": zt.format_memory_report(reports["saved"]),
            "ledger": {k: ledger[k] for k in ("shard_bytes", "grad_bytes", "optimizer_bytes")}}


if __name__ == "__main__":
    run_mode({"report": mode_report})
