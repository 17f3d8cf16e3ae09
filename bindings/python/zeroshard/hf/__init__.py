"""Hugging Face's Trainer on the zeroshard engine: a script written for
`transformers.Trainer` with a DeepSpeed JSON trains unchanged but for one
import.

    from zeroshard.hf import Trainer          # was: from transformers import Trainer
    args = TrainingArguments(output_dir="out", deepspeed="ds_zero3.json", ...)
    trainer = Trainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()

Why a subclass: Hugging Face routes `TrainingArguments(deepspeed=...)` to
DeepSpeed through Accelerate, with no hook for another engine; a subclass
of `transformers.Trainer` is how Hugging Face itself and the libraries on it
(TRL's trainers, Seq2SeqTrainer) change what the training loop runs on. The
JSON is read, its "auto" values resolved from the TrainingArguments as
Hugging Face's DeepSpeed integration resolves them (resolve_config), and
the run's DeepSpeed wiring removed from the arguments the base class sees:
the engine acts on the config instead.

What the engine does in the loop: the model is partitioned (zeroshard.torch),
never wrapped in DDP; the optimizer is the engine's (the JSON's "optimizer"
section, else the TrainingArguments'); the JSON's "scheduler" section runs
DeepSpeed's WarmupLR / WarmupDecayLR, else the Trainer's own scheduler; the
backward scales the loss under fp16 (ZeroShardOptimizer.backward); clipping
is the config's gradient_clipping (max_grad_norm); float inputs are cast to
the model's 16-bit dtype under bf16/fp16. Checkpoints (save_strategy) hold
the engine's sharded, crash-safe checkpoint in <checkpoint>/zeroshard and
resume at any world size; save_model writes model.safetensors and the
config, which from_pretrained reads unsharded.

For a Trainer subclass of another library, whatever its signature (TRL's
SFTTrainer, DPOTrainer, GRPOTrainer, ...): `zeroshard.hf.trainer_class(X)`;
the model may be a path, loaded partitioned, and reference and reward
models are partitioned frozen beside it (trainer.py).
"""
from .accelerator import Accelerator
from .config import resolve_config
from .pretrained import HfZeroShardConfig
from ..torch import heal_dist, hf_resize
from .schedulers import WarmupDecayLR, WarmupLR
from .trainer import Seq2SeqTrainer, Trainer, trainer_class

hf_resize.install()  # resize_token_embeddings on partitioned models
# In a process replacing a lost rank, torch.distributed's init goes over the
# engine (torch/heal_dist.py): the survivors' Gloo group is gone.
heal_dist.route_replacement_init()

__all__ = ["Trainer", "Seq2SeqTrainer", "trainer_class", "Accelerator", "resolve_config", "HfZeroShardConfig",
           "WarmupLR", "WarmupDecayLR"]
