#include "impl/partition/param.h"

#include <xxhash.h>

#include <cstdio>
#include <limits>

#include "impl/common/error.h"

namespace zs {

const char* param_status_name(ParamStatus s) {
  switch (s) {
    case ParamStatus::NotAvailable: return "NOT_AVAILABLE";
    case ParamStatus::Inflight: return "INFLIGHT";
    case ParamStatus::Available: return "AVAILABLE";
  }
  return "UNKNOWN";
}

uint64_t checked_numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) fail(Code::InvalidArgument, "shape[", i, "] = ", shape[i], ": expected >= 0");
    const auto d = static_cast<uint64_t>(shape[i]);
    if (d != 0 && n > (std::numeric_limits<uint64_t>::max() >> 4) / d)
      fail(Code::InvalidArgument, "shape[", i, "] = ", shape[i], ": element count overflows");
    n *= d;
  }
  return n;
}

Param::Param(uint64_t ctx_id, std::string param_name, DType param_dtype,
             std::vector<int64_t> param_shape, std::shared_ptr<Group> param_group)
    : context_id(ctx_id),
      name(std::move(param_name)),
      dtype(param_dtype),
      shape(std::move(param_shape)),
      group(std::move(param_group)),
      layout(ShardLayout::make(checked_numel(shape), group->size(), group->rank())) {}

void Param::rebind(BufferPtr fresh, Ledger& ledger) {
  const ShardLayout next = ShardLayout::make(layout.numel, group->size(), group->rank());
  if (status_ != ParamStatus::NotAvailable || swapped || packet || grad || !fresh ||
      fresh->bytes() < next.shard_numel * elem_bytes())
    fail(Code::Internal, "rebind of ", describe(), ": ", param_status_name(status_), swapped ? ", swapped" : "",
         packet ? ", packed" : "", grad ? ", with a gradient" : "", " (needs a gathered-nothing, in-memory shard)");
  ledger.sub(Held::Shards, shard_bytes());
  layout = next;
  shard = std::move(fresh);
  ledger.add(Held::Shards, shard_bytes());
}

void Param::start_gather(BufferPtr full, bool aliases_shard, std::shared_ptr<Work> work, Ledger& ledger) {
  if (!aliases_shard && full != full_) ledger.add(Held::Gathered, full->bytes());
  full_ = std::move(full);
  aliases_shard_ = aliases_shard;
  inflight_ = std::move(work);
  status_ = ParamStatus::Inflight;
}

Param::Settled Param::settle(Ledger& ledger) {
  if (status_ != ParamStatus::Inflight || !inflight_->done()) return Settled::Unchanged;
  Settled result = Settled::Available;
  try {
    inflight_->rethrow_if_failed();
    status_ = ParamStatus::Available;
  } catch (const Error&) {
    release(ledger);  // the error stays with the work, for whoever waits on it
    result = Settled::Failed;
  }
  inflight_.reset();
  return result;
}

void Param::release(Ledger& ledger) {
  if (full_ && !aliases_shard_) ledger.sub(Held::Gathered, full_->bytes());
  full_.reset();
  status_ = ParamStatus::NotAvailable;
}

std::string Param::describe() const {
  // Appends rather than a stream: every fetch's collective label calls this.
  std::string s;
  s.reserve(name.size() + 40);
  s += "param '";
  s += name;
  s += "' (";
  s += dtype_name(dtype);
  s += " [";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += "])";
  return s;
}

std::string params_label(const std::string& verb,
                         const std::vector<std::shared_ptr<Param>>& params) {
  constexpr size_t kNamed = 2;
  std::string label = verb;
  uint64_t h = params.size();
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    if (i < kNamed) label += (i ? ", " : " ") + p.describe() + " #" + std::to_string(p.ordinal);
    h = XXH3_64bits_withSeed(p.name.data(), p.name.size(), h ^ p.ordinal);
    h = XXH3_64bits_withSeed(p.shape.data(), p.shape.size() * sizeof(int64_t),
                             h + static_cast<uint64_t>(p.dtype));
  }
  if (params.size() > kNamed) {
    char tail[64];
    std::snprintf(tail, sizeof tail, " and %zu more [params %016llx]", params.size() - kNamed,
                  static_cast<unsigned long long>(h));
    label += tail;
  }
  return label;
}

}  // namespace zs
