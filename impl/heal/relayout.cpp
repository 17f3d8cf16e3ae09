#include "impl/heal/relayout.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "impl/checkpoint/reshard_plan.h"
#include "impl/common/error.h"
#include "impl/device/ops.h"
#include "impl/fetch/coordinator.h"
#include "impl/fetch/gather.h"
#include "impl/heal/join.h"
#include "impl/partition/register.h"

namespace zs::heal {
namespace {

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
    heal.run("healing: the shards laid out anew", [&](Communicator& c) {
      c.exchange(sends.empty() ? me : to, sends, recvs.empty() ? me : from, recvs);
    });
  }
}

}  // namespace

void drop_old_world_state(Context& ctx, Optimizer& opt) {
  ctx.expect_locked();
  if (Coordinator* coord = coordinator_if_any(ctx)) coord->reset_for_heal();
  drop_step_in_flight(ctx, opt);
  drop_secondaries(ctx);
  for (const auto& p : registered_params(ctx)) release_when_done(ctx, *p);
}

void relayout(Context& ctx, Optimizer& opt, PeerCopy& pc, const OldLayout& old) {
  ctx.expect_locked();
  const std::vector<int>& before = old.members;
  const int old_world = static_cast<int>(before.size());
  const auto position = [&](int r) {
    const auto it = std::find(before.begin(), before.end(), r);
    return it == before.end() ? -1 : static_cast<int>(it - before.begin());
  };
  const int me = position(ctx.ranks().rank);  // -1: a joiner, which holds nothing
  const std::vector<PeerCopy::Parts>& replica = old.replica;
  const std::vector<Optimizer::SlotState> slots = pc.slots_locked();
  if (!replica.empty() && replica.size() != slots.size())
    fail(Code::Internal, "healing: the replica of rank ", old.replica_of, " has ", replica.size(), " params, this rank ",
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
    const uint64_t old_shard = ShardLayout::make(numel, old_world, 0).shard_numel;
    const uint64_t new_shard = ShardLayout::make(numel, new_world, 0).shard_numel;
    // A master older than its shard (the shard rewritten since it was
    // read) is read again first, as the next step would.
    if (me >= 0 && s.master && s.master_stale)
      ops::cast_to_f32(*dev, p.shard->data(), p.dtype, static_cast<float*>(s.master->data()), old_shard);
    if (!replica.empty() && replica[i].master && replica[i].master_stale)
      ops::cast_to_f32(*dev, replica[i].shard->data(), p.dtype, static_cast<float*>(replica[i].master->data()),
                       old_shard);
    const auto field = [&](const BufferPtr& own, BufferPtr PeerCopy::Parts::*part, size_t elem, MemKind kind) {
      Field f;
      f.numel = numel;
      f.elem = elem;
      f.old_shard = old_shard;
      f.new_shard = new_shard;
      if (me >= 0) f.held.emplace_back(me, static_cast<const uint8_t*>(own->data()));
      if (!replica.empty()) {
        const BufferPtr& theirs = replica[i].*part;
        if (!theirs)
          fail(Code::Internal, "healing: rank ", old.replica_of, "'s replica of ", p.describe(),
               " lacks a part this rank has");
        f.held.emplace_back(position(old.replica_of), static_cast<const uint8_t*>(theirs->data()));
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
  move(ctx, *ctx.heal_group(), fields, old_world, old.provider);
  dev->synchronize();

  // Every param takes its new shard, the optimizer its masters and moments.
  std::vector<Optimizer::SlotState> optimized;
  for (size_t i = 0; i < slots.size(); ++i) {
    slots[i].param->rebind(shards[i], ctx.ledger());
    if (slots[i].group != kInNoOptimizer) optimized.push_back(next[i]);
  }
  opt.adopt_resharded_locked(optimized);
}

}  // namespace zs::heal
