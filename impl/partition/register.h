// Registering a parameter: compute its layout, keep only this rank's shard.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/partition/param.h"

namespace zs {

enum class InitKind : int { Zeros = 0, FromRank = 1, FromAll = 2, Normal = 3, Uniform = 4 };

struct ParamSpec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  InitKind init = InitKind::Zeros;
  const void* data = nullptr;
  size_t data_bytes = 0;
  int src_rank = 0;  // group rank
  uint64_t seed = 0;
  double a = 0.0, b = 1.0;
  std::shared_ptr<Group> group;  // null: the context's partition group
};

// Collective over the group for FromRank. Takes the engine lock.
std::shared_ptr<Param> register_param(Context& ctx, const ParamSpec& spec);

// Every param registered in the context and not unregistered since, in
// the order the ranks registered them (alike on every rank of one
// program). Under the engine lock.
std::vector<std::shared_ptr<Param>> registered_params(Context& ctx);

// A layer above that keeps state per param (fetch/: a gathered copy in
// flight or held; grad/: a gradient shard, maybe in a pending bucket)
// keeps it in a context attachment implementing this, and is told here
// when the param is unregistered, so that it lets go of that state first.
class ParamKeeper : public Context::Attachment {
 public:
  virtual void forget(Param& param) = 0;
};

// Under the engine lock: every ParamKeeper forgets the param, then it is
// marked unregistered and the memory counters updated (fetch/ drops its
// hpZ secondary shard as it forgets it). Others holding the param (a coordinator's trace) see
// the mark.
void unregister_param(Context& ctx, Param& param);

}  // namespace zs
