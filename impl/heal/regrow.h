// Regrow (docs/healing.md, section 4): after a shrink, the world grows back
// by the ranks left out for which a process has come (all, or some: the
// others stay out until theirs comes), every rank's program unchanged:
//
// 1. The process for a rank left out is started with ZS_HEAL_JOIN=grow and
//    ZS_HEAL_REPLACEMENT=n (zsrun --regrow-after does); at its create it
//    asks to come back and waits for the survivors' answer
//    (Context::await_regrow).
// 2. The lowest live rank reads the requests at each optimizer step while
//    ranks are left out (one store call a step); once one has come, at the
//    first step that ends an iteration (every optimizer with a peer copy
//    at the same step count), it posts the joiners, the live ranks after
//    the regrow, each joiner's admission (the next generation) and votes 1
//    in the step's norm all-reduce (PeerCopy::grow_vote), so every survivor
//    learns it alike, at the same step.
// 3. After that step (zs_optimizer_step, zs_optimizer_step_end) every
//    survivor regrows (regrow_after_step): once the lowest has said that
//    every joiner posted its heartbeat address (a joiner that died after
//    it asked never does: past a deadline the survivors go on as they
//    were, Context::missing_joiners), Context::regrow (heartbeats, the
//    world and heal groups over the live ranks and the joiners), the
//    joiners' builds compared with the survivors' (join.h's check_builds),
//    the shared trainer state and the step counts posted for them, and the
//    state laid out over the grown world in memory (relayout.h), then the
//    peer copies placed over it (seeded at the next step): each optimizer
//    in the order made. The joiner's zs_heal_join for each (regrow_join)
//    takes part in the same rendezvous and exchange and returns the steps
//    taken, C: every rank begins the next iteration, step C + 1 of every
//    optimizer, gradients averaged over the grown world.
//
// Several optimizers whose steps never end an iteration so (one stepping
// every other iteration): after three of the first optimizer's steps with
// none, a request is refused by name (the joiner's create fails with
// ZS_ERR_NOT_TAKEN saying why), and the job trains on shrunk. A joiner
// still waiting when the lowest live rank's context ends is told so
// (ZS_ERR_NOT_TAKEN at its create). A rank lost during the regrow (the
// joiner, a survivor) leaves the state laid out for neither world: every
// rank that sees it fails with StateLost by name (a disk checkpoint), and
// none waits for the store's timeout.
#pragma once

#include "impl/core/context.h"
#include "impl/heal/join.h"
#include "impl/optim/optimizer.h"

namespace zs::heal {

// Under the engine lock, inside opt's step (opt the `ordinal`-th optimizer
// with a peer copy): 1 on the lowest live rank when the world grows back
// after it, else 0. Never throws (a store failure is a vote of 0, named on
// stderr).
float regrow_vote(Context& ctx, Optimizer& opt, int ordinal);
// After an optimizer step, under no hold: the survivors' regrow of every
// optimizer with a peer copy when the step's votes said so, else nothing.
// Collective with the joiners' joins.
void regrow_after_step(Context& ctx, Optimizer& opt);
// On a survivor after a shrink: from here the lowest live rank answers the
// requests to come back, and at its context's end tells a joiner still
// waiting, or one that asks later, that the run is over.
void await_joiners(Context& ctx);
// A joiner's zs_heal_join (Context::growing()).
Joined regrow_join(Context& ctx, Optimizer& opt);

}  // namespace zs::heal
