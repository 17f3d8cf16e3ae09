// The element-wise work of the training step on whichever device holds
// the memory: the CPU kernels (kernels/optim.h) on the host, the CUDA
// kernels (kernels/cuda/kernels.h) on the device's engine stream. Both
// compute the same formulas (kernels/elementwise.h), so a step gives the
// same numbers on either. Pointers are memory of `dev`.
#pragma once

#include <cstddef>
#include <vector>

#include "impl/common/copy_tally.h"
#include "impl/common/dtype.h"
#include "impl/device/device.h"
#include "kernels/optim.h"
#include "kernels/quant.h"

namespace zs::ops {

kernels::WorkDtype work_dtype(DType t);

// dst[i] = widen(src[i]) / divisor (divisor 1: no division).
void widen_scaled(Device& dev, const void* src, DType dtype, float* dst, size_t n, float divisor);
// dst[i] = round_to(dst_dtype, widen(src[i]) / divisor): a gradient into a
// 16-bit reduction bucket, the same division as widen_scaled's, rounded once.
void narrow_scaled(Device& dev, const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                   float divisor);
void add_f32(Device& dev, float* dst, const float* src, size_t n);  // dst += src
// A gradient shard's write (kernels::store_sum_squares' modes) that also
// takes the sum of squares of the written values: on the host into *sumsq,
// in the same loop, the same bits sum_squares_and_finite would find, and
// returns true. On a GPU it only writes (Assign as zero then add_f32: the
// same bits) and returns false: the norm is then read back as before.
bool store_sum_squares(Device& dev, float* dst, const float* src, size_t n,
                       kernels::StoreMode mode, double* sumsq);
// A gradient of n `dtype` values straight into a gradient shard, as
// store_sum_squares writes one: each value as a reduction bucket of `wire`
// would have carried it (widen_scaled by `divisor`; for a 16-bit wire
// narrow_scaled, then widened back), the same bits, with no buffer the
// size of the gradient on the host (made a block at a time:
// kernels::store_sum_squares_made). For a group of one, whose
// reduce-scatter is the identity. On a GPU through one temporary (counted
// as grad_into_bucket), unless the gradient is fp32 on an fp32 wire
// undivided. Returns as store_sum_squares.
bool store_gradient_sum_squares(Device& dev, float* dst, const void* src, DType dtype, DType wire,
                                size_t n, float divisor, kernels::StoreMode mode, double* sumsq);
// The last hop of a host reduce-scatter written straight into a gradient
// shard, as store_sum_squares writes one: each value (own[i] + in[i]) *
// scale, the bits the ring's reduce_f32_into gives (own[i] * scale where
// `in` is null: a group of one), made a block at a time, so the reduced
// block needs no buffer of its own and no second pass. Host memory only.
void store_reduced_sum_squares(Device& dev, float* dst, const float* own, const float* in, float scale,
                               size_t n, kernels::StoreMode mode, double* sumsq);
void cast_to_f32(Device& dev, const void* src, DType dtype, float* dst, size_t n);
void cast_from_f32(Device& dev, const float* src, DType dtype, void* dst, size_t n);
// A 16-bit param's fp32 master after its working shard was rewritten: keeps
// the master where the working value is still its rounding, takes the
// working value where it changed (kernels::refreshed_master).
void refresh_master(Device& dev, const void* working, DType dtype, float* master, size_t n);
// Sum of squares in double, and whether every element is finite, of each
// range at once (one synchronisation for all of them on a GPU).
struct Range {
  const float* data;
  size_t n;
};
void sum_squares_and_finite(Device& dev, const std::vector<Range>& ranges, double* sum,
                            bool* finite);
void adam_step(Device& dev, float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
               size_t n, const kernels::AdamHyper& h, float grad_scale, void* working,
               DType working_dtype);
void sgd_step(Device& dev, float* master, float* momentum_buf, const float* grad, size_t n,
              const kernels::SgdHyper& h, float grad_scale, void* working, DType working_dtype);

// adam_step / sgd_step over many tensors at once, each its own
// hyper-parameters (kernels::adam_step_many / sgd_step_many on the host; on
// a GPU one launch per working dtype, kernels::cuda::adam_step_many /
// sgd_step_many): the same bits as stepping each tensor alone.
void adam_step_many(Device& dev, const std::vector<kernels::AdamTensor>& tensors, float grad_scale);
void sgd_step_many(Device& dev, const std::vector<kernels::SgdTensor>& tensors, float grad_scale);
// The same over masters and moments in F32 or BF16 (the _mixed steps).
void adam_step_mixed_many(Device& dev, const std::vector<kernels::AdamMixedTensor>& tensors, float grad_scale);
void sgd_step_mixed_many(Device& dev, const std::vector<kernels::SgdMixedTensor>& tensors, float grad_scale);

// The steps over a master and moments each in F32 or BF16
// (kernels::adam_step_mixed / sgd_step_mixed): a bf16 master is the param's
// working shard, stepped in place.
void adam_step_mixed(Device& dev, void* master, DType master_dtype, void* exp_avg, void* exp_avg_sq,
                     DType state_dtype, const float* grad, size_t n, const kernels::AdamHyper& h,
                     float grad_scale);
void sgd_step_mixed(Device& dev, void* master, DType master_dtype, void* momentum_buf,
                    DType state_dtype, const float* grad, size_t n, const kernels::SgdHyper& h,
                    float grad_scale);

// Block quantization (kernels/quant.h) of n elements of a float dtype.
void quantize(Device& dev, const void* src, DType dtype, size_t n, const kernels::QuantSpec& s,
              uint8_t* codes, float* scales);
void dequantize(Device& dev, const uint8_t* codes, const float* scales, size_t n,
                const kernels::QuantSpec& s, void* dst, DType dtype);
// LoCo error feedback: quantize g + err, err updated (kernels/quant.h).
void quantize_with_error(Device& dev, const float* g, float* err, float beta, size_t n,
                         const kernels::QuantSpec& s, uint8_t* codes, float* scales);

// Many copies as one: one kernel on a GPU, memcpy on the host; their bytes
// counted as `counted_as` (copy_tally.h).
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};
void copy_many(Device& dev, const std::vector<Copy>& copies, CopyKind counted_as);

}  // namespace zs::ops
