"""zeroshard.hf.Trainer heals a lost rank in place (docs/healing.md, section
3, landing step 5): under `zsrun --restarts` a plain Trainer script, unchanged,
loses a rank and goes on with a replacement that zsrun starts with its id,
the survivors' processes kept and nothing read from disk.

Survivors. Every engine call after a loss raises RankLostError, and so does
torch.distributed, which runs over the engine's world group while healing
(torch/heal_dist.py). Where the Trainer's step is cut short:
- in the token count's gather that opens a step (_get_num_items_in_batch),
  in a micro-batch's forward or backward (training_step), or in the
  optimizer step before it commits: heal (zeroshard.torch.heal.recover),
  then redo the step so far with the same batches and RNG: the count's
  gather, every micro-batch's training_step, then the cut one (the losses
  the Trainer already added are not added again);
- in the optimizer step after it committed (the survivors' agreement says
  so): heal, and the Trainer goes on as after any step;
- in the logging, evaluation or save after a step
  (_maybe_log_save_evaluate): heal, and run it again with the replacement.

The replacement runs the same script from the top. Its model is built
without a collective or a disk read; train() creates the optimizer, joins
(the engine hands it its shards from its holder's copy), and resumes
through the Trainer's own resume path: a folder holding only
trainer_state.json (the survivors' TrainerState), in /dev/shm where there
is one; the scheduler, the optimizers' hyper-parameters and this rank's RNG
come from the heal, not the folder. The survivors' state says where they
are: after a step's bookkeeping ("next"), inside its logging ("log"), or
one step behind (the loss came in the update of a step that committed):
the replacement then does that step's bookkeeping and logging itself, so
that its collectives line up with the survivors'.

Heals: transformers.Trainer itself, its Seq2SeqTrainer (whose training
is the Trainer's; its evaluation, generate() included, is run again as any
evaluation cut short) and TRL's SFTTrainer, DPOTrainer, GRPOTrainer,
RLOOTrainer, RewardTrainer and KTOTrainer
(whose forwards add gathered metrics and a token count: taken at a step's
opening and put back before a redo, kept across a logging run again,
handed to a replacement; DPO's, KTO's, GRPO's and RLOO's reference
model, frozen in no optimizer, rides in the peer copy; GRPO's and RLOO's
generation, scoring and buffering is part of its step's first
micro-batch and is redone with it, its micro-batch count and token count
put back first, and completions buffered for later steps ride in the
rank's blob), not other subclasses, nor GRPO or RLOO with vLLM, adaptive
entropy, environments or a rollout function (state outside the step), nor
DPO or KTO with precompute_ref_log_probs (scored in the construction), with
the engine's optimizer (AdamW, Adam or SGD), when the context keeps peer
copies: under zsrun --restarts (ZS_HEAL=auto) for a model this Trainer
partitions or from_pretrained loads partitioned (both keep the copies on);
one built under zeroshard.torch.Init by the script itself needs
zeroshard.torch.enable_healing() first.

Under zeroshard.healing.min_ranks (zsrun --min-nproc M --shrink) the
survivors go on without a lost rank in memory and take it back at a step
(torch/heal_world.py): Accelerate's process index and count follow, a
redone step counts its tokens again over the live ranks, and the rank
that comes back takes the others' mean of the loss summed since the last
log (_zs_even_out).
"""
import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers

from .. import torch as zt
from ..errors import RankLostError, StateLostError
from ..torch import _context, heal, heal_dist, heal_state, heal_world
from . import accelerate_heal

HEAL_FOLDER_PREFIX = "zeroshard-heal-"


# TRL's trainers whose steps are the Trainer's plus gathered metrics
# (metrics_state): SFT's, the reward model's, DPO's and KTO's (whose
# reference model, frozen in no optimizer, rides in the first optimizer's
# peer copy) and GRPO's and RLOO's (whose first micro-batch of a
# generation generates, scores and buffers completions: redone with the
# step, its counters put back first).
_TRL_HEALING = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RLOOTrainer", "RewardTrainer", "KTOTrainer",
                "DistillationTrainer")


def _is_trl_healing(base):
    return base.__name__ in _TRL_HEALING and base.__module__.split(".")[0] == "trl"


