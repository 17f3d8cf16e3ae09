#include "impl/grad/reducer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "impl/comm/algo/collectives.h"
#include "impl/comm/algo/quantized_reduce.h"
#include "impl/common/copy_tally.h"
#include "impl/common/fault_point.h"
#include "impl/common/reduce.h"
#include "impl/core/context.h"
#include "impl/device/ops.h"
#include "kernels/optim.h"

namespace zs {

DType gradient_wire_dtype(const Config& c) {
  if (c.zero_quantized_gradients) return DType::F32;
  if (c.communication_data_type == "fp32") return DType::F32;
  if (c.communication_data_type == "bf16") return DType::BF16;
  if (c.communication_data_type == "fp16") return DType::F16;
  if (c.bf16) return DType::BF16;
  if (c.fp16) return DType::F16;
  return DType::F32;
}

GradReducer::GradReducer(Context& ctx)
    : ctx_(ctx),
      wire_(gradient_wire_dtype(ctx.config())),
      loco_(ctx),
      bucket_given_(ctx.config().given("zero_optimization.reduce_bucket_size")) {}

void GradReducer::set_accumulation_steps(int steps) {
  const auto held = ctx_.lock();
  if (steps < 1) fail(Code::InvalidArgument, "accumulation steps ", steps, ": expected >= 1");
  grad_divisor_ = static_cast<float>(steps);
}

// Elements of one bucket (all ranks' blocks): reduce_bucket_size where the
// config sets it; else two typical gather units of the model once the
// coordinator has seen one (a unit's gradient, which FSDP2 reduces at once,
// with room for its shards' padding and the next unit's first params), at
// least Context::kFittedWindowFloorBytes of the wire dtype and at most the
// default. Two buckets are out at a time (one reducing,
// one filling): at the default's 80 MB a 162M GPT held 200 MiB of them at
// the backward's peak (bench/bench_torch_memory.py). Without the floor a
// model of tiny units had buckets of a few hundred bytes, and the direct
// route (a quarter of the bucket) took every weight: 200 Linear(8, 8)
// reduced in 212 reduce-scatters a step instead of 1 (issue 62). Alike on
// every rank.
uint64_t GradReducer::bucket_elements() const {
  const Config& c = ctx_.config();
  const auto configured = static_cast<uint64_t>(c.reduce_bucket_size);
  const uint64_t unit = ctx_.typical_unit();
  if (bucket_given_ || unit == 0) return configured;
  const uint64_t floor = Context::kFittedWindowFloorBytes / dtype_size(wire_);
  return std::min(std::max(2 * unit, floor), configured);
}

GradReducer::Bucket& GradReducer::open_bucket(const std::shared_ptr<Group>& group,
                                              uint64_t shard_numel) {
  Bucket& b = open_[group.get()];
  if (b.data && b.used + shard_numel > b.capacity) flush(b);
  if (!b.data) {
    const auto g = static_cast<uint64_t>(group->size());
    const auto per_block = bucket_elements() / g;
    b.group = group;
    b.capacity = std::max<uint64_t>({per_block, shard_numel, 1});
    b.data = std::make_unique<Buffer>(ctx_.device(), b.capacity * g * dtype_size(wire_), MemKind::ReduceBuckets);
  }
  return b;
}

namespace {

// Why a push of this gradient is refused, before anything is taken.
void check_push(const Param& p, const void* grad, DType dtype, size_t bytes) {
  if (p.frozen)
    fail(Code::InvalidState, "gradient of ", p.describe(),
         ": the param is frozen (zs_param_freeze) and takes no gradient");
  if (dtype == DType::U8)
    fail(Code::InvalidArgument, "gradient of ", p.describe(), ": dtype uint8 is not a float type");
  if (bytes != p.layout.numel * dtype_size(dtype))
    fail(Code::BufferSize, "gradient of ", p.describe(), ": grad_bytes is ", bytes, ", expected ",
         p.layout.numel * dtype_size(dtype), " (", p.layout.numel, " elements of ",
         dtype_name(dtype), ")");
  if (grad == nullptr && bytes > 0) fail(Code::InvalidArgument, "grad is NULL");
}

// A gradient that is not in the engine's device memory (a host gradient for
// a GPU context, or the reverse) comes over in one copy first: that copy,
// with grad pointed at it; null where grad already is in that memory.
std::unique_ptr<Buffer> onto_device(const std::shared_ptr<Device>& devp, const void*& grad,
                                    size_t bytes) {
  const DeviceRef where = pointer_location(grad);
  if (bytes == 0 || (!where.is_cuda() && !devp->is_cuda()) || where == devp->ref()) return nullptr;
  auto moved = std::make_unique<Buffer>(devp, bytes, MemKind::ReduceBuckets);
  copy_between(moved->data(), grad, bytes);
  copy_tally::add(CopyKind::GradOntoDevice, bytes);
  grad = moved->data();
  return moved;
}

}  // namespace

void GradReducer::push(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                       size_t bytes) {
  checked_take(param, grad, dtype, bytes, false);
}

void GradReducer::push_many(const std::vector<std::shared_ptr<Param>>& params,
                            const void* const* grads, const size_t* bytes, DType dtype) {
  const auto held = ctx_.lock();
  ctx_.check_async_error();
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads[i] == nullptr) continue;  // no gradient this time
    try {
      check_push(*params[i], grads[i], dtype, bytes[i]);
    } catch (const Error& e) {
      fail(e.code(), "params[", i, "]: ", e.what());
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i] != nullptr) take(params[i], grads[i], dtype, bytes[i]);
}

