"""ZeroShardStrategy heals a lost rank in place (docs/healing.md, section 3,
"Lightning"): under `zsrun --restarts` a Lightning script, unchanged, loses
a rank and goes on with a replacement that zsrun starts with its id, the
survivors' processes kept and nothing read from disk.

Survivors. Every engine call after a loss raises RankLostError, and so does
torch.distributed, which runs over the engine's world group while healing
(torch/heal_dist.py). An optimizer step's micro-batches form a window: the
closure Lightning makes for each (training_step, zero_grad, backward; it
calls all but the last itself, the last inside the optimizer's step) heals
when called. A loss in one, or in the optimizer step before it commits,
heals (zeroshard.torch.heal.recover) and runs the window's closures so far
again with the RNG and logged values of their start; a loss in the update
after the commit heals and the step is done. A loss in one of the fit's
validations heals and runs it again from its start.

At every window's first batch (the strategy's on_train_batch_start) and
every validation's start, the state every rank shares is registered:
Lightning's checkpoint of the fit less weights and optimizer (the loops'
progress, callbacks, LR schedulers), the optimizers' hyper-parameters and
how many batches of the epoch are done.

The replacement runs the same script from the top. Its model is built
without a collective or a disk read; the strategy's setup joins once the
optimizer exists (its shards come from its holder's copy) and the fit
resumes through Lightning's own resume from a checkpoint, the survivors'
state in place of a file; its train loader skips the batches of the epoch
the survivors did. Until it reaches where the survivors are, its
torch.distributed collectives (the fit's setup, which the survivors ran
long ago, and what Lightning runs between micro-batches they redo alone)
answer locally. There it takes its predecessor's RNG and epoch values (the
blob of the committed step) and either runs the window (or validation)
with them or, when the window's step committed in the loss, runs it
hollow: no forward, no update (its state is the committed one already),
Lightning's bookkeeping as the survivors do it.

So that a replacement's RNG is its predecessor's where it resumes, nothing
between two optimizer steps may draw from the global RNG: the loaders'
iterators, each of which draws its workers' seed, are made under a fork of
it (the same seed, the RNG left as it was), in the reference run as in a
healed one. Manual optimization heals with its training_step as the
window (Healing.manual_step). Heals: engine optimizers (AdamW, Adam
or SGD), one under automatic optimization; under manual optimization
several, stepped in one training_step (a GAN's), heal a loss before the
first of them commits and end the fit by name after (the rest of the
training_step runs from values computed before that step, which neither
a redo nor a replacement has). A loss in a checkpoint save or a hook
between steps and validations is not healed: it ends the fit with
RankLostError, and zsrun restarts the job.
"""
import os
import sys

from . import torch as zt
from .errors import RankLostError, StateLostError
from .torch import _context, heal, heal_dist, heal_state, hollow

# The ckpt_path a replacement's fit resumes from: the survivors' state.
HEAL_CHECKPOINT = "zeroshard-heal://survivors"
WHO = "ZeroShardStrategy"
_said = [False]


def why_not(trainer, module):
    """Why a fit of `module` by `trainer` cannot heal, or None."""
    if trainer is None or module is None:
        return "it has no Trainer or LightningModule"
    if str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return "only a fit heals"
    return None


def _say(ctx, why):
    if ctx is not None and ctx.rank == 0 and not _said[0]:
        _said[0] = True
        print(f"zeroshard.lightning: the context keeps peer copies, but this fit does not heal a lost rank in place "
              f"({why}): a loss restarts the job from its last checkpoint", file=sys.stderr, flush=True)


def before_context(trainer, module):
    """ZeroShardStrategy.setup_environment, before torch.distributed and the
    context: in a replacement, torch.distributed's init gives the engine's
    group without a rendezvous (the survivors' Gloo group is gone); under
    zsrun --restarts (ZS_HEAL=auto) the peer copies stay on for a fit that
    can heal."""
    if _context.current_context() is not None:
        return
    heal_dist.route_replacement_init()
    if why_not(trainer, module) is not None:
        return
    if _context.is_replacement():
        # The fit's setup (Trainer.log_dir's broadcast, ...), which the
        # survivors ran long ago, answers locally until it catches up.
        heal_dist.answering_locally(True)
    if os.environ.get("ZS_HEAL") == "auto":
        zt.enable_healing()


