// Every param a peer copy carries laid out anew over the heal group as it
// stands now, from the layout over another set of ranks (docs/healing.md,
// section 4): a shrink (N -> N - 1, a lost rank's shards from its holder's
// replica) and a regrow (N - 1 -> N, a joiner holding nothing) alike.
//
// Each buffer of a slot (shard, fp32 master, moments) is one field; each
// new shard's elements come from the old shard that held them
// (reshard_plan.h's moves): what this rank gives itself is copied, the rest
// crosses the heal group in N' - 1 rounds (round s: to the member s places
// on, from the one s places back). Both sides walk fields and moves in the
// same order, so the pieces pair without a header. Then every param takes
// its new shard (Param::rebind) and the optimizer its masters and moments
// (update and step counts unchanged).
#pragma once

#include <vector>

#include "impl/core/context.h"
#include "impl/heal/peer_copy.h"
#include "impl/optim/optimizer.h"

namespace zs::heal {

struct OldLayout {
  std::vector<int> members;   // the world ranks laid out over before, by position
  std::vector<int> provider;  // by old position: the world rank that sends that old shard
  // A lost rank's state at C this rank provides (its holder's replica), and
  // whose; empty when it provides none.
  std::vector<PeerCopy::Parts> replica;
  int replica_of = -1;
};

// Under the caller's hold, collective over the heal group (its new
// members). A rank not among old.members (a joiner) provides nothing.
void relayout(Context& ctx, Optimizer& opt, PeerCopy& pc, const OldLayout& old);

// Under the caller's hold, before a relayout: what was laid out for the old
// world goes (the fetch coordinator's orders and gathered params, every
// gathered param, the step in flight's gradients, hpZ secondaries).
void drop_old_world_state(Context& ctx, Optimizer& opt);

}  // namespace zs::heal