uint64_t GradReducer::borrow(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                            size_t bytes) {
  return checked_take(param, grad, dtype, bytes, true);
}

uint64_t GradReducer::checked_take(const std::shared_ptr<Param>& param, const void* grad,
                                   DType dtype, size_t bytes, bool borrowed) {
  const auto held = ctx_.lock();
  ctx_.check_async_error();
  check_push(*param, grad, dtype, bytes);
  return take(param, grad, dtype, bytes, borrowed);
}

uint64_t GradReducer::released() {
  const auto held = ctx_.lock();
  while (!borrowed_.empty() && borrowed_.front().second->done()) borrowed_.pop_front();
  return borrowed_.empty() ? tickets_ : borrowed_.front().first - 1;
}

// The ledger counts a param's gradient shard once, from its first push on,
// through the steps that free and make it again: grad_bytes is the state a
// step holds, as params and optimizer state are; the memory report's
// "grads" is what is allocated now.
void GradReducer::make_grad_shard(Param& p) {
  p.grad = std::make_shared<GradShard>(ctx_.device(), p.layout.shard_numel, p.grad_sink);
  if (!p.grad_released) ctx_.ledger().add(Held::Grads, p.grad->bytes());
}

uint64_t GradReducer::take(const std::shared_ptr<Param>& param, const void* grad, DType dtype,
                           size_t bytes, bool borrowed) {
  memory_tally::set_phase(MemPhase::Backward);  // gradients arriving: the backward's bytes
  Param& p = *param;
  Device& dev = *ctx_.device();
  if (!p.grad) make_grad_shard(p);  // not zeroed: not current until its first write, which assigns
  if (touched_set_.insert(&p).second) touched_.push_back(param);
  p.grad_pushed = true;
  if (p.layout.numel == 0) return 0;
  if (p.group->size() == 1) {
    store_alone(p, grad, dtype, bytes);
    return 0;
  }
  if (direct_route(p)) return reduce_direct(param, grad, dtype, bytes, borrowed);

  Bucket& b = open_bucket(p.group, p.layout.shard_numel);
  const uint64_t offset = b.used;
  const size_t elem = dtype_size(dtype);
  const size_t wire = dtype_size(wire_);
  const auto moved = onto_device(ctx_.device(), grad, bytes);
  auto* blocks = static_cast<uint8_t*>(b.data->data());
  uint64_t copied = 0;
  for (int r = 0; r < p.group->size(); ++r) {
    const uint64_t first = static_cast<uint64_t>(r) * p.layout.shard_numel;
    const uint64_t valid = ShardLayout::valid_in(p.layout.numel, first, p.layout.shard_numel);
    uint8_t* dst = blocks + (static_cast<uint64_t>(r) * b.capacity + offset) * wire;
    const uint8_t* src = static_cast<const uint8_t*>(grad) + first * elem;
    if (wire_ == DType::F32)
      ops::widen_scaled(dev, src, dtype, reinterpret_cast<float*>(dst), valid, grad_divisor_);
    else
      ops::narrow_scaled(dev, src, dtype, dst, wire_, valid, grad_divisor_);
    if (valid < p.layout.shard_numel)  // padding
      dev.zero(dst + valid * wire, (p.layout.shard_numel - valid) * wire);
    copied += valid * wire;
  }
  copy_tally::add(CopyKind::GradIntoBucket, copied);
  // The caller may reuse its gradient memory once we return.
  if (dev.is_cuda()) dev.synchronize();
  b.params.push_back(param);
  b.offsets.push_back(offset);
  b.used += p.layout.shard_numel;
  return 0;
}

