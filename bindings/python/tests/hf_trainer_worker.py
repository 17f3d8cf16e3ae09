"""One rank of the Hugging Face Trainer tests, launched by zsrun or torchrun.

    zsrun -n N -- python3 hf_trainer_worker.py MODE[,MODE...] ENGINE

The same script as a user's: TrainingArguments with deepspeed= pointing at
a DeepSpeed JSON full of "auto"s, a small model from a config with random
weights, a random dataset; `Trainer` is transformers.Trainer under DDP
(ENGINE ddp) or zeroshard.hf.Trainer (ENGINE zeroshard), the one line that
differs. Rank 0 writes what the test checks as JSON to $ZS_TEST_RESULT;
outputs go under $ZS_TEST_DIR.

MODE: causal_lm, classifier, seq2seq (train, evaluate, predict; losses per
logged step), save (save_model, then from_pretrained unsharded), resume_save
/ resume_load (save_strategy "steps", then resume_from_checkpoint, maybe at
another world size). MODE@ENGINE runs one mode through another engine than
the launch's. ENGINE fsdp2: transformers.Trainer under Accelerate's FSDP2
code (FSDP2Trainer); zeroshard_fsdp2: the same FSDP2 arguments through
zeroshard.hf.Trainer; deepspeed: transformers.Trainer under DeepSpeed.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

import zeroshard.hf
from launch_env import exit_without_teardown

VOCAB, SEQ, N = 96, 16, 48

DS_CONFIG = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, kind, n=N, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
        self.kind = kind

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = self.ids[i]
        if self.kind == "classifier":
            return {"input_ids": x, "labels": int(x[0] % 3)}
        if self.kind == "seq2seq":
            return {"input_ids": x, "labels": x.flip(0)[: SEQ // 2]}
        return {"input_ids": x, "labels": x}


def build(kind):
    torch.manual_seed(0)
    if kind == "classifier":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    if kind == "seq2seq":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    # $ZS_TEST_GPT2 "WIDTHxLAYERS" (e.g. 512x8) for figures on a larger model; the tests use 32x2.
    width, layers = map(int, os.environ.get("ZS_TEST_GPT2", "32x2").split("x"))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=width, n_layer=layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


# The blocks an FSDP2 script's fsdp_config wraps, by model kind.
BLOCKS = {"causal_lm": "GPT2Block", "classifier": "BertLayer", "seq2seq": "T5Block"}


def arguments(engine, out, kind="causal_lm", state_dict_type="FULL_STATE_DICT", **extra):
    kwargs = dict(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0,
                  num_train_epochs=2, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True,
                  dataloader_drop_last=True, disable_tqdm=True, eval_strategy="no")
    kwargs.update(extra)
    if engine in ("zeroshard", "deepspeed"):  # "deepspeed": transformers.Trainer under DeepSpeed itself
        kwargs.setdefault("deepspeed", DS_CONFIG)
    elif engine in ("zeroshard_fsdp2", "fsdp2"):  # an FSDP2 Trainer script's arguments
        kwargs.update(fsdp="full_shard auto_wrap",
                      fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [BLOCKS[kind]],
                                   "state_dict_type": state_dict_type})
    return transformers.TrainingArguments(**kwargs)


class FSDP2Trainer(transformers.Trainer):
    """transformers.Trainer under Accelerate's FSDP2 code on a CPU world
    (ENGINE fsdp2). Accelerate takes FSDP on accelerators only and runs a
    CPU world as MULTI_CPU, its plugin ignored: the distributed type and
    plugin are set as AcceleratorState sets them on a GPU, the Trainer's
    is_fsdp_enabled as it derives it. From there prepare (fully_shard),
    the checkpoint's save and load are the Trainer's and Accelerate's own
    FSDP2 code."""

    def create_accelerator_and_postprocess(self):
        import accelerate
        from accelerate.utils import DistributedType
        super().create_accelerator_and_postprocess()
        self.accelerator.state.distributed_type = DistributedType.FSDP
        accelerate.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = accelerate.FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


def trainer_class(engine, kind):
    ours = engine.startswith("zeroshard")
    if kind == "seq2seq":
        return zeroshard.hf.Seq2SeqTrainer if ours else transformers.Seq2SeqTrainer
    if engine == "fsdp2":
        return FSDP2Trainer
    return zeroshard.hf.Trainer if ours else transformers.Trainer


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def mode_train(kind, engine, out):
    cls = trainer_class(engine, kind)
    # The causal LM with gradient checkpointing (recomputed forwards in backward).
    args = arguments(engine, out, kind, eval_strategy="steps", eval_steps=3,
                     gradient_checkpointing=kind == "causal_lm")
    if kind == "seq2seq":
        args = transformers.Seq2SeqTrainingArguments(**{**args.to_dict(), "predict_with_generate": True,
                                                       "generation_max_length": 6,
                                                       "deepspeed": args.deepspeed})
    model = build(kind)
    trainer = cls(model=model, args=args, train_dataset=Tokens(kind), eval_dataset=Tokens(kind, n=16, seed=1),
                  callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=100)]
                  if kind == "classifier" else None)
    if kind == "classifier":
        args.metric_for_best_model = "eval_loss"
    trainer.train()
    evaluated = trainer.evaluate()
    predicted = trainer.predict(Tokens(kind, n=24, seed=2))
    return {"losses": losses(trainer), "eval_loss": evaluated["eval_loss"],
            "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
            "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h],
            "lrs": [h.get("learning_rate") for h in trainer.state.log_history if "loss" in h],
            "predict_shape": list(predicted.predictions.shape
                                  if not isinstance(predicted.predictions, tuple) else
                                  predicted.predictions[0].shape),
            "predictions": (predicted.predictions if not isinstance(predicted.predictions, tuple)
                            else predicted.predictions[0]).reshape(-1)[:64].tolist() if kind == "seq2seq" else None,
            "partitioned": all(zeroshard.torch.is_partitioned(p) for p in model.parameters())
            if engine.startswith("zeroshard") else False,
            "fsdp_units": sorted(type(m).__name__ for m in model.modules() if "_zs_fsdp" in m.__dict__)}


def mode_optim(optim, engine, out):
    """TrainingArguments(optim=...) naming a torch optimizer other than AdamW
    (transformers' Adafactor, torch's RMSprop): under zeroshard it steps the
    shards (Adafactor each tensor whole, on its owner rank)."""
    args = arguments(engine, out, optim=optim, num_train_epochs=1)
    trainer = trainer_class(engine, "causal_lm")(model=build("causal_lm"), args=args,
                                                 train_dataset=Tokens("causal_lm"))
    trainer.train()
    return {"losses": losses(trainer), "optimizer": type(trainer.optimizer.optimizer
                                                         if hasattr(trainer.optimizer, "optimizer")
                                                         else trainer.optimizer).__name__,
            "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h]}


MUON_SECTION = {"type": "Muon", "params": {"lr": "auto", "muon_lr": 0.02, "momentum": 0.9, "betas": "auto",
                                           "eps": "auto", "weight_decay": "auto", "ns_method": "gram"}}


def mode_muon_config(engine, out):
    """DeepSpeed's Muon from the JSON ("optimizer": {"type": "Muon", ...})
    under zeroshard; under DDP the Trainer gets DeepSpeed's own
    MuonWithAuxAdam over the same groups (the Trainer's decay groups, each
    split into Muon and AdamW halves by DeepSpeed's rule)."""
    args = arguments(engine, out, num_train_epochs=1)
    model = build("causal_lm")
    optimizers = (None, None)
    if engine == "zeroshard":
        args.deepspeed = dict(DS_CONFIG, optimizer=MUON_SECTION)
        args = transformers.TrainingArguments(**{**args.to_dict(), "deepspeed": args.deepspeed})
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        from launch_env import deepspeed_gram_in_fp32
        deepspeed_gram_in_fp32()
        torch.compiler.set_stance("force_eager")  # DeepSpeed compiles its Muon update: eager, the same math
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        hidden = {id(p) for g in zeroshard.torch.muon_param_groups(model) if g["use_muon"] for p in g["params"]}
        groups = []
        for names_decay in (True, False):
            for use_muon in (True, False):
                params = [p for n, p in model.named_parameters()
                          if (n in decay) is names_decay and (id(p) in hidden) is use_muon]
                wd = args.weight_decay if names_decay else 0.0
                if params:
                    groups.append(dict(params=params, use_muon=True, lr=0.02, momentum=0.9, weight_decay=wd,
                                       ns_method="gram") if use_muon else
                                  dict(params=params, use_muon=False, lr=args.learning_rate, weight_decay=wd,
                                       betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon))
        optimizers = (MuonWithAuxAdam(groups), None)
    trainer = trainer_class(engine, "causal_lm")(model=model, args=args, train_dataset=Tokens("causal_lm"),
                                                 optimizers=optimizers)
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {"losses": losses(trainer), "optimizer": type(opt).__name__, "kind": getattr(opt, "kind", None),
            "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h],
            "muon_groups": sum(1 for g in opt.param_groups if g["use_muon"])}


def mode_save(kind, engine, out):
    args = arguments(engine, out, num_train_epochs=1)
    model = build(kind)
    trainer = trainer_class(engine, kind)(model=model, args=args, train_dataset=Tokens(kind))
    trainer.train()
    final = os.path.join(out, "final")
    trainer.save_model(final)
    sd = model.state_dict()  # full values (gathered under zeroshard), every rank
    dist.barrier()
    back = type(model).from_pretrained(final)
    same = all(torch.equal(back.state_dict()[k], v) for k, v in sd.items() if k in back.state_dict())
    return {"files": sorted(os.listdir(final)), "equal": same,
            "keys_missing": sorted(set(sd) - set(back.state_dict()))}


def mode_resume(kind, engine, out, phase):
    # 8 optimizer steps of a global batch of 12 (2 or 3 ranks); the run saves at step 4.
    # Phase "save" or "load", "_s2bf16" after it: bf16 in the same script,
    # and under a DeepSpeed JSON ZeRO stage 2 (DeepSpeed's stage-2 layout);
    # "_s1": fp32 under a ZeRO stage 1 JSON (the same files as stage 2's);
    # "_bf16": bf16 under the ZeRO-3 JSON; "_lora": a PEFT LoRA model; "_full": FSDP2's
    # arguments with FULL_STATE_DICT (else SHARDED_STATE_DICT).
    phase, _, variant = phase.partition("_")
    extra_args = {}
    if variant in ("s2bf16", "bf16"):
        extra_args["bf16"] = True
    if variant == "s2bf16" and engine in ("zeroshard", "deepspeed"):
        extra_args["deepspeed"] = dict(DS_CONFIG, zero_optimization={"stage": 2, "overlap_comm": True})
    if variant == "s1" and engine in ("zeroshard", "deepspeed"):
        extra_args["deepspeed"] = dict(DS_CONFIG, zero_optimization={"stage": 1})
    args = arguments(engine, out, save_strategy="steps", save_steps=4, max_steps=8, num_train_epochs=1,
                     gradient_accumulation_steps=1,
                     state_dict_type="FULL_STATE_DICT" if variant == "full" else "SHARDED_STATE_DICT",
                     per_device_train_batch_size=12 // int(os.environ["WORLD_SIZE"]),
                     **extra_args)
    model = build(kind)
    if variant == "lora":  # "_lora": LoRA adapters (PEFT) on the frozen base; checkpoints hold the adapters alone
        import peft
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                           lora_dropout=0.0, fan_in_fan_out=True))
    extra = {}
    if engine.startswith("zeroshard") and os.environ.get("ZS_TEST_ASYNC_CHECKPOINT") == "1":
        extra["async_checkpoint"] = True
    if engine == "zeroshard" and os.environ.get("ZS_TEST_DEEPSPEED_CHECKPOINT"):
        # DeepSpeed ZeRO-3's layout beside the engine's, for this world size or the one named
        given = os.environ["ZS_TEST_DEEPSPEED_CHECKPOINT"]
        extra["deepspeed_checkpoint"] = True if given == "1" else int(given.removeprefix("world"))
    if engine.startswith("zeroshard") and os.environ.get("ZS_TEST_FSDP_CHECKPOINT") == "1":
        extra["fsdp_checkpoint"] = True  # FSDP2's sharded layout beside the engine's
    trainer = trainer_class(engine, kind)(model=model, args=args, train_dataset=Tokens(kind, n=96), **extra)
    timed = {}  # seconds of each save and load step, for the figures in docs/checkpoints.md
    if phase == "save":
        layout = _time(trainer, "_save_deepspeed_layout", timed, "deepspeed_layout_s") \
            if "deepspeed_checkpoint" in extra else contextlib.nullcontext()
        with _time(trainer, "_save_optimizer_and_scheduler", timed, "save_s"), layout:
            trainer.train()
    else:  # this engine's own checkpoint, or the one $ZS_TEST_RESUME_ENGINE's run of this mode wrote
        root = os.environ.get("ZS_TEST_RESUME_ROOT")  # under its ZS_TEST_DIR
        saved = os.path.join(root, "_".join(["resume_save", *([variant] if variant else [])]),
                             os.environ["ZS_TEST_RESUME_ENGINE"]) if root else out
        import transformers.trainer as hf_trainer
        # DeepSpeed's load_checkpoint as the Trainer calls it (under DeepSpeed only)
        # and the Trainer's two load steps (weights; optimizer and scheduler), whichever engine
        with _time(hf_trainer, "deepspeed_load_checkpoint", timed, "load_s"), \
                _time(trainer, "_load_from_checkpoint", timed, "load_weights_s"), \
                _time(trainer, "_load_optimizer_and_scheduler", timed, "load_optimizer_s"):
            trainer.train(resume_from_checkpoint=os.path.join(saved, "checkpoint-4"))
    model_type = type(trainer.model_wrapped).__name__
    return {"losses": losses(trainer), "steps": trainer.state.global_step, "model_type": model_type,
            "lr": trainer.lr_scheduler.get_last_lr()[0], **timed}


