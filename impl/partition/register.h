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

// Caller holds ctx.lock(). Collective over the group for FromRank.
std::shared_ptr<Param> register_param(Context& ctx, const ParamSpec& spec);

// Caller holds ctx.lock(), and has released the param if it was gathered
// (fetch/ release_when_done) and freed its gradient (grad/ forget_grad):
// marks it unregistered, drops its hpZ secondary shard, updates the memory
// counters.
void unregister_param(Context& ctx, Param& param);

}  // namespace zs
