"""Healing a plain zeroshard.torch loop in place (docs/healing.md, section 3;
landing step 4): a rank lost to a crash is replaced by a process zsrun
starts with its id, while the survivors keep their processes, and the run
goes on as if nothing happened, bit for bit.

    zt.enable_healing()                  # before the context: peer copies on
    ...build the model and ZeroShardOptimizer...
    zt.healing_loop(loader, train_step, after_step, shared={"sched": sched})

Survivors: every engine call after a loss raises RankLostError; the loop
catches it in train_step or after_step, agrees on the committed step C and
takes the replacement in (recover), drops what pointed into the engine's
memory (gathered views, the hooks' state of the abandoned forward), then
redoes train_step with the same batch and RNG (StepRecord) if the step did
not commit, else goes on to after_step. A replacement (ZS_HEAL_REPLACEMENT
set by zsrun) runs the same script from the top: the engine builds its model
without a collective or a disk read, and healing_loop joins before its
first step, takes its state from its holder's copy, its RNG from the blob
it left before step C, the `shared` objects and the data position from the
survivors, and skips the loader to where they are without calling anything.

Per-rank blob: the RNG states, set by ZeroShardOptimizer.step as it begins
(after the backward) while a healing loop runs; the engine posts it to the
job's store before the step can commit. Shared state: the data position and
the `shared` objects' state_dict(), set after every after_step. Both JSON
(heal_state.py).
"""
import copy
import os
import sys
import weakref

from .._ffi import ZS_EXIT_STATE_LOST as EXIT_STATE_LOST  # zsrun: "restart from the checkpoint"
from ..errors import RankLostError, StateLostError
from . import _context, heal_buffers, heal_state, heal_world, inference_gather
from ._context import get_context
from ._params import detach_views, registered_params
from .hook_state import hook_state, step_done

_optimizers = []  # weakrefs to the ZeroShardOptimizers, in the order made (the engine's)
_running = [False]  # a healing loop runs: optimizer steps set the per-rank blob
# What a trainer adds to the per-rank blob (a callable returning JSON-able
# data: zeroshard.hf's Trainer, its loss and FLOPs since the last log), or None.
_rank_extras = [None]
_last_stepped = [None]  # the engine optimizer that stepped last (healing_loop's order check)


def enable_healing():
    """Keep the engine's peer copies on under zsrun --restarts (ZS_HEAL=auto),
    which zeroshard.torch otherwise turns off for a loop that cannot heal:
    call it before the context is created (before Init or
    partition_module), in a program that trains with healing_loop."""
    ctx = _context.current_context()
    if ctx is not None and not heals(ctx):
        raise RuntimeError("zeroshard.torch.enable_healing(): the context exists already, without peer copies; "
                           "call it before zeroshard.torch.Init / partition_module create the context")
    _context.heal_wanted[0] = True


def heals(ctx=None):
    """Whether the context keeps peer copies (zeroshard.healing.peer_copy
    resolved on), i.e. a loss can be healed."""
    return _context.heals(ctx or get_context())


def note_optimizer(opt):
    """A ZeroShardOptimizer was made (the engine's order of optimizers);
    the first also notes the live ranks, which a shrink and a regrow change
    (heal_world)."""
    _optimizers[:] = [r for r in _optimizers if r() is not None]
    _optimizers.append(weakref.ref(opt))
    heal_world.note(get_context())


def optimizers():
    return [o for o in (r() for r in _optimizers) if o is not None]


def before_engine_step(engine):
    """ZeroShardOptimizer.step begins (its backward done): this rank's RNG
    states (and what its trainer adds) go to the engine as the blob of the
    step it takes now."""
    _last_stepped[0] = engine
    if _running[0]:
        extras = _rank_extras[0]
        blob = {"local": heal_state.local_state(), "extra": extras() if extras is not None else None}
        engine.heal_set_rank_state(heal_state.dumps(blob, "this rank's state"))