@contextlib.contextmanager
def _time(owner, name, into, key):
    """owner.name timed while in the block: each call's seconds appended to
    into[key]; put back after."""
    import time
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.setdefault(key, []).append(time.perf_counter() - t)
    setattr(owner, name, timed)
    try:
        yield
    finally:
        if owner.__dict__.get(name) is timed:
            if isinstance(owner, type) or not hasattr(type(owner), name):
                setattr(owner, name, inner)
            else:
                delattr(owner, name)  # the instance's own copy: the class's method again


def mode_pretrained(engine, out):
    """args, then from_pretrained, then the Trainer: DeepSpeed's order, in
    which the model is partitioned as it loads."""
    args = arguments(engine, out, num_train_epochs=1)
    directory = os.path.join(os.environ["ZS_TEST_DIR"], "pretrained")
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        build("causal_lm").save_pretrained(directory)
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    partitioned = all(zeroshard.torch.is_partitioned(p) for p in model.parameters())
    from safetensors.torch import load_file
    saved = load_file(os.path.join(directory, "model.safetensors"))
    with (zeroshard.torch.GatheredParameters(list(model.parameters())) if partitioned else contextlib_null()):
        loaded = all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters() if n in saved)
    trainer = trainer_class(engine, "causal_lm")(model=model, args=args, train_dataset=Tokens("causal_lm"))
    trainer.train()
    return {"partitioned_at_load": partitioned, "loaded": loaded, "losses": losses(trainer)}