def _grpo_why_not(arguments):
    """Why a GRPOTrainer or RLOOTrainer made with these __init__ arguments
    cannot heal, or None: what its generation keeps outside the step this
    module redoes."""
    args = arguments.get("args")
    if getattr(args, "use_vllm", False):
        return "use_vllm generates in a vLLM engine, which nothing here heals"
    if getattr(args, "use_adaptive_entropy", False):
        return "use_adaptive_entropy steers a coefficient from every step's entropies, which no heal hands over"
    for name in ("environment_factory", "rollout_func"):
        if arguments.get(name) is not None:
            return f"{name} keeps state of its own, which a redone step would advance twice"
    return None


def _precompute_why_not(arguments):
    """Why a DPOTrainer or KTOTrainer made with these __init__ arguments
    cannot heal, or None: precompute_ref_log_probs scores the dataset in
    the trainer's construction, which a replacement would run on its own
    before it joins (refused there by name, a job restart after all)."""
    if getattr(arguments.get("args"), "precompute_ref_log_probs", False):
        return ("precompute_ref_log_probs scores the dataset in the trainer's construction, with gathers a "
                "replacement would run before it joins")
    return None


def _dispatch_why_not(arguments):
    """Why a Trainer with these __init__ arguments cannot heal, or None:
    Accelerate's DataLoaderDispatcher (dispatch_batches; Accelerate's
    default for an IterableDataset) has rank 0 read every batch and send
    each rank its slice, a collective a batch, which a replacement skipping
    to the survivors' batch would run alone (seen: a collective mismatch,
    then a job restart with no word of why)."""
    args, dataset = arguments.get("args"), arguments.get("train_dataset")
    dispatch = getattr(getattr(args, "accelerator_config", None), "dispatch_batches", None)
    if dispatch is None:
        dispatch = isinstance(dataset, torch.utils.data.IterableDataset)
    if dispatch:
        return ("its training batches are dispatched from rank 0 (Accelerate's dispatch_batches, the default for an "
                "IterableDataset), which a replacement cannot skip to the survivors' batch alone; with "
                "accelerator_config={'dispatch_batches': False} each rank reads the stream for its own slice, and "
                "the Trainer heals")
    return None


# What a TRL trainer's own arguments can keep from healing (RLOO's and
# DistillationTrainer's generation is GRPO's).
_TRL_WHY_NOT = {"GRPOTrainer": _grpo_why_not, "RLOOTrainer": _grpo_why_not, "DistillationTrainer": _grpo_why_not,
                "DPOTrainer": _precompute_why_not,
                "KTOTrainer": _precompute_why_not}


def _why_not(trainer, base, engine_optimizer):
    """Why `trainer` (of Trainer class `base`) cannot heal, or None."""
    if base not in (transformers.Trainer, transformers.Seq2SeqTrainer) and not _is_trl_healing(base):
        return (f"{base.__name__} is not transformers.Trainer, Seq2SeqTrainer or TRL's "
                f"{', '.join(_TRL_HEALING[:-1])} or {_TRL_HEALING[-1]}")
    arguments = getattr(trainer, "_zs_init_arguments", None) or {}
    check = _TRL_WHY_NOT.get(base.__name__)
    why = (check(arguments) if check is not None else None) or _dispatch_why_not(arguments)
    if why is not None:
        return why
    if trainer._zs_fsdp is not None:
        return "the FSDP2 route (fsdp=...) steps a torch optimizer"
    zero = (getattr(trainer, "zs_config", None) or {}).get("zero_optimization") or {}
    if zero.get("zero_quantized_nontrainable_weights"):
        return ("zero_quantized_nontrainable_weights keeps frozen shards as quantized codes, which the peer copy "
                "does not carry")
    if not engine_optimizer:
        return "its optimizer is not the engine's AdamW, Adam or SGD"
    if not all(hasattr(transformers.Trainer, m) for m in ("_run_epoch", "_get_num_items_in_batch")):
        return f"transformers {transformers.__version__} has no Trainer._run_epoch / _get_num_items_in_batch"
    return None


def before_context(trainer, base, engine_optimizer):
    """ZeroShardTrainerMixin.__init__, before the model is partitioned:
    under zsrun --restarts (ZS_HEAL=auto) the peer copies are kept on when
    this Trainer can heal (zeroshard.torch turns them off otherwise, and
    says why: this Trainer's reason)."""
    if os.environ.get("ZS_HEAL") == "auto" and _context.current_context() is None:
        why = _why_not(trainer, base, engine_optimizer)
        if why is None:
            zt.enable_healing()
        else:
            _context.heal_declined[0] = f"zeroshard.hf: this Trainer does not heal a lost rank in place ({why})"


