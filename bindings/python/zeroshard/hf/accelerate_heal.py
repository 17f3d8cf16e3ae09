"""zeroshard.hf.Accelerator heals a lost rank in place (docs/healing.md,
"Accelerate scripts"): under `zsrun --restarts` a script written against
Accelerate, unchanged but for its import, loses a rank and goes on with a
replacement zsrun starts with the lost rank's id; the survivors keep their
processes and nothing is read from disk.

The loop is the user's, so a step cut short cannot be redone from here.
Its window (the training DataLoader's batches since the last optimizer
step, micro-batches of an `accumulate` included) is instead:
- recorded: the prepared training DataLoader (the first one prepared)
  keeps the window's batches (references) with the end-of-dataloader flag
  each carried, and this rank's RNG states at its first batch (the other
  prepared DataLoaders make their iterators without drawing from the
  global RNG, which a replacement could not follow);
- hollow after a loss: the first RankLostError inside it turns the rest of
  the window hollow (torch/hollow.py: zeros for gathered params, gradients
  dropped, torch.distributed answering locally);
- healed at its step: the prepared optimizer's `step()` runs the heal
  (zeroshard.torch.heal.recover). Step C not committed: the step reports
  itself skipped and the rest of the iteration reads as one that took no
  step (`sync_gradients` false: the scheduler does not step, the script's
  own step count passes it by), and the DataLoader yields the window's
  batches again, from its RNG. Committed
  (the loss came in the update): the step stands.

The replacement runs the script from the top. In `prepare()`, once the
engine's optimizer exists, it joins (its shards from their holder's copy),
takes the units' learned fetches and the data position (epoch, batch and
the sampler's generator) from the survivors' state, and its training DataLoader yields nothing for the epochs the
survivors finished and starts the current one at their window, with the
RNG its predecessor left at step C. Until that window's first batch it
runs hollow (hollow.catch_up: no collective, zeros for params): the
survivors ran the script's code before it long ago. There it takes the
param groups, the prepared schedulers' state and Accelerate's
accumulation counter, over whatever its own code did to them meanwhile.

A loss outside a window (an evaluation, a save, the logging between a
step and the next batch) is not healed: RankLostError ends the script and
`zsrun --restarts` restarts every rank from the last `save_state`, as
before.

Under zeroshard.healing.min_ranks (zsrun --min-nproc M --shrink) the
survivors go on without a lost rank in memory (the heal is a shrink) and
take it back at a step (torch/heal_world.py): Accelerate's process index
and count follow, each rank keeps its share of the data, and the rank
that comes back (ZS_HEAL_JOIN=grow) joins as a replacement does, at the
window after the step it came back in.
"""
import os
import sys

import accelerate.data_loader
import accelerate.scheduler
import accelerate.state
import torch

from .. import torch as zt
from ..errors import RankLostError, StateLostError
from ..torch import _context, heal, heal_dist, heal_state, heal_world, hollow

WHO = "zeroshard.hf.Accelerator"
KIND = "accelerate"


def before_context(config, fsdp):
    """Accelerator.__init__: under zsrun --restarts (ZS_HEAL=auto) keep the
    peer copies on (zeroshard.torch turns them off for a loop that cannot
    heal), unless the engine's route cannot heal."""
    zero = (config or {}).get("zero_optimization") or {}
    if os.environ.get("ZS_HEAL") == "auto" and _context.current_context() is None and fsdp is None \
            and not zero.get("zero_quantized_nontrainable_weights"):
        zt.enable_healing()


def _accelerate_states():
    """Accelerate's two shared states that exist, each of which a process
    count is read from (AcceleratorState() copies PartialState's when made)."""
    return [s._shared_state for s in (accelerate.state.PartialState, accelerate.state.AcceleratorState)
            if s._shared_state]


def process_follows(position, count, grew):
    """After a shrink or a regrow (heal_world.on_change): Accelerate's
    process index and count (what its gathers size their output by, what
    a script scales by) are this rank's position among the live ranks and
    their count. The data loaders keep the split they were made with: each
    rank its own share, as healing_loop."""
    for shared in _accelerate_states():
        shared["process_index"], shared["num_processes"] = position, count