// Under the engine lock, on the calling thread. Every gradient of the
// param comes this way (the route depends on its group only), so no
// reduction in flight on a group's thread writes this shard; readers
// (shard_data, the step) come after a sync, as for any shard.
void GradReducer::store_alone(Param& p, const void* grad, DType dtype, size_t bytes) {
  const auto& devp = ctx_.device();
  const auto moved = onto_device(devp, grad, bytes);  // a gradient in the other memory: over first
  p.grad->store_gradient(*devp, grad, dtype, wire_, grad_divisor_);
  if (devp->is_cuda()) devp->synchronize();  // the caller may reuse its memory once we return
}

bool GradReducer::direct_route(const Param& p) const {
  const Config& c = ctx_.config();
  const auto g = static_cast<uint64_t>(p.group->size());
  return !ctx_.device()->is_cuda() && wire_ == DType::F32 && g > 1 && p.layout.numel % g == 0 &&
         p.layout.numel * 4 >= bucket_elements() &&
         !(c.zero_quantized_gradients && ctx_.quantizes(*p.group));
}

uint64_t GradReducer::reduce_direct(const std::shared_ptr<Param>& param, const void* grad,
                                    DType dtype, size_t bytes, bool borrowed) {
  Param& p = *param;
  const auto& devp = ctx_.device();
  const uint64_t numel = p.layout.numel;
  ++reductions_;
  // In place: fp32 host memory the caller lends; the accumulation divisor
  // is then applied to this rank's shard after the average. Else a private
  // fp32 copy, divided as a bucket's is (the same bits as a bucket).
  borrowed = borrowed && dtype == DType::F32 && !pointer_location(grad).is_cuda();
  std::shared_ptr<Buffer> copy;
  const float* src = static_cast<const float*>(grad);
  if (!borrowed) {
    const auto moved = onto_device(devp, grad, bytes);  // a CUDA gradient: to host memory first
    copy = std::make_shared<Buffer>(devp, numel * sizeof(float), MemKind::ReduceBuckets);
    ops::widen_scaled(*devp, grad, dtype, static_cast<float*>(copy->data()), numel, grad_divisor_);
    copy_tally::add(CopyKind::GradIntoBucket, numel * sizeof(float));
    src = static_cast<const float*>(copy->data());
  }
  const float after = borrowed && grad_divisor_ != 1.0f ? 1.0f / grad_divisor_ : 1.0f;
  const uint64_t n = p.layout.shard_numel;
  GradShardPtr shard = p.grad;
  // The first write since the step reduces straight into the shard;
  // later ones (accumulation), and any into a shard that goes to its sink,
  // into a shard-sized buffer stored from.
  auto w = p.group->submit(
      params_label("gradient reduce-scatter of", {param}),
      [src, copy, shard, n, after, devp](Communicator& comm) {
        fault_point("reduce_scatter");
        GradShard& s = *shard;
        std::unique_ptr<Buffer> mine;
        float* out = nullptr;
        if (s.writes_in_place()) {
          out = static_cast<float*>(s.data());
        } else {
          mine = std::make_unique<Buffer>(devp, n * sizeof(float), MemKind::ReduceBuckets);
          out = static_cast<float*>(mine->data());
        }
        comm.reduce_scatter(src, out, n, DType::F32, ReduceOp::Avg);
        if (after != 1.0f) kernels::scale_inplace(out, n, after);  // host memory: direct_route
        s.store(*devp, out);
      });
  uint64_t ticket = 0;
  if (borrowed && ctx_.config().overlap_comm) {
    ticket = ++tickets_;
    borrowed_.emplace_back(ticket, w);
  }
  track(std::move(w));
  return ticket;
}

