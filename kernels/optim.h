// CPU numeric kernels of the sharded optimizer: AdamW / Adam / SGD updates on
// fp32 master shards (or bf16 masters and moments: the _mixed variants), and
// the reductions and casts of the gradient path.
//
// Every kernel is vectorised (AVX-512F, AVX2+FMA+F16C, scalar fallback; the
// path is chosen once at first use, ZS_SIMD=scalar|avx2|avx512 forces one)
// and multi-threaded over the pool of kernels/parallel.h (inputs under 64K
// elements run on the calling thread). All paths compute in fp32 with the
// same operation order as the scalar reference (no FMA contraction), so a
// vector path's results equal the scalar reference's, and results never
// depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/parallel.h"

namespace zs::kernels {

// The working (model) copy's dtype.
enum class WorkDtype { F32 = 0, BF16 = 1, F16 = 2 };

size_t work_dtype_size(WorkDtype t);

struct AdamHyper {
  float lr, beta1, beta2, eps, weight_decay;
  bool adamw;            // decoupled weight decay (AdamW) vs L2 added to the grad (Adam)
  bool bias_correction;  // off: step_size = lr, denom = sqrt(v) + eps (DeepSpeed's option)
  int64_t step;          // 1-based, after increment
};

struct SgdHyper {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first_step;  // momentum buffer = grad on the first step, as torch
};

// One update over n elements of an fp32 master shard. Each grad element is
// multiplied by grad_scale first (unscaling / clipping / averaging folded
// in). If working != nullptr the updated master is also written there in
// working_dtype (round to nearest even). torch.optim.AdamW / Adam / SGD
// semantics in the order of torch's single-tensor implementation, per
// element, in fp32 (scalars derived in double, then rounded to fp32):
//   g = grad * grad_scale
//   Adam:  AdamW: p = p * (1 - lr*wd)      Adam (L2): g = g + wd * p
//          m = lerp(m, g, 1 - beta1)  (torch's lerp: m + w*(g - m) for w < 0.5,
//                                      else g - (g - m)*(1 - w))
//          v = v * beta2 + ((1 - beta2) * g) * g
//          denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//          p = p + (-(lr / (1 - beta1^step)) * m) / denom
//   SGD:   g = g + wd * p (wd != 0)
//          momentum != 0: buf = first_step ? g : buf * momentum + (1 - dampening) * g
//                         g = nesterov ? g + momentum * buf : buf
//          p = p + (-lr) * g
// NaN/inf are not checked (all_finite runs before the step). momentum_buf
// may be null when momentum == 0; a null required pointer with n > 0
// throws std::invalid_argument.
void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, size_t n,
               const AdamHyper& h, float grad_scale, void* working, WorkDtype working_dtype);
void sgd_step(float* master, float* momentum_buf, const float* grad, size_t n, const SgdHyper& h,
              float grad_scale, void* working, WorkDtype working_dtype);

// One tensor of a multi-tensor Adam/AdamW step: adam_step's arguments, each
// tensor with its own hyper-parameters (its own step count).
struct AdamTensor {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const float* grad;
  size_t n;
  AdamHyper h;
  void* working;
  WorkDtype working_dtype;
};
// adam_step over every tensor in one parallel pass: their elements are cut
// into the threads' ranges as one range (each tensor from a multiple of 64
// elements in it, as adam_step's ranges start), so tensors under the
// parallel grain, which adam_step runs one after another on the calling
// thread, share the threads. Element-wise, so the results are adam_step's
// bit for bit however the ranges fall.
void adam_step_many(const AdamTensor* tensors, size_t count, float grad_scale);

// One tensor of a multi-tensor SGD step: sgd_step's arguments, each tensor
// with its own hyper-parameters (its own first step: momentum_buf may be
// null where h.momentum == 0).
struct SgdTensor {
  float* master;
  float* momentum_buf;
  const float* grad;
  size_t n;
  SgdHyper h;
  void* working;
  WorkDtype working_dtype;
};
// sgd_step over every tensor in one parallel pass, cut as adam_step_many
// cuts them: bit for bit sgd_step's results on each.
void sgd_step_many(const SgdTensor* tensors, size_t count, float grad_scale);

// One tensor of a multi-tensor step over masters and moments in F32 or BF16
// (adam_step_mixed / sgd_step_mixed's arguments; a bf16 master is the
// param's working shard, stepped in place).
struct AdamMixedTensor {
  void* master;
  WorkDtype master_dtype;
  void* exp_avg;
  void* exp_avg_sq;
  WorkDtype state_dtype;
  const float* grad;
  size_t n;
  AdamHyper h;
};
struct SgdMixedTensor {
  void* master;
  WorkDtype master_dtype;
  void* momentum_buf;  // may be null where h.momentum == 0
  WorkDtype state_dtype;
  const float* grad;
  size_t n;
  SgdHyper h;
};
// adam_step_mixed / sgd_step_mixed over every tensor in one parallel pass,
// cut as adam_step_many cuts them: bit for bit their results on each.
void adam_step_mixed_many(const AdamMixedTensor* tensors, size_t count, float grad_scale);
void sgd_step_mixed_many(const SgdMixedTensor* tensors, size_t count, float grad_scale);

