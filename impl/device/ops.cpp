#include "impl/device/ops.h"

#include <cmath>
#include <cstring>

#include "impl/common/reduce.h"
#include "impl/device/buffer.h"

#ifdef ZS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "impl/device/cuda/cuda_check.h"
#include "kernels/cuda/kernels.h"
#endif

namespace zs::ops {

kernels::WorkDtype work_dtype(DType t) {
  switch (t) {
    case DType::F32: return kernels::WorkDtype::F32;
    case DType::BF16: return kernels::WorkDtype::BF16;
    case DType::F16: return kernels::WorkDtype::F16;
    case DType::U8: break;
  }
  fail(Code::InvalidArgument, "dtype ", dtype_name(t), " is not a float type");
}

#ifdef ZS_WITH_CUDA
namespace {
// Launchers return a cudaError_t value; 0 is success.
void check_launch(int err, const char* kernel, Device& dev) {
  check_cuda(static_cast<cudaError_t>(err), kernel, " on ", dev.ref().str());
}
}  // namespace
#define ZS_ON_CUDA(dev, kernel, ...)                                            \
  if ((dev).is_cuda()) {                                                        \
    (dev).bind_thread();                                                        \
    check_launch(kernels::cuda::kernel(__VA_ARGS__, (dev).stream()), #kernel, dev); \
    return;                                                                     \
  }
#else
#define ZS_ON_CUDA(dev, kernel, ...) (void)(dev);
#endif

void widen_scaled(Device& dev, const void* src, DType dtype, float* dst, size_t n, float divisor) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, cast_to_f32_scaled, src, work_dtype(dtype), dst, n, divisor)
  widen_to_f32(src, dtype, dst, n);
  // A true division, as the CUDA kernel does (a reciprocal multiply can
  // differ in the last bit).
  if (divisor != 1.0f)
    for (size_t i = 0; i < n; ++i) dst[i] = dst[i] / divisor;
}

void narrow_scaled(Device& dev, const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                   float divisor) {
  if (n == 0) return;
  if (src_dtype == dst_dtype && divisor == 1.0f) {
    dev.copy(dst, src, n * dtype_size(dst_dtype));
    return;
  }
  ZS_ON_CUDA(dev, cast_scaled, src, work_dtype(src_dtype), dst, work_dtype(dst_dtype), n, divisor)
  const auto st = work_dtype(src_dtype), dt = work_dtype(dst_dtype);
  for (size_t i = 0; i < n; ++i) {
    const float x = kernels::load_work1(src, st, i);
    kernels::store_work1(dst, dt, i, divisor == 1.0f ? x : x / divisor);
  }
}

void add_f32(Device& dev, float* dst, const float* src, size_t n) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, add_f32, dst, src, n)
  reduce_f32(dst, src, n, ReduceOp::Sum);
}

bool store_sum_squares(Device& dev, float* dst, const float* src, size_t n,
                       kernels::StoreMode mode, double* sumsq) {
  *sumsq = 0.0;
  if (dev.is_cuda()) {
    if (n == 0) return false;
    if (mode == kernels::StoreMode::Copy) {
      dev.copy(dst, src, n * sizeof(float));
      return false;
    }
    if (mode == kernels::StoreMode::Assign) dev.zero(dst, n * sizeof(float));
    add_f32(dev, dst, src, n);
    return false;
  }
  *sumsq = kernels::store_sum_squares(dst, src, n, mode);
  return true;
}

namespace {

struct GradientBlocks {
  Device& dev;
  const uint8_t* src;
  DType dtype, wire;
  float divisor;
};

void make_gradient_block(void* ctx, size_t begin, size_t count, float* out) {
  const auto& g = *static_cast<const GradientBlocks*>(ctx);
  const uint8_t* s = g.src + begin * dtype_size(g.dtype);
  if (g.wire == DType::F32) {
    widen_scaled(g.dev, s, g.dtype, out, count, g.divisor);
    return;
  }
  uint16_t narrow[kernels::kSumBlockElements];
  narrow_scaled(g.dev, s, g.dtype, narrow, g.wire, count, g.divisor);
  cast_to_f32(g.dev, narrow, g.wire, out, count);
}

}  // namespace