void GradReducer::flush(Bucket& b) {
  if (!b.data || b.used == 0) return;
  ++reductions_;
  // Blocks were laid out capacity apart. The host's reduce-scatter reads
  // them where they are (a strided ring: no pass over the bucket); qgZ's
  // quantized exchanges want them used apart, so there the gaps close in
  // place: block r moves down to r * used, below its source and past the
  // blocks already moved, and the host copy is memmove, so overlap is
  // fine; no second bucket-sized buffer sits next to the first while the
  // backward peaks. On a GPU into a fresh buffer (device copies must not
  // overlap; NCCL wants them packed).
  const auto& devp = ctx_.device();
  const int g = b.group->size();
  const size_t wire = dtype_size(wire_);
  const bool quantized = ctx_.config().zero_quantized_gradients && g > 1 && ctx_.quantizes(*b.group);
  auto data = std::shared_ptr<Buffer>(std::move(b.data));
  const uint64_t stride = quantized || devp->is_cuda() ? b.used : b.capacity;
  if (b.used < b.capacity && g > 1 && !devp->is_cuda() && quantized) {
    auto* blocks = static_cast<uint8_t*>(data->data());
    for (int r = 1; r < g; ++r) {
      const auto rank = static_cast<uint64_t>(r);
      devp->copy(blocks + rank * b.used * wire, blocks + rank * b.capacity * wire, b.used * wire);
    }
    copy_tally::add(CopyKind::BucketCompaction, static_cast<uint64_t>(g - 1) * b.used * wire);
  } else if (b.used < b.capacity && g > 1 && devp->is_cuda()) {
    auto packed = std::make_shared<Buffer>(devp, b.used * static_cast<uint64_t>(g) * wire, MemKind::ReduceBuckets);
    std::vector<ops::Copy> copies;
    const auto* from = static_cast<const uint8_t*>(data->data());
    auto* to = static_cast<uint8_t*>(packed->data());
    for (int r = 0; r < g; ++r)
      copies.push_back({to + static_cast<uint64_t>(r) * b.used * wire,
                        from + static_cast<uint64_t>(r) * b.capacity * wire, b.used * wire});
    ops::copy_many(*devp, copies, CopyKind::BucketCompaction);
    data = std::move(packed);
  }
  auto params = std::move(b.params);
  auto offsets = std::move(b.offsets);
  const uint64_t used = b.used;
  const auto group = std::move(b.group);
  b = Bucket{};
  // The task holds the gradient shards themselves, so a param unregistered
  // meanwhile cannot pull them away from under it. One unregistered while
  // its gradient sat in this bucket has none: its block still goes through
  // the collective (the peers' layout has it), and its result is dropped.
  std::vector<GradShardPtr> shards;
  for (const auto& p : params) shards.push_back(p->grad);
  // qgZ: quantized codes over an all-to-all instead of the fp32 ring where
  // the group spans hosts (Context::quantizes); a group of one, or within
  // one host, stays exact. Across whole nodes, two hops (quantized_reduce.h),
  // each on its own group's thread; the first, within a node, is exact when
  // the node is one host: only traffic between hosts is quantized.
  const kernels::QuantSpec spec{static_cast<int>(ctx_.config().zero_quantized_gradients_bits),
                                static_cast<size_t>(ctx_.config().zero_quantized_gradients_block_size)};
  // The first write since the step assigns (the shard holds an old
  // gradient, not zeros), later ones add; each leaves the sum of squares
  // of the whole shard as it now stands.
  auto add_into_shards = [shards, offsets, devp](const float* src) {
    for (size_t i = 0; i < shards.size(); ++i)
      if (shards[i]) shards[i]->store(*devp, src + offsets[i]);
    devp->synchronize();
  };
  const auto& intra = ctx_.qgz_intra_group();
  const auto& inter = ctx_.qgz_inter_group();
  const bool two_hops = quantized && intra && inter && group.get() == ctx_.world().get();
  const bool exact_hop1 = two_hops && !ctx_.quantizes(*intra);
  // LoCo: this bucket's errors, one per element each hop sends (the
  // tasks hold them, and only their own group's thread touches them).
  const bool loco = quantized && ctx_.config().zeropp_loco;
  const auto gu = static_cast<size_t>(g) * used;
  const LocoErrors::Buffers errs =
      loco ? loco_.for_bucket(group.get(), params, offsets, used, exact_hop1 ? 0 : gu,
                              two_hops ? static_cast<size_t>(inter->size()) * used : 0)
           : LocoErrors::Buffers{};
  const auto beta = static_cast<float>(ctx_.config().zeropp_loco_err_beta);
  auto feedback = [beta](const std::shared_ptr<Buffer>& err) {
    return err ? ErrorFeedback{static_cast<float*>(err->data()), beta} : ErrorFeedback{};
  };
  std::shared_ptr<Work> w;
  if (two_hops) {
    const std::string what = params_label("quantized gradient all-to-all of", params);
    const int nodes = inter->size();
    auto partial = std::make_shared<Buffer>(devp, used * static_cast<uint64_t>(nodes) * sizeof(float), MemKind::ReduceBuckets);
    auto first = intra->submit(
        what + (exact_hop1 ? " (qgZ hop 1: within the node, full precision)" : " (qgZ hop 1: within the node)"),
        [data, partial, used, nodes, devp, spec, exact_hop1, e = errs.hop1, feedback](Communicator& c) {
          const auto* send = static_cast<const float*>(data->data());
          auto* sums = static_cast<float*>(partial->data());
          if (exact_hop1)
            sum_within_node(c, devp, send, sums, used, nodes);
          else
            qgz_within_node(c, devp, send, sums, used, nodes, spec, feedback(e));
        });
    w = inter->submit(what + " (qgZ hop 2: across nodes)",
                      [first, partial, used, g, devp, spec, add_into_shards, e = errs.hop2,
                       feedback](Communicator& c) {
                        first->wait(-1);
                        Buffer mine(devp, used * sizeof(float), MemKind::ReduceBuckets);
                        qgz_across_nodes(c, devp, static_cast<const float*>(partial->data()),
                                         static_cast<float*>(mine.data()), used, g, spec,
                                         feedback(e));
                        add_into_shards(static_cast<const float*>(mine.data()));
                      });
  } else {
    const DType wire_dtype = wire_;
    w = group->submit(
        params_label(quantized ? "quantized gradient all-to-all of" : "gradient reduce-scatter of",
                     params),
        [data, used, stride, devp, quantized, spec, add_into_shards, shards, offsets, e = errs.hop1,
         feedback, wire_dtype](Communicator& comm) {
          fault_point("reduce_scatter");
          if (!quantized && wire_dtype == DType::F32 && !devp->is_cuda()) {
            // The ring's last hop sums straight into each shard (assigned or
            // added, its sum of squares taken in the same pass): no block of
            // the reduction's own and no copy out of it.
            comm.reduce_scatter_into(
                static_cast<const float*>(data->data()), used, stride, ReduceOp::Avg,
                [&](const float* own, const float* in, float scale) {
                  for (size_t i = 0; i < shards.size(); ++i)
                    if (shards[i])
                      shards[i]->store_reduced(*devp, own + offsets[i], in ? in + offsets[i] : nullptr, scale);
                });
            return;
          }
          Buffer mine(devp, used * sizeof(float), MemKind::ReduceBuckets);
          if (quantized) {
            quantized_reduce_scatter_avg(comm, devp, static_cast<const float*>(data->data()),
                                         static_cast<float*>(mine.data()), used, spec,
                                         feedback(e));
          } else if (wire_dtype == DType::F32) {
            comm.reduce_scatter_strided(data->data(), mine.data(), used, stride, DType::F32, ReduceOp::Avg);
          } else {
            // 16-bit on the wire, widened once into the fp32 shards' sum.
            Buffer narrow(devp, used * dtype_size(wire_dtype), MemKind::ReduceBuckets);
            comm.reduce_scatter_strided(data->data(), narrow.data(), used, stride, wire_dtype, ReduceOp::Avg);
            ops::cast_to_f32(*devp, narrow.data(), wire_dtype, static_cast<float*>(mine.data()), used);
            copy_tally::add(CopyKind::WireWiden, used * sizeof(float));
          }
          add_into_shards(static_cast<const float*>(mine.data()));
        });
  }
  track(std::move(w));
}