def joined_rank_state(ctx):
    """In a replacement that joined: the blob its lost predecessor left at
    the committed step, {"local": ..., "extra": ...}, or None."""
    blob = ctx.heal_joined_state("rank")
    return heal_state.loads(blob) if blob is not None else None


def take_donors_buffers(ctx):
    """In a rank that came back at a regrow (ZS_HEAL_JOIN=grow), which has
    no predecessor's blob: the module buffers (BatchNorm's statistics) of
    the lowest survivor as the step the regrow came in left them, as a
    checkpoint load gives every rank rank 0's; before, it went on with the
    values it was built with. Its RNG stays its own (the donor's would
    repeat the donor's draws). Returns whether there were any."""
    blob = ctx.heal_joined_state("donor")
    if blob is None:
        return False
    heal_buffers.restore(heal_state.loads(blob)["local"]["buffers"])
    return True


class running:
    """While a trainer that heals runs (a `with` block): each optimizer step
    sets this rank's blob, with `extras()` in it (None: the RNG alone)."""

    def __init__(self, extras=None):
        self.extras = extras

    def __enter__(self):
        _running[0], _rank_extras[0] = True, self.extras
        return self

    def __exit__(self, *exc):
        _running[0], _rank_extras[0] = False, None


def set_running(on):
    """A loop that heals runs from now on (on; the RNG alone in the blob),
    for loops that are the user's and have no `with` block around them
    (zeroshard.hf.Accelerator's)."""
    _running[0], _rank_extras[0] = bool(on), None


is_replacement = _context.is_replacement


class StepRecord:
    """What a redo needs of a step: its batch (a reference) and this rank's
    own state at its entry (RNG, changing module buffers)."""

    __slots__ = ("batch", "local")

    def __init__(self, batch):
        self.batch = batch
        self.local = heal_state.local_state()

    def restore(self):
        heal_state.set_local_state(self.local)


def recover(agreed=None, allowed=None, who="zeroshard.torch", optimizer=None):
    """After RankLostError on a survivor: the agreement on the committed
    step and the replacement's join, for every ZeroShardOptimizer in the
    order made; then the frontend forgets the step cut short. Returns C of
    `optimizer` (default: the first made; each optimizer's own is its
    `steps` now). agreed(C), if given, runs between the two: what it
    registers as the shared state reaches the replacement. `allowed`, if
    given: the values of C the caller's step in progress can heal at
    (RuntimeError naming `who` otherwise). StateLostError when a rank and
    the holder of its copy were lost together."""
    opts = optimizers()
    if not opts:
        raise RuntimeError("zeroshard.torch.heal.recover(): no ZeroShardOptimizer to heal")
    which = next((i for i, o in enumerate(opts) if o is optimizer), 0)
    committed = [o._engine.heal_agree()[0] for o in opts]
    if agreed is not None:
        agreed(committed[which])
    for o in opts:
        o._engine.heal_join()  # under min_ranks: the shrink in memory
    forget_step_in_flight()
    heal_world.follow(get_context())
    if allowed is not None and committed[which] not in allowed:
        raise RuntimeError(f"{who}: healed at optimizer step {committed[which]}, but this rank's step in progress "
                           f"began at {min(allowed)}")
    return committed[which]


def state_lost_exit(who, error):
    """A heal that cannot be, a survivor's or a replacement's (`error`, a
    StateLostError): says why, and returns the SystemExit with status 75
    (ZS_EXIT_STATE_LOST) to raise, for zsrun --restarts to name it and
    restart every rank from the last checkpoint."""
    print(f"{who}: rank {get_context().rank}: healing is impossible: {error}; exiting with status "
          f"{EXIT_STATE_LOST} for the launcher to restart every rank from the last checkpoint", file=sys.stderr,
          flush=True)
    return SystemExit(EXIT_STATE_LOST)


