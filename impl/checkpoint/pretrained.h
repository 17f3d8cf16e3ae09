// Full tensors from a safetensors file, or a Hugging Face sharded set
// (model.safetensors.index.json), into partitioned params: every rank sees
// the files and preads only the bytes of its own shards, casting to each
// param's dtype, so memory is bounded by this rank's shards. Nothing
// changes on any rank unless every rank read its part. Or (from_rank0) rank
// 0 reads and scatters, holding one full tensor at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "impl/checkpoint/shard_io.h"
#include "impl/core/context.h"
#include "impl/optim/optimizer.h"
#include "impl/partition/param.h"

namespace zs::ckpt {

struct PretrainedOptions {
  std::vector<std::string> names;  // one per param; empty: registration names
  bool strict = true;              // a param the files lack is an error (else left as is)
  // Only rank 0 reads (the files need not exist elsewhere), one full tensor
  // at a time, and scatters the shards; params must be partitioned over
  // the world.
  bool from_rank0 = false;
  Progress progress;
};

// path: a .safetensors file, an index .json, or a directory holding
// model.safetensors.index.json or model.safetensors. With opt, the fp32
// masters of 16-bit params are set from the file's values too. Collective
// over the world (one agreement). Returns the number of params loaded.
size_t load_pretrained(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, Optimizer* opt,
                       const std::string& path, const PretrainedOptions& options);

}  // namespace zs::ckpt
