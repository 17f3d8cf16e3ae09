// A replacement joins the survivors (docs/healing.md, section 3; landing
// step 3): a process started with a lost rank's id and ZS_HEAL_REPLACEMENT
// set builds its model and optimizer as at the start (no disk read, no
// collective: Context::replacing), and every rank then calls join for the
// optimizer the survivors agreed on (protocol.h):
//
// 1. Survivors (once per loss, at the first optimizer's join) regroup in
//    the next generation (Context::regroup): the replacement is readmitted
//    to the heartbeat and every group reconnects with it.
// 2. Each rank posts a description of what it built (the effective config,
//    then per param of the optimizer its name, dtype, shape and group, then
//    the optimizer's kind, groups and hyper-parameters); the lowest
//    survivor compares each replacement's with its own and posts a verdict.
//    A replacement that differs fails every rank with InvalidState naming
//    the first difference (never a wait until a timeout).
// 3. The step the loss cut short is dropped on the survivors: gathers in
//    flight settled and released, the reducer's buckets and gradients
//    (GradReducer::reset_for_heal), so the redo starts clean.
// 4. The holder of a lost rank's copy hands its replica (state at C) to the
//    replacement (PeerCopy::hand_over); a survivor whose holder was lost
//    seeds the replacement at its next step.
// Then every rank redoes step C + 1 with the same batch.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"

namespace zs::heal {

struct Joined {
  int64_t committed = 0;   // C: the steps opt has taken on every rank now
  int64_t generation = 0;  // the context's generation after the join
  bool replacement = false;
  std::vector<int> replaced;  // the world ranks that joined, ascending
};

// Collective over the world of the next generation. InvalidState on a
// survivor that has not agreed (zs_heal_agree) since its last loss, or on
// a rank that is neither survivor nor replacement; InvalidState naming the
// difference when a replacement's model, optimizer or config differ;
// Timeout naming the rank when no replacement came within the store's
// timeout.
Joined join(Context& ctx, Optimizer& opt);

// Step 2 above, for the ranks that come in (replacements, a regrow's
// joiners): every rank posts what it built under opt_prefix; the
// coordinator compares each newcomer's with its own and, when all agree,
// runs before_ok (what the newcomers read after the verdict) and posts
// "ok"; every rank reads the verdict. A difference fails every rank with
// InvalidState naming it.
void check_builds(Context& ctx, Optimizer& opt, const std::string& opt_prefix, int coordinator,
                  const std::vector<int>& newcomers, const std::function<void()>& before_ok);

// What a rank built, as join compares it (one token a line).
std::string describe_build(Context& ctx, Optimizer& opt);

// The step a loss cut short, dropped on a survivor (under the caller's
// hold): its gathers settle and go, and its gradients (pushed, bucketed
// or reduced) are forgotten.
void drop_step_in_flight(Context& ctx, Optimizer& opt);

}  // namespace zs::heal
