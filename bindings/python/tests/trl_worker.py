"""One rank of the TRL tests (test_trl.py), launched by zsrun or torchrun.

    python3 trl_worker.py ENGINE TRAINER [TRAINER ...]

A user's script: TRL's trainers on a small Llama saved to a directory with
its tokenizer (random weights, a word-level vocabulary), fp32,
TrainingArguments the same for both engines but for the DeepSpeed JSON.
ENGINE ddp runs TRL's class as it is under torchrun (DDP); ENGINE zeroshard
runs zeroshard.hf.trainer_class(TRL's class) with the JSON. Rank 0 writes
what the test checks as JSON to $ZS_TEST_RESULT; files go under
$ZS_TEST_DIR.

TRAINER: dpo (the policy as a path: TRL loads it and its reference model),
grpo (the policy as a module, a reference model for beta > 0, completions
ending at different lengths on different ranks), kto (a reference model
given as a module), reward (a sequence classifier loaded by TRL), rloo,
grpo_reward_model (zeroshard only: a reward model as a path),
weights (the trained policy streamed by zeroshard.torch.full_weights into a
plain model).
"""
import json
import math
import os
import sys
import time

import torch
import transformers
from datasets import Dataset, load_from_disk

ENGINE = sys.argv[1]
if ENGINE == "zeroshard":
    import zeroshard.hf
    import zeroshard.torch as zt
import trl  # noqa: E402 (after zeroshard.hf, as a user's script may have it)
from launch_env import exit_without_teardown

WORDS = [f"w{i}" for i in range(60)]
RANK = int(os.environ.get("RANK", "0"))
OUT = os.environ["ZS_TEST_DIR"]
DS_CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "train_batch_size": "auto"}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def llama_config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)


def policy_dir():
    """The policy saved once by rank 0 (the same weights for every run)."""
    path = os.path.join(OUT, "policy")
    done = os.path.join(path, "done")
    if RANK == 0 and not os.path.exists(done):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config())
        # Several stop tokens: sampled completions end at different lengths.
        model.generation_config.eos_token_id = [1, *range(3, 11)]
        model.save_pretrained(path)
        tokenizer().save_pretrained(path)
        open(done, "w").close()
    deadline = time.time() + 120
    while not os.path.exists(done):
        if time.time() > deadline:
            raise TimeoutError(f"{done} did not appear")
        time.sleep(0.1)
    return path


