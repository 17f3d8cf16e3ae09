#include "impl/fetch/gather.h"

#include <cstring>
#include <unordered_set>

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

}  // namespace

void settle(Context& ctx, Param& p) {
  if (p.status != ParamStatus::Inflight || !p.inflight->done()) return;
  try {
    p.inflight->rethrow_if_failed();
    p.status = ParamStatus::Available;
  } catch (const Error&) {
    if (!p.full_aliases_shard) ctx.sub_gathered(p.padded_bytes());
    p.full.reset();
    p.status = ParamStatus::NotAvailable;
  }
  p.inflight.reset();
}

std::shared_ptr<Work> fetch_params(Context& ctx, const ParamList& params) {
  ctx.check_async_error();
  const auto& group = common_group(ctx, params, "fetch");
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    settle(ctx, p);
    if (p.status != ParamStatus::NotAvailable)
      fail(Code::InvalidState, "fetch: params[", i, "] ", p.describe(), " is ",
           param_status_name(p.status), ", expected NOT_AVAILABLE (release it first)");
  }
  // A group of one needs no traffic: the shard is the whole param.
  const bool alias = group->size() == 1;
  std::vector<HostBufferPtr> fulls;
  fulls.reserve(params.size());
  for (const auto& p : params)
    fulls.push_back(alias ? p->shard : std::make_shared<HostBuffer>(p->padded_bytes()));

  // Segments keep the buffers alive until the group thread is done with
  // them, even if a param is unregistered mid-flight.
  std::vector<GatherSegment> segments;
  std::vector<HostBufferPtr> keep;
  segments.reserve(params.size());
  keep.reserve(2 * params.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    segments.push_back({p.shard->data(), fulls[i]->data(), p.shard_bytes()});
    keep.push_back(p.shard);
    keep.push_back(fulls[i]);
    bytes += p.padded_bytes();
  }
  auto work = group->submit("fetch of " + std::to_string(params.size()) + " params",
                            [segments = std::move(segments), keep = std::move(keep)](
                                Communicator& comm) { comm.allgather_coalesced(segments); });
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    p.full = std::move(fulls[i]);
    p.full_aliases_shard = alias;
    p.inflight = work;
    p.status = ParamStatus::Inflight;
  }
  if (!alias) ctx.add_gathered(bytes);
  return work;
}

void release_one(Context& ctx, Param& p) {
  if (!p.full_aliases_shard) ctx.sub_gathered(p.padded_bytes());
  p.full.reset();
  p.status = ParamStatus::NotAvailable;
}

void release_params(Context& ctx, const ParamList& params) {
  common_group(ctx, params, "release");
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    settle(ctx, p);
    if (p.status != ParamStatus::Available)
      fail(Code::InvalidState, "release: params[", i, "] ", p.describe(), " is ",
           param_status_name(p.status),
           p.status == ParamStatus::NotAvailable ? ", it was never fetched or is already released"
                                                 : ", wait for its gather first");
  }
  for (const auto& p : params) release_one(ctx, *p);
}

const HostBufferPtr& available_data(Context& ctx, Param& p, const char* what) {
  settle(ctx, p);
  if (p.status != ParamStatus::Available)
    fail(Code::InvalidState, what, ": ", p.describe(), " is ", param_status_name(p.status),
         p.status == ParamStatus::NotAvailable ? ": fetch it and wait for the gather first"
                                               : ": wait for its gather first");
  return p.full;
}

void update_params(Context& ctx, const ParamList& params, int modifier_rank) {
  ctx.check_async_error();
  const auto& group = common_group(ctx, params, "update");
  if (modifier_rank < 0 || modifier_rank >= group->size())
    fail(Code::InvalidArgument, "update: modifier_rank ", modifier_rank,
         " is out of range for group '", group->name(), "' of size ", group->size());
  for (const auto& p : params) available_data(ctx, *p, "update");
  group->run("update of " + std::to_string(params.size()) + " params", [&](Communicator& comm) {
    for (const auto& p : params) comm.broadcast(p->full->data(), p->full_bytes(), modifier_rank);
  });
  for (const auto& p : params) {
    if (p->full_aliases_shard || p->layout.shard_valid == 0) continue;
    const size_t elem = p->elem_bytes();
    std::memcpy(p->shard->data(),
                static_cast<const uint8_t*>(p->full->data()) + p->layout.shard_offset * elem,
                p->layout.shard_valid * elem);
  }
}

}  // namespace zs
