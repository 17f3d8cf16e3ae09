// A param's fp32 gradient shard, and what the writes into it left known.
// The reducer (grad/reducer.h) writes it on its group's thread while a
// reduction is in flight; everything else reads or marks it only when no
// reduction is (after GradReducer::sync, under the engine lock), so these
// fields need no lock of their own.
//
// No pass zeroes the shards between steps: the step marks them not
// current, the first write after that assigns instead of adding, and until
// then every reader takes the shard as zeros. The write that leaves the
// values also takes their sum of squares (ops::store_sum_squares), so the
// step's global norm need not read the gradients again.
#pragma once

#include "impl/device/buffer.h"

namespace zs {

struct GradShard : Buffer {
  using Buffer::Buffer;
  // Written since the last optimizer step (or since creation); if not,
  // the bytes are an old gradient and mean zeros.
  bool current = false;
  // sumsq is the sum of squares, in double, of the values as they stand
  // (bit for bit ops::sum_squares_and_finite's over the shard). Any write
  // that does not update it clears this.
  bool sum_known = false;
  double sumsq = 0.0;
};

using GradShardPtr = std::shared_ptr<GradShard>;

}  // namespace zs