void GradReducer::track(std::shared_ptr<Work> w) {
  if (!ctx_.config().overlap_comm) {
    w->wait(-1);
    return;
  }
  // A backward that outruns the wire waits here for the older reduction
  // (one reducing, the next being filled, as DeepSpeed's double-buffered
  // reduction), instead of queueing every bucket's full-size copy until
  // the step (a model's whole gradient).
  pending_.push_back(std::move(w));
  const auto wait_begin = Trace::Clock::now();
  bool waited = false;
  while (pending_.size() > kMaxInFlight || (!pending_.empty() && pending_.front()->done())) {
    waited = waited || !pending_.front()->done();
    const auto oldest = std::move(pending_.front());
    pending_.pop_front();
    oldest->wait(-1);  // rethrows its error
  }
  if (waited)
    ctx_.comm_stats()->add_wait(std::chrono::duration<double>(Trace::Clock::now() - wait_begin).count());
}

void GradReducer::wait_pending() {
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& w : pending) w->wait(-1);
}

void GradReducer::sync() {
  const auto held = ctx_.lock();
  sync_locked();
}

void GradReducer::sync_locked() {
  ctx_.expect_locked();
  for (auto& [group, bucket] : open_) flush(bucket);
  open_.clear();
  auto pending = std::move(pending_);
  pending_.clear();
  const auto wait_begin = Trace::Clock::now();
  for (auto& w : pending) w->wait(-1);
  const auto wait_end = Trace::Clock::now();
  ctx_.comm_stats()->add_wait(std::chrono::duration<double>(wait_end - wait_begin).count());
  if (ctx_.trace() && !pending.empty())
    ctx_.trace()->event("wait", "gradient reduction wait", "trainer", wait_begin, wait_end);
  loco_.end_round();  // nothing in flight now
  replica_average();
}