def join_as_replacement(who="zeroshard.torch"):
    """In a replacement, once its model and optimizers exist: the join, then
    the frontend starts clean. Returns C. When its state's only copy was
    lost before it came (its holder lost in the join: StateLostError), it
    exits with status 75 as a survivor does (state_lost_exit), naming it."""
    opts = optimizers()
    if not opts:
        raise RuntimeError("zeroshard.torch: a replacement (ZS_HEAL_REPLACEMENT) joins once its "
                           "ZeroShardOptimizer exists; none was made")
    try:
        committed = [o._engine.heal_join() for o in opts]
    except StateLostError as e:
        raise state_lost_exit(who, e) from e
    _context.replacement_joined[0] = True
    forget_step_in_flight()
    heal_world.follow(get_context(), joined=True)
    return committed[0]


def survivors_state(committed, who, kind, ours):
    """In a replacement that joined at step `committed`: the survivors'
    shared state (heal_state), which `ours(state)` says is of a `kind` (a
    "Trainer", a "Lightning fit"); else RuntimeError naming what is wrong
    (`who`: the trainer that asks)."""
    data = get_context().heal_joined_state("shared")
    if data is None:
        raise RuntimeError(f"{who}: joined at step {committed} but the survivors handed no state of a {kind} (do "
                           f"they run {who} under the same conditions?)")
    state = heal_state.loads(data)
    if not ours(state):
        raise RuntimeError(f"{who}: the survivors' state is not a {kind}'s (another loop heals there)")
    return state


def forget_step_in_flight():
    """The engine dropped the step a loss cut short (its gathers, its
    gradients) and its coordinator's order: the frontend drops what pointed
    there too: gathered views, the hooks' holds and queues of the abandoned
    forward and backward, gradients, frozen models' kept copies."""
    state = hook_state()
    engines = list(state.ran)
    params = registered_params()
    for p in params:
        e = p.zs.engine if p.zs is not None else None
        if e is not None and all(e is not q for q in engines):
            engines.append(e)
    for e in engines:
        e.forget_held()
    state.running.clear()
    state.opened.clear()
    state.step_open, state.scopes, state.inference = False, 0, False
    state.scaled_backwards = 0
    step_done()
    for p in params:
        if p.zs is not None:
            p.grad = None
            p.zs.stash = None
    # Frozen models' kept copies go on every rank: a replacement has none,
    # and ranks must decide alike whether the next call gathers.
    inference_gather.let_go_all()
    detach_views([p for p in params if p.zs is not None])


def param_groups_state():
    """Every ZeroShardOptimizer's param-group hyper-parameters, for the
    shared state: a schedule changes them, and a replacement starts from
    the initial ones."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers()]


def load_param_groups(saved, who="zeroshard.torch healing_loop"):
    """param_groups_state() of the survivors, into this replacement's
    optimizers."""
    opts = optimizers()
    if len(saved) != len(opts):
        raise RuntimeError(f"{who}: the survivors have {len(saved)} ZeroShardOptimizers, this replacement "
                           f"{len(opts)}")
    for o, groups in zip(opts, saved):
        for g, kept in zip(o.param_groups, groups):
            g.update(kept)


def _hook_engines():
    """The models' hook engines, each keyed by the lowest registration
    index of its params (alike in every process of the same script)."""
    engines = {}
    for p in registered_params():
        e = getattr(p.zs, "engine", None) if p.zs is not None else None
        if e is not None and id(e) not in engines:
            engines[id(e)] = (p.zs.index, e)
    return list(engines.values())


def learned_fetches():
    """The params the models' units learned to fetch with theirs (read
    outside their own module's forward: hooks.fetch_on_access), for the
    shared state: a replacement starts without them, and its first forward,
    learning them again, would issue its gathers in another order than the
    survivors'."""
    return [[key, unit, index] for key, e in _hook_engines() for unit, index in e.learned]


def load_learned_fetches(saved, who="zeroshard.torch healing_loop"):
    """learned_fetches() of the survivors, into this replacement's units."""
    engines = dict(_hook_engines())
    params = {p.zs.index: p for p in registered_params() if p.zs is not None}
    for key, unit_name, index in saved:
        e, p = engines.get(key), params.get(index)
        unit = next((u for u in e.units if u.name == unit_name), None) if e is not None else None
        if unit is None or p is None:
            raise RuntimeError(f"{who}: the survivors' unit {unit_name} fetches their param #{index}, which this "
                               "replacement's model lacks (is it built as theirs?)")
        if all(p is not q for q in unit.params):
            e.learn_fetch(unit, p)


