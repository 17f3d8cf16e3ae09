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
//
// A shard with a sink (optimizer state on NVMe: optim/swapped_state.h)
// lives there between its writes, as DeepSpeed swaps gradients out with
// the optimizer state: each write brings it into memory (read back only
// when it adds to a current gradient: accumulation), stores, and puts it
// away, so the model's gradients never sit in memory from the backward to
// the step. The step reads them from the sink with the moments. A caller
// that writes through data() holds it in memory until the step frees it.
#pragma once

#include <cstdint>
#include <memory>

#include "impl/common/dtype.h"
#include "impl/device/buffer.h"
#include "kernels/optim.h"

namespace zs {

// Where a shard goes between writes: the whole shard, `n` fp32 values.
// Called from the reducer's group threads: implementations are thread-safe.
class GradSink {
 public:
  virtual ~GradSink() = default;
  virtual void write(const float* src, uint64_t n) = 0;
  virtual void read(float* dst, uint64_t n) = 0;
};

class GradShard {
 public:
  // Without a sink the memory is taken now (not zeroed: not current);
  // with one, when a write needs it.
  GradShard(std::shared_ptr<Device> device, uint64_t numel, std::shared_ptr<GradSink> sink = nullptr);
  GradShard(const GradShard&) = delete;
  GradShard& operator=(const GradShard&) = delete;

  uint64_t numel() const { return numel_; }
  size_t bytes() const { return numel_ * sizeof(float); }
  // The values in memory. A shard in its sink, or one with a sink never
  // written, has none: Internal error (load() or hold() first).
  void* data() const;
  // Whether the values are in the sink, not in memory.
  bool in_sink() const { return in_sink_; }
  // Whether a reduction may write straight into data() (assigning): no
  // current gradient, and the memory stays (no sink, or held).
  bool writes_in_place() const { return !current && mem_ && (!sink_ || held_); }

  // The reduction's write of all numel values from src (which may be
  // data()): assigned if no current gradient, else added; the sum of
  // squares taken as it writes; then put away if the shard has a sink.
  void store(Device& dev, const float* src);
  // store() of a group of one, straight from the trainer's gradient
  // (numel values of `dtype`, in the device's memory): each value as a
  // reduction bucket of `wire` divided by `divisor` would have carried it
  // (ops::store_gradient_sum_squares), the same bits as store() of the
  // bucket's reduce-scatter, in one pass.
  void store_gradient(Device& dev, const void* grad, DType dtype, DType wire, float divisor);
  // store() of the last hop of a host reduce-scatter: each value (own[i] +
  // in[i]) * scale (ops::store_reduced_sum_squares), written as it is
  // reduced: no copy, the same bits as store() of the reduced block.
  void store_reduced(Device& dev, const float* own, const float* in, float scale);
  // The values into memory (read from the sink if there).
  void load();
  // load(), and the memory stays until the shard is freed: the caller
  // writes through data().
  void hold();
  // Into the sink, the memory back to the pool (unless held or no sink).
  void put_away();
  // Divides every value by `divisor` wherever it is (clip_grad_norm); the
  // sum of squares is taken again when the values go back to the sink.
  void divide(Device& dev, float divisor);
  // The memory straight back to the system, past the pool's cache; the
  // shard has no values after (it is being dropped).
  void free_to_system();

  bool current = false;  // written since the last step; if not, the bytes mean zeros
  // sumsq is the sum of squares, in double, of the values as they stand
  // (bit for bit ops::sum_squares_and_finite's over the shard). Any write
  // that does not update it clears sum_known.
  bool sum_known = false;
  double sumsq = 0.0;

 private:
  void ensure_memory();
  // A write of every value: `write` stores into the memory in the mode
  // given (Assign if no current gradient, else Add) and returns whether it
  // took the sum of squares; then the shard goes to its sink if it has one.
  template <typename Write>
  void write_all(Device& dev, Write&& write);

  std::shared_ptr<Device> device_;
  uint64_t numel_;
  std::shared_ptr<GradSink> sink_;
  std::unique_ptr<Buffer> mem_;
  bool in_sink_ = false;
  bool held_ = false;
};

using GradShardPtr = std::shared_ptr<GradShard>;

}  // namespace zs
