#include "impl/fetch/gather.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "impl/common/fault_point.h"
#include "impl/comm/two_hop_gather.h"
#include "impl/device/ops.h"
#include "impl/fetch/quantized.h"
#include "impl/partition/register.h"
#include "impl/partition/shard_residence.h"

namespace zs {
namespace {

// Every param in one fetch shares a context and a group, appears once.
const std::shared_ptr<Group>& common_group(Context& ctx, const ParamList& params,
                                           const char* what) {
  if (params.empty()) fail(Code::InvalidArgument, what, ": the param list is empty");
  std::unordered_set<const Param*> seen;
  const auto& group = params.front()->group;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    if (p.context_id != ctx.id())
      fail(Code::InvalidArgument, what, ": params[", i, "] ", p.describe(),
           " belongs to another context");
    if (p.group != group)
      fail(Code::InvalidArgument, what, ": params[", i, "] ", p.describe(),
           " is partitioned over group '", p.group->name(), "' but params[0] over '",
           group->name(), "'; fetch each group separately");
    if (!seen.insert(&p).second)
      fail(Code::InvalidArgument, what, ": params[", i, "] ", p.describe(),
           " is listed twice");
  }
  return group;
}

// The fetch layer's state per context, under the engine lock: each
// param's hpZ secondary shard (this rank's slice of it within the
// intra-node group: `held` once a gather left it, counted in the ledger;
// `pending` while that gather is in flight); and, for a param being
// unregistered, its gather waited out, its full buffer and secondary freed.
struct FetchState : ParamKeeper {
  struct Secondary {
    std::weak_ptr<Param> param;  // tells a live param from a reused address
    BufferPtr held, pending;
  };
  explicit FetchState(Context& c) : ctx(c) {}
  void forget(Param& p) override {
    release_when_done(ctx, p);
    if (Secondary* s = find(p)) {
      if (s->held) ctx.ledger().sub(Held::Secondary, s->held->bytes());
      secondaries.erase(&p);
    }
  }
  Secondary* find(const Param& p) {
    const auto it = secondaries.find(&p);
    if (it == secondaries.end()) return nullptr;
    if (it->second.param.lock().get() != &p) {  // a param destroyed unregistered
      if (it->second.held) ctx.ledger().sub(Held::Secondary, it->second.held->bytes());
      secondaries.erase(it);
      return nullptr;
    }
    return &it->second;
  }
  Context& ctx;
  std::unordered_map<const Param*, Secondary> secondaries;
};

// The param's secondary shard, or null.
BufferPtr secondary_of(Context& ctx, const Param& p) {
  auto* state = ctx.find_attachment<FetchState>();
  FetchState::Secondary* s = state ? state->find(p) : nullptr;
  return s ? s->held : nullptr;
}

}  // namespace

void drop_secondaries(Context& ctx) {
  ctx.expect_locked();
  auto* state = ctx.find_attachment<FetchState>();
  if (state == nullptr) return;
  for (auto it = state->secondaries.begin(); it != state->secondaries.end();) {
    FetchState::Secondary& s = it->second;
    if (s.held) ctx.ledger().sub(Held::Secondary, s.held->bytes());
    s.held.reset();
    // One still in flight is kept: its gather's settle makes it the new one.
    it = s.pending ? std::next(it) : state->secondaries.erase(it);
  }
}

ParamStatus settle(Context& ctx, Param& p) {
  const auto held = ctx.lock();
  return settle_locked(ctx, p);
}

ParamStatus settle_locked(Context& ctx, Param& p) {
  ctx.expect_locked();
  const Param::Settled settled = p.settle(ctx.ledger());
  auto* state = settled == Param::Settled::Unchanged ? nullptr : ctx.find_attachment<FetchState>();
  FetchState::Secondary* s = state ? state->find(p) : nullptr;
  if (s && s->pending) {
    if (settled == Param::Settled::Available) {
      if (s->held) ctx.ledger().sub(Held::Secondary, s->held->bytes());
      s->held = std::move(s->pending);
      ctx.ledger().add(Held::Secondary, s->held->bytes());
    }
    s->pending.reset();
  }
  return p.status();
}

