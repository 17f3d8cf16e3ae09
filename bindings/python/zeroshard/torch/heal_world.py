"""zeroshard.torch follows the engine's world as it shrinks and grows back
(docs/healing.md, section 4): under zeroshard.healing.min_ranks a loss
may end in a shrink in memory (inside recover(): the survivors lay every
shard out anew over the live ranks) and a rank left out may come back at
a step (inside a ZeroShardOptimizer's step: the regrow). Either way the
engine has moved every shard, freed the gathered params and started its
fetch coordinator over; here the frontend does the same for what it
keeps of them:

- each partitioned param's shard layout (size, offset, valid elements),
  which checkpoints and the optimizer's state_dict() read;
- the gathered views and the hooks' holds and queues: the caller's
  (heal.forget_step_in_flight, which recover and the join call anyway; a
  ZeroShardOptimizer step calls it when follow() says the world moved);
- torch.distributed's default group where it runs over the engine
  (heal_dist): made again with this rank's position among the live ranks
  and their count;
- what a trainer registered with on_change (zeroshard.hf: Accelerate's
  process index and count).

Ranks keep their ids (Context.rank, world_size); the data of a rank left
out is left out until it comes back (each survivor keeps its own share),
as in the C API. A torch optimizer stepped on shards (shard_optim) holds
its state as views of the engine's: refused under min_ranks by name. The
check is one group query a step, made only where the world can change
(peer copies on and min_ranks set). Below heal and the optimizers in
the import graph: it imports neither."""
import sys

from . import _context, heal_dist
from ._context import on_shutdown
from ._params import registered_params

_seen = {}  # id(context) -> the live ranks it had when last looked at
_followers = []  # what else follows (a trainer's state), called after the frontend


def on_change(fn):
    """Call fn(position, count, grew) whenever the frontend follows a new
    world: this rank's position among the live ranks, their count, and
    whether they are more than before (once per fn)."""
    if fn not in _followers:
        _followers.append(fn)


def may_change(ctx):
    """Whether the engine may shrink or grow this context's world: healing
    with zeroshard.healing.min_ranks."""
    return _context.heals(ctx) and bool(ctx.config["zeroshard"]["healing"].get("min_ranks"))


def refuse(ctx, who, instead):
    """`who` does not follow a shrink in memory: NotImplementedError naming
    it when the context may shrink, on every rank alike."""
    if may_change(ctx):
        min_ranks = ctx.config["zeroshard"]["healing"]["min_ranks"]
        raise NotImplementedError(
            f"{who}: zeroshard.healing.min_ranks {min_ranks} (ZS_HEAL_MIN_RANKS, which zsrun --min-nproc M "
            f"--shrink exports) shrinks the engine in memory after a loss, which {who} does not follow yet: "
            f"{instead}; heal with a replacement (zsrun --restarts R, without --shrink), or shrink a plain "
            "zeroshard.torch loop under zeroshard.torch.healing_loop")


def note(ctx):
    """Remember the live ranks as they are now, once per context: when its
    first ZeroShardOptimizer is made (heal.note_optimizer), before any heal
    can shrink it (a heal needs one)."""
    if id(ctx) not in _seen:
        _seen[id(ctx)] = tuple(ctx.live_ranks) if may_change(ctx) else None


@on_shutdown
def _forget():
    """The context is gone (its id may be reused by the next)."""
    _seen.clear()


def follow(ctx, joined=False):
    """After a heal or an optimizer step: when the live ranks changed since
    last seen, bring the frontend over to the new layout (module
    docstring). `joined`: in a process that just joined, whose params were
    registered before the join laid their shards out over the world it
    joined, whether or not the list it saw changed. Returns whether the
    frontend moved: the caller then drops what pointed into the old layout
    (heal.forget_step_in_flight)."""
    before = _seen.get(id(ctx))
    if before is None:
        return False
    live = tuple(ctx.live_ranks)
    if live == before and not joined:
        return False
    _seen[id(ctx)] = live
    for p in registered_params():
        if p.zs is not None:
            p.zs.zparam.refresh_layout()
    here, count, grew = live.index(ctx.rank), len(live), len(live) > len(before)
    if heal_dist.is_engine_group():
        heal_dist.remake(here, count)
    for fn in _followers:
        fn(here, count, grew)
    if live != before:
        print(f"zeroshard.torch: rank {ctx.rank}: the world {'grew back' if grew else 'shrank'} to {len(live)} of "
              f"{ctx.world_size} ranks {list(live)}; this rank's shards are laid out anew", file=sys.stderr,
              flush=True)
    return True


def position(ctx):
    """(this rank's position among the live ranks, their count)."""
    live = ctx.live_ranks
    return live.index(ctx.rank), len(live)