bool store_gradient_sum_squares(Device& dev, float* dst, const void* src, DType dtype, DType wire,
                                size_t n, float divisor, kernels::StoreMode mode, double* sumsq) {
  if (dtype == DType::F32 && wire == DType::F32 && divisor == 1.0f)
    return store_sum_squares(dev, dst, static_cast<const float*>(src), n, mode, sumsq);
  if (dev.is_cuda()) {
    Buffer values(dev.device_shared(), n * sizeof(float), MemKind::ReduceBuckets);
    auto* v = static_cast<float*>(values.data());
    if (wire == DType::F32) {
      widen_scaled(dev, src, dtype, v, n, divisor);
    } else {
      Buffer narrow(dev.device_shared(), n * dtype_size(wire), MemKind::ReduceBuckets);
      narrow_scaled(dev, src, dtype, narrow.data(), wire, n, divisor);
      cast_to_f32(dev, narrow.data(), wire, v, n);
    }
    copy_tally::add(CopyKind::GradIntoBucket, n * sizeof(float));
    const bool known = store_sum_squares(dev, dst, v, n, mode, sumsq);
    dev.synchronize();  // the temporaries go when we return
    return known;
  }
  GradientBlocks blocks{dev, static_cast<const uint8_t*>(src), dtype, wire, divisor};
  *sumsq = kernels::store_sum_squares_made(dst, n, mode, make_gradient_block, &blocks);
  return true;
}

namespace {

struct ReducedBlocks {
  const float* own;
  const float* in;
  float scale;
};

void make_reduced_block(void* ctx, size_t begin, size_t count, float* out) {
  const auto& r = *static_cast<const ReducedBlocks*>(ctx);
  const float* own = r.own + begin;
  if (r.in == nullptr) {
    for (size_t i = 0; i < count; ++i) out[i] = own[i] * r.scale;
    return;
  }
  // The ring's own last hop, so the bits are the reduce-scatter's.
  reduce_f32_into(out, own, r.in + begin, count, ReduceOp::Avg, r.scale);
}

}  // namespace

void store_reduced_sum_squares(Device& dev, float* dst, const float* own, const float* in, float scale,
                               size_t n, kernels::StoreMode mode, double* sumsq) {
  if (dev.is_cuda()) fail(Code::Internal, "store_reduced_sum_squares: host memory only");
  ReducedBlocks blocks{own, in, scale};
  *sumsq = kernels::store_sum_squares_made(dst, n, mode, make_reduced_block, &blocks);
}

void refresh_master(Device& dev, const void* working, DType dtype, float* master, size_t n) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, refresh_master, working, work_dtype(dtype), master, n)
  kernels::refresh_master(working, work_dtype(dtype), master, n);
}

void cast_to_f32(Device& dev, const void* src, DType dtype, float* dst, size_t n) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, cast_to_f32, src, work_dtype(dtype), dst, n)
  kernels::cast_to_f32(src, work_dtype(dtype), dst, n);
}

void cast_from_f32(Device& dev, const float* src, DType dtype, void* dst, size_t n) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, cast_from_f32, src, dst, work_dtype(dtype), n)
  kernels::cast_from_f32(src, dst, work_dtype(dtype), n);
}

void adam_step(Device& dev, float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
               size_t n, const kernels::AdamHyper& h, float grad_scale, void* working,
               DType working_dtype) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, adam_step, master, exp_avg, exp_avg_sq, grad, n, h, grad_scale, working,
             work_dtype(working_dtype))
  kernels::adam_step(master, exp_avg, exp_avg_sq, grad, n, h, grad_scale, working,
                     work_dtype(working_dtype));
}

void sgd_step(Device& dev, float* master, float* momentum_buf, const float* grad, size_t n,
              const kernels::SgdHyper& h, float grad_scale, void* working, DType working_dtype) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, sgd_step, master, momentum_buf, grad, n, h, grad_scale, working,
             work_dtype(working_dtype))
  kernels::sgd_step(master, momentum_buf, grad, n, h, grad_scale, working,
                    work_dtype(working_dtype));
}

void adam_step_many(Device& dev, const std::vector<kernels::AdamTensor>& tensors, float grad_scale) {
  if (tensors.empty()) return;
  ZS_ON_CUDA(dev, adam_step_many, tensors.data(), tensors.size(), grad_scale)
  kernels::adam_step_many(tensors.data(), tensors.size(), grad_scale);
}

void sgd_step_many(Device& dev, const std::vector<kernels::SgdTensor>& tensors, float grad_scale) {
  if (tensors.empty()) return;
  ZS_ON_CUDA(dev, sgd_step_many, tensors.data(), tensors.size(), grad_scale)
  kernels::sgd_step_many(tensors.data(), tensors.size(), grad_scale);
}

void adam_step_mixed_many(Device& dev, const std::vector<kernels::AdamMixedTensor>& tensors, float grad_scale) {
  if (tensors.empty()) return;
  ZS_ON_CUDA(dev, adam_step_mixed_many, tensors.data(), tensors.size(), grad_scale)
  kernels::adam_step_mixed_many(tensors.data(), tensors.size(), grad_scale);
}

void sgd_step_mixed_many(Device& dev, const std::vector<kernels::SgdMixedTensor>& tensors, float grad_scale) {
  if (tensors.empty()) return;
  ZS_ON_CUDA(dev, sgd_step_mixed_many, tensors.data(), tensors.size(), grad_scale)
  kernels::sgd_step_mixed_many(tensors.data(), tensors.size(), grad_scale);
}