namespace {

// Elements of the full buffer: the group's padding, or the hpZ group's if
// that is larger (a gather from secondary shards fills h equal slices).
uint64_t full_numel(const Context& ctx, const Param& p) {
  uint64_t n = p.layout.padded_numel;
  const auto& hpz = ctx.hpz_group();
  if (hpz && p.group == ctx.partition_group()) {
    const auto h = static_cast<uint64_t>(hpz->size());
    n = std::max(n, (p.layout.numel + h - 1) / h * h);
  }
  return n;
}

// One param's packet on its way (qwZ, or a frozen param kept packed).
// Each rank packs its shard into `send` (a packed param's `send` is its
// packet already: `shard` is null); `recv` holds every member's packet in
// the group's order; each packet is dequantized into its shard's place in
// `full`.
struct QuantSlot {
  const void* shard;
  void* send;
  uint8_t* recv;
  uint8_t* full;
  DType dtype;
  uint64_t shard_numel;
  size_t packet;
  kernels::QuantSpec spec;
};

void pack_all(Device& dev, const std::vector<QuantSlot>& slots) {
  bool packed = false;
  for (const auto& q : slots) {
    if (q.shard == nullptr) continue;
    pack_quantized(dev, q.shard, q.dtype, q.shard_numel, q.spec, q.send);
    packed = true;
  }
  if (packed) dev.synchronize();  // the transport reads the packets next
}

// Packet k of recv belongs to shard k.
void unpack_all(Device& dev, const std::vector<QuantSlot>& slots, int members) {
  for (const auto& q : slots) {
    const size_t shard_bytes = q.shard_numel * dtype_size(q.dtype);
    for (int k = 0; k < members; ++k)
      unpack_quantized(dev, q.recv + static_cast<size_t>(k) * q.packet, q.dtype, q.shard_numel,
                       q.spec, q.full + static_cast<size_t>(k) * shard_bytes);
  }
}

// Whether a gather sends p as packets: a packed (frozen) param's own, or
// qwZ's where the packet is smaller than the shard (a small param travels
// exact, quant_packet.h).
bool sends_packet(const Param& p, const ShardAccess& shard, bool qwz,
                  const kernels::QuantSpec& qwz_spec) {
  return shard.packed() || (qwz && worth_quantizing(p.dtype, p.layout.shard_numel, qwz_spec));
}

// The slot of params[i] gathered as packets (qwZ, or kept packed), its
// send and receive buffers added to `keep`.
QuantSlot quant_slot(const std::shared_ptr<Device>& dev, const Param& p, const ShardAccess& shard,
                     const BufferPtr& full, const kernels::QuantSpec& qwz, int members,
                     std::vector<BufferPtr>& keep) {
  const kernels::QuantSpec spec = shard.packed() ? p.packet_spec : qwz;
  const size_t packet = quant_packet(p.layout.shard_numel, spec).bytes;
  BufferPtr send = shard.packed() ? shard.buffer() : std::make_shared<Buffer>(dev, packet, MemKind::CommStaging);
  auto recv = std::make_shared<Buffer>(dev, packet * static_cast<size_t>(members), MemKind::CommStaging);
  keep.push_back(send);
  keep.push_back(recv);
  return {shard.packed() ? nullptr : shard.data(), send->data(),
          static_cast<uint8_t*>(recv->data()), static_cast<uint8_t*>(full->data()),
          p.dtype, p.layout.shard_numel, packet, spec};
}

// A replacement of a lost rank before its join (docs/healing.md, section
// 3): the survivors wait for it in the join, so a collective of its own
// would wait for them until the timeout. Refused at once, by name.
void refuse_before_join(const Context& ctx, const char* what, const ParamList& params) {
  if (!ctx.replacing() || params.empty()) return;
  fail(Code::InvalidState, what, " of ", params.size(), " param", params.size() == 1 ? "" : "s", " (",
       params[0]->describe(), params.size() > 1 ? ", ..." : "", ") in a replacement of rank ", ctx.ranks().rank,
       " (ZS_HEAL_REPLACEMENT) before zs_heal_join: the survivors wait for it in the join, so nothing collective "
       "runs before it; join first (zeroshard.torch.healing_loop joins before its first step)");
}

}  // namespace

std::shared_ptr<Work> fetch_params(Context& ctx, const ParamList& params, bool into_gathered,
                                   bool exact) {
  const auto held = ctx.lock();
  return fetch_params_locked(ctx, params, into_gathered, exact);
}