def after_context(trainer, module):
    """Once the context exists: a Healing when it keeps peer copies and the
    fit can heal (torch.distributed then runs over the engine's world group,
    on every rank at the same point), else None, having said why once."""
    ctx = _context.current_context()
    why = why_not(trainer, module)
    if ctx is None or not heal.heals(ctx) or why is not None:
        heal_dist.answering_locally(False)
        if why is not None and ctx is not None and heal.heals(ctx):
            _say(ctx, why)
        return None
    heal_dist.use_engine_process_group()
    return Healing()


def _engine_optimizer(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)


# What a logged tensor keeps between two steps: a redo puts it back, or the
# redone training_step would log an epoch's mean over the step twice.
_RESULT_FIELDS = ("value", "cumulated_batch_size", "_forward_cache", "_computed", "_update_count", "has_reset")


def _results_state(results):
    """The logged values of `results` (Lightning's _ResultCollection): each
    update assigns new tensors, so references are a snapshot."""
    return {k: {f: getattr(m, f) for f in _RESULT_FIELDS if hasattr(m, f)} for k, m in results.items()}


def _load_results_state(results, state):
    for k in [k for k in results if k not in state]:
        del results[k]  # first logged by the step cut short
    for k, fields in state.items():
        for f, v in fields.items():
            setattr(results[k], f, v)


def _hollow_logs_go(results, logged, carried):
    """What the hollow part of a replacement's manual training_step logged
    goes: each value its predecessor logged this epoch is as the
    predecessor's step left it (`carried`, _epoch_results), any other as
    at the window's start (`logged`, _results_state); one first logged
    there goes."""
    metrics = (carried or {}).get("metrics") or {}
    for k in list(results):
        m, state = results[k], metrics.get(k)
        if state is not None:
            m.value = state["value"].to(m.value.device)
            if state["cumulated_batch_size"] is not None:
                m.cumulated_batch_size = state["cumulated_batch_size"].to(m.value.device)
            m._update_count = state["update_count"]
            m._computed = None
        elif k in logged:
            for f, v in logged[k].items():
                setattr(m, f, v)
        else:
            del results[k]


def _epoch_results(trainer):
    """This rank's part of the blob: what the epoch's logged values hold so
    far (the mean, max, min or sum Lightning logs at the epoch's end, of
    the values training_step logged on_epoch)."""
    results = trainer.fit_loop.epoch_loop._results
    metrics = {k: {"value": m.value, "cumulated_batch_size": getattr(m, "cumulated_batch_size", None),
                   "update_count": m._update_count}
               for k, m in results.items() if m.is_tensor and m.meta.on_epoch}
    return {"epoch": trainer.current_epoch, "metrics": metrics}


def _carry_epoch_results(trainer, carried):
    """In a replacement: its predecessor's epoch results (_epoch_results),
    each put in as its training_step logs that key again (Lightning makes
    the entry, with its settings, at the first log), within that epoch."""
    results = trainer.fit_loop.epoch_loop._results
    pending, epoch = dict(carried["metrics"]), carried["epoch"]
    if not pending or trainer.current_epoch != epoch:
        return
    original = results.update_metrics

    def update_metrics(key, value, batch_size):
        if trainer.current_epoch != epoch:
            pending.clear()
        state = pending.pop(key, None)
        if state is not None:
            m = results[key]
            m.value = state["value"].to(m.value.device)
            if state["cumulated_batch_size"] is not None:
                m.cumulated_batch_size = state["cumulated_batch_size"].to(m.value.device)
            m._update_count = state["update_count"]
        original(key, value, batch_size)
        if not pending:
            del results.update_metrics  # the class's again

    results.update_metrics = update_metrics


