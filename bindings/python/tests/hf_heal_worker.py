"""One rank of the Hugging Face Trainer healing tests: a plain Trainer
script (zeroshard.hf.Trainer, a GPT-2 with dropout from a config, random
tokens, no checkpoint saving), launched by `zsrun --restarts R`, which a
rank may leave by SIGKILL.

    python3 hf_heal_worker.py OUT STEPS [KILL ...]

KILL is RANK:STEP:WHERE (STEP counts from 1, as the Trainer's global_step):
"after" (once step STEP's optimizer step and bookkeeping are done, before
its logging: a callback's on_step_end), "backward" (in the middle of step
STEP's second micro-batch's backward, from a hook on the first block's
output), "update" (in the engine's optimizer update of step STEP, its
fault point ZS_FAULT_POINT=update:RANK:STEP), "norm_allreduce" (in the
optimizer step, before the gradient norm's all-reduce: not committed, the
survivors redo the step from their optimizer step), "generate" (GRPO: in
step STEP's generation, at its third forward without gradients: the
survivors are in generate()'s gathers) or "eval" (in the evaluation
after step STEP, at its second batch; $ZS_TEST_EVAL_STEPS > 0 evaluates
every that many steps on a held-out set). $ZS_TEST_SEQ2SEQ=1: a T5 with
zeroshard.hf.Seq2SeqTrainer instead, its evaluation generating
(predict_with_generate: the eval's kill falls between generate() calls,
whose gathers the survivors are in). $ZS_TEST_PRETRAINED: the model
from_pretrained from that folder instead, partitioned as it loads (a
replacement reads nothing). $ZS_TEST_TRL_DPO=1 (with
$ZS_TEST_PRETRAINED): TRL's DPOTrainer on preference pairs made of the
tokens, its reference model loaded by TRL from the same folder (frozen, in
no optimizer). $ZS_TEST_TRL_GRPO=1 (with $ZS_TEST_PRETRAINED): TRL's
GRPOTrainer on prompts made of the tokens, 2 completions of up to 8
tokens each sampled and scored by a count of words, a reference model
(beta 0.1) from the same folder, one generation serving 2 optimizer steps
(steps_per_generation 4: completions buffered across steps).
$ZS_TEST_TRL_SFT=1: TRL's SFTTrainer
(zeroshard.hf.trainer_class) on the same GPT-2 and tokens, as a dataset
of input_ids with a word-level tokenizer: its metrics (entropy, token
accuracy, token count) are gathered in every forward and logged.
$ZS_TEST_ITERABLE=1: the tokens as an IterableDataset, whose batches
Accelerate dispatches from rank 0 (a Trainer that does not heal);
$ZS_TEST_ITERABLE=own: the same stream with accelerator_config's
dispatch_batches=False (each rank reads it and keeps its own slice).
$ZS_TEST_LOGGING_STEPS: the Trainer's logging_steps (5). $ZS_TEST_SHRUNK_PAUSE_S:
after each step taken on fewer ranks than were
started (a shrink, under zsrun --shrink), sleep that long. $ZS_TEST_COUNT_FORWARDS=1:
the model has a persistent buffer counting its training forwards (as
BatchNorm's batch count), logged at each step. Only a rank's first process
kills itself. What differs from a user's script is only that, and what it
writes for the test: each process appends JSON lines to OUT.<rank> (its
steps with times; at the end its optimizer state's hash and step count,
and rank 0 the consolidated params' hash and the Trainer's log history).
"""
import hashlib
import json
import os
import signal
import sys
import time

import torch
import transformers

import zeroshard.hf
import zeroshard.torch as zt
from launch_env import exit_without_teardown