std::shared_ptr<Work> fetch_params_locked(Context& ctx, const ParamList& params,
                                          bool into_gathered, bool exact) {
  ctx.expect_locked();
  ctx.check_async_error();
  refuse_before_join(ctx, "fetch", params);
  // A fetch is the forward's until gradients arrive (a backward's recompute
  // or re-gather stays the backward's).
  if (memory_tally::phase() != MemPhase::Backward) memory_tally::set_phase(MemPhase::Forward);
  ctx.attachment<FetchState>();  // so that unregister_param lets go of what we gather
  const auto& group = common_group(ctx, params, "fetch");
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    settle_locked(ctx, p);
    const bool again = into_gathered && p.status() == ParamStatus::Available && !p.full_aliases_shard();
    if (p.status() != ParamStatus::NotAvailable && !again)
      fail(Code::InvalidState, "fetch: params[", i, "] ", p.describe(), " is ",
           param_status_name(p.status()), ", expected NOT_AVAILABLE (release it first)");
  }
  const size_t n = params.size();
  // A group of one needs no traffic: the shard is the whole param (unless
  // it is offloaded: a cached shard may be dropped while gathered).
  bool alias = group->size() == 1 && !params_offloaded(ctx);
  for (const auto& p : params) alias = alias && !p->packet;  // a packet is no alias of anything
  const auto& hpz = ctx.hpz_group();
  const bool hpz_route = hpz && group == ctx.partition_group();
  bool from_secondary = hpz_route;
  std::vector<BufferPtr> secondaries;
  for (const auto& p : params) {
    if (!from_secondary) break;
    secondaries.push_back(secondary_of(ctx, *p));
    from_secondary = secondaries.back() != nullptr;
  }
  // Each param's shard for this gather: resident while the gather is set
  // up (it keeps its own references after that), or, offloaded, a buffer
  // its group thread reads back first (read_backs).
  std::vector<ShardAccess> reading;
  std::vector<std::function<void()>> read_backs;
  if (!from_secondary)
    for (const auto& p : params) {
      reading.emplace_back(ctx, *p, ShardAccess::ReadInGather);
      if (reading.back().read_back()) read_backs.push_back(reading.back().read_back());
    }
  const bool hierarchical = ctx.mics_inter_group() && group == ctx.mics_shard_group();
  // qwZ: gathers from the primary shards (forward; every gather without
  // hpZ) travel quantized, but for params too small to gain from it, and
  // for groups within one host (Context::quantizes: every member must end
  // with the same values, so the choice is the group's, not each pair's);
  // hpZ's secondary gathers stay exact.
  const bool qwz = !exact && !alias && ctx.config().zero_quantized_weights && ctx.quantizes(*group);
  const kernels::QuantSpec spec = weight_quant_spec(ctx.config());

  const auto& dev = ctx.device();
  std::vector<BufferPtr> fulls;
  fulls.reserve(n);
  for (const auto& p : params) {
    if (p->status() == ParamStatus::Available) {  // into_gathered: the buffer it has
      fulls.push_back(p->full());
      continue;
    }
    fulls.push_back(alias ? p->shard
                          : std::make_shared<Buffer>(dev, full_numel(ctx, *p) * p->elem_bytes(), MemKind::Gathered));
  }

  // Segments keep the buffers alive until the group thread is done with
  // them, even if a param is unregistered mid-flight.
  std::vector<GatherSegment> segments;
  std::vector<BufferPtr> keep(fulls);
  std::shared_ptr<Work> work;
  const std::string what = params_label("fetch of", params);
  ctx.ledger().count(Fetched::Gather);
  if (from_secondary) {
    const auto h = static_cast<uint64_t>(hpz->size());
    for (size_t i = 0; i < n; ++i) {
      const uint64_t slice = (params[i]->layout.numel + h - 1) / h * params[i]->elem_bytes();
      segments.push_back({secondaries[i]->data(), fulls[i]->data(), slice});
      keep.push_back(secondaries[i]);
    }
    ctx.ledger().count(Fetched::HpzGather);
    work = hpz->submit(what + " from hpZ secondary shards",
                       [segments, keep](Communicator& c) { c.allgather_coalesced(segments); });
  } else if (hierarchical) {
    // Each hop moves the unit a rank sends: its shard, or its qwZ packet
    // (gathered into a packet per member, then dequantized into place).
    TwoHopGather gather;
    std::vector<QuantSlot> quants;
    const int members = group->size();
    for (size_t i = 0; i < n; ++i) {
      Param& p = *params[i];
      const BufferPtr& shard = reading[i].buffer();
      keep.push_back(shard);
      if (!sends_packet(p, reading[i], qwz, spec)) {
        gather.units.push_back({shard->data(), fulls[i]->data(), p.shard_bytes()});
        continue;
      }
      quants.push_back(quant_slot(dev, p, reading[i], fulls[i], spec, members, keep));
      gather.units.push_back({quants.back().send, quants.back().recv,
                              quants.back().packet, true});
    }
    gather.keep = keep;
    gather.before = [quants, dev, read_backs] {
      for (const auto& read_back : read_backs) read_back();
      pack_all(*dev, quants);
    };
    gather.after = [quants, dev, members] { unpack_all(*dev, quants, members); };
    ctx.ledger().count(Fetched::HierarchicalGather);
    work = submit_two_hop_gather(*ctx.mics_inter_group(), *ctx.mics_intra_group(), dev,
                                 std::move(gather), what);
  } else {
    // Primary gather; with hpZ it also leaves each param's secondary slice.
    std::vector<ops::Copy> slices;
    std::vector<QuantSlot> quants;
    const int members = group->size();
    for (size_t i = 0; i < n; ++i) {
      Param& p = *params[i];
      const BufferPtr& shard = reading[i].buffer();
      keep.push_back(shard);
      if (sends_packet(p, reading[i], qwz, spec)) {
        quants.push_back(quant_slot(dev, p, reading[i], fulls[i], spec, members, keep));
        segments.push_back({quants.back().send, quants.back().recv,
                            quants.back().packet, true});
      } else {
        segments.push_back({shard->data(), fulls[i]->data(), p.shard_bytes()});
      }
      if (!hpz_route || alias) continue;
      // The secondary slice copies what this gather left, dequantized
      // under qwZ: backward then computes with the forward's weights.
      const auto h = static_cast<uint64_t>(hpz->size());
      const uint64_t slice_numel = (p.layout.numel + h - 1) / h;
      const uint64_t first = static_cast<uint64_t>(hpz->rank()) * slice_numel;
      FetchState& state = ctx.attachment<FetchState>();
      FetchState::Secondary* secondary = state.find(p);
      if (!secondary) {
        secondary = &state.secondaries[&p];
        secondary->param = p.shared_from_this();
      }
      secondary->pending = std::make_shared<Buffer>(dev, slice_numel * p.elem_bytes(), MemKind::Secondary, true);
      keep.push_back(secondary->pending);
      const uint64_t valid = ShardLayout::valid_in(p.layout.numel, first, slice_numel);
      slices.push_back({secondary->pending->data(),
                        static_cast<const uint8_t*>(fulls[i]->data()) + first * p.elem_bytes(),
                        valid * p.elem_bytes()});
    }
    work = group->submit(what, [segments, keep, slices, dev, quants, members,
                                read_backs](Communicator& c) {
      fault_point("fetch");
      for (const auto& read_back : read_backs) read_back();
      pack_all(*dev, quants);
      c.allgather_coalesced(segments);
      unpack_all(*dev, quants, members);
      ops::copy_many(*dev, slices, CopyKind::GatherStaging);
      dev->synchronize();
    });
  }
  for (size_t i = 0; i < n; ++i) params[i]->start_gather(std::move(fulls[i]), alias, work, ctx.ledger());
  return work;
}

