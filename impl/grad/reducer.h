// Gradient reduction: full gradients handed over by the trainer are packed
// into buckets laid out rank-major (block r holds every bucketed param's
// shard r), so one reduce-scatter per bucket leaves each rank exactly its
// shards, averaged over the group (with qgZ, quantized over an all-to-all:
// quantized_reduce.h); the group thread then sums them into the fp32
// gradient shards, taking each shard's sum of squares as it writes it
// (partition/grad_shard.h). Buckets go out as they fill, overlapping the
// trainer's backward. Each call takes the engine lock itself.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "impl/comm/work.h"
#include "impl/core/context.h"
#include "impl/device/buffer.h"
#include "impl/grad/loco.h"
#include "impl/partition/param.h"
#include "impl/partition/register.h"

namespace zs {

class GradReducer : public ParamKeeper {
 public:
  explicit GradReducer(Context& ctx) : ctx_(ctx), loco_(ctx) {}

  void push(const std::shared_ptr<Param>& param, const void* grad, DType dtype, size_t bytes);
  // push() of params[i]'s gradient grads[i] (bytes[i] bytes) in order, a
  // null grads[i] skipped (no gradient); every gradient is checked before
  // any is taken, so a refused call takes none.
  void push_many(const std::vector<std::shared_ptr<Param>>& params, const void* const* grads,
                 const size_t* bytes, DType dtype);
  // Flush, wait, and (MiCS) average across the replica groups.
  void sync();
  void set_accumulation_steps(int steps);
  // The param's fp32 gradient shard, or null before its first push; an
  // old gradient (none pushed since the last step) is zeroed first. The
  // caller may write through it, so its sum of squares is forgotten.
  float* shard_data(Param& param);
  // After an optimizer step: every gradient shard becomes old (its next
  // write assigns, and it reads as zeros until then), with no pass over them.
  void end_step();
  // A param being unregistered (unregister_param calls this): the reducer
  // forgets it, and its gradient shard is freed and uncounted. A bucket
  // still in flight holds the shard itself.
  void forget(Param& param) override;
  // Zero qgZ's LoCo errors (checkpoint load: they are not saved).
  void reset_error_feedback();

 private:
  struct Bucket {
    std::shared_ptr<Group> group;
    std::vector<std::shared_ptr<Param>> params;
    std::vector<uint64_t> offsets;  // of each param's shard within a block
    uint64_t used = 0;              // elements per block so far
    uint64_t capacity = 0;          // elements per block
    std::unique_ptr<Buffer> data;  // group size * capacity floats
  };
  // A checked gradient into its bucket.
  void take(const std::shared_ptr<Param>& param, const void* grad, DType dtype, size_t bytes);
  Bucket& open_bucket(const std::shared_ptr<Group>& group, uint64_t shard_numel);
  void flush(Bucket& bucket);
  void replica_average();
  void wait_pending();  // every bucket in flight, errors rethrown

  Context& ctx_;
  float grad_divisor_ = 1.0f;
  std::map<const Group*, Bucket> open_;
  // Buckets reducing on their group's thread (overlap_comm), oldest first;
  // at most kMaxInFlight, each holding its full-size fp32 copy.
  static constexpr size_t kMaxInFlight = 2;
  std::deque<std::shared_ptr<Work>> pending_;
  std::vector<std::shared_ptr<Param>> touched_;  // params with grads, in push order
  std::set<const Param*> touched_set_;
  LocoErrors loco_;  // used with zeropp_loco_param and qgZ
};

// The context's gradient reducer, created on first use.
inline GradReducer& grads(Context& ctx) { return ctx.attachment<GradReducer>(); }

}  // namespace zs