bool GradReducer::fusable(const std::vector<float>& extras) const {
  const Config& c = ctx_.config();
  const auto& world = ctx_.world();
  if (reductions_ != 0 || !pending_.empty() || open_.size() != 1 || world->size() < 2 ||
      ctx_.device()->is_cuda() || wire_ != DType::F32 ||
      (c.zero_quantized_gradients && ctx_.quantizes(*world)))
    return false;
  const auto& replica = ctx_.mics_replica_group();
  if (replica && replica->size() > 1) return false;
  const Bucket& b = open_.begin()->second;
  if (b.group != world || !b.data || b.used == 0) return false;
  const uint64_t floats = b.used * static_cast<uint64_t>(world->size()) + extras.size();
  return floats * sizeof(float) <= collectives::kDirectAllReduceBytes;
}

GradReducer::FusedNorm GradReducer::sync_fusing_locked(std::vector<float>& extras,
                                                       const std::vector<const Param*>& stepped) {
  ctx_.expect_locked();
  FusedNorm out;
  if (!fusable(extras)) {
    sync_locked();
    return out;
  }
  Bucket b = std::move(open_.begin()->second);
  open_.clear();
  ++reductions_;
  Device& dev = *ctx_.device();
  const int g = b.group->size();
  const int me = b.group->rank();
  const uint64_t used = b.used;
  // This rank's doubt, summed with the extras: a bucket param the
  // optimizer does not step or that came twice (accumulation), or a
  // stepped shard already holding a gradient (a group of one's, or one
  // written through shard_data), leaves the norm to the shards and the
  // step's own all-reduce, as after sync_locked().
  float doubt = 0.0f;
  std::map<const Param*, uint64_t> offset_of;
  for (size_t i = 0; i < b.params.size(); ++i)
    if (!offset_of.emplace(b.params[i].get(), b.offsets[i]).second) doubt = 1.0f;
  std::set<const Param*> stepped_set(stepped.begin(), stepped.end());
  for (const auto& p : b.params)
    if (!stepped_set.count(p.get())) doubt = 1.0f;
  for (const Param* p : stepped)
    if (p->grad && p->grad->current) doubt = 1.0f;
  // Every rank's bucket (blocks packed used apart), extras and doubt, to
  // every rank: one exchange, as the reduce-scatter's was at this size. An
  // all-to-all of g copies, so that the stats count it as the gradient
  // reduction it is.
  const uint64_t per_rank = used * static_cast<uint64_t>(g) + extras.size() + 1;
  const uint64_t bytes = per_rank * sizeof(float);
  Buffer copies(ctx_.device(), bytes * static_cast<uint64_t>(g), MemKind::ReduceBuckets);
  Buffer all(ctx_.device(), bytes * static_cast<uint64_t>(g), MemKind::ReduceBuckets);
  auto* send = static_cast<float*>(copies.data());
  const auto* blocks = static_cast<const float*>(b.data->data());
  for (int r = 0; r < g; ++r)
    std::memcpy(send + static_cast<uint64_t>(r) * used, blocks + static_cast<uint64_t>(r) * b.capacity,
                used * sizeof(float));
  std::copy(extras.begin(), extras.end(), send + used * static_cast<uint64_t>(g));
  send[per_rank - 1] = doubt;
  for (int r = 1; r < g; ++r) std::memcpy(send + static_cast<uint64_t>(r) * per_rank, send, bytes);
  copy_tally::add(CopyKind::BucketCompaction, static_cast<uint64_t>(g) * bytes);
  b.group->run(params_label("gradient exchange (the step's only reduction, with its agreement) of", b.params),
               [&](Communicator& c) {
                 c.alltoall(send, all.data(), bytes, Communicator::Payload::Exact);
               });
  const auto* got = static_cast<const float*>(all.data());
  auto rank_vector = [&](int r) { return got + static_cast<uint64_t>((r % g + g) % g) * per_rank; };
  // The extras and doubts summed in rank order, as the step's all-reduce
  // sums them.
  const uint64_t tail = used * static_cast<uint64_t>(g);
  for (size_t k = 0; k <= extras.size(); ++k) {
    float sum = rank_vector(0)[tail + k];
    for (int r = 1; r < g; ++r) sum += rank_vector(r)[tail + k];
    if (k < extras.size()) extras[k] = sum; else doubt = sum;
  }
  // Each block summed as the ring reduce-scatter sums it (from rank b+1
  // around to rank b, the last sum times 1/g: the ring's reduce_f32_into,
  // hop by hop), so every value, each
  // block's sum of squares as its owner takes it, and the norm summed in
  // rank order are the bits the reduce-scatter and the step's all-reduce
  // give (the fused path changes no number: GradFusion compares them).
  const float scale = 1.0f / static_cast<float>(g);
  std::vector<float> sum(used);
  float norm = 0.0f;
  bool finite = true;
  for (int blk = 0; blk < g; ++blk) {
    const uint64_t at = static_cast<uint64_t>(blk) * used;
    const float* first = rank_vector(blk + 1) + at;
    std::copy(first, first + used, sum.begin());
    for (int k = 2; k < g; ++k)
      reduce_f32_into(sum.data(), rank_vector(blk + k) + at, sum.data(), used, ReduceOp::Sum);
    reduce_f32_into(sum.data(), rank_vector(blk) + at, sum.data(), used, ReduceOp::Avg, scale);
    std::vector<ops::Range> ranges;
    for (const Param* p : stepped) {
      const auto it = offset_of.find(p);
      if (it != offset_of.end()) ranges.push_back(ops::Range{sum.data() + it->second, p->layout.shard_numel});
    }
    double sq = 0.0;
    bool f = true;
    if (!ranges.empty()) ops::sum_squares_and_finite(dev, ranges, &sq, &f);
    norm = blk == 0 ? static_cast<float>(sq) : norm + static_cast<float>(sq);
    finite = finite && f;
    if (blk == me)
      for (size_t i = 0; i < b.params.size(); ++i)
        if (b.params[i]->grad) b.params[i]->grad->store(dev, sum.data() + b.offsets[i]);
  }
  out.done = true;
  out.complete = doubt == 0.0f;
  out.sum_squares = norm;
  out.finite = finite;
  loco_.end_round();
  return out;
}