// The same updates over a master and moments kept in fp32 or bf16 (DeepSpeed's
// bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states):
// master_dtype and state_dtype are WorkDtype::F32 or BF16 (F16 throws
// std::invalid_argument). Per element: the master and moments are widened
// to fp32 (exact), the fp32 update above runs on them unchanged, and each
// is stored back in its dtype, rounded once (to nearest even, as
// cast_from_f32). A bf16 master is the param's working shard itself, so
// there is no separate working write-back. With both dtypes F32 the
// results equal adam_step / sgd_step's without a working copy.
void adam_step_mixed(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                     WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                     float grad_scale);
void sgd_step_mixed(void* master, WorkDtype master_dtype, void* momentum_buf, WorkDtype state_dtype,
                    const float* grad, size_t n, const SgdHyper& h, float grad_scale);

// Reference scalar versions: one thread, plain loops, the same results.
void adam_step_mixed_scalar(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                            WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                            float grad_scale);
void sgd_step_mixed_scalar(void* master, WorkDtype master_dtype, void* momentum_buf,
                           WorkDtype state_dtype, const float* grad, size_t n, const SgdHyper& h,
                           float grad_scale);
void adam_step_scalar(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                      size_t n, const AdamHyper& h, float grad_scale, void* working,
                      WorkDtype working_dtype);
void sgd_step_scalar(float* master, float* momentum_buf, const float* grad, size_t n,
                     const SgdHyper& h, float grad_scale, void* working, WorkDtype working_dtype);

// Reductions and casts of the gradient path.
// Sum of x[i]^2 in double (squares are exact in double). The result does
// not depend on the thread count (fixed blocks summed in order); it may
// differ between SIMD paths in the last bits (summation order).
double sum_squares(const float* x, size_t n);
bool all_finite(const float* x, size_t n);  // false if any inf/NaN
// How store_sum_squares writes dst[i]:
//   Add     dst[i] + src[i]   (accumulating into a gradient shard)
//   Assign  0.0f + src[i]     (the bits of adding into zeros: -0 becomes +0,
//                              so a shard need not be zeroed first)
//   Copy    src[i]
enum class StoreMode { Add = 0, Assign = 1, Copy = 2 };
// Writes dst and returns the sum of squares of its new values, computed in
// the same loop (no second read of dst): bit for bit what sum_squares(dst,
// n) returns afterwards (same blocks, same accumulators, on every SIMD
// path), so a gradient's norm can be taken as it is written.
double store_sum_squares(float* dst, const float* src, size_t n, StoreMode mode);
// The blocks store_sum_squares and sum_squares sum in order.
constexpr size_t kSumBlockElements = 8192;
// store_sum_squares of values made a block at a time: make(ctx, begin,
// count, out) writes the values of elements [begin, begin + count) into
// out (count <= kSumBlockElements), which are stored into dst + begin as
// store_sum_squares stores src's; the sum is store_sum_squares' for the
// same values, bit for bit. Blocks may be made on several threads at once.
// For a gradient widened and divided on its way into its shard, with no
// buffer the size of the gradient in between.
using BlockMaker = void (*)(void* ctx, size_t begin, size_t count, float* out);
double store_sum_squares_made(float* dst, size_t n, StoreMode mode, BlockMaker make, void* ctx);
void scale_inplace(float* x, size_t n, float s);
// fp32 -> working dtype (round to nearest even, NaN stays NaN); F32 copies.
void cast_from_f32(const float* src, void* dst, WorkDtype t, size_t n);
void cast_to_f32(const void* src, WorkDtype t, float* dst, size_t n);
// dst += widen(src), for gradient accumulation.
void add_to_f32(const void* src, WorkDtype t, float* dst, size_t n);
// master[i] = refreshed_master(master[i], widen(working[i])).
void refresh_master(const void* working, WorkDtype t, float* master, size_t n);

// SIMD dispatch.
enum class SimdPath { Scalar = 0, Avx2 = 1, Avx512 = 2 };
// The path in use: "avx512", "avx2" or "scalar".
const char* simd_path();
SimdPath simd_path_id();
const char* simd_path_name(SimdPath p);
// Compiled in and supported by this CPU (and OS).
bool simd_path_available(SimdPath p);
// "scalar" | "avx2" | "avx512" (the ZS_SIMD values); false if unknown.
bool parse_simd_path(const char* s, SimdPath* out);
// Forces a path for tests and benchmarks; false (and no change) when the
// path is not available here. Not for use while kernels run on other threads.
bool set_simd_path_for_testing(SimdPath p);

}  // namespace zs::kernels