def sentence(g, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def arguments(config_class, name, **extra):
    kwargs = dict(output_dir=os.path.join(OUT, f"{name}-{ENGINE}"), per_device_train_batch_size=2,
                  learning_rate=1e-3, max_steps=3, logging_steps=1, report_to=[], seed=0, use_cpu=True,
                  save_strategy="no", disable_tqdm=True, bf16=False, **extra)
    if ENGINE == "zeroshard":
        kwargs["deepspeed"] = DS_CONFIG
    return config_class(**kwargs)


def trainer_class(cls):
    return zeroshard.hf.trainer_class(cls) if ENGINE == "zeroshard" else cls


def logged(trainer, *keys):
    return {k: [h[k] for h in trainer.state.log_history if k in h and "train_runtime" not in h] for k in keys}


def frozen_facts(model):
    """What the engine keeps of an inference-only model on this rank."""
    params = list(model.parameters())
    return {"partitioned": all(zt.is_partitioned(p) for p in params),
            "trainable": sum(p.requires_grad for p in params),
            "grads": sum(p.grad is not None for p in params),
            "shard_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params),
            "full_bytes": sum(p.numel() * p.element_size() for p in params),
            # its whole gather kept for the next scoring call (it fits)
            "kept": all(p.zs is not None and p.zs.attached for p in params)}


def shared_dataset(data, name):
    """`data` saved by rank 0 and loaded from that folder on every rank:
    precompute_ref_log_probs caches its scores beside the dataset's files,
    which every rank must read (a dataset in memory keeps a cache per
    process)."""
    folder = os.path.join(OUT, f"{name}_data-{ENGINE}")
    if RANK == 0:
        data.save_to_disk(folder)
        open(folder + ".done", "w").close()
    while not os.path.exists(folder + ".done"):
        time.sleep(0.05)
    return load_from_disk(folder)


def run_dpo(path, precompute=False):
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_list([{"prompt": sentence(g, 4), "chosen": sentence(g, 3), "rejected": sentence(g, 5)}
                              for _ in range(16)])
    if precompute:
        data = shared_dataset(data, "dpo")
    # precompute_ref_log_probs: TRL scores the dataset with the reference in its __init__ and keeps none after.
    args = arguments(trl.DPOConfig, "dpo_precompute" if precompute else "dpo", max_length=32,
                     precompute_ref_log_probs=precompute)
    trainer = trainer_class(trl.DPOTrainer)(model=path, args=args, train_dataset=data)
    trainer.train()
    out = logged(trainer, "loss", "grad_norm", "rewards/margins")
    if ENGINE == "zeroshard" and not precompute:  # with precomputed log-probs TRL keeps no reference
        out["ref"] = frozen_facts(trainer.ref_model)
        out["optimized"] = sum(len(gr["params"]) for gr in trainer.optimizer.param_groups)
        out["policy_params"] = len(list(trainer.model.parameters()))
    return out


def count_w1(completions, **_):
    return [float(c.count("w1") + c.count("w2")) for c in completions]


def run_dpo_precompute(path):
    return run_dpo(path, precompute=True)


def run_grpo(path):
    g = torch.Generator().manual_seed(1)
    data = Dataset.from_list([{"prompt": sentence(g, 4)} for _ in range(16)])
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    args = arguments(trl.GRPOConfig, "grpo", num_generations=2, max_completion_length=8, beta=0.1)
    trainer = trainer_class(trl.GRPOTrainer)(model=model, reward_funcs=count_w1, args=args, train_dataset=data)
    trainer.train()
    out = logged(trainer, "loss", "reward", "kl", "completions/min_length", "completions/max_length")
    if ENGINE == "zeroshard":
        out["ref"] = frozen_facts(trainer.ref_model)
    return out


def run_grpo_reward_model(path):
    """GRPO scored by a reward model given as a path (TRL loads a sequence
    classifier from it, partitioned; frozen beside the policy)."""
    g = torch.Generator().manual_seed(5)
    data = Dataset.from_list([{"prompt": sentence(g, 4)} for _ in range(16)])
    args = arguments(trl.GRPOConfig, "grpo_rm", num_generations=2, max_completion_length=8)
    trainer = trainer_class(trl.GRPOTrainer)(model=path, reward_funcs=[count_w1, path], args=args,
                                             train_dataset=data)
    trainer.train()
    out = logged(trainer, "loss", "reward")
    out["reward_model"] = frozen_facts(trainer.reward_funcs[1])
    return out


def run_kto(path):
    g = torch.Generator().manual_seed(2)
    data = Dataset.from_list([{"prompt": sentence(g, 4), "completion": sentence(g, 3), "label": bool(i % 2)}
                              for i in range(16)])
    policy = transformers.AutoModelForCausalLM.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    trainer = trainer_class(trl.KTOTrainer)(model=policy, ref_model=ref,
                                            args=arguments(trl.KTOConfig, "kto", max_length=32), train_dataset=data)
    trainer.train()
    out = logged(trainer, "loss")
    if ENGINE == "zeroshard":
        out["ref"] = frozen_facts(trainer.ref_model)
    return out


def run_kto_precompute(path):
    # From the path (the policy, and no reference: TRL scores with the
    # policy in its construction), reference log-probs precomputed.
    g = torch.Generator().manual_seed(2)
    data = shared_dataset(Dataset.from_list([{"prompt": sentence(g, 4), "completion": sentence(g, 3),
                                              "label": bool(i % 2)} for i in range(16)]), "kto")
    args = arguments(trl.KTOConfig, "kto_precompute", max_length=32, precompute_ref_log_probs=True)
    trainer = trainer_class(trl.KTOTrainer)(model=path, args=args, train_dataset=data)
    trainer.train()
    return logged(trainer, "loss")


def run_reward(path):
    g = torch.Generator().manual_seed(3)
    data = Dataset.from_list([{"chosen": sentence(g, 6), "rejected": sentence(g, 5)} for _ in range(16)])
    trainer = trainer_class(trl.RewardTrainer)(model=path, args=arguments(trl.RewardConfig, "reward", max_length=32),
                                               train_dataset=data)
    trainer.train()
    return logged(trainer, "loss", "accuracy")


def run_rloo(path):
    g = torch.Generator().manual_seed(4)
    data = Dataset.from_list([{"prompt": sentence(g, 4)} for _ in range(16)])
    args = arguments(trl.RLOOConfig, "rloo", num_generations=2, max_completion_length=8)
    trainer = trainer_class(trl.RLOOTrainer)(model=path, reward_funcs=count_w1, args=args, train_dataset=data)
    trainer.train()
    return logged(trainer, "loss", "reward")


def run_distillation(path):
    # On-policy distillation: the student (from the path) samples, a teacher
    # (the same model, a module) scores; the teacher is inference-only.
    g = torch.Generator().manual_seed(5)
    data = Dataset.from_list([{"prompt": sentence(g, 4)} for _ in range(16)])
    teacher = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():  # another model than the student: a loss above 0
        for p in teacher.parameters():
            p.mul_(1.5)
    args = arguments(trl.DistillationConfig, "distillation", max_completion_length=8)
    trainer = trainer_class(trl.DistillationTrainer)(model=path, teacher_model=teacher, args=args,
                                                     train_dataset=data)
    trainer.train()
    out = logged(trainer, "loss")
    if ENGINE == "zeroshard":
        out["teacher"] = frozen_facts(trainer.teacher_model)
    return out


def run_weights(path):
    """A partitioned policy (from the path, trained one step by hand so its
    weights differ from the file's) streamed into a plain model with a
    bound of two of its largest params: equal to its gathered state_dict,
    the engine's gathered bytes never above the bound."""
    with zt.Init(config=DS_CONFIG):
        model = transformers.LlamaForCausalLM(llama_config())
    zt.partition_module(model)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    bound = 2 * largest
    ctx = zt.get_context()
    before = ctx.memory_by_kind()["gathered"]
    plain = transformers.LlamaForCausalLM(llama_config())
    target = dict(plain.named_parameters())
    target.update(dict(plain.named_buffers()))
    names, peak = [], 0
    with torch.no_grad():
        for name, tensor in zt.full_weights(model, max_bytes=bound):
            peak = max(peak, ctx.memory_by_kind()["gathered"] - before)
            target[name].copy_(tensor)
            names.append(name)
    full = model.state_dict()
    equal = all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
    return {"equal": equal, "names": sorted(names) == sorted(full.keys()), "peak_extra": peak, "bound": bound,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main():
    path = policy_dir()
    result = {}
    for name in sys.argv[2:]:
        result[name] = globals()[f"run_{name}"](path)
    for name, out in result.items():
        if "loss" in out:
            out["finite"] = all(math.isfinite(x) for x in out["loss"])
    if RANK == 0:
        with open(os.environ["ZS_TEST_RESULT"], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_without_teardown()