void GradReducer::reset_error_feedback() {
  ctx_.expect_locked();
  loco_.clear();
}

// MiCS: shard groups reduced within themselves; replicas hold the same
// shard positions, so one all-reduce across each replica group completes
// the average over the world. It stays fp32 whatever the wire dtype: it
// averages the fp32 shards once per step (not per micro-step), and a
// 16-bit copy would round the accumulated gradients a second time.
void GradReducer::replica_average() {
  const auto& replica = ctx_.mics_replica_group();
  if (!replica || replica->size() == 1) return;
  std::vector<std::shared_ptr<Param>> params;
  uint64_t total = 0;
  Device& dev = *ctx_.device();
  for (const auto& p : touched_) {
    if (p->group != ctx_.mics_shard_group()) continue;
    // A shard with no gradient since the step holds an old one: it goes
    // in as the zeros it stands for (every replica's is zero, or current
    // where a rank read it through shard_data).
    if (!p->grad) make_grad_shard(*p);  // freed by the last step: zeros, as below
    p->grad->load();  // from its sink, if there: the average is put away again below
    if (!p->grad->current) {
      dev.zero(p->grad->data(), p->grad->bytes());
      p->grad->current = true;
    }
    params.push_back(p);
    total += p->layout.shard_numel;
  }
  if (total == 0) return;
  replica->run("MiCS replica gradient all-reduce", [&](Communicator& comm) {
    Buffer flat(ctx_.device(), total * sizeof(float), MemKind::ReduceBuckets);
    auto* f = static_cast<float*>(flat.data());
    std::vector<ops::Copy> in, out;
    uint64_t off = 0;
    for (const auto& p : params) {
      const size_t b = p->layout.shard_numel * sizeof(float);
      in.push_back({f + off, p->grad->data(), b});
      out.push_back({p->grad->data(), f + off, b});
      off += p->layout.shard_numel;
    }
    ops::copy_many(dev, in, CopyKind::MicsReplica);
    comm.allreduce(f, f, total, DType::F32, ReduceOp::Avg);
    // The averages replace the sums of squares the reduction took: on the
    // host taken in the copy back, on a GPU (one batched copy) left to the step.
    if (dev.is_cuda()) {
      ops::copy_many(dev, out, CopyKind::MicsReplica);
      for (const auto& p : params) p->grad->sum_known = false;
    } else {
      for (size_t i = 0; i < params.size(); ++i) {
        GradShard& g = *params[i]->grad;
        g.sum_known = ops::store_sum_squares(dev, static_cast<float*>(g.data()),
                                             static_cast<const float*>(out[i].src),
                                             params[i]->layout.shard_numel,
                                             kernels::StoreMode::Copy, &g.sumsq);
        copy_tally::add(CopyKind::MicsReplica, g.bytes());
      }
    }
    dev.synchronize();
    for (const auto& p : params) p->grad->put_away();
  });
}

