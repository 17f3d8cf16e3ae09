// The survivors' agreement after a loss (docs/healing.md, section 2;
// landing step 2): which step is committed, who rolls forward, and whether
// a lost rank's state survives in its holder's replica.
//
// Each survivor posts, through the store, its report for one optimizer:
// the steps it has taken, the last norm all-reduce result it obtained, and
// the steps of the replica it holds. The lowest live rank reads the live
// ranks' reports (a member lost meanwhile is dropped: its wait is cut
// short by the heartbeat, and it reads again), computes the plan and posts
// it; every survivor waits for it and applies it:
//
// - C, the committed step: the most steps any survivor took. Step C was
//   committed iff some survivor obtained its norm all-reduce's result with
//   every acknowledgement (commits == world size): only then does a rank
//   update. Survivors one step behind roll forward (apply step C with that
//   result: Optimizer::roll_forward_locked; a holder's replica replays it
//   too), so no update is ever undone.
// - A lost rank whose holder is lost too: StateLost, "rank 1's shard state
//   is lost: rank 1 and rank 2, which held its copy, were lost together".
// - Otherwise the lost rank's state at C is its holder's replica.
//
// After it, survivors take in a replacement of each lost rank (join.h), or
// exit and the launcher restarts every rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"

namespace zs::heal {

struct Outcome {
  int64_t committed = 0;      // C
  bool rolled_forward = false;  // this rank applied step C in the agreement
  std::vector<int> lost;      // the world ranks lost, ascending
};

// Collective over the survivors, after a call of this context failed with
// RankLost (else InvalidState). Throws StateLost on a double loss (also
// recorded as the context's error), Comm when the agreement itself cannot
// complete (rank 0, which serves the store, was lost).
Outcome agree(Context& ctx, Optimizer& opt);

}  // namespace zs::heal