def _register_shared(ctx, position, engine_steps, shared):
    state = {"position": position, "engine_steps": engine_steps, "param_groups": param_groups_state(),
             "learned_fetches": learned_fetches(),
             "objects": {k: obj.state_dict() for k, obj in shared.items()}}
    ctx.heal_set_shared_state(heal_state.dumps(state, "the shared state"))


def _load_shared(shared, state):
    load_param_groups(state["param_groups"])
    load_learned_fetches(state["learned_fetches"])
    objects = state["objects"]
    missing = sorted(set(shared) - set(objects))
    if missing:
        raise RuntimeError(f"zeroshard.torch healing_loop: the survivors' shared state lacks {missing} "
                           "(every rank must pass the same `shared` keys)")
    for k, obj in shared.items():
        obj.load_state_dict(objects[k])


_said = [False]


def healing_loop(loader, train_step, after_step=None, shared=None, optimizer=None):
    """Run train_step(batch) for each batch of `loader`, then after_step(i,
    result) once the step committed; heal a lost rank in place.

    train_step: forward, backward and exactly one step of the loop's
    optimizer (with any number of micro-batches); redone with the same
    batch and RNG when a loss cuts it short before its step commits. Other
    ZeroShardOptimizers may step in it too, before the loop's (a GAN's
    discriminator, then its generator as `optimizer`; refused by name when
    one steps after it): a loss before the first of them commits heals as
    above, one between their commits cannot (the committed step cannot be
    undone, a redo would take it twice) and raises StateLostError, as
    below. after_step: bookkeeping
    once per committed step (scheduler, logging); `result` is what
    train_step returned, or None where a loss cut train_step short after
    its step committed, and in a replacement for the step committed just
    before it joined. shared: name -> object with state_dict() /
    load_state_dict(), equal on every rank (an LR scheduler), handed to a
    replacement with the data position. optimizer: the ZeroShardOptimizer
    whose steps count the loop's (default: the first made), the one
    train_step steps last.

    Batches must not be drawn from the global RNG (a replacement skips to
    its position without them), nor may after_step draw from it. Returns
    the number of steps the loop ran (as a replacement: those it skipped
    too). A heal that cannot be (StateLostError: a rank and the holder of
    its copy lost together) ends the process with status 75
    (ZS_EXIT_STATE_LOST) after printing why: zsrun --restarts then names
    it and restarts every rank, which resume from their last checkpoint."""
    try:
        return _healing_loop(loader, train_step, after_step, shared, optimizer)
    except StateLostError as e:
        raise state_lost_exit("zeroshard.torch healing_loop", e) from e