def before_loading():
    """from_pretrained loads partitioned (a zeroshard config registered),
    before any Trainer exists: under ZS_HEAL=auto the context it makes
    keeps the peer copies, for the Trainer that follows (which says so if
    it cannot heal)."""
    if os.environ.get("ZS_HEAL") == "auto" and _context.current_context() is None:
        zt.enable_healing()


def after_context(trainer, base, engine_optimizer):
    """Once the context exists: a context with peer copies and a Trainer
    that can heal route torch.distributed over the engine (on every rank,
    at the same point) and heal; one that cannot says why, once."""
    ctx = _context.current_context()
    if ctx is None or not heal.heals(ctx):
        return
    why = _why_not(trainer, base, engine_optimizer)
    if why is not None:
        if ctx.rank == 0:
            print(f"zeroshard.hf: the context keeps peer copies, but this Trainer does not heal a lost rank in "
                  f"place ({why}): a loss restarts the job from its last checkpoint", file=sys.stderr, flush=True)
        return
    heal_dist.use_engine_process_group()
    heal_world.on_change(_accelerate_follows)
    trainer._zs_heals = True


# A regrow since the last _maybe_log_save_evaluate: on the ranks that went
# on, and (came back) on a rank started to grow the world back, which
# summed no loss over the steps the others took without it.
_regrown = {"grew": False, "came_back": False}


def _accelerate_follows(position, count, grew):
    """After a shrink or a regrow: Accelerate's process index and count
    follow (what the Trainer scales a loss averaged over every rank's
    tokens by), and a regrow is noted for the next bookkeeping."""
    _regrown["grew"] = _regrown["grew"] or grew
    accelerate_heal.process_follows(position, count, grew)


def _engine():
    """The engine optimizer whose steps count the Trainer's (its first)."""
    return heal.optimizers()[0]._engine


class _HistoryJSON:
    """The TrainerState's log history as JSON text, each entry encoded once:
    the history only grows between two registrations (encoding all of it
    at every step cost about 10 ms a thousand entries)."""

    PLACEHOLDER = "\u0000zeroshard log history\u0000"

    def __init__(self):
        self.parts = []

    def text(self, history):
        for entry in history[len(self.parts):]:
            self.parts.append(json.dumps(heal_state.encode(entry, "a log entry"), separators=(",", ":")))
        return "[" + ",".join(self.parts[:len(history)]) + "]"

    def forget(self):
        """Entries were put back (a logging run again): encode afresh."""
        self.parts = []


_METRIC_MODES = ("train", "eval")


def metrics_state(trainer):
    """What a TRL trainer's forwards add to besides the Trainer's own state:
    its metrics since the last log (`_metrics`: mode -> name -> values,
    gathered, so alike on every rank), its count of trained tokens, and
    GRPO's count of micro-batches (`_step`, which says when to generate);
    None for a trainer without them. (GRPO's log of completions, `_logs`,
    holds the last training generation alone, as each fills its bounded
    length: a redone generation replaces it whole.)"""
    metrics = getattr(trainer, "_metrics", None)
    if not isinstance(metrics, dict):
        return None
    return {"metrics": {mode: {k: list(v) for k, v in metrics.get(mode, {}).items()} for mode in _METRIC_MODES},
            "total_train_tokens": getattr(trainer, "_total_train_tokens", None),
            "micro_steps": getattr(trainer, "_step", None)}


def load_metrics_state(trainer, state):
    """metrics_state(), put back (a redo, a logging run again, a replacement
    taking the survivors')."""
    if state is None:
        return
    import collections
    for mode in _METRIC_MODES:
        trainer._metrics[mode] = collections.defaultdict(list, {k: list(v) for k, v in state["metrics"][mode].items()})
    if state["total_train_tokens"] is not None:
        trainer._total_train_tokens = state["total_train_tokens"]
    if state.get("micro_steps") is not None:
        trainer._step = state["micro_steps"]


