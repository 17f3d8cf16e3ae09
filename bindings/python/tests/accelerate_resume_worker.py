"""One rank of test_accelerate_resume.py, launched by zsrun: a folder that
accelerate.Accelerator.save_state wrote under DeepSpeed ZeRO-3, loaded with
zeroshard.hf.Accelerator.load_state by the same script (one import
switched), at 2 and at 3 ranks.

    zsrun -n 2 -- python accelerate_resume_worker.py deepspeed,fsdp2,zeroshard:deepspeed,zeroshard:fsdp2
    zsrun -n 3 -- python accelerate_resume_worker.py zeroshard:deepspeed:fsdp2,zeroshard:fsdp2,zeroshard:deepspeed,bad

deepspeed: accelerate.Accelerator(deepspeed_plugin=ZeRO-3) (DS_ACCELERATOR=cpu;
no cpu=True, with which Accelerate ignores DeepSpeed): 3 steps,
save_state($ZS_TEST_DIR/deepspeed), 3 more (its continuation), then its own
load_state of the folder (timed) and the 3 steps again. fsdp2: the same
with Accelerator(fsdp_plugin=FSDP2, SHARDED_STATE_DICT, cpu=True): Accelerate
takes FSDP on accelerators only and runs a CPU world as MULTI_CPU, its plugin
ignored, so the script sets the state's distributed_type to FSDP as
AcceleratorState would on a GPU; prepare, save_state and load_state are then
Accelerate's FSDP2 code (fully_shard, DCP). zeroshard:SOURCE: the source's
script with zeroshard.hf.Accelerator: load_state of the source's folder
(timed), the 3 steps after the save; zeroshard:SOURCE:OTHER: OTHER's script
(its optimizer: ZeroShardOptimizer under DeepSpeed's plugin, the torch
AdamW stepping the shards under FSDP2's) loads SOURCE's folder. bad: load_state of each folder under
$ZS_TEST_DIR/bad, its error message.

A global batch of 12 sequences a step at any world size (each rank takes
its rows itself: Accelerate under DeepSpeed on a CPU does not shard a
prepared loader, under FSDP it does), so the losses
averaged over ranks are one curve at 2 and 3 ranks. Rank 0 writes JSON to
$ZS_TEST_RESULT.
"""
import os
import sys
import time
from pathlib import Path

import accelerate
import torch
import transformers

import zeroshard.hf
from hf_trainer_worker import Tokens, build
from launch_env import exit_without_teardown, write_rank0_result

GLOBAL_BATCH, SAVE_AT, STEPS = 12, 3, 6