def mode_lora(engine, out):
    """A LoRA adapter (PEFT) on a frozen base loaded by from_pretrained
    (partitioned at load under zeroshard): only the adapters train."""
    import peft
    args = arguments(engine, out, num_train_epochs=1)
    directory = os.path.join(os.environ["ZS_TEST_DIR"], "pretrained")
    if dist.get_rank() == 0 and not os.path.isdir(directory):
        build("causal_lm").save_pretrained(directory)
    dist.barrier()
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                      lora_dropout=0.0, fan_in_fan_out=True))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    trainer = trainer_class(engine, "causal_lm")(model=model, args=args, train_dataset=Tokens("causal_lm"))
    frozen_before = {n: v.clone() for n, v in model.state_dict().items() if "lora_" not in n}
    trainer.train()
    frozen_after = model.state_dict()
    adapter = os.path.join(out, "adapter")
    trainer.save_model(adapter)
    return {"losses": losses(trainer), "trainable": trainable,
            "base_unchanged": all(torch.equal(v, frozen_after[n]) for n, v in frozen_before.items()),
            "adapter_files": sorted(os.listdir(adapter)) if dist.get_rank() == 0 else None}


def mode_sft(engine, out):
    """TRL's SFTTrainer on text through a tokenizer built here (no Hub):
    zeroshard.hf.trainer_class(SFTTrainer) against SFTTrainer under DDP."""
    import datasets
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (12,), generator=g)) for _ in range(N)]
    config = trl.SFTConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           learning_rate=3e-3, num_train_epochs=2, logging_steps=1, report_to=[], use_cpu=True,
                           save_strategy="no", seed=0, data_seed=0, max_length=SEQ, disable_tqdm=True, bf16=False,
                           deepspeed=DS_CONFIG if engine == "zeroshard" else None)
    model = build("causal_lm")
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    cls = zeroshard.hf.trainer_class(trl.SFTTrainer) if engine == "zeroshard" else trl.SFTTrainer
    trainer = cls(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                  processing_class=tokenizer)
    trainer.train()
    return {"losses": losses(trainer)}