def _buffered_across_steps(trainer):
    """GRPO's completions buffered for later optimizer steps (one generation
    serves more micro-batches than a step has: steps_per_generation above
    gradient_accumulation_steps, or num_iterations > 1): per-rank state,
    which rides in this rank's blob."""
    args = trainer.args
    every = getattr(args, "steps_per_generation", None), getattr(trainer, "num_iterations", None)
    return None not in every and every[0] * every[1] > args.gradient_accumulation_steps


class _Window:
    """The optimizer step in progress: what a redo needs."""

    __slots__ = ("before", "opening", "micro", "model", "metrics", "count")

    def __init__(self, before, opening, metrics):
        self.before = before      # the engine's step count when it began (C if it does not commit)
        self.opening = opening    # (batch_samples, device) of its token count, or None
        # (heal.StepRecord, num_items_in_batch, tokens its step counted) per
        # micro-batch so far: GRPO counts a generation's tokens inside it,
        # which a redo would count again.
        self.micro = []
        self.model = None
        self.metrics = metrics    # metrics_state() at its opening: a redo adds its forwards' metrics once
        # The token count as a heal's redo counted it again: after a shrink
        # it is the live ranks', which the Trainer's own (its loop's local,
        # passed to every micro-batch of the step) is not.
        self.count = None