class PlannedScheduler(accelerate.scheduler.AcceleratedScheduler):
    """A prepared scheduler that steps as many times a step as there were
    processes at the start. Accelerate steps it num_processes times an
    optimizer step (each process took a batch); after a shrink each rank
    still takes its own share's steps, an epoch as many as before, so the
    schedule planned over the run's steps holds only when it goes on at
    the count it was prepared with, not the live one (which Accelerate's
    gathers need, process_follows)."""

    def step(self, *args, **kwargs):
        states = _accelerate_states()
        live = [s["num_processes"] for s in states]
        for s in states:
            s["num_processes"] = _context.get_context().world_size
        try:
            super().step(*args, **kwargs)
        finally:
            for s, n in zip(states, live):
                s["num_processes"] = n


class Healing:
    """An Accelerator's healing: its training window and the replacement's
    join. Made by prepare() once the engine's optimizer is prepared, on a
    context that keeps peer copies."""

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        self.optimizer = optimizer  # the AcceleratedOptimizer over the engine's
        self.loader = None          # the training DataLoader (the first prepared)
        # The data position: epochs begun, batches of this one yielded.
        self.epoch = -1
        self.index = 0
        self.generator = None  # the sampler's generator state at this epoch's start
        # The window: its first batch's position, its batches, its RNG.
        self.open = False
        self.start = 0
        self.batches = []
        self.local = None
        self.replay = []
        self.replaying = False  # the next window is a skipped step's again: its RNG back first
        self.off = False  # the steps do not train on the first DataLoader: nothing is healed
        # A replacement: where the survivors are, until its loader gets there.
        self.resume = None
        self.joined_state = None
        self.from_donor = False  # a rank that came back at a regrow takes the lowest survivor's buffers
        self.window_state = None  # what the open window registered (a regrow's registration replaces it)
        # The world may shrink and grow back (healing.min_ranks): fixed for
        # the context, read once rather than from its config every step.
        self.world_may_change = heal_world.may_change(_context.get_context())
        heal_dist.use_engine_process_group()
        heal_world.on_change(process_follows)
        heal.set_running(True)
        if heal.is_replacement():
            self._join()

    # -- the replacement ----------------------------------------------------
    def _join(self):
        try:
            committed = heal.join_as_replacement(WHO)
        except StateLostError as e:
            raise heal.state_lost_exit(WHO, e) from e
        ctx = _context.get_context()
        # Hollow until its first batch, where the survivors are: the
        # script's code before it (a wait_for_everyone, an evaluation of an
        # epoch it skips) ran on the survivors long ago.
        hollow.catch_up()
        blob = heal.joined_rank_state(ctx)
        data = ctx.heal_joined_state("shared")
        state = heal_state.loads(data) if data is not None else None
        if state is None:
            if committed != 0:
                raise RuntimeError(f"{WHO}: joined at step {committed} but the survivors handed no state of an "
                                   "Accelerate loop (do they run zeroshard.hf.Accelerator under the same "
                                   "conditions?)")
            print(f"{WHO}: rank {ctx.rank} joined before any step: it starts from the top", file=sys.stderr)
            return
        if state.get("kind") != KIND:
            raise RuntimeError(f"{WHO}: the survivors' state is not an Accelerate loop's (another loop heals there)")
        if state["engine_steps"] != committed:
            raise RuntimeError(f"{WHO}: joined at step {committed}, but the survivors' loop state is of step "
                               f"{state['engine_steps']}")
        heal.load_learned_fetches(state["learned_fetches"], WHO)  # before any forward, a hollow one too
        self.joined_state = state
        self.resume = {"epoch": state["epoch"], "index": state["index"], "generator": state["generator"],
                       "local": blob["local"] if blob is not None else None}
        self.from_donor = blob is None  # a rank that came back at a regrow: no predecessor's blob
        print(f"{WHO}: rank {ctx.rank} joined at step {committed}: it goes on at epoch {state['epoch']}, "
              f"batch {state['index']}", file=sys.stderr, flush=True)

    def _caught_up(self):
        """A replacement at the survivors' window (its first batch): what
        their loop has alike, taken now rather than at the join, over
        whatever its own code did meanwhile (an epoch's scheduler step for
        an epoch it skipped)."""
        heal.forget_step_in_flight()  # what its hollow catching up left in the hooks
        hollow.leave()
        state, self.joined_state = self.joined_state, None
        if state is None:
            return
        if self.from_donor:  # over what its hollow forwards wrote in them
            self.from_donor = False
            heal.take_donors_buffers(_context.get_context())
        heal.load_param_groups(state["param_groups"], WHO)
        schedulers, saved = self.accelerator._schedulers, state["schedulers"]
        if len(schedulers) != len(saved):
            raise RuntimeError(f"{WHO}: this replacement prepared {len(schedulers)} schedulers, the survivors "
                               f"{len(saved)}")
        for s, kept in zip(schedulers, saved):
            s.scheduler.load_state_dict(kept)
            for _ in range(state["scheduler_steps_due"]):
                s.step()  # the survivors' own sched.step() after the step that committed in the loss
        self.accelerator.step = state["accumulation_step"]

    # -- the survivors' shared state -------------------------------------------
    def _register(self, index, steps_due, engine_steps=None):
        """The state a replacement takes at the join: the data position of
        the window it starts at, and what the survivors' loop has alike
        (`engine_steps`: the step count it is of, the engine's by default).
        Returns it, encoded."""
        state = {"kind": KIND, "epoch": self.epoch, "index": index, "generator": self.generator,
                 "engine_steps": self.optimizer.optimizer._engine.steps if engine_steps is None else engine_steps,
                 "accumulation_step": self.accelerator.step,
                 "param_groups": heal.param_groups_state(), "learned_fetches": heal.learned_fetches(),
                 "schedulers": [s.scheduler.state_dict() for s in self.accelerator._schedulers],
                 "scheduler_steps_due": steps_due}
        data = heal_state.dumps(state, "the Accelerate loop's state")
        _context.get_context().heal_set_shared_state(data)
        return data

    # -- the training DataLoader --------------------------------------------
    def iterate(self, loader, batches):
        """The training DataLoader's __iter__ (`batches`: Accelerate's own,
        a function returning its generator): records each window, yields a
        skipped step's window again; in a replacement, goes to where the
        survivors are first."""
        resume = self.resume
        if resume is not None and self.epoch + 1 < resume["epoch"]:
            self.epoch += 1
            loader.iteration = self.epoch + 1  # an epoch the survivors finished: nothing to yield
            return
        self.epoch += 1
        self.index = 0
        generator = loader.synchronized_generator
        rng_types = loader.rng_types
        if resume is not None:
            # The survivors drew this epoch's order at its start: take it,
            # without the collective that synchronised it.
            if generator is not None and resume["generator"] is not None:
                generator.set_state(resume["generator"])
            if resume["index"] == 0 and resume["local"] is not None:
                heal_state.set_local_state(resume["local"])  # its predecessor's at step C, before this epoch's iter()
        elif rng_types:
            from accelerate.utils import synchronize_rng_states
            synchronize_rng_states(rng_types, generator)
        self.generator = generator.get_state() if generator is not None else None
        loader.rng_types = None  # synchronised above (Accelerate's own __iter__ would again)
        inner = batches()
        try:
            first = next(inner, _END)
        finally:
            loader.rng_types = rng_types
        if resume is not None:
            for _ in range(resume["index"]):  # the survivors trained on these
                first = next(inner, _END)
                self.index += 1
            if resume["index"] and resume["local"] is not None:
                heal_state.set_local_state(resume["local"])
            self.resume = None
            if first is _END and hollow.active():
                # The survivors' last step was the epoch's last: what the
                # script runs after the epoch (an evaluation) they run now,
                # with this rank, live.
                self._caught_up()
        pending = first
        try:
            while True:
                while self.replay:
                    batch, last = self.replay.pop(0)
                    loader.end_of_dataloader = last
                    yield self._yielding(batch, last)
                if pending is _NEXT:
                    pending = next(inner, _END)
                if pending is _END:
                    return
                batch, pending = pending, _NEXT
                yield self._yielding(batch, loader.end_of_dataloader)
        finally:
            hollow.arm(False)
            self.open = False

    def _yielding(self, batch, last):
        if hollow.active() and not self.open:
            self._caught_up()  # a replacement, at the survivors' window
        if self.off:
            return batch
        if not self.open:
            self.open = True
            if self.optimizer.zs_healed_skip:
                # A heal's skip set sync_gradients off until this window:
                # back as Accelerate keeps it outside `accumulate`.
                self.accelerator.gradient_state._set_sync_gradients(True)
                self.optimizer.zs_healed_skip = False
            self.start, self.batches = self.index, []
            if self.local is not None and self.replaying:
                heal_state.set_local_state(self.local)
            self.replaying = False
            self.local = heal_state.local_state()
            self.window_state = self._register(self.index, 0)
            hollow.arm(True)
        self.batches.append((batch, last))
        self.index += 1
        return batch

    def iterate_held_out(self, batches):
        """Another prepared DataLoader's __iter__ (an evaluation's): its
        iterator made without drawing from the global RNG (torch's DataLoader
        draws its workers' base seed there), which a replacement's RNG, its
        predecessor's at the last optimizer step, would otherwise miss when
        the next window follows an evaluation (as Lightning's strategy makes
        its loaders' iterators)."""
        inner = batches()
        with torch.random.fork_rng(devices=[]):
            first = next(inner, _END)
        if first is _END:
            return
        yield first
        yield from inner

    def wrap(self, loader, training):
        """`loader` as a copy whose iteration this heal follows (Accelerate's
        loaders answer `__class__` with their base DataLoader's, so their
        class cannot be swapped in place): the training one's windows, the
        others' iterators; itself when it is wrapped already or is not a
        DataLoaderShard."""
        if getattr(loader, "_zs_healing", None) is self or \
                type(loader) is not accelerate.data_loader.DataLoaderShard:
            return loader
        cls = _healing_class(type(loader), training)
        twin = cls.__new__(cls)
        twin.__dict__.update(loader.__dict__)
        twin._zs_healing = self
        if training:
            self.loader = twin
        return twin

    def adopt_schedulers(self):
        """Where the world may shrink, the prepared schedulers go on at the
        count of processes they were prepared with (PlannedScheduler)."""
        if not self.world_may_change:
            return
        for s in self.accelerator._schedulers:
            if type(s) is accelerate.scheduler.AcceleratedScheduler:
                s.__class__ = PlannedScheduler

    # -- the optimizer's step -------------------------------------------------
    def step(self, run):
        """The prepared optimizer's step at a window's end (`run`: the step
        itself). Heals a loss in the window or in the step."""
        engine = self.optimizer.optimizer._engine
        before = engine.steps
        if not self.open and not hollow.active() and not self.off:
            # No batch of the first prepared DataLoader since the last step:
            # the steps train on another, whose batches no window records.
            self.off = True
            if _context.get_context().rank == 0:
                print(f"{WHO}: optimizer step {before} took no batch of the first DataLoader prepared, which the "
                      "heal takes as the training one: a lost rank is not healed in place in this run (a loss "
                      "restarts the job from its last save_state); prepare the training DataLoader first",
                      file=sys.stderr, flush=True)
        if self.off:
            run()
            return
        if not hollow.active():
            if self.world_may_change:
                # A regrow may come inside this step (a rank left out taken
                # back): it starts at the next window, as after a step that
                # committed in a loss. A loss in the step registers again.
                self._register(self.index, 1, engine_steps=before + 1)
            try:
                run()
            except RankLostError:
                pass
            else:
                self._close()
                return
        try:
            committed = heal.recover(agreed=lambda c: self._agreed(c, before), allowed=(before, before + 1),
                                     who=WHO)
        except StateLostError as e:
            raise heal.state_lost_exit(WHO, e) from e
        finally:
            hollow.leave()
        if committed == before:
            # Not committed: skipped, and its window again from its first batch.
            # The rest of this iteration reads as one that took no step: the
            # script's own step count (`if accelerator.sync_gradients:
            # completed_steps += 1`) and the scheduler's step pass it by.
            self.optimizer.zs_healed_skip = True
            self.accelerator.gradient_state._set_sync_gradients(False)
            self.replay = self.batches + self.replay
            self.index = self.start
            self.replaying = True
        else:
            # Committed in the loss: its result as this rank's step had it.
            self.optimizer.optimizer.last_result = engine.heal_committed_result()
        self._close()

    def _agreed(self, committed, before):
        if committed == before + 1:
            # The step stands: a replacement starts at the next window, its
            # schedulers stepped once (the survivors' sched.step() follows).
            self._register(self.index, 1)
        elif self.window_state is not None:
            # Not committed: it starts at this window, as registered when
            # it opened (a regrow's registration for the step replaced it).
            _context.get_context().heal_set_shared_state(self.window_state)

    def _close(self):
        self.open = False
        hollow.arm(False)


_END, _NEXT = object(), object()  # Accelerate's iterator ended; the next batch is yet to be drawn


def _healing_class(base, training):
    """`base` (a DataLoaderShard) whose iterator the heal follows: the
    training one's (Healing.iterate) or another's (iterate_held_out)."""
    class HealingDataLoader(base):
        def __iter__(self):
            if training:
                return self._zs_healing.iterate(self, super().__iter__)
            return self._zs_healing.iterate_held_out(super().__iter__)

        def __reduce__(self):
            return base.__reduce__(self)

    HealingDataLoader.__name__ = HealingDataLoader.__qualname__ = base.__name__
    return HealingDataLoader