def _adopt_checkpoint_dirs(trainer, callbacks):
    """A replacement's ModelCheckpoints save where the survivors' do. Each
    resolved its folder at its setup from the logger's version, which a
    replacement's logger takes anew (the next free one: Lightning's own
    resume does the same, and a rank-0 replacement logs there); the
    survivors' rank 0 broadcast theirs at the fit's start, and every rank
    writes its shards of one checkpoint into that one folder."""
    for cb in trainer.checkpoint_callbacks:
        theirs = (callbacks.get(cb.state_key) or {}).get("dirpath")
        if theirs is not None and getattr(cb, "dirpath", theirs) != theirs:
            cb.dirpath = theirs


class Healing:
    """What ZeroShardStrategy does to heal (module docstring)."""

    def __init__(self):
        self.running = None
        # In a replacement, from its join to the batch the survivors are in:
        # (the survivors' state, its predecessor's blob, whether that batch's
        # step committed).
        self.joined = None
        self.several = False  # the fit steps several engine optimizers (manual optimization)
        self.skip = 0  # in a replacement: batches of the epoch its train loader skips
        self.val_loop = None  # the fit's validation loop, whose run heals (after_setup)
        self.window = None  # the optimizer step's _Window in progress
        self.hollow = False  # a replacement's window whose step committed in the loss
        self.automatic = None  # the fit's _AutomaticOptimization, whose closures heal (after_setup)
        self.window_state = None  # the shared state registered at the window's start
        self.local_closures = 0  # a replacement: closures to enter before its collectives are the survivors'
        self.trainer = None  # the fit's (after_setup)
        self.manual = None  # manual optimization: the training_step's _ManualWindow in progress
        self.carried = None  # a replacement: its predecessor's epoch results (_epoch_results), once caught up
        self.stepless = False  # manual optimization: the last training_step took no optimizer step

    # -- setup ----------------------------------------------------------------
    def after_setup(self, strategy, trainer):
        """The strategy's setup made the optimizers: self when they heal
        (a replacement joins here), None when they do not."""
        opts = list(strategy.optimizers or [])
        stock = [type(o).__name__ for o in map(_engine_optimizer, opts) if not isinstance(o, zt.ZeroShardOptimizer)]
        why = ("no optimizer" if not opts else
               f"its optimizer {stock[0]} is not the engine's AdamW, Adam or SGD" if stock else
               f"{len(opts)} optimizers under automatic optimization"
               if len(opts) > 1 and trainer.lightning_module.automatic_optimization else None)
        if why is not None:
            if _context.awaiting_join(zt.get_context()):
                raise RuntimeError(f"{WHO}: this replacement cannot join the survivors: {why}")
            _say(zt.get_context(), why)
            return None
        # Manual optimization may step several optimizers in a training_step
        # (a GAN's): a loss before the first commits heals, one after does not.
        self.several = len(opts) > 1
        self.running = heal.running(lambda: {"results": _epoch_results(trainer)})
        self.running.__enter__()
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run = val_loop.run

        def validate():  # the fit's validations (not the sanity check) heal
            return run() if trainer.sanity_checking else self._validate(trainer, val_loop, run)

        val_loop.run = validate
        self.val_loop = val_loop
        automatic = trainer.fit_loop.epoch_loop.automatic_optimization
        make_closure = automatic._make_closure

        def healing_closure(*args, **kwargs):
            closure = make_closure(*args, **kwargs)
            self._closure_made(closure)
            return closure

        automatic._make_closure = healing_closure
        self.automatic = automatic
        self.trainer = trainer
        if _context.awaiting_join(zt.get_context()):
            self._join(trainer)
        return self

    def teardown(self):
        if self.running is not None:
            self.running.__exit__(None, None, None)
            self.running = None
        if self.val_loop is not None:
            del self.val_loop.run  # the class's again, for the trainer's next call
            self.val_loop = None
        if self.automatic is not None:
            del self.automatic._make_closure
            self.automatic = None
        heal_dist.answering_locally(False)

    def on_exception(self, exception):
        """The fit ends with `exception` (Lightning's on_exception): a loss
        outside a training step or a validation is not healed; say so."""
        if isinstance(exception, RankLostError) and not isinstance(exception, _NotHealed):
            print(f"{WHO}: rank {zt.get_context().rank}: a rank was lost outside a training step and a validation "
                  "(in a checkpoint save or a hook between them), where this strategy does not heal it: the fit "
                  "ends, and zsrun --restarts starts the job again from its last checkpoint", file=sys.stderr,
                  flush=True)

    def _join(self, trainer):
        committed = heal.join_as_replacement(WHO)
        ctx = zt.get_context()
        shared = heal.survivors_state(committed, WHO, "Lightning fit", lambda state: state.get("kind") == "lightning")
        behind = committed - shared["steps"][0]
        if behind not in (0, 1) or (behind and shared["phase"] != "batch") or \
                (self.several and list(_steps()) != [s + behind for s in shared["steps"]]):
            # Several optimizers heal only where none had stepped in the
            # window (the survivors end the fit otherwise), or where every
            # one had: a regrow comes after the last's step (at an iteration's
            # end, with every optimizer at one count), before the batch's end.
            raise RuntimeError(f"{WHO}: joined at optimizer step(s) {list(_steps())}; the survivors' state is of "
                               f"step(s) {shared['steps']}")
        heal.load_learned_fetches(shared["learned_fetches"], WHO)
        heal.load_param_groups(shared["param_groups"], WHO)
        _adopt_checkpoint_dirs(trainer, shared["checkpoint"]["callbacks"])
        self.joined = (shared, heal.joined_rank_state(ctx), behind)
        self.skip = shared["skip"]
        heal_dist.answering_locally(True)
        # Lightning's resume from a checkpoint, the survivors' state in place
        # of its file (load_checkpoint below), whatever ckpt_path fit had.
        connector = trainer._checkpoint_connector
        resume_start = connector.resume_start

        def resume_from_the_survivors(checkpoint_path=None, weights_only=None):
            del connector.resume_start  # once
            return resume_start(HEAL_CHECKPOINT, weights_only)

        connector.resume_start = resume_from_the_survivors
        print(f"zeroshard.lightning: rank {ctx.rank} joined at step {committed}: training goes on at step "
              f"{committed + 1}", file=sys.stderr, flush=True)

    def checkpoint(self):
        """Lightning's checkpoint of the survivors' fit (ZeroShardStrategy.
        load_checkpoint of HEAL_CHECKPOINT): the weights came with the join."""
        if self.joined is None:
            raise RuntimeError(f"{WHO}: {HEAL_CHECKPOINT} is the state a replacement joins with; none is at hand")
        checkpoint = dict(self.joined[0]["checkpoint"])
        checkpoint["state_dict"] = {}
        checkpoint["zeroshard"] = "heal"
        return checkpoint

    # -- every batch ------------------------------------------------------------
    def register(self, trainer, phase="batch"):
        """The state every rank shares at an optimizer step's first batch's
        start (phase "batch") or a validation's ("val"): module docstring."""
        if phase == "batch" and self.window is not None:
            return  # a later micro-batch of the step: a replacement starts at the first
        import lightning.pytorch as pl
        from lightning.pytorch.trainer import call
        epoch_loop = trainer.fit_loop.epoch_loop
        loops = {"fit_loop": trainer.fit_loop.state_dict()}
        fit = loops["fit_loop"]
        if phase == "batch" and not epoch_loop._should_accumulate():
            # Lightning counts a batch as stepped when it resumes a checkpoint
            # written after a step but before its count (on_train_batch_end),
            # where the batch steps; this state is of a batch's start,
            # counted already.
            fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
        if phase == "batch":
            # The batch was fetched (counted ready) before its start, and a
            # resume fetches it again: its `current` counts go back to the
            # completed ones there, its `total` counts do not.
            fit["epoch_loop.batch_progress"]["total"]["ready"] -= 1
        # The validation progress as it is (the loop's state_dict can read
        # one batch more started than finished, seen after a sanity check:
        # a resume would then run a validation due there again), or, at a
        # validation's start, with one batch started and none finished: the
        # only state from which Lightning's resume runs a validation (one
        # found done or not begun is skipped).
        live = epoch_loop.val_loop.batch_progress
        val = fit["epoch_loop.val_loop.batch_progress"]
        for k in ("total", "current"):
            val[k] = getattr(live, k).state_dict()
            if phase == "val":
                done = val[k]["completed"] if k == "total" else 0  # the fetcher takes `current` as done
                val[k].update(ready=done + 1, started=done + 1, processed=done, completed=done)
        checkpoint = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                      "pytorch-lightning_version": pl.__version__, "loops": loops,
                      "callbacks": call._call_callbacks_state_dict(trainer),
                      "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}
        precision = trainer.precision_plugin.state_dict()
        if precision:
            checkpoint[type(trainer.precision_plugin).__qualname__] = precision
        state = {"kind": "lightning", "phase": phase, "steps": list(_steps()),
                 "skip": epoch_loop.batch_progress.current.completed, "param_groups": heal.param_groups_state(),
                 "learned_fetches": heal.learned_fetches(), "checkpoint": checkpoint}
        if phase == "batch":
            self.window_state = state
        self._post(state)

    @staticmethod
    def _post(state):
        zt.get_context().heal_set_shared_state(heal_state.dumps(state, "the fit's shared state"))

    def loader(self, trainer, dataloader):
        """The strategy's process_dataloader: a torch DataLoader whose
        iterators are made under a fork of the global RNG, and in a
        replacement the train loader skipping the epoch's done batches."""
        import torch
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            if self.skip and trainer.training:
                raise RuntimeError(f"{WHO}: this replacement resumes {self.skip} batches into the epoch, but its "
                                   f"train loader is a {type(dataloader).__name__}, not a torch DataLoader it can "
                                   "skip")
            return dataloader
        if not getattr(type(dataloader), "_zs_healing", False):
            dataloader.__class__ = _healing_class(type(dataloader))
        if self.skip and trainer.training:
            dataloader._zs_skip, self.skip = self.skip, 0
        return dataloader

    def _catch_up(self, trainer, phase):
        """A replacement reaches what the survivors are in (`phase`): its
        predecessor's RNG and epoch results, its collectives theirs again.
        Returns whether that batch's step committed in the loss."""
        shared, blob, behind = self.joined
        self.joined = None
        if shared["phase"] != phase:
            raise RuntimeError(f"{WHO}: this replacement reached a {phase} first, but the survivors are in a "
                               f"{shared['phase']}")
        self.carried = None
        if blob is not None:
            heal_state.set_local_state(blob["local"])  # as its predecessor's where it left
            self.carried = (blob.get("extra") or {})["results"]
            _carry_epoch_results(trainer, self.carried)
        else:  # a rank that came back at a regrow; a manual window's hollow part puts them back after it
            heal.take_donors_buffers(zt.get_context())
        if phase == "val":
            heal_dist.answering_locally(False)
            # The shared state said its first batch started (Lightning's
            # resume runs a validation only from there, and has read it
            # already); the validation fetches and starts it again.
            total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
            total.ready, total.started = total.completed, total.completed
        elif not behind:
            # The survivors redo the step's first `redo` micro-batches'
            # closures alone: what Lightning runs between them (each batch's
            # SIGTERM broadcast, hooks) they ran before the loss.
            self.local_closures = shared.get("redo", 1)
        return behind

    def _validate(self, trainer, val_loop, run):
        """A validation of the fit, run again from its start with the
        replacement when a loss cuts it short: its progress, the callbacks'
        state, the RNG and the model's train mode put back first."""
        from lightning.pytorch.trainer import call
        if self.joined is not None:
            self._catch_up(trainer, "val")
        steps = heal.optimizers()[0]._engine.steps
        self.register(trainer, "val")
        progress = val_loop.batch_progress.state_dict()
        callbacks = call._call_callbacks_state_dict(trainer)
        local = heal_state.local_state()
        while True:
            try:
                return run()
            except RankLostError:
                self._recover({steps})
                val_loop._module_mode.restore(trainer.lightning_module)  # its start put the model in eval mode
                val_loop.batch_progress.load_state_dict(progress)
                call._call_callbacks_load_state_dict(trainer, {"callbacks": callbacks})
                trainer._logger_connector.reset_results()
                heal_state.set_local_state(local)

    # -- the step -----------------------------------------------------------------
    # An optimizer step's window: its micro-batches' closures (Lightning
    # calls all but the last itself, the last inside the optimizer step),
    # each with the RNG at its start, and the logged values and the engine's
    # step count at the window's start.
    def _closure_made(self, closure):
        """_AutomaticOptimization._make_closure made `closure` for the next
        micro-batch: it heals when called (_healing_closure_class)."""
        if self.window is None:
            results = self.trainer._results
            self.window = _Window(heal.optimizers()[0]._engine.steps, results,
                                  _results_state(results) if results is not None else None)
        self.window.closures.append((closure, heal_state.local_state()))
        closure.__class__ = _healing_closure_class(type(closure))
        closure._zs_healing = self

    def _hollow_or_caught_up(self, trainer):
        """In a replacement, at its first micro-batch or optimizer step: it
        reaches the survivors' batch. True while this window is hollow (its
        step committed in the loss: the join brought its result)."""
        if self.joined is not None:
            self.hollow = bool(self._catch_up(trainer, "batch"))
            if self.window is not None:  # its first micro-batch starts from the predecessor's RNG
                self.window.closures = [(c, heal_state.local_state()) for c, _ in self.window.closures]
        return self.hollow

    def _call_closure(self, closure, call):
        """A micro-batch's closure, healed: a loss in it (before its window's
        step commits) heals and runs the window's closures so far again, the
        RNG and logged values of their start put back."""
        from lightning.pytorch.loops.optimization.automatic import ClosureResult
        if self._hollow_or_caught_up(self.trainer):
            closure._result = ClosureResult(None)
            return None
        if self.local_closures:
            self.local_closures -= 1
            if not self.local_closures:  # the closure the survivors' redo is at: caught up
                heal_dist.answering_locally(False)
        w = self.window
        while True:
            try:
                return call()
            except RankLostError:
                self._recover({w.before}, redo=self._redone(closure))
                self._redo(upto=closure)

    def _redo(self, upto):
        """The window's closures before `upto` again (all when None), from
        the logged values of its start; healed again if cut short."""
        w = self.window
        while True:
            try:
                if w.logged is not None:
                    _load_results_state(w.results, w.logged)
                for closure, local in w.closures:
                    heal_state.set_local_state(local)
                    if closure is upto:
                        return
                    type(closure).__bases__[0].__call__(closure)
                return
            except RankLostError:
                self._recover({w.before}, redo=self._redone(upto))

    def _redone(self, upto):
        """How many of the window's closures a redo up to `upto` (through it;
        all when None) runs: a replacement's collectives are the survivors'
        from the last one's start."""
        closures = [c for c, _ in self.window.closures]
        return closures.index(upto) + 1 if upto is not None else len(closures)

    # -- manual optimization --------------------------------------------------
    # The window is the training_step, which steps the optimizer itself
    # (self.optimizers().step(); a second step in it is not healed). A loss
    # before its step heals and runs it again from its start (the RNG, the
    # logged values and Lightning's count of optimizer steps put back); a loss
    # in the step heals there: committed, the training_step goes on after it,
    # else it runs again. A replacement at a window whose step committed in the
    # loss runs it hollow (zeros, no engine call, no collective) up to its step,
    # which it skips, and live after it, as the survivors run that part; the
    # values it logged before the step go, and its training_step returns None.
    def manual_step(self, trainer, run):
        """The strategy's training_step under manual optimization; run()
        runs the user's."""
        hollow_window = False
        if self.joined is not None:  # its predecessor's RNG from here
            hollow_window = bool(self._catch_up(trainer, "batch"))
            self.local_closures = 0
            if not hollow_window:  # the survivors run this training_step again from its start
                heal_dist.answering_locally(False)
        m = self.manual = _ManualWindow(trainer, _steps())
        m.hollow = hollow_window
        try:
            while True:
                if m.hollow:
                    hollow.catch_up()
                try:
                    out = run()
                    return None if m.ran_hollow else out
                except _RunAgain:
                    pass  # healed in its step, which did not commit
                except _NotHealed:
                    raise
                except RankLostError as e:
                    if _steps() != m.before:
                        raise _not_healed(e, self._after_a_step()) from e
                    if self.stepless:
                        raise _not_healed(e, "in a manual training_step after one that took no optimizer step: the "
                                          "gradients of the training_steps before it (accumulated by hand) are "
                                          "gone with the step cut short, and only this one would run again") from e
                    self._recover({m.before[0]})  # the first optimizer's C: every one at its m.before
                m.put_back()
        finally:
            self.manual = None
            self.stepless = _steps() == m.before and not m.ran_hollow

    def _after_a_step(self):
        """Where a loss after an optimizer step of a manual training_step
        came, for _not_healed."""
        if self.several:
            return (f"in or after the first optimizer step of this manual training_step, which steps "
                    f"{len(heal.optimizers())} optimizers: the rest of it runs from values computed before that "
                    "step, which neither a redo nor a replacement has")
        return ("after the optimizer step of this manual training_step, in code of its own that called the engine or "
                "torch.distributed, which this strategy cannot run again")

    def _manual_optimizer_step(self, optimizer, closure, step):
        m = self.manual
        opt = _engine_optimizer(optimizer)
        if m.hollow:
            m.hollow_steps += 1
            if m.hollow_steps < len(heal.optimizers()):
                # Several optimizers: the window committed every one's step
                # (a regrow comes after the last of them), so the training_step
                # runs hollow through them all.
                return None
            # The survivors' state is this step's result already: what the
            # hollow part logged goes, and from here the training_step runs
            # with them.
            heal.forget_step_in_flight()
            hollow.leave()
            hollow.arm(False)
            if m.results is not None:
                _hollow_logs_go(m.results, m.logged, self.carried)
            heal_state.set_local_state(m.local)  # as its predecessor's after the step: the hollow part drew none
            heal_dist.answering_locally(False)
            m.hollow, m.ran_hollow = False, True
            return None
        if _steps() != m.before:
            # A second step in one training_step: it runs as it would without
            # healing, and a loss from here ends the fit (manual_step).
            return step(closure)

        def run_again():
            raise _RunAgain()

        return self._step_healing(opt, opt._engine.steps, lambda: step(closure), run_again)

    def optimizer_step(self, trainer, optimizer, closure, step):
        """The strategy's optimizer_step; step(closure) is Lightning's."""
        from lightning.pytorch.loops.optimization.automatic import ClosureResult
        if self.manual is not None:
            return self._manual_optimizer_step(optimizer, closure, step)
        try:
            if self._hollow_or_caught_up(trainer):
                closure._result = ClosureResult(None)  # no forward (the survivors run none), no update
                self.hollow = False
                heal_dist.answering_locally(False)  # the survivors are past this step: caught up
                return None
            opt = _engine_optimizer(optimizer)
            before = self.window.before if self.window is not None else opt._engine.steps

            def redo_window():  # every closure of the window again, then the step again
                self._redo(upto=None)
                return False

            return self._step_healing(opt, before, lambda: step(closure), redo_window,
                                      redone=lambda: self._redone(None))
        finally:
            self.window = None

    def _step_healing(self, opt, before, run, not_committed, redone=None):
        """run(), Lightning's optimizer step, with a loss in the engine's
        step healed there (ZeroShardOptimizer.on_rank_lost): committed, the
        step stands; else not_committed() says what follows (False: the
        engine steps again; or it raises). redone(): the closures the
        survivors run again, for _recover."""
        def cut_short():
            if self._recover({before, before + 1}, redo=redone() if redone else None, opt=opt) == before + 1:
                if self.several and self.manual is not None:
                    # The rest of the training_step steps other optimizers from
                    # values computed before this step, which a replacement
                    # (hollow up to here) would not have.
                    raise _not_healed("a rank was lost in an optimizer step, which committed", self._after_a_step())
                return True
            return not_committed()

        opt.on_rank_lost = cut_short
        try:
            return run()
        finally:
            opt.on_rank_lost = None

    def _recover(self, allowed, redo=None, opt=None):
        """Heal (zeroshard.torch.heal.recover); returns C of `opt` (default:
        the first optimizer), one of `allowed`. `redo`: how many closures
        of the step's window the survivors run again, which the replacement
        learns with the window's state."""
        def agreed(committed):
            if redo is not None and self.window_state is not None:
                self._post(dict(self.window_state, redo=redo))

        try:
            return heal.recover(agreed, allowed, WHO, optimizer=opt)
        except StateLostError as e:
            raise heal.state_lost_exit(WHO, e) from e


