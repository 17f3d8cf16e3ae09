#include "impl/heal/shrink.h"

#include <algorithm>
#include <string>
#include <vector>

#include "impl/checkpoint/reshard_plan.h"
#include "impl/common/error.h"
#include "impl/device/ops.h"
#include "impl/fetch/coordinator.h"
#include "impl/fetch/gather.h"
#include "impl/heal/peer_copy.h"
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

// One buffer of a slot (its shard, master or a moment) on its way to the
// new layout: its elements' size, the old shards this rank has (its own at
// its old position; a lost rank's replica where this rank holds it) and
// the new shard it fills.
struct Field {
  uint64_t numel = 0;
  size_t elem = 0;
  uint64_t old_shard = 0, new_shard = 0;  // shard_numel before and after
  std::vector<std::pair<int, const uint8_t*>> held;  // (old position, its data)
  BufferPtr fresh;
  const uint8_t* at(int position) const {
    for (const auto& [k, data] : held)
      if (k == position) return data;
    return nullptr;
  }
};

// Every field's new shard filled: what this rank provides to itself is
// copied, the rest crosses the heal group in N - 1 rounds, round s sending
// to the member s places on and receiving from the one s places back. Both
// sides walk the fields and their moves in the same order, so the pieces
// pair without a header. provider[k]: the world rank that has old shard k.
void move(Context& ctx, Group& heal, const std::vector<Field>& fields, int old_world,
          const std::vector<int>& provider) {
  const int n = heal.size(), me = heal.rank();
  const int my_rank = ctx.ranks().rank;
  const auto& members = heal.world_ranks();
  std::vector<std::vector<Move>> moves;
  moves.reserve(fields.size());
  for (const Field& f : fields) moves.push_back(reshard_moves(f.numel, old_world, n));
  for (int s = 0; s < n; ++s) {
    const int to = (me + s) % n, from = (me - s + n) % n;
    std::vector<ExchangeSend> sends;
    std::vector<ExchangeRecv> recvs;
    for (size_t i = 0; i < fields.size(); ++i) {
      const Field& f = fields[i];
      for (const Move& m : moves[i]) {
        const size_t bytes = m.numel * f.elem;
        const int source = provider[static_cast<size_t>(m.from)];
        const uint8_t* src = source == my_rank ? f.at(m.from) + (m.offset - m.from * f.old_shard) * f.elem : nullptr;
        auto* dst = static_cast<uint8_t*>(f.fresh->data()) + (m.offset - m.to * f.new_shard) * f.elem;
        if (s == 0) {
          if (src != nullptr && m.to == me) ctx.device()->copy(dst, src, bytes);
          continue;
        }
        if (src != nullptr && m.to == to) sends.push_back({src, bytes});
        if (m.to == me && source == members[static_cast<size_t>(from)]) recvs.push_back({dst, bytes});
      }
    }
    if (s == 0) continue;
    heal.run("shrink: the shards laid out anew", [&](Communicator& c) {
      c.exchange(sends.empty() ? me : to, sends, recvs.empty() ? me : from, recvs);
    });
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
  }
  const auto held = ctx.lock();
  PeerCopy& pc = peer_copy_of(ctx, opt);
  if (Coordinator* coord = coordinator_if_any(ctx)) coord->reset_for_heal();
  drop_step_in_flight(ctx, opt);
  drop_secondaries(ctx);
  for (const auto& p : registered_params(ctx)) release_when_done(ctx, *p);  // gathered for the old world

  Joined out;
  out.committed = pc.agreed.committed;
  pc.agreed = PeerCopy::Agreed{};
  const std::vector<int>& before = shrunk.before;
  const int old_world = static_cast<int>(before.size());
  const auto position = [&](int r) {
    return static_cast<int>(std::find(before.begin(), before.end(), r) - before.begin());
  };
  // Who has each old shard: its rank, or a lost rank's holder.
  std::vector<int> provider(before.size());
  for (size_t k = 0; k < before.size(); ++k)
    provider[k] = std::binary_search(lost.begin(), lost.end(), before[k]) ? pc.holder_of(before[k]) : before[k];
  const int me = ctx.ranks().rank;
  const int source = pc.source();
  std::vector<PeerCopy::Parts> replica;
  if (std::binary_search(lost.begin(), lost.end(), source)) replica = pc.replica_at(out.committed);

  const std::vector<Optimizer::SlotState> slots = pc.slots_locked();
  if (!replica.empty() && replica.size() != slots.size())
    fail(Code::Internal, "shrink: the replica of rank ", source, " has ", replica.size(), " params, this rank ",
         slots.size());
  const auto& dev = ctx.device();
  const int new_world = ctx.partition_group()->size();
  std::vector<Field> fields;
  std::vector<Optimizer::SlotState> next = slots;
  std::vector<BufferPtr> shards(slots.size());  // each param's new shard
  for (size_t i = 0; i < slots.size(); ++i) {
    const Optimizer::SlotState& s = slots[i];
    Param& p = *s.param;
    const uint64_t numel = p.layout.numel;
    const uint64_t new_shard = ShardLayout::make(numel, new_world, 0).shard_numel;
    // A master older than its shard (the shard rewritten since it was
    // read) is read again first, as the next step would.
    if (s.master && s.master_stale)
      ops::cast_to_f32(*dev, p.shard->data(), p.dtype, static_cast<float*>(s.master->data()), p.layout.shard_numel);
    if (!replica.empty() && replica[i].master && replica[i].master_stale)
      ops::cast_to_f32(*dev, replica[i].shard->data(), p.dtype, static_cast<float*>(replica[i].master->data()),
                       p.layout.shard_numel);
    const auto field = [&](const BufferPtr& own, BufferPtr PeerCopy::Parts::*part, size_t elem, MemKind kind) {
      Field f;
      f.numel = numel;
      f.elem = elem;
      f.old_shard = p.layout.shard_numel;
      f.new_shard = new_shard;
      f.held.emplace_back(position(me), static_cast<const uint8_t*>(own->data()));
      if (!replica.empty()) {
        const BufferPtr& theirs = replica[i].*part;
        if (!theirs)
          fail(Code::Internal, "shrink: rank ", source, "'s replica of ", p.describe(), " lacks a part this rank has");
        f.held.emplace_back(position(source), static_cast<const uint8_t*>(theirs->data()));
      }
      f.fresh = std::make_shared<Buffer>(dev, new_shard * elem, kind, true);
      fields.push_back(f);
      return f.fresh;
    };
    shards[i] = field(p.shard, &PeerCopy::Parts::shard, p.elem_bytes(), MemKind::Shards);
    const size_t esize = dtype_size(s.state_dtype);
    if (s.master) next[i].master = field(s.master, &PeerCopy::Parts::master, sizeof(float), MemKind::Masters);
    if (s.state1) next[i].state1 = field(s.state1, &PeerCopy::Parts::state1, esize, MemKind::OptimizerState);
    if (s.state2) next[i].state2 = field(s.state2, &PeerCopy::Parts::state2, esize, MemKind::OptimizerState);
  }
  move(ctx, *ctx.heal_group(), fields, old_world, provider);
  dev->synchronize();

  // Every param takes its new shard, the optimizer its masters and moments.
  std::vector<Optimizer::SlotState> optimized;
  for (size_t i = 0; i < slots.size(); ++i) {
    slots[i].param->rebind(shards[i], ctx.ledger());
    if (slots[i].group != kInNoOptimizer) optimized.push_back(next[i]);
  }
  opt.adopt_resharded_locked(optimized);
  pc.place_over(ctx.topology().live());
  out.generation = ctx.generation();
  return out;
}

}  // namespace zs::heal