void release_one(Context& ctx, Param& p) {
  ctx.expect_locked();
  p.release(ctx.ledger());
}

void release_when_done(Context& ctx, Param& p) {
  ctx.expect_locked();
  settle_locked(ctx, p);
  if (p.status() == ParamStatus::Inflight) {
    try {
      p.inflight()->wait(-1);
    } catch (const Error&) {
      // Recorded as the context's async error; settle frees the buffer.
    }
    settle_locked(ctx, p);
  }
  if (p.status() == ParamStatus::Available) release_one(ctx, p);
}

void release_params(Context& ctx, const ParamList& params) {
  const auto held = ctx.lock();
  release_params_locked(ctx, params);
}

void release_params_locked(Context& ctx, const ParamList& params) {
  ctx.expect_locked();
  common_group(ctx, params, "release");
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    settle_locked(ctx, p);
    if (p.status() != ParamStatus::Available)
      fail(Code::InvalidState, "release: params[", i, "] ", p.describe(), " is ",
           param_status_name(p.status()),
           p.status() == ParamStatus::NotAvailable ? ", it was never fetched or is already released"
                                                 : ", wait for its gather first");
  }
  for (const auto& p : params) release_one(ctx, *p);
}

BufferPtr available_data(Context& ctx, Param& p, const char* what) {
  const auto held = ctx.lock();
  return available_data_locked(ctx, p, what);
}

