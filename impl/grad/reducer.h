// Gradient reduction: full gradients handed over by the trainer are packed
// into buckets of gradient_wire_dtype's elements (reduce_bucket_size counts
// elements, as in DeepSpeed: a 16-bit bucket takes half the memory), laid
// out rank-major (block r holds every bucketed param's shard r), so one
// reduce-scatter per bucket leaves each rank exactly its shards, averaged
// over the group (with qgZ, quantized from fp32 buckets over an
// all-to-all: quantized_reduce.h); the group thread then sums them into the fp32
// gradient shards, taking each shard's sum of squares as it writes it
// (partition/grad_shard.h). On the host, fp32 on the wire, the ring reads a
// partly filled bucket's blocks where they lie and its last hop sums
// straight into the shards (Communicator::reduce_scatter_into): neither
// the bucket nor the reduced block is copied. Accumulation is fp32 whatever the wire dtype,
// on purpose: DeepSpeed's ZeRO-3 accumulates bf16 gradients in bf16, which
// rounds every micro-step's sum to 8 bits; fp32 shards cost 4 bytes per
// element of this rank's shard only. Buckets go out as they fill,
// overlapping the trainer's backward.
//
// In a group of one (a world of one, or a param's own group of one rank)
// the reduce-scatter is the identity: a gradient goes straight into its
// shard in one pass, divided and rounded through the wire dtype as a bucket
// would have carried it (the same bits), on the calling thread, so the
// caller's memory is its own again when the push returns (a lent one gets
// ticket 0). No bucket, no reduce-scatter copy, no second buffer.
//
// A large gradient (at least a quarter of reduce_bucket_size, its numel a
// multiple of the group size, an fp32 wire on a host context) gains
// nothing from a bucket: it is reduce-scattered alone, laid out as it
// comes (block r is shard r), straight into the gradient shard when that
// holds no current gradient. The route depends on the param and the config
// only, so every rank issues the same collectives whichever push it calls.
// Pushed by borrow(), the reduction reads the trainer's own memory, which
// the trainer keeps until its ticket is released (the copy a bucket
// would take is the size of the gradient: on a wide layer the backward's
// peak); by push(), from a private copy. Each call takes the engine lock
// itself.
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
  explicit GradReducer(Context& ctx);

  void push(const std::shared_ptr<Param>& param, const void* grad, DType dtype, size_t bytes);
  // push() of params[i]'s gradient grads[i] (bytes[i] bytes) in order, a
  // null grads[i] skipped (no gradient); every gradient is checked before
  // any is taken, so a refused call takes none.
  void push_many(const std::vector<std::shared_ptr<Param>>& params, const void* const* grads,
                 const size_t* bytes, DType dtype);
  // push() that may read `grad` after it returns instead of copying it:
  // returns a ticket (> 0) when it does, the caller keeping the memory
  // valid and unchanged until released() reaches the ticket; 0 when it
  // took a copy (a gradient not on the direct route, not fp32 host memory,
  // or reduced before returning: overlap_comm off).
  uint64_t borrow(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                  size_t bytes);
  // The highest ticket that, with every lower one, is no longer read.
  uint64_t released();
  // Flush, wait, and (MiCS) average across the replica groups. sync_locked
  // is for a caller that holds the engine lock (the optimizer's step: the
  // lock is not recursive).
  void sync();
  void sync_locked();
  // sync_locked() for the optimizer's step, whose agreement floats
  // (`extras`, this rank's) are summed over the world by the step's last
  // reduction when that is its only one: a single bucket of the world
  // group, fp32 on the wire, small enough (kDirectAllReduceBytes with the
  // extras) that one all-reduce of the whole bucket costs one exchange, as
  // its reduce-scatter did. Every rank then holds every rank's reduced
  // block, so the sum of squares of the world group's gradient shards and
  // whether one is not finite come out alike on every rank, and the step
  // needs no second collective for its norm (a model of 200 Linear(8, 8) on
  // 2 ranks: the step's gap to DDP's, issue 62). The route depends on the
  // bucket, the config and the last step only, so every rank takes the same.
  // `stepped` are the optimizer's params: the norm is `complete` when they
  // are exactly the bucket's, each once, and none was written by the
  // caller (shard_data) before, on every rank (a flag in the sum).
  struct FusedNorm {
    bool done = false;      // the all-reduce carried `extras` (now summed)
    bool complete = false;  // sum_squares and finite cover every stepped shard
    double sum_squares = 0.0;
    bool finite = true;
  };
  FusedNorm sync_fusing_locked(std::vector<float>& extras, const std::vector<const Param*>& stepped);
  void set_accumulation_steps(int steps);
  // The param's fp32 gradient shard, or null before its first push; an
  // old gradient (none pushed since the last step) is zeroed first. The
  // caller may write through it, so its sum of squares is forgotten.
  float* shard_data(Param& param);
  // After an optimizer step over `stepped`: their gradient shards become
  // old (the next write assigns, and they read as zeros until then), with
  // no pass over them. Others keep accumulating, as torch's .grad of a
  // param no optimizer steps does (a second optimizer over other params
  // steps them next). Under the caller's hold of the engine lock, as are
  // the next two.
  void end_step(const std::set<const Param*>& stepped);
  // torch's optimizer.zero_grad() between a backward and the step (a GAN's
  // generator loss reaching the discriminator's params): the gradients
  // pushed for `params` since their last step are dropped, as end_step
  // drops a stepped one, so their next step sees only what is pushed after
  // (none: it leaves them alone, as torch skips a param whose .grad is
  // None). Nothing pushed for any of them: returns at once, no collective;
  // else the reductions in flight are settled first (sync_locked), which
  // every rank reaches alike, as it pushed alike. Under the caller's hold.
  void discard_locked(const std::vector<std::shared_ptr<Param>>& params);
  // A param being unregistered (unregister_param calls this): the reducer
  // forgets it, and its gradient shard is freed and uncounted. A bucket
  // still in flight holds the shard itself.
  void forget(Param& param) override;
  // Zero qgZ's LoCo errors (checkpoint load: they are not saved).
  void reset_error_feedback();
  // Healing (docs/healing.md, section 3): the step a loss cut short is
  // redone from its first push, so what it reduced is dropped: open
  // buckets, reductions in flight (failed by the abort; waited for first),
  // and every gradient shard becomes old as at a step's end.
  void reset_for_heal();

 private:
  struct Bucket {
    std::shared_ptr<Group> group;
    std::vector<std::shared_ptr<Param>> params;
    std::vector<uint64_t> offsets;  // of each param's shard within a block
    uint64_t used = 0;              // elements per block so far
    uint64_t capacity = 0;          // elements per block
    std::unique_ptr<Buffer> data;  // group size * capacity elements of wire_
  };
  // Under the engine lock: check the gradient, then take() it.
  uint64_t checked_take(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                        size_t bytes, bool borrowed);
  // A checked gradient into its bucket, or onto the direct route (then
  // read in place when `borrowed` allows it: the ticket, else 0).
  uint64_t take(const std::shared_ptr<Param>& param, const void* grad, DType dtype, size_t bytes,
                bool borrowed = false);
  bool direct_route(const Param& p) const;
  // A gradient of a param whose group has one member, into its shard.
  void store_alone(Param& p, const void* grad, DType dtype, size_t bytes);
  uint64_t reduce_direct(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                         size_t bytes, bool borrowed);
  Bucket& open_bucket(const std::shared_ptr<Group>& group, uint64_t shard_numel);
  uint64_t bucket_elements() const;
  // end_step's and discard_locked's: the gradients of `params` dead.
  void release(const std::set<const Param*>& params);
  // A fresh fp32 gradient shard for p, counted in the ledger.
  void make_grad_shard(Param& p);
  void flush(Bucket& bucket);
  bool fusable(const std::vector<float>& extras) const;
  // A reduction now on its group's thread: waited for at once without
  // overlap_comm, else tracked, the oldest waited for past kMaxInFlight.
  void track(std::shared_ptr<Work> w);
  void replica_average();
  void wait_pending();  // every bucket in flight, errors rethrown

  Context& ctx_;
  // The dtype buckets hold and the reduce-scatter moves (gradient_wire_dtype).
  const DType wire_;
  float grad_divisor_ = 1.0f;
  std::map<const Group*, Bucket> open_;
  // Reductions on their group's thread (overlap_comm), oldest first; at
  // most kMaxInFlight, each holding its bucket or (direct) gradient. One:
  // the group's thread reduces one at a time anyway, so a second queued
  // behind it would not reach the wire sooner; it would only hold a
  // gradient more (64 MiB per rank on bench_torch_step's wide model, peak
  // RSS 1955 -> 1894 MiB per rank, step time unchanged at 1.84-1.86 s).
  static constexpr size_t kMaxInFlight = 1;
  std::deque<std::shared_ptr<Work>> pending_;
  // Borrowed gradients still read by a reduction: ticket and its work, in
  // ticket order.
  std::deque<std::pair<uint64_t, std::shared_ptr<Work>>> borrowed_;
  uint64_t tickets_ = 0;  // the last ticket handed out
  uint64_t reductions_ = 0;  // flushed or sent directly since the last end_step
  std::vector<std::shared_ptr<Param>> touched_;  // params with grads, in push order
  std::set<const Param*> touched_set_;
  LocoErrors loco_;  // used with zeropp_loco_param and qgZ
  const bool bucket_given_;  // the config sets reduce_bucket_size (bucket_elements)
};

// The dtype gradients are reduce-scattered in: communication_data_type,
// else DeepSpeed's default (its engine.communication_data_type: the 16-bit
// dtype under bf16.enabled or fp16.enabled, else fp32), so that a DeepSpeed
// config moves the same bytes here as there (half of fp32's in 16 bits).
// qgZ quantizes from fp32 whatever it says.
DType gradient_wire_dtype(const Config& config);

// The context's gradient reducer, created on first use.
inline GradReducer& grads(Context& ctx) { return ctx.attachment<GradReducer>(); }

}  // namespace zs
