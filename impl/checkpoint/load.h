// Load at any world size: each rank reads only the byte ranges of the
// files that overlap its current shards, verifies their block checksums,
// and only when every rank has read everything are the shards and the
// optimizer state replaced.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"
#include "impl/partition/param.h"

namespace zs::ckpt {

struct LoadOptions {
  std::string tag;     // empty: path itself, or path/latest
  bool strict = true;  // a checkpoint param not in the list is an error
  std::vector<std::string> names;  // as SaveOptions::names
  // phase "read" with bytes done/total, then "done".
  std::function<void(const char* phase, uint64_t done, uint64_t total)> progress;
};

struct LoadResult {
  std::string dir;        // the checkpoint directory loaded
  std::string user_json;  // as saved
  int64_t step = 0;
  uint64_t bytes_read = 0;  // by this rank
};

// Collective over the world when it has more than one rank (an agreement
// that every rank read its part, then the refresh of persistent params).
// params are matched by name; with opt, its state, step count, loss scaler
// and group hyper-parameters are loaded too. Caller holds ctx.lock().
LoadResult load(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                const std::string& path, const LoadOptions& options);

}  // namespace zs::ckpt