VOCAB, SEQ = 96, 16
CONFIG = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"},
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed=0):
        self.ids = torch.randint(2, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


TIMING = ("runtime", "samples_per_second", "steps_per_second", "step_time")  # step_time: GRPO's


def word_tokenizer():
    """A tokenizer for the random tokens (no download): word t<i> is id i,
    t0 the padding and t1 the end of a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def saved_files(folder):
    """{path under folder: sha256} of every file the saves wrote; of a
    trainer_state.json, without the timings in its log history."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            if name == "trainer_state.json":
                state = json.loads(data)
                state["log_history"] = [{k: v for k, v in e.items() if not k.endswith(TIMING)}
                                        for e in state["log_history"]]
                data = json.dumps(state, sort_keys=True).encode()
            found[os.path.relpath(path, folder)] = hashlib.sha256(data).hexdigest()
    return found


def main():
    out, steps = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    first = os.environ.get("ZS_HEAL_REPLACEMENT", "") in ("", "0") and \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    kills = [tuple(k.split(":")) for k in sys.argv[3:]]
    mine = {(int(s), where) for r, s, where in kills if int(r) == rank} if first else set()
    save_steps = int(os.environ.get("ZS_TEST_SAVE_STEPS", "0"))
    faults = []
    for s, where in mine:
        if where in ("update", "norm_allreduce"):  # the engine's fault points, passed once a step
            faults.append(f"{where}:{rank}:{s}")
        if where == "save":  # passed once a save, its file written
            faults.append(f"save:{rank}:{s // save_steps}")
    if faults:
        os.environ["ZS_FAULT_POINT"] = ",".join(faults)
    log = open(f"{out}.{rank}", "a")

    def note(**kv):
        log.write(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(), **kv}) + "\n")
        log.flush()

    def die(step, where):
        note(event="kill", step=step, where=where)
        os.kill(os.getpid(), signal.SIGKILL)

    eval_steps = int(os.environ.get("ZS_TEST_EVAL_STEPS", "0"))
    seq2seq = os.environ.get("ZS_TEST_SEQ2SEQ") == "1"
    sft = os.environ.get("ZS_TEST_TRL_SFT") == "1"
    arguments, trainer_class = (transformers.Seq2SeqTrainingArguments, zeroshard.hf.Seq2SeqTrainer) if seq2seq \
        else (transformers.TrainingArguments, zeroshard.hf.Trainer)
    generation = {"predict_with_generate": True, "generation_max_length": 6} if seq2seq else {}
    dpo = os.environ.get("ZS_TEST_TRL_DPO") == "1"
    rloo = os.environ.get("ZS_TEST_TRL_RLOO") == "1"  # GRPO's setting, TRL's RLOOTrainer
    # GRPO's setting, TRL's DistillationTrainer (its teacher from $ZS_TEST_TEACHER)
    distill = os.environ.get("ZS_TEST_TRL_DISTILLATION") == "1"
    grpo = os.environ.get("ZS_TEST_TRL_GRPO") == "1" or rloo or distill
    reward = os.environ.get("ZS_TEST_TRL_REWARD") == "1"
    kto = os.environ.get("ZS_TEST_TRL_KTO") == "1"
    if sft or dpo or grpo or reward or kto:
        import trl
        arguments, trainer_class = (trl.DPOConfig, zeroshard.hf.trainer_class(trl.DPOTrainer)) if dpo else \
            (trl.RewardConfig, zeroshard.hf.trainer_class(trl.RewardTrainer)) if reward else \
            (trl.KTOConfig, zeroshard.hf.trainer_class(trl.KTOTrainer)) if kto else \
            (trl.SFTConfig, zeroshard.hf.trainer_class(trl.SFTTrainer))
        generation = {"max_length": SEQ, "bf16": False}  # TRL's configs default to bf16 where torch has it
        if grpo:
            arguments, trainer_class = (trl.RLOOConfig, zeroshard.hf.trainer_class(trl.RLOOTrainer)) if rloo else \
                (trl.GRPOConfig, zeroshard.hf.trainer_class(trl.GRPOTrainer))
            generation = {"bf16": False, "num_generations": 2, "max_completion_length": 8, "beta": 0.1,
                          "steps_per_generation": 4}
            if distill:
                arguments, trainer_class = trl.DistillationConfig, zeroshard.hf.trainer_class(trl.DistillationTrainer)
                generation = {"bf16": False, "max_completion_length": 8}
    iterable = os.environ.get("ZS_TEST_ITERABLE", "")
    args = arguments(
        output_dir=os.path.join(os.path.dirname(out), "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, max_steps=steps,
        lr_scheduler_type="linear", warmup_steps=5,
        logging_steps=int(os.environ.get("ZS_TEST_LOGGING_STEPS", "5")), report_to=[], seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        data_seed=0, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True, deepspeed=CONFIG,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None, per_device_eval_batch_size=2,
        **({"accelerator_config": {"dispatch_batches": False}} if iterable == "own" else {}), **generation)
    pretrained = os.environ.get("ZS_TEST_PRETRAINED")
    if dpo or grpo or kto:
        model = pretrained  # TRL loads the policy and its reference from the folder
    elif reward:  # a scalar head on a small GPT-2 (dropout 0.1 everywhere)
        torch.manual_seed(0)
        model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, num_labels=1, pad_token_id=0))
    elif pretrained:  # partitioned as it loads (the arguments' deepspeed= registers the config)
        model = transformers.GPT2LMHeadModel.from_pretrained(pretrained)
    elif seq2seq:
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1))  # dropout 0.1
    else:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2))  # dropout 0.1 everywhere
    world = int(os.environ["WORLD_SIZE"])
    data = Tokens(steps * 2 * 2 * world)
    if iterable:  # a streamed dataset: Accelerate dispatches its batches, or (own) each rank reads it
        rows = data

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (rows[i] for i in range(len(rows)))

        data = Stream()
    extra = {}
    if sft:
        import datasets
        data = datasets.Dataset.from_dict({"input_ids": data.ids.tolist()})
        extra["processing_class"] = word_tokenizer()
    words = lambda row: " ".join(f"t{int(i)}" for i in row)  # noqa: E731  (tokens as word_tokenizer's words)
    if dpo:  # preference pairs in words; the policy and its reference loaded from $ZS_TEST_PRETRAINED
        import datasets
        data = datasets.Dataset.from_dict({"prompt": [words(r[:6]) for r in data.ids],
                                           "chosen": [words(r[6:11]) for r in data.ids],
                                           "rejected": [words(r[11:]) for r in data.ids]})
        extra["processing_class"] = word_tokenizer()
    if reward or kto:  # preference pairs (reward), or completions marked desirable or not (KTO), in words
        import datasets
        data = datasets.Dataset.from_dict(
            {"chosen": [words(r[:7]) for r in data.ids], "rejected": [words(r[7:]) for r in data.ids]} if reward
            else {"prompt": [words(r[:6]) for r in data.ids], "completion": [words(r[6:11]) for r in data.ids],
                  "label": [bool(i % 2) for i in range(len(data.ids))]})
        extra["processing_class"] = word_tokenizer()
    if grpo:  # prompts in words, completions scored by how many words t5.. (sampled: the RNG matters)
        import datasets
        data = datasets.Dataset.from_dict({"prompt": [words(r[:6]) for r in data.ids]})
        extra = {"processing_class": word_tokenizer(),
                 "reward_funcs": lambda completions, **_: [float(c.count("t5")) for c in completions]}
        if distill:  # another model than the student ($ZS_TEST_TEACHER): a loss above 0
            extra = {"processing_class": word_tokenizer(), "teacher_model": os.environ["ZS_TEST_TEACHER"]}

    class Scaffold(transformers.TrainerCallback):
        """The kills, and the steps' times for the test."""
        micro = evaluated = 0

        def on_step_begin(self, args, state, control, **kw):
            self.micro = 0
            note(event="begin", step=state.global_step + 1)

        def on_substep_end(self, args, state, control, **kw):
            self.micro += 1

        def on_step_end(self, args, state, control, **kw):
            live = zt.get_context().live_ranks
            note(event="step", step=state.global_step, live=live,
                 **({"forwards": int(trainer.model.forwards)} if counting else {}))
            if len(live) < world:
                time.sleep(shrunk_pause)  # time for a rank left out to come back
            self.evaluated = 0
            if (state.global_step, "after") in mine:
                die(state.global_step, "after")

        def on_prediction_step(self, args, state, control, **kw):
            self.evaluated += 1
            if (state.global_step, "eval") in mine and self.evaluated == 2:
                die(state.global_step, "eval")

    shrunk_pause = float(os.environ.get("ZS_TEST_SHRUNK_PAUSE_S", "0"))
    counting = os.environ.get("ZS_TEST_COUNT_FORWARDS") == "1"
    if counting:  # a buffer training writes, as BatchNorm's batch count: one a training forward
        model.register_buffer("forwards", torch.zeros((), dtype=torch.long))

        def count_forward(module, _):
            if module.training:
                module.forwards.add_(1)
        model.register_forward_pre_hook(count_forward)
    scaffold = Scaffold()
    held_out = Tokens(4 * 2 * world, seed=1) if eval_steps else None  # 4 batches a rank
    trainer = trainer_class(model=model, args=args, train_dataset=data, eval_dataset=held_out,
                            callbacks=[scaffold], **extra)
    model = trainer.model

    generating = [0]  # forwards without gradients in this step's first micro-batch (GRPO's generation)

    def on_block(module, inputs, output):
        step = trainer.state.global_step + 1
        if (step, "generate") in mine and scaffold.micro == 0 and not torch.is_grad_enabled():
            generating[0] += 1
            if generating[0] == 3:
                die(step, "generate")
        hidden = output[0] if isinstance(output, tuple) else output
        # (KTO runs a forward without gradients for its KL term too.)
        if model.training and (step, "backward") in mine and scaffold.micro == 1 and hidden.requires_grad:
            hidden.register_hook(lambda grad: die(step, "backward"))

    (model.encoder.block[0] if seq2seq else model.transformer.h[0]).register_forward_hook(on_block)
    trainer.train()

    # This rank's optimizer state and step count, hashed; rank 0: the
    # consolidated params' hash and the log.
    digest, taken, params = zt.training_digest(trainer.optimizer, trainer.model)
    if rank == 0:
        note(event="params", sha256=params, log_history=trainer.state.log_history, saved=saved_files(args.output_dir))
    note(event="end", digest=digest, steps=taken, global_step=trainer.state.global_step,
         lr=trainer.optimizer.param_groups[0]["lr"])
    zt.shutdown()


if __name__ == "__main__":
    main()
    exit_without_teardown()