class HealingTrainerMixin:
    """The overrides that heal (module docstring); inert unless
    self._zs_heals (set by ZeroShardTrainerMixin once the context exists)."""

    _zs_heals = False
    _zs_window = None
    _zs_after = False  # in _maybe_log_save_evaluate (logging, evaluation, save): no step's window
    _zs_joined = None  # in a replacement, until its first epoch: (shared state, blob, steps behind) of its join
    _zs_heal_folder = None  # in a replacement: the folder its train() resumes from
    _zs_local = None  # in a replacement: its RNG and buffers once it caught up with the survivors
    _zs_history = None  # _HistoryJSON of the log history registered so far
    _zs_registered = False  # this train() registered its state before its first step

    # -- survivors: a step cut short --------------------------------------------
    def _zs_recover(self, allowed, agreed=None):
        return heal.recover(agreed, allowed, "zeroshard.hf.Trainer")

    def _get_num_items_in_batch(self, *args, **kwargs):
        # Also counted in an evaluation's prediction_step: that one is no
        # step's opening, and a loss there reruns the whole evaluation.
        if not self._zs_heals or self._zs_after:
            return super()._get_num_items_in_batch(*args, **kwargs)
        return self._zs_count(*args, **kwargs)

    def _zs_count(self, batch_samples, device):
        steps = _engine().steps
        self._zs_window = _Window(steps, (batch_samples, device), metrics_state(self))
        while True:
            try:
                return super()._get_num_items_in_batch(batch_samples, device)
            except RankLostError:
                self._zs_recover({steps})

    def training_step(self, *args, **kwargs):
        if not self._zs_heals:
            return super().training_step(*args, **kwargs)
        return self._zs_training_step(*args, **kwargs)

    def _zs_training_step(self, model, inputs, num_items_in_batch=None):
        w = self._zs_window
        if w is None:  # a step not opened by the Trainer's count (a caller of training_step itself)
            w = self._zs_window = _Window(_engine().steps, None, metrics_state(self))
        w.model = model
        if w.count is not None:
            num_items_in_batch = w.count
        record = heal.StepRecord(inputs)
        entry = [record, num_items_in_batch, 0]
        w.micro.append(entry)
        seen = self.state.num_input_tokens_seen
        while True:
            try:
                result = super().training_step(model, inputs, num_items_in_batch)
                entry[2] = self.state.num_input_tokens_seen - seen
                return result
            except RankLostError:
                self.state.num_input_tokens_seen = seen
                self._zs_recover({w.before})
                self._zs_redo(w, upto=len(w.micro) - 1)
                if w.count is not None:
                    num_items_in_batch = entry[1] = w.count
                seen = self.state.num_input_tokens_seen
                record.restore()

    def _zs_redo(self, w, upto):
        """The window's opening and its first `upto` micro-batches again,
        after a heal that dropped their gradients; healed again if cut."""
        seen = self.state.num_input_tokens_seen
        while True:
            try:
                load_metrics_state(self, w.metrics)
                if w.opening is not None:
                    w.count = super()._get_num_items_in_batch(*w.opening)
                for entry in w.micro[:upto]:
                    record, n, counted = entry
                    if w.count is not None:
                        n = entry[1] = w.count
                    record.restore()
                    self.state.num_input_tokens_seen -= counted
                    super().training_step(w.model, record.batch, n)
                return
            except RankLostError:
                self.state.num_input_tokens_seen = seen
                self._zs_recover({w.before})

    def _zs_step_cut_short(self):
        """ZeroShardOptimizer.on_rank_lost: True when the step committed."""
        w = self._zs_window
        before = w.before if w is not None else _engine().steps

        def agreed(committed):
            # Committed: the replacement logs this step too, with its norm.
            if committed == before + 1:
                self._zs_register("next", steps=before,
                                  committed=_engine().heal_committed_result())

        if self._zs_recover({before, before + 1}, agreed) == before + 1:
            return True
        if w is None:
            raise RuntimeError("zeroshard.hf.Trainer: a rank was lost in an optimizer step whose forward and "
                               "backward this Trainer did not run; it cannot be redone")
        self._zs_redo(w, upto=len(w.micro))
        return False

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model)
        if self._zs_heals and isinstance(opt, zt.ZeroShardOptimizer):
            opt.on_rank_lost = self._zs_step_cut_short
        return opt

    # -- survivors: after a step ---------------------------------------------------
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        if not self._zs_heals:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        return self._zs_after_step(*args, **kwargs)

    def _zs_after_step(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                       learning_rate=None):
        self._zs_window = None
        if _regrown["grew"]:
            self._zs_even_out(tr_loss)
        grad_norm = self._zs_grad_norm(grad_norm)
        c = self.control
        saved = None
        if c.should_log or c.should_evaluate or c.should_save:  # else nothing collective runs before "next"
            self._zs_register("log", grad_norm=grad_norm, learning_rate=learning_rate, epoch=epoch)
            saved = self._zs_logging_state(tr_loss)
        steps = _engine().steps
        self._zs_after = True
        try:
            while True:
                try:
                    super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                                     start_time, learning_rate=learning_rate)
                    break
                except RankLostError:
                    # Again from its start, with the replacement, which
                    # begins there too (the "log" state registered above).
                    self._zs_recover({steps})
                    self._zs_logging_state(tr_loss, restore=saved)
        finally:
            self._zs_after = False
        self._zs_register("next")

    def _zs_even_out(self, tr_loss):
        """The first bookkeeping after a regrow (every rank at this same
        point: the ranks that went on after the step the regrow came in, a
        rank that came back in its catch-up of that step): the loss summed
        since the last log becomes, on a rank that came back, the mean of
        the others' sums, so that the log's mean over the ranks (the
        Trainer's) stays the mean over the ranks that trained each step.
        One all-gather over torch.distributed (the engine's group)."""
        import torch
        import torch.distributed as dist
        came_back = _regrown["came_back"]
        _regrown["grew"] = _regrown["came_back"] = False
        mine = torch.tensor([float(tr_loss.detach().sum()), 0.0 if came_back else 1.0], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        if came_back:
            sums, trained = torch.stack(parts).unbind(1)
            tr_loss.fill_(float((sums * trained).sum() / trained.sum()))

    def _zs_logging_state(self, tr_loss, restore=None):
        """What the logging, evaluation and save change (the loss summed
        since the last log, the TrainerState with its log history, the
        control flags, the running totals, the RNG): taken, or put back."""
        if restore is None:
            return (tr_loss.detach().clone(), copy.deepcopy(self.state), copy.deepcopy(self.control),
                    self._globalstep_last_logged, self._total_loss_scalar, self.current_flos,
                    heal_state.local_state(),  # an evaluation's DataLoader draws its seed from it
                    metrics_state(self))  # a TRL trainer's log() empties them
        loss, state, control, last_logged, total, flos, local, metrics = restore
        load_metrics_state(self, metrics)
        if self._zs_history is not None:
            self._zs_history.forget()
        heal_state.set_local_state(local)
        tr_loss.copy_(loss)
        self.state, self.control = copy.deepcopy(state), copy.deepcopy(control)
        self._globalstep_last_logged, self._total_loss_scalar, self.current_flos = last_logged, total, flos
        return restore

    def _zs_register(self, phase, steps=None, committed=None, **log_args):
        """The state every rank shares, for a replacement: where the
        survivors are (`phase`), the TrainerState, the schedule, the
        optimizers' hyper-parameters, the logging's running totals and the
        control flags; with "log", the logging call's own arguments; with
        `committed`, the result of the step after it, which a loss cut
        short once it had committed (`steps`: the step count the state is
        of, the engine's by default)."""
        ctx = zt.get_context()
        history = self.state.log_history
        self.state.log_history = []  # spliced in below, from the entries encoded so far
        try:
            trainer_state = dataclasses.asdict(self.state)
        finally:
            self.state.log_history = history
        if self._zs_history is None:
            self._zs_history = _HistoryJSON()
        state = {"phase": phase, "engine_steps": _engine().steps if steps is None else steps,
                 "trainer_state": trainer_state, "log_history": _HistoryJSON.PLACEHOLDER,
                 "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 "param_groups": heal.param_groups_state(), "learned_fetches": heal.learned_fetches(),
                 "globalstep_last_logged": self._globalstep_last_logged,
                 "total_loss_scalar": self._total_loss_scalar,
                 "initial_global_step": self._initial_global_step,
                 "initial_num_input_tokens_seen": self._initial_num_input_tokens_seen,
                 "control": dict(vars(self.control)), "log_args": log_args or None, "committed": committed,
                 "trl_metrics": metrics_state(self)}
        text = heal_state.dumps(state, "the Trainer's shared state").decode("utf-8")
        text = text.replace(json.dumps(_HistoryJSON.PLACEHOLDER), self._zs_history.text(history), 1)
        ctx.heal_set_shared_state(text.encode("utf-8"))

    def _zs_rank_extras(self):
        """This rank's part of the blob: the loss and FLOPs it summed since
        the last log (the Trainer's _tr_loss and current_flos)."""
        tr_loss = getattr(self, "_tr_loss", None)
        # With what the logging and a save reset them against: a replacement
        # joining after step C's logging (or save) must start from zero, not
        # from what its predecessor had at C's optimizer step.
        extras = {"tr_loss": tr_loss.detach().clone() if tr_loss is not None else None,
                  "current_flos": float(getattr(self, "current_flos", 0.0)),
                  "last_logged": self._globalstep_last_logged, "total_flos": float(self.state.total_flos)}
        if _buffered_across_steps(self):
            extras["buffered_inputs"] = self._buffered_inputs  # this rank's completions for the next steps
        return extras

    def _run_epoch(self, *args, **kwargs):
        if self._zs_heals:
            if self._zs_joined is not None:
                self._zs_catch_up(**kwargs)
            elif not self._zs_registered:
                self._zs_register("next")  # before the first step: a loss in it finds a state to hand over
            self._zs_registered = True
        return super()._run_epoch(*args, **kwargs)

    # -- the run ------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if not self._zs_heals:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self._zs_registered = False
        folder = None
        try:
            with heal.running(self._zs_rank_extras):
                if _context.awaiting_join(zt.get_context()):
                    folder = self._zs_join()
                    resume_from_checkpoint = folder
                return super().train(resume_from_checkpoint, *args, **kwargs)
        except StateLostError as e:
            raise heal.state_lost_exit("zeroshard.hf.Trainer", e) from e
        finally:
            if folder is not None:
                self._zs_heal_folder = None
                shutil.rmtree(folder, ignore_errors=True)

    # -- the replacement ----------------------------------------------------------
    def _zs_join(self):
        """Join the survivors (the optimizer made first, as the join needs
        it), and write the folder the Trainer resumes from."""
        if self.optimizer is None:
            self.create_optimizer()
        committed = heal.join_as_replacement("zeroshard.hf.Trainer")
        ctx = zt.get_context()
        shared = heal.survivors_state(committed, "zeroshard.hf.Trainer", "Trainer",
                                      lambda state: "trainer_state" in state)
        behind = committed - shared["engine_steps"]
        if behind not in (0, 1) or (behind == 1 and shared["phase"] != "next"):
            raise RuntimeError(f"zeroshard.hf.Trainer: joined at optimizer step {committed}; the survivors' state "
                               f"is of step {shared['engine_steps']} ({shared['phase']})")
        heal.load_learned_fetches(shared["learned_fetches"], "zeroshard.hf.Trainer")
        data = dict(shared["trainer_state"], log_history=shared["log_history"])
        if behind:  # the loss came in step C's update, which committed: the Trainer resumes after it
            data["global_step"] += 1
        where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        folder = tempfile.mkdtemp(prefix=HEAL_FOLDER_PREFIX, dir=where)
        with open(os.path.join(folder, transformers.trainer.TRAINER_STATE_NAME), "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)  # as TrainerState.save_to_json writes it
        self._zs_heal_folder = folder
        self._zs_joined = (shared, heal.joined_rank_state(ctx), behind)
        if os.environ.get("ZS_HEAL_JOIN") == "grow":
            _regrown["grew"] = _regrown["came_back"] = True
        print(f"zeroshard.hf.Trainer: rank {ctx.rank} joined at step {committed}: training goes on at step "
              f"{committed + 1}", file=sys.stderr, flush=True)
        return folder

    def _zs_healing_folder(self, checkpoint):
        return checkpoint is not None and checkpoint == self._zs_heal_folder

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._zs_healing_folder(resume_from_checkpoint):
            return  # the weights came with the join
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not self._zs_healing_folder(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        shared = self._zs_joined[0]
        heal.load_param_groups(shared["param_groups"], "zeroshard.hf.Trainer")
        if shared["scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(shared["scheduler"])

    def _load_rng_state(self, checkpoint):
        if not self._zs_healing_folder(checkpoint):
            return super()._load_rng_state(checkpoint)
        if self._zs_local is not None:  # its RNG and buffers as of _zs_catch_up
            heal_state.set_local_state(self._zs_local)

    def _zs_catch_up(self, model, trial, epoch, ignore_keys_for_eval, start_time, steps_in_epoch,
                     steps_trained_in_current_epoch, **_):
        """The replacement's first epoch begins: the logging totals as the
        survivors have them, then what they are in the middle of: the
        bookkeeping of the step that committed in the loss, its logging."""
        shared, blob, behind = self._zs_joined
        self._zs_joined = None
        # The RNG as the survivors' was at the committed step's optimizer
        # step, before what it replays draws from it (an evaluation's
        # DataLoader); HF's _load_rng_state then sets what it left.
        if blob is not None:
            heal_state.set_local_state(blob["local"])
        else:  # a rank that came back at a regrow
            heal.take_donors_buffers(zt.get_context())
        extra = (blob or {}).get("extra") or {}
        # The blob is of step C's optimizer step; its logging (which empties
        # the summed loss) and its store_flos (a logging's or a save's, which
        # empties the FLOPs) may have run since, on the survivors.
        logged_since = extra.get("last_logged", shared["globalstep_last_logged"]) != shared["globalstep_last_logged"]
        stored_since = extra.get("total_flos", shared["trainer_state"]["total_flos"]) != \
            shared["trainer_state"]["total_flos"]
        if extra.get("tr_loss") is not None:
            loss = extra["tr_loss"].to(self._tr_loss.device)
            self._tr_loss = loss - loss if logged_since else loss
        self.current_flos = 0.0 if stored_since else extra.get("current_flos", 0.0)
        if "buffered_inputs" in extra:
            self._buffered_inputs = extra["buffered_inputs"]
        self._globalstep_last_logged = shared["globalstep_last_logged"]
        self._total_loss_scalar = shared["total_loss_scalar"]
        # The run's totals are over the survivors' train() call, not from the join.
        self._initial_global_step = shared["initial_global_step"]
        self._initial_num_input_tokens_seen = shared["initial_num_input_tokens_seen"]
        for k, v in shared["control"].items():
            setattr(self.control, k, v)
        load_metrics_state(self, shared["trl_metrics"])
        if behind:
            # As the Trainer does after an optimizer step (_run_epoch): the
            # learning rate before the schedule moves, the schedule, the
            # epoch, the callbacks' step end, then the logging.
            learning_rate = self._get_learning_rate()
            self.lr_scheduler.step()
            self.state.epoch = epoch + steps_trained_in_current_epoch / steps_in_epoch
            self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
            result = shared.get("committed")
            self._maybe_log_save_evaluate(self._tr_loss, result["grad_norm"] if result else None, model, trial, epoch,
                                          ignore_keys_for_eval, start_time, learning_rate=learning_rate)
        elif shared["phase"] == "log":
            a = shared["log_args"]
            self._maybe_log_save_evaluate(self._tr_loss, a["grad_norm"], model, trial, a["epoch"],
                                          ignore_keys_for_eval, start_time, learning_rate=a["learning_rate"])
        self._zs_local = heal_state.local_state()