def mode_bf16(engine, out):
    """TrainingArguments(bf16=True) and the JSON's "bf16": "auto": bf16
    params on fp32 masters under zeroshard (DeepSpeed's reading), bf16
    autocast over fp32 params under DDP."""
    args = arguments(engine, out, bf16=True)
    model = build("causal_lm")
    trainer = trainer_class(engine, "causal_lm")(model=model, args=args, train_dataset=Tokens("causal_lm"))
    trainer.train()
    return {"losses": losses(trainer), "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


def mode_compiled(engine, out):
    """TrainingArguments(torch_compile=True): the GPT-2 compiled (whole,
    as Accelerate compiles it) over one epoch."""
    model = build("causal_lm")
    args = arguments(engine, out, torch_compile=True, num_train_epochs=1)
    trainer = trainer_class(engine, "causal_lm")(model=model, args=args, train_dataset=Tokens("causal_lm"))
    trainer.train()
    compiled = trainer.model_wrapped is not model and hasattr(trainer.model_wrapped, "_orig_mod")
    return {"losses": losses(trainer), "compiled": compiled,
            "partitioned": all(zeroshard.torch.is_partitioned(p) for p in model.parameters())
            if engine.startswith("zeroshard") else False,
            "fsdp_units": sorted(type(m).__name__ for m in model.modules() if "_zs_fsdp" in m.__dict__)}


def mode_resize(engine, out):
    """model.resize_token_embeddings(VOCAB + 7) (the new rows drawn from the
    old rows' mean and covariance, HF's default), then training: on a
    model from_pretrained partitioned under zeroshard, unsharded under DDP."""
    model = build("causal_lm")
    # A folder per rank: ranks writing one folder at once race (torch.distributed
    # is not up yet to order them); the weights are the same (seeded).
    mine = os.path.join(out, "rank" + os.environ.get("RANK", "0"))
    model.save_pretrained(os.path.join(mine, "base"))
    args = arguments(engine, out, num_train_epochs=1)
    torch.manual_seed(0)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(mine, "base"))
    torch.manual_seed(1)
    loaded.resize_token_embeddings(VOCAB + 7)
    shapes = {n: list(p.shape) for n, p in loaded.named_parameters()}
    trainer = trainer_class(engine, "causal_lm")(model=loaded, args=args, train_dataset=Tokens("causal_lm"))
    trainer.train()
    # An untied head (Llama): transformers replaces the head module.
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    if dist.get_rank() == 0:  # the Trainer started torch.distributed: rank 0 writes
        llama.save_pretrained(os.path.join(out, "llama"))
    dist.barrier()
    llama = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "llama"))
    torch.manual_seed(2)
    llama.resize_token_embeddings(VOCAB + 5)
    untied = {n: list(p.shape) for n, p in llama.named_parameters() if "embed" in n or "lm_head" in n}
    if engine == "zeroshard":
        zeroshard.torch.partition_module(llama)
    ids = Tokens("causal_lm")[0]["input_ids"][None]
    with torch.no_grad():
        untied_loss = float(llama(input_ids=ids, labels=ids).loss)
    return {"losses": losses(trainer), "shapes": shapes, "untied_shapes": untied, "untied_loss": untied_loss,
            "untied_partitioned": all(zeroshard.torch.is_partitioned(p) for p in llama.parameters()),
            "vocab": loaded.config.vocab_size,
            "partitioned": all(zeroshard.torch.is_partitioned(p) for p in loaded.parameters())
            if engine == "zeroshard" else False}