void GradReducer::forget(Param& param) {
  ctx_.expect_locked();
  if (touched_set_.erase(&param) != 0)
    touched_.erase(std::remove_if(touched_.begin(), touched_.end(),
                                  [&](const auto& p) { return p.get() == &param; }),
                   touched_.end());
  loco_.clear();  // layouts holding it are gone; keys must not meet its address again
  if (!param.grad && !param.grad_released) return;
  ctx_.ledger().sub(Held::Grads, param.layout.shard_numel * sizeof(float));
  param.grad.reset();
  param.grad_released = false;
}

float* GradReducer::shard_data(Param& param) {
  const auto held = ctx_.lock();
  if (!param.grad && param.grad_released) make_grad_shard(param);  // zeros since the step: zeroed below
  if (!param.grad) return nullptr;
  wait_pending();  // no write of the group thread races with ours below
  GradShard& g = *param.grad;
  g.hold();  // the caller writes through the pointer: in memory until the step
  if (!g.current) {
    Device& dev = *ctx_.device();
    dev.zero(g.data(), g.bytes());
    dev.synchronize();
    g.current = true;
  }
  g.sum_known = false;  // the caller may write through the pointer
  return static_cast<float*>(g.data());
}

void GradReducer::reset_for_heal() {
  ctx_.expect_locked();
  for (auto& w : pending_) {
    try {
      w->wait(-1);
    } catch (const Error&) {
      // Failed by the loss, as expected: its gradients are dropped.
    }
  }
  pending_.clear();
  for (auto& b : borrowed_) {
    try {
      b.second->wait(-1);
    } catch (const Error&) {
    }
  }
  borrowed_.clear();
  open_.clear();
  std::set<const Param*> all;
  for (const auto& p : touched_) all.insert(p.get());
  end_step(all);
}

void GradReducer::end_step(const std::set<const Param*>& stepped) {
  ctx_.expect_locked();
  reductions_ = 0;
  release(stepped);
}

void GradReducer::discard_locked(const std::vector<std::shared_ptr<Param>>& params) {
  ctx_.expect_locked();
  std::set<const Param*> pushed;
  for (const auto& p : params)
    if (p->grad_pushed) pushed.insert(p.get());
  if (pushed.empty()) return;
  sync_locked();  // a bucket in flight may hold them: reduced, then dropped
  release(pushed);
}

void GradReducer::release(const std::set<const Param*>& params) {
  for (const auto& p : touched_) {
    if (!params.count(p.get())) continue;
    // A stepped gradient is dead until the next backward writes it, as
    // torch's zero_grad(set_to_none=True) drops .grad: its memory goes back
    // instead of sitting out the forward (785 MiB a rank at 406M on 2
    // ranks); the next push makes it again. On the host past the pool's
    // cache: kept idle there, the blocks stayed resident through the
    // forward, which cannot use them (a trainer's activations come from
    // malloc), and the backward's peak held them beside the activations
    // (docs/memory.md). On a GPU the pool keeps them (a cudaFree
    // synchronizes the device).
    if (p->grad) {
      if (!ctx_.device()->is_cuda()) p->grad->free_to_system();
      p->grad.reset();
      p->grad_released = true;
    }
    p->grad_pushed = false;
  }
}

}  // namespace zs
