// Collective, crash-safe save of params and optimizer state.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"
#include "impl/partition/param.h"

namespace zs::ckpt {

// phase: "write" (this rank's bytes), "manifest", "rename", "latest"
// (rank 0 commits), "done"; done/total count bytes for "write", else 0/0.
using PhaseProgress = std::function<void(const char* phase, uint64_t done, uint64_t total)>;

struct SaveOptions {
  std::string tag;        // empty: "step-<optimizer steps>"
  std::string user_json;  // rank 0's is kept; empty: {}
  std::chrono::milliseconds timeout{0};  // 0: the context's
  bool overwrite = false;  // replace an existing tag (atomic exchange)
  bool update_latest = true;
  // The names params are saved under, one per param (e.g. a framework's
  // qualified names); empty: their registration names.
  std::vector<std::string> names;
  PhaseProgress progress;  // asynchronous: not called after save returns
  // Return once this rank's shards are staged in host memory; the write
  // and commit run in the background (pending_save.h).
  bool async_save = false;
};

// Every rank of the world calls it with the same params (names unique) in
// the same order. Rank 0 commits: the files go to dir/.<tag>.partial,
// manifest last, fsynced, then the directory is renamed to dir/<tag> and
// dir/latest replaced by rename. A rank that fails or never arrives within
// the timeout makes every rank fail with a message naming it; dir/<tag>
// and dir/latest are then as they were. Caller holds ctx.lock().
// Waits first for an asynchronous save in flight. Returns the checkpoint's
// directory.
std::string save(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                 const std::string& dir, const SaveOptions& options);

}  // namespace zs::ckpt