def _healing_loop(loader, train_step, after_step, shared, optimizer):
    ctx = get_context()
    shared = dict(shared or {})
    opts = optimizers()
    opt = optimizer or (opts[0] if opts else None)
    if opt is None:
        raise RuntimeError("zeroshard.torch.healing_loop needs a ZeroShardOptimizer (made before the loop)")
    engine = opt._engine
    healing = heals(ctx)
    if not healing and os.environ.get("ZS_HEAL") in ("auto", "0") and ctx.rank == 0 and not _said[0]:
        _said[0] = True
        print("zeroshard.torch.healing_loop: no peer copies in this context, so a lost rank is not healed "
              "(call zeroshard.torch.enable_healing() before the context is created)", file=sys.stderr)
    position, resume_after = 0, False
    if healing and is_replacement():
        join_as_replacement("zeroshard.torch.healing_loop")
        committed = engine.steps  # C: the loop's optimizer's, whichever was made first
        blob = joined_rank_state(ctx)
        if blob is not None:
            heal_state.set_local_state(blob["local"])
        else:
            take_donors_buffers(ctx)  # a rank that came back: nothing runs before its next batch
        data = ctx.heal_joined_state("shared")
        if data is not None:
            state = heal_state.loads(data)
            _load_shared(shared, state)
            position = state["position"]
            # The survivors' state is of the end of the step before C's
            # after_step when the loss came after C committed.
            resume_after = committed == state["engine_steps"] + 1
        elif committed != 0:
            raise RuntimeError(f"zeroshard.torch healing_loop: joined at step {committed} but the survivors "
                               "handed no loop state (do they run healing_loop?)")
        print(f"zeroshard.torch: rank {ctx.rank} joined at step {committed}: the loop goes on at batch "
              f"{position + (1 if resume_after else 0)}", file=sys.stderr)
    batches = iter(loader)
    for _ in range(position):
        next(batches)  # the survivors trained on these: skipped, nothing called
    _running[0] = healing
    try:
        if resume_after:
            next(batches)  # the survivors committed this one before the loss
            _after(ctx, after_step, position, None, healing, engine, shared)
            position += 1
        elif healing:
            _register_shared(ctx, position, engine.steps, shared)
        for batch in batches:
            record = StepRecord(batch)
            before = engine.steps
            others = [(o, o._engine.steps) for o in optimizers() if o._engine is not engine]
            result = None
            while True:
                try:
                    _last_stepped[0] = None
                    result = train_step(batch)
                    break
                except RankLostError:
                    if not healing:
                        raise
                    recover()
                    committed = engine.steps  # C, for the loop's optimizer
                    if committed == before:
                        _no_step_taken_in(others, position, before)
                        record.restore()  # not committed: the same batch again
                        continue
                    if committed != before + 1:
                        raise RuntimeError(f"zeroshard.torch healing_loop: step {position} began at optimizer "
                                           f"step {before}, the survivors committed {committed}") from None
                    break  # committed (rolled forward, or lost in the update): on to after_step
            if engine.steps not in (before, before + 1):
                raise RuntimeError(f"zeroshard.torch healing_loop: train_step took {engine.steps - before} "
                                   "optimizer steps; it must take one")
            if healing and others and engine.steps == before + 1 and _last_stepped[0] not in (None, engine):
                raise RuntimeError("zeroshard.torch healing_loop: train_step stepped another ZeroShardOptimizer "
                                   "after the loop's: a loss between the two steps would leave the other's step "
                                   "untaken while the loop counts the batch as done; pass the one train_step "
                                   "steps last as healing_loop(optimizer=...)")
            _after(ctx, after_step, position, result, healing, engine, shared)
            position += 1
    finally:
        _running[0] = False
    return position


def _no_step_taken_in(others, position, before):
    """After a heal in which the loop's optimizer did not commit its step
    (at `before`): StateLostError when another optimizer committed one in
    this train_step, which a redo would take twice and which cannot be
    undone (its step changed its params, and the survivors keep no state
    from before it): the job must restart from its last checkpoint."""
    ahead = next(((o, steps) for o, steps in others if o._engine.steps != steps), None)
    if ahead is not None:
        o, steps = ahead
        raise StateLostError(f"a rank was lost in batch {position} between two optimizer steps of its train_step: "
                             f"another ZeroShardOptimizer committed its step {o._engine.steps} (from {steps}), the "
                             f"loop's did not (at {before}); redoing the batch would step the first twice and its "
                             "step cannot be undone")


def _after(ctx, after_step, position, result, healing, engine, shared):
    """after_step(position, result), run again from the shared objects'
    state before it when a loss cuts it short (the step committed), then
    that state registered for a replacement."""
    if after_step is not None:
        saved = copy.deepcopy({k: obj.state_dict() for k, obj in shared.items()}) if healing else None
        while True:
            try:
                after_step(position, result)
                break
            except RankLostError:
                if not healing:
                    raise
                recover()
                for k, obj in shared.items():
                    obj.load_state_dict(saved[k])
    if healing:
        _register_shared(ctx, position + 1, engine.steps, shared)
