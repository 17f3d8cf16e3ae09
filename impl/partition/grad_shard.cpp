#include "impl/partition/grad_shard.h"

#include "impl/common/copy_tally.h"
#include "impl/common/error.h"
#include "impl/device/ops.h"

namespace zs {

GradShard::GradShard(std::shared_ptr<Device> device, uint64_t numel, std::shared_ptr<GradSink> sink)
    : device_(std::move(device)), numel_(numel), sink_(std::move(sink)) {
  if (!sink_) ensure_memory();
}

void GradShard::ensure_memory() {
  if (!mem_) mem_ = std::make_unique<Buffer>(device_, bytes(), MemKind::Grads);
}

void* GradShard::data() const {
  if (!mem_)
    fail(Code::Internal, "gradient shard of ", numel_, " elements read in memory while ",
         in_sink_ ? "it is in its swap file" : "it has no memory yet (never written)");
  return mem_->data();
}

void GradShard::load() {
  ensure_memory();
  if (!in_sink_) return;
  sink_->read(static_cast<float*>(mem_->data()), numel_);
  copy_tally::add(CopyKind::GradSpill, bytes());
  in_sink_ = false;
}

void GradShard::hold() {
  load();
  held_ = true;
}

void GradShard::put_away() {
  if (!sink_ || held_ || in_sink_ || !mem_) return;
  sink_->write(static_cast<const float*>(mem_->data()), numel_);
  copy_tally::add(CopyKind::GradSpill, bytes());
  mem_.reset();
  in_sink_ = true;
}

template <typename Write>
void GradShard::write_all(Device& dev, Write&& write) {
  if (current) load();  // accumulation: the sum so far, from the sink if there
  else ensure_memory();
  const auto mode = current ? kernels::StoreMode::Add : kernels::StoreMode::Assign;
  sum_known = write(static_cast<float*>(mem_->data()), mode);
  current = true;
  if (sink_ && !held_) {
    dev.synchronize();
    put_away();
  }
}

void GradShard::store(Device& dev, const float* src) {
  write_all(dev, [&](float* dst, kernels::StoreMode mode) {
    if (src != dst) copy_tally::add(CopyKind::IntoGradShard, bytes());  // else reduced in place
    return ops::store_sum_squares(dev, dst, src, numel_, mode, &sumsq);
  });
}

void GradShard::store_gradient(Device& dev, const void* grad, DType dtype, DType wire, float divisor) {
  write_all(dev, [&](float* dst, kernels::StoreMode mode) {
    copy_tally::add(CopyKind::IntoGradShard, bytes());
    return ops::store_gradient_sum_squares(dev, dst, grad, dtype, wire, numel_, divisor, mode, &sumsq);
  });
}

void GradShard::store_reduced(Device& dev, const float* own, const float* in, float scale) {
  write_all(dev, [&](float* dst, kernels::StoreMode mode) {
    ops::store_reduced_sum_squares(dev, dst, own, in, scale, numel_, mode, &sumsq);
    return true;
  });
}

void GradShard::free_to_system() {
  if (mem_) mem_->free_to_system();
  mem_.reset();
}

void GradShard::divide(Device& dev, float divisor) {
  const bool from_sink = in_sink_;
  load();
  auto* g = static_cast<float*>(mem_->data());
  ops::widen_scaled(dev, g, DType::F32, g, numel_, divisor);
  if (!from_sink) {
    sum_known = false;
    return;
  }
  // Back to the sink, whose values are read by the step without a pass of
  // their own: their sum of squares is taken now.
  bool finite = true;
  ops::sum_squares_and_finite(dev, {ops::Range{g, numel_}}, &sumsq, &finite);
  sum_known = true;
  put_away();
}

}  // namespace zs