def run(mode, engine, out):
    modes = {"sft": mode_sft, "bf16": mode_bf16, "lora": mode_lora, "pretrained": mode_pretrained,
             "compiled": mode_compiled, "resize": mode_resize, "muon_config": mode_muon_config}
    if mode in modes:
        return modes[mode](engine, out)
    if mode == "save":
        return mode_save("causal_lm", engine, out)
    if mode.startswith("optim_"):
        return mode_optim(mode[len("optim_"):], engine, out)
    if mode.startswith("resume_"):
        return mode_resume("causal_lm", engine, out, mode[len("resume_"):])
    return mode_train(mode, engine, out)


def main():
    modes, engine = sys.argv[1].split(","), sys.argv[2]
    if len(modes) == 1:
        name, _, own = modes[0].partition("@")  # MODE@ENGINE: see below
        result = run(name, own or engine, os.path.join(os.environ["ZS_TEST_DIR"], own or engine))
    else:
        # Several modes in this launched world, one after another, each in a
        # folder of its own and ending with zeroshard's shutdown as a launch
        # of its own would: {mode: its result}.
        result, top = {}, os.environ["ZS_TEST_DIR"]
        for mode in modes:
            # MODE@ENGINE: this mode through another engine than the launch's
            name, _, own = mode.partition("@")
            os.environ["ZS_TEST_DIR"] = os.path.join(top, name)
            result[mode] = run(name, own or engine, os.path.join(os.environ["ZS_TEST_DIR"], own or engine))
            dist.barrier()
            zeroshard.torch.shutdown()
    if dist.get_rank() == 0:
        with open(os.environ["ZS_TEST_RESULT"], "w") as f:
            json.dump(result, f)
    dist.barrier()
    zeroshard.torch.shutdown()
    dist.destroy_process_group()
    # torch's Gloo worker thread can still drop a finished barrier's Python
    # tensors while the interpreter finalises, which aborts the process
    # (about 1 run in 8 of the DDP reference, zeroshard or not); the
    # results are written, so leave without finalising.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
