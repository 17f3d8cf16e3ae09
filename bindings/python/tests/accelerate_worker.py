"""One rank of the Accelerate tests, started by `accelerate launch`.

    accelerate launch --cpu --num_processes N [--use_deepspeed --zero_stage 3 ...] accelerate_worker.py ENGINE

A script written against Accelerate (prepare, accumulate, backward,
clip_grad_norm_, save_state / load_state): ENGINE ddp runs it on
accelerate.Accelerator (DDP on CPU ranks), zeroshard on
zeroshard.hf.Accelerator with a DeepSpeedPlugin, zeroshard_fsdp on it with
Accelerate's FSDP2 plugin (fully_shard per GPT2Block, then the model),
zeroshard_env on
zeroshard.hf.Accelerator() with the plugin made from `accelerate launch
--use_deepspeed` variables. Rank 0 writes JSON to $ZS_TEST_RESULT.
"""
import json
import os
import sys

import accelerate
import torch
import transformers

import zeroshard.hf
from hf_trainer_worker import Tokens, build
from launch_env import exit_without_teardown

STEPS = 6  # optimizer steps; 2 micro-batches each
SAVE_AT = 3


def main():
    engine = sys.argv[1]
    if engine == "ddp":
        acc = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    elif engine == "zeroshard":
        plugin = accelerate.DeepSpeedPlugin(
            hf_ds_config={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
                          "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                          "train_micro_batch_size_per_gpu": "auto"}, zero_stage=3)
        acc = zeroshard.hf.Accelerator(deepspeed_plugin=plugin, cpu=True)
    elif engine == "zeroshard_fsdp":
        plugin = accelerate.FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
        acc = zeroshard.hf.Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2, cpu=True)
    else:
        acc = zeroshard.hf.Accelerator(cpu=True)
    model = build("causal_lm")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=STEPS)
    data = torch.utils.data.DataLoader(Tokens("causal_lm", n=96), batch_size=4, shuffle=False)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    batches = list(data)
    state = os.path.join(os.environ["ZS_TEST_DIR"], engine)

    def micro(i):
        with acc.accumulate(model):
            loss = model(**batches[i]).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        return acc.gather(loss.detach()).mean().item()

    losses = []
    for i in range(2 * STEPS):
        if i == 2 * SAVE_AT:
            acc.save_state(state)
        losses.append(micro(i))
    # Back to the state saved after SAVE_AT steps: the same losses again.
    acc.load_state(state)
    again = [micro(i) for i in range(2 * SAVE_AT, 2 * STEPS)]
    result = {"losses": losses, "again": again, "lr": sched.get_last_lr(), "world": acc.num_processes,
              "batches": len(batches), "type": str(acc.distributed_type),
              "partitioned": all(zeroshard.torch.is_partitioned(p) for p in model.parameters()),
              "config": getattr(acc, "zs_config", None), "model_type": type(acc.unwrap_model(model)).__name__,
              "fsdp_units": sorted(type(m).__name__ for m in model.modules() if "_zs_fsdp" in m.__dict__),
              "optimizer": type(getattr(opt, "optimizer", opt)).__name__}
    if acc.is_main_process:
        with open(os.environ["ZS_TEST_RESULT"], "w") as f:
            json.dump(result, f)
    acc.wait_for_everyone()
    zeroshard.torch.shutdown()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see hf_trainer_worker.py


if __name__ == "__main__":
    main()
    exit_without_teardown()