def plugin(world):
    return accelerate.DeepSpeedPlugin(hf_ds_config={
        "zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 1,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world}, zero_stage=3)


def fsdp2_plugin(full=False):
    return accelerate.FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="FULL_STATE_DICT" if full else "SHARDED_STATE_DICT")


def script(cls, world, fsdp=False, full=False):
    # step_scheduler_with_optimizer=False: the scheduler steps once a step
    # at any world size (else Accelerate steps it once per process where it
    # shards the loader: MULTI_CPU, FSDP, not DeepSpeed on a CPU).
    if fsdp:
        acc = cls(fsdp_plugin=fsdp2_plugin(full), cpu=True, step_scheduler_with_optimizer=False)
        if cls is accelerate.Accelerator:
            from accelerate.utils import DistributedType
            # Accelerate takes FSDP on accelerators only (a CPU run is
            # MULTI_CPU, its plugin ignored): set as AcceleratorState sets it.
            acc.state.distributed_type = DistributedType.FSDP
            accelerate.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            acc.state.fsdp_plugin = fsdp2_plugin(full)
    else:
        acc = cls(deepspeed_plugin=plugin(world), step_scheduler_with_optimizer=False)
    model = build("causal_lm")
    opt = torch.optim.AdamW(model.parameters(), lr=float(os.environ.get("ZS_TEST_LR", "3e-3")), weight_decay=0.01,
                            foreach=False)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=2 * STEPS)
    model, opt, sched = acc.prepare(model, opt, sched)
    tokens = Tokens("causal_lm", n=GLOBAL_BATCH * STEPS)
    rank, per = int(os.environ["RANK"]), GLOBAL_BATCH // world  # (Accelerate without cpu=True on a CPU says 0)

    def step(i):
        # Each rank its rows of global batch i, whatever Accelerate would
        # shard (on a CPU it does not shard under DeepSpeed).
        rows = [tokens[j] for j in range(i * GLOBAL_BATCH + rank * per, i * GLOBAL_BATCH + (rank + 1) * per)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()  # Accelerate's gather under DeepSpeed is GPU-only (gloo refuses)
        torch.distributed.all_reduce(mean)
        return mean.item() / world

    return acc, model, opt, sched, step


def timed_load(acc, folder):
    start = time.perf_counter()
    acc.load_state(folder)
    return time.perf_counter() - start


def state_of(acc, opt, sched):
    inner = getattr(opt, "optimizer", opt)
    engine = getattr(inner, "_engine", None)
    if engine is not None:
        step = int(engine.steps)
    else:  # a torch optimizer (stepping the shards, or FSDP's / DeepSpeed's own)
        states = [v for v in getattr(inner, "state", {}).values() if "step" in v]
        step = int(states[0]["step"]) if states else None
    return {"lr": sched.get_last_lr()[0], "scheduler": sched.scheduler.last_epoch if hasattr(sched, "scheduler")
            else sched.last_epoch, "optimizer_step": step}


def source_run(mode, root, world):
    """The source engine's script: 3 steps, save_state, 3 more, then its own
    load_state of the folder (timed) and the 3 steps again."""
    acc, model, opt, sched, step = script(accelerate.Accelerator, world, fsdp=mode.startswith("fsdp2"),
                                          full=mode == "fsdp2_full")
    out = {"type": str(acc.distributed_type), "first": [step(i) for i in range(SAVE_AT)]}
    acc.save_state(str(root / mode))
    out["continuation"] = [step(i) for i in range(SAVE_AT, STEPS)]
    out["own_load_s"] = timed_load(acc, str(root / mode))
    out["own_state"] = state_of(acc, opt, sched)
    out["own"] = [step(i) for i in range(SAVE_AT, STEPS)]
    out["files"] = sorted(os.listdir(root / mode))
    out["model_type"] = type(model).__name__
    return out


def zeroshard_run(source, root, world, script_of=None):
    """The source's script (or script_of's) with zeroshard.hf.Accelerator:
    load_state of the source's folder (timed), the 3 steps after the save."""
    acc, model, opt, sched, step = script(zeroshard.hf.Accelerator, world,
                                          fsdp=(script_of or source).startswith("fsdp2"))
    out = {"type": str(acc.distributed_type), "load_s": timed_load(acc, str(root / source))}
    out["state"] = state_of(acc, opt, sched)
    out["resumed"] = [step(i) for i in range(SAVE_AT, STEPS)]
    out["partitioned"] = all(zeroshard.torch.is_partitioned(p) for p in model.parameters())
    return out, acc


def main():
    """Modes, comma-separated, in one process (Accelerate's state reset
    between them): deepspeed, fsdp2, fsdp2_full (the sources; the last
    with FULL_STATE_DICT), zeroshard:SOURCE[:SCRIPT],
    bad (load_state of each folder under $ZS_TEST_DIR/bad by the last
    zeroshard Accelerator; and of one that does not exist)."""
    root = Path(os.environ["ZS_TEST_DIR"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = {"world": world}
    acc, environ = None, dict(os.environ)
    for mode in sys.argv[1].split(","):
        if mode == "bad":
            errors = {}
            for case in sorted(os.listdir(root / "bad")) + ["absent"]:
                try:
                    acc.load_state(str(root / "bad" / case))
                    errors[case] = None
                except Exception as e:  # noqa: BLE001  the message is the result
                    errors[case] = f"{type(e).__name__}: {e}"
            out["errors"] = errors
            continue
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()  # the variables an Accelerator set (ACCELERATE_USE_DEEPSPEED, ...) go too
        os.environ.update(environ)
        if mode.startswith("zeroshard:"):
            out[mode], acc = zeroshard_run(*mode.split(":")[1:2], root, world, *mode.split(":")[2:])
        else:
            out[mode] = source_run(mode, root, world)
    write_rank0_result(rank, out)
    sys.stdout.flush()
    os._exit(0)  # past torch's and DeepSpeed's teardown, as the other workers leave


if __name__ == "__main__":
    main()
    exit_without_teardown()