void adam_step_mixed(Device& dev, void* master, DType master_dtype, void* exp_avg, void* exp_avg_sq,
                     DType state_dtype, const float* grad, size_t n, const kernels::AdamHyper& h,
                     float grad_scale) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, adam_step_mixed, master, work_dtype(master_dtype), exp_avg, exp_avg_sq,
             work_dtype(state_dtype), grad, n, h, grad_scale)
  kernels::adam_step_mixed(master, work_dtype(master_dtype), exp_avg, exp_avg_sq,
                           work_dtype(state_dtype), grad, n, h, grad_scale);
}

void sgd_step_mixed(Device& dev, void* master, DType master_dtype, void* momentum_buf,
                    DType state_dtype, const float* grad, size_t n, const kernels::SgdHyper& h,
                    float grad_scale) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, sgd_step_mixed, master, work_dtype(master_dtype), momentum_buf,
             work_dtype(state_dtype), grad, n, h, grad_scale)
  kernels::sgd_step_mixed(master, work_dtype(master_dtype), momentum_buf, work_dtype(state_dtype),
                          grad, n, h, grad_scale);
}

void sum_squares_and_finite(Device& dev, const std::vector<Range>& ranges, double* sum,
                            bool* finite) {
  *sum = 0.0;
  *finite = true;
  (void)dev;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) {
    // One slot per range on the device, summed on the host in range order
    // (the same order as the CPU path), after one synchronisation.
    const size_t k = ranges.size();
    Buffer sums(dev.device_shared(), k * sizeof(double) + k * sizeof(int), MemKind::Scratch);
    auto* dsum = static_cast<double*>(sums.data());
    auto* dflag = reinterpret_cast<int*>(dsum + k);
    dev.bind_thread();
    for (size_t i = 0; i < k; ++i) {
      check_launch(kernels::cuda::sum_squares(ranges[i].data, ranges[i].n, dsum + i, dev.stream()),
                   "sum_squares", dev);
      check_launch(kernels::cuda::all_finite(ranges[i].data, ranges[i].n, dflag + i, dev.stream()),
                   "all_finite", dev);
    }
    std::vector<double> hsum(k);
    std::vector<int> hflag(k);
    if (k > 0) {
      dev.copy(hsum.data(), dsum, k * sizeof(double));
      dev.copy(hflag.data(), dflag, k * sizeof(int));
    }
    dev.synchronize();
    for (size_t i = 0; i < k; ++i) {
      *sum += hsum[i];
      if (!hflag[i]) *finite = false;
    }
    return;
  }
#endif
  // One pass, not two: the double square of an inf or NaN float is inf or
  // NaN and stays so in the sum, while finite squares (< 1.2e77) cannot
  // overflow a double sum, so the sum is finite exactly when every element is.
  for (const auto& r : ranges) *sum += kernels::sum_squares(r.data, r.n);
  *finite = std::isfinite(*sum);
}

void quantize(Device& dev, const void* src, DType dtype, size_t n, const kernels::QuantSpec& s,
              uint8_t* codes, float* scales) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, quantize, src, work_dtype(dtype), n, s.bits, s.block, codes, scales)
  kernels::quantize(src, work_dtype(dtype), n, s, codes, scales);
}

void quantize_with_error(Device& dev, const float* g, float* err, float beta, size_t n,
                         const kernels::QuantSpec& s, uint8_t* codes, float* scales) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, quantize_with_error, g, err, beta, n, s.bits, s.block, codes, scales)
  kernels::quantize_with_error(g, err, beta, n, s, codes, scales);
}

void dequantize(Device& dev, const uint8_t* codes, const float* scales, size_t n,
                const kernels::QuantSpec& s, void* dst, DType dtype) {
  if (n == 0) return;
  ZS_ON_CUDA(dev, dequantize, codes, scales, n, s.bits, s.block, dst, work_dtype(dtype))
  kernels::dequantize(codes, scales, n, s, dst, work_dtype(dtype));
}

void copy_many(Device& dev, const std::vector<Copy>& copies, CopyKind counted_as) {
  uint64_t bytes = 0;
  for (const auto& c : copies) bytes += c.bytes;
  copy_tally::add(counted_as, bytes);
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) {
    if (copies.empty()) return;
    std::vector<kernels::cuda::CopySegment> segs;
    segs.reserve(copies.size());
    for (const auto& c : copies)
      if (c.bytes > 0) segs.push_back({c.dst, c.src, c.bytes});
    if (segs.empty()) return;
    dev.bind_thread();
    check_launch(kernels::cuda::batched_copy(segs.data(), segs.size(), dev.stream()),
                 "batched_copy", dev);
    return;
  }
#endif
  for (const auto& c : copies) dev.copy(c.dst, c.src, c.bytes);
}

}  // namespace zs::ops