BufferPtr available_data_locked(Context& ctx, Param& p, const char* what) {
  ctx.expect_locked();
  settle_locked(ctx, p);
  if (p.status() != ParamStatus::Available)
    fail(Code::InvalidState, what, ": ", p.describe(), " is ", param_status_name(p.status()),
         p.status() == ParamStatus::NotAvailable ? ": fetch it and wait for the gather first"
                                               : ": wait for its gather first");
  return p.full();
}

void update_params(Context& ctx, const ParamList& params, int modifier_rank) {
  const auto held = ctx.lock();
  ctx.check_async_error();
  refuse_before_join(ctx, "update", params);
  const auto& group = common_group(ctx, params, "update");
  if (modifier_rank < 0 || modifier_rank >= group->size())
    fail(Code::InvalidArgument, "update: modifier_rank ", modifier_rank,
         " is out of range for group '", group->name(), "' of size ", group->size());
  for (const auto& p : params) available_data_locked(ctx, *p, "update");
  drop_secondaries(ctx);  // the shards are about to change
  std::vector<ShardAccess> writing;
  for (const auto& p : params) writing.emplace_back(ctx, *p, ShardAccess::Write);
  group->run("update of " + std::to_string(params.size()) + " params", [&](Communicator& comm) {
    for (const auto& p : params) comm.broadcast(p->full()->data(), p->full_bytes(), modifier_rank);
  });
  std::vector<ops::Copy> copies;
  const bool qwz = ctx.config().zero_quantized_weights && ctx.quantizes(*group);
  const kernels::QuantSpec spec = weight_quant_spec(ctx.config());
  for (size_t i = 0; i < params.size(); ++i) {
    Param* p = params[i].get();
    ++p->shard_version;
    if (p->full_aliases_shard() || p->layout.shard_valid == 0) continue;
    const size_t elem = p->elem_bytes();
    const uint8_t* mine = static_cast<const uint8_t*>(p->full()->data()) + p->layout.shard_offset * elem;
    // What the modifier did not touch stays exact under qwZ; a packed
    // param has no exact values (its access requantizes what changed); a
    // param qwZ gathered exact needs no comparison (and must not have one:
    // a value set to what quantizing would give is still a change).
    if (qwz && !p->packet && worth_quantizing(p->dtype, p->layout.shard_numel, spec)) {
      write_back_keeping_exact(*ctx.device(), writing[i].data(), p->dtype, p->layout.shard_numel,
                               p->layout.shard_valid, spec, mine);
      continue;
    }
    copies.push_back({writing[i].data(), mine, p->layout.shard_valid * elem});
  }
  ops::copy_many(*ctx.device(), copies, CopyKind::Other);  // the caller's change
  ctx.device()->synchronize();
}

void write_param(Context& ctx, Param& p, const void* data, size_t bytes) {
  const auto held = ctx.lock();
  ctx.check_async_error();
  if (bytes != p.full_bytes())
    fail(Code::BufferSize, "write: ", p.describe(), ": data_bytes is ", bytes, ", expected ",
         p.full_bytes(), " (", p.layout.numel, " elements of ", dtype_name(p.dtype), ")");
  if (data == nullptr && bytes > 0) fail(Code::InvalidArgument, "write: data is NULL");
  if (settle_locked(ctx, p) == ParamStatus::Inflight)
    fail(Code::InvalidState, "write: ", p.describe(), " is INFLIGHT: wait for its gather first");
  Device& dev = *ctx.device();
  const size_t elem = p.elem_bytes();
  const auto* src = static_cast<const uint8_t*>(data);
  drop_secondaries(ctx);  // a secondary shard would serve the old values
  if (p.status() == ParamStatus::Available && !p.full_aliases_shard()) {
    dev.copy(p.full()->data(), src, bytes);
    copy_tally::add(CopyKind::Other, bytes);
  }
  if (p.layout.shard_valid > 0) {
    const ShardAccess shard(ctx, p, ShardAccess::Write);
    dev.copy(shard.data(), src + p.layout.shard_offset * elem, p.layout.shard_valid * elem);
    copy_tally::add(CopyKind::Other, p.layout.shard_valid * elem);
  }
  dev.synchronize();
  ++p.shard_version;
}

}  // namespace zs