def _steps():
    """Every engine optimizer's step count, in the order made."""
    return tuple(o._engine.steps for o in heal.optimizers())


class _NotHealed(RankLostError):
    """A loss in a manual training_step where the strategy cannot heal it:
    its message says where (Healing.on_exception adds nothing)."""


def _not_healed(error, where):
    return _NotHealed(f"{WHO}: {error}; it came {where}: not healed, the fit ends and zsrun --restarts starts the "
                      "job again from its last checkpoint")


class _RunAgain(Exception):
    """A manual training_step's optimizer step healed and did not commit:
    the training_step runs again from its start (Healing.manual_step)."""


class _ManualWindow:
    """A manual training_step's start: every engine optimizer's step count,
    the RNG, the logged values and Lightning's count of optimizer steps,
    put back when it runs again."""

    def __init__(self, trainer, before):
        self.before = before
        self.results = trainer._results
        self.logged = _results_state(self.results) if self.results is not None else {}
        self.local = heal_state.local_state()
        self.progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        self.counted = self.progress.state_dict()
        self.hollow = False  # a replacement's window whose step committed in the loss: hollow up to it
        self.ran_hollow = False
        self.hollow_steps = 0  # the optimizer steps the hollow part skipped

    def put_back(self):
        if self.results is not None:
            _load_results_state(self.results, self.logged)
        heal_state.set_local_state(self.local)
        self.progress.load_state_dict(self.counted)


