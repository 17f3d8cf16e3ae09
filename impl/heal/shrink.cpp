#include "impl/heal/shrink.h"

#include <algorithm>
#include <string>
#include <vector>

#include "impl/common/error.h"
#include "impl/heal/peer_copy.h"
#include "impl/heal/regrow.h"
#include "impl/heal/relayout.h"
#include "impl/partition/register.h"
#include "impl/partition/shard_residence.h"

namespace zs::heal {
namespace {

// The partition group's members before the shrink, for the optimizers
// laid out after the first one's shrink regrouped the context.
struct Shrunk final : Context::Attachment {
  explicit Shrunk(Context&) {}
  std::vector<int> before;
};

// Step 1 of shrink.h, under the hold: what a shrink cannot lay out in
// memory, named before anything changes.
void refuse_what_stays(Context& ctx) {
  const char* const then = "; the survivors cannot go on without the lost rank: resume from the last disk "
                           "checkpoint at the new world size";
  if (params_offloaded(ctx))
    fail(Code::NotSupported, "a shrink in memory with zero_optimization.offload_param (", ctx.config().offload_param.device,
         "): the shards in its swap file are laid out for the old world", then);
  if (ctx.config().offload_optimizer.device == "nvme")
    fail(Code::NotSupported, "a shrink in memory with zero_optimization.offload_optimizer (nvme): the optimizer "
         "state in its swap file is laid out for the old world", then);
  if (ctx.config().zeropp_loco && ctx.config().zero_quantized_gradients)
    fail(Code::NotSupported, "a shrink in memory with zero_optimization.zeropp_loco_param: its error feedback is "
         "laid out for the old world", then);
  const std::vector<const Param*> copied = copied_params(ctx);
  for (const auto& p : registered_params(ctx)) {
    if (p->packet)
      fail(Code::NotSupported, "a shrink in memory with zero_optimization.zero_quantized_nontrainable_weights: ",
           p->describe(), " is kept as quantized codes", then);
    if (!std::binary_search(copied.begin(), copied.end(), p.get()))
      fail(Code::NotSupported, "a shrink in memory: ", p->describe(), " is in no optimizer with a peer copy and not "
           "frozen, so no peer holds the lost rank's shard of it", then);
  }
}

}  // namespace

Joined shrink(Context& ctx, Optimizer& opt) {
  if (!ctx.heals())
    fail(Code::InvalidState, "zs_heal_shrink needs zeroshard.healing.peer_copy on, with heartbeats");
  std::vector<int> lost;
  {
    const auto held = ctx.lock();
    PeerCopy& pc = peer_copy_of(ctx, opt);
    if (pc.awaiting_state)
      fail(Code::InvalidState, "zs_heal_shrink in a replacement (ZS_HEAL_REPLACEMENT): the survivors shrink "
           "without the lost rank; a replacement joins them (zs_heal_join)");
    if (!pc.agreed.done)
      fail(Code::InvalidState, "zs_heal_shrink on a survivor runs after zs_heal_agree (for this optimizer), once a "
           "call failed with ZS_ERR_RANK_LOST; no agreement is pending here");
    lost = pc.agreed.lost;
    refuse_what_stays(ctx);
  }
  // Once per loss, at the first optimizer's shrink: the new generation.
  Shrunk& shrunk = ctx.attachment<Shrunk>();
  if (!ctx.lost_ranks().empty()) {
    shrunk.before = ctx.partition_group()->world_ranks();
    ctx.shrink(lost);
    await_joiners(ctx);
  }
  const auto held = ctx.lock();
  PeerCopy& pc = peer_copy_of(ctx, opt);
  drop_old_world_state(ctx, opt);

  Joined out;
  out.committed = pc.agreed.committed;
  pc.agreed = PeerCopy::Agreed{};
  const std::vector<int>& before = shrunk.before;
  // Who has each old shard: its rank, or a lost rank's holder.
  std::vector<int> provider(before.size());
  for (size_t k = 0; k < before.size(); ++k)
    provider[k] = std::binary_search(lost.begin(), lost.end(), before[k]) ? pc.holder_of(before[k]) : before[k];
  const int source = pc.source();
  std::vector<PeerCopy::Parts> replica;
  if (std::binary_search(lost.begin(), lost.end(), source)) replica = pc.replica_at(out.committed);

  OldLayout old;
  old.members = before;
  old.provider = provider;
  old.replica = std::move(replica);
  old.replica_of = source;
  relayout(ctx, opt, pc, old);
  pc.place_over(ctx.topology().live());
  out.generation = ctx.generation();
  return out;
}

}  // namespace zs::heal