class _Window:
    __slots__ = ("before", "results", "logged", "closures")

    def __init__(self, before, results, logged):
        self.before, self.results, self.logged, self.closures = before, results, logged, []


_healing_closure_classes = {}


def _healing_closure_class(cls):
    """A subclass of Lightning's Closure class `cls` whose call heals
    (Healing._call_closure); its method in its own dict, as for loaders."""
    if cls not in _healing_closure_classes:
        def __call__(self, *args, **kwargs):
            return self._zs_healing._call_closure(self, lambda: cls.__call__(self, *args, **kwargs))

        _healing_closure_classes[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                                                    "__call__": __call__})
    return _healing_closure_classes[cls]


_healing_classes = {}


def _healing_class(cls):
    """A subclass of the DataLoader class `cls` whose iterators are made
    under a fork of the global RNG (the workers' seed drawn, the RNG left
    as it was) and skip the instance's `_zs_skip` first batches once
    (Healing.loader). Its methods in its own dict: a mixin base would
    change the instances' layout, and with it __class__ assignment."""
    if cls not in _healing_classes:
        def __iter__(self):
            import torch
            with torch.random.fork_rng(devices=[]):
                it = cls.__iter__(self)
            skip, self._zs_skip = self._zs_skip, 0
            return _Skipping(it, skip) if skip else it

        _healing_classes[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__iter__": __iter__,
                                                            "_zs_skip": 0, "_zs_healing": True})
    return _healing_classes[cls]


class _Skipping:
    """An iterator that drops its first `skip` items at the first next():
    a DistributedSampler draws its epoch's order there, after Lightning set
    the epoch."""

    def __init__(self, it, skip):
        self.it, self.skip = it, skip

    def __iter__(self):
        return self

    def __next__(self):
        while self.skip:
            self.skip -= 1
            next(self.it)
        return next(self.it)

    def __len__(self):
        return len(self.it) - self.skip
