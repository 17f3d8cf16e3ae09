// CUDA twins of the CPU kernels in kernels/optim.h: the optimizer steps,
// the reductions and casts of the gradient path, and a batched copy for
// packing flat buffers. Plain C++: includable without the CUDA headers.
//
// Conventions, for every launcher:
//  - All pointers are device-accessible memory (device, managed or mapped
//    pinned memory) of the current device; `stream` is a cudaStream_t of
//    that device (nullptr: the legacy default stream).
//  - The work is asynchronous on `stream`: a launcher returns after
//    enqueueing it; results (including the device scalars of sum_squares
//    and all_finite) are ready once the stream reaches that point.
//  - The return value is a cudaError_t value as int: 0 (cudaSuccess) when
//    the work was enqueued, else the error (cudaErrorInvalidValue = 1 for
//    bad arguments, detected before anything is enqueued; otherwise what
//    the runtime reported, which may be a sticky error of earlier work on
//    the device). cudaGetErrorString(static_cast<cudaError_t>(e)) names it,
//    as does error_string(e) below. Launchers never throw.
//  - n == 0 enqueues nothing and returns 0, except that sum_squares and
//    all_finite still write their result (0.0 and 1).
//  - Results are bit-identical to the CPU scalar reference (the shared
//    formulas of kernels/elementwise.h), except sum_squares, which sums in
//    another order (see there).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/optim.h"

namespace zs::kernels::cuda {

// AdamW / Adam over n elements of an fp32 master shard, with optional
// write-back of the updated master into `working` (working_dtype); the
// semantics and the arguments of kernels::adam_step. Bit-identical to
// kernels::adam_step_scalar. Bad arguments (null pointer with n > 0,
// bias_correction with step < 1): cudaErrorInvalidValue.
int adam_step(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, size_t n,
              const AdamHyper& h, float grad_scale, void* working, WorkDtype working_dtype,
              void* stream);

// SGD (momentum, dampening, Nesterov, weight decay); kernels::sgd_step's
// semantics. momentum_buf may be null when h.momentum == 0. Bit-identical to
// kernels::sgd_step_scalar.
int sgd_step(float* master, float* momentum_buf, const float* grad, size_t n, const SgdHyper& h,
             float grad_scale, void* working, WorkDtype working_dtype, void* stream);

// Multi-tensor twins of adam_step / sgd_step over a list of tensors
// (kernels::adam_step_many / sgd_step_many's arguments: each tensor its own
// hyper-parameters, step and working copy): one kernel launch per working
// dtype present in the list (none, F32, BF16, F16), each over up to
// kStepTensorsPerLaunch tensors (more: more launches). Each tensor's
// results are adam_step's / sgd_step's on it, bit for bit (the same
// element update with the same constants). The list is read from host
// memory during the call (it may be freed on return); tensors of n == 0
// are skipped; a bad argument of any tensor (as adam_step / sgd_step
// check them), or a null list with count > 0, is cudaErrorInvalidValue
// with nothing enqueued.
int adam_step_many(const AdamTensor* tensors, size_t count, float grad_scale, void* stream);
int sgd_step_many(const SgdTensor* tensors, size_t count, float grad_scale, void* stream);

// adam_step_mixed / sgd_step_mixed over a list of tensors (masters and
// moments each F32 or BF16): one launch per (master, state) dtype pair
// present, as adam_step_many; bit-identical to the per-tensor launchers.
int adam_step_mixed_many(const AdamMixedTensor* tensors, size_t count, float grad_scale, void* stream);
int sgd_step_mixed_many(const SgdMixedTensor* tensors, size_t count, float grad_scale, void* stream);

// The most tensors a multi-tensor launcher passes in one launch (the
// table travels as the kernel's parameter, which is at most 32,764 bytes).
constexpr size_t kStepTensorsPerLaunch = 320;

// kernels::adam_step_mixed / sgd_step_mixed: the master and moments each in
// F32 or BF16 (widened, updated in fp32, rounded once on store); a bf16
// master is the working shard itself. Bit-identical to
// kernels::adam_step_mixed_scalar / sgd_step_mixed_scalar. Another dtype, a
// null pointer with n > 0 or bias_correction with step < 1:
// cudaErrorInvalidValue.
int adam_step_mixed(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                    WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                    float grad_scale, void* stream);
int sgd_step_mixed(void* master, WorkDtype master_dtype, void* momentum_buf, WorkDtype state_dtype,
                   const float* grad, size_t n, const SgdHyper& h, float grad_scale, void* stream);

// *out = sum of x[i]^2 in double (each square exact), written to device
// memory. Deterministic: a fixed decomposition that depends only on n (not
// on the device, the pointer's alignment or timing), two passes, no
// atomics; it may differ from the CPU's kernels::sum_squares in the last
// bits (summation order). Up to 16384 elements: one kernel. Above, a
// second kernel sums the (at most 1024) block results, kept in a scratch
// buffer from the stream-ordered allocator (cudaMallocAsync/cudaFreeAsync on
// `stream`; where the device has no memory pools, cudaMalloc/cudaFree, which
// makes the call synchronous).
int sum_squares(const float* x, size_t n, double* out, void* stream);

// *out = 1 if every x[i] is finite, else 0 (an int in device memory).
int all_finite(const float* x, size_t n, int* out, void* stream);

// x[i] = x[i] * s.
int scale_inplace(float* x, size_t n, float s, void* stream);

// fp32 -> working dtype (round to nearest even, NaN stays NaN); F32 copies.
int cast_from_f32(const float* src, void* dst, WorkDtype t, size_t n, void* stream);
// working dtype -> fp32 (exact).
int cast_to_f32(const void* src, WorkDtype t, float* dst, size_t n, void* stream);
// dst[i] = widen(src[i]) / divisor: a true IEEE division, not a multiply by
// 1/divisor (divisor 1 gives widen exactly).
int cast_to_f32_scaled(const void* src, WorkDtype t, float* dst, size_t n, float divisor,
                       void* stream);
// dst[i] = round_to(dt, widen(src[i]) / divisor): any working dtype into any
// other, rounded once (a gradient into a 16-bit reduction bucket); the
// same division as cast_to_f32_scaled (divisor 1: none).
int cast_scaled(const void* src, WorkDtype st, void* dst, WorkDtype dt, size_t n, float divisor,
                void* stream);
// dst[i] = dst[i] + widen(src[i]), for gradient accumulation.
int add_to_f32(const void* src, WorkDtype t, float* dst, size_t n, void* stream);
// dst[i] = dst[i] + src[i].
int add_f32(float* dst, const float* src, size_t n, void* stream);
// master[i] = refreshed_master(master[i], widen(working[i])).
int refresh_master(const void* working, WorkDtype t, float* master, size_t n, void* stream);

// One copy of a batch: `bytes` bytes from src to dst (device-accessible,
// any alignment; segments must not overlap each other's destinations or a
// destination with a source).
struct CopySegment {
  void* dst;
  const void* src;
  size_t bytes;
};

// Copies every segment with one kernel launch per 1000 segments. The table
// is read from host memory during the call (it may be freed on return);
// segments of 0 bytes are skipped, and a null dst or src with bytes > 0 is
// cudaErrorInvalidValue (nothing is enqueued). Each segment is copied with
// the widest word (16, 8, 4, 2 bytes) that its dst and src share an
// alignment for, with byte copies at its ends.
int batched_copy(const CopySegment* segments, size_t count, void* stream);

// The largest count batched_copy passes in one launch.
constexpr size_t kBatchedCopySegmentsPerLaunch = 1000;

// Block quantization (kernels/quant.h: layout, formulas, error bound):
// src holds n elements of t; codes quant_code_bytes bytes, scales
// quant_blocks floats. Bit-identical to kernels::quantize / dequantize.
// An invalid (bits, block) or dtype, or a null pointer with n > 0:
// cudaErrorInvalidValue.
int quantize(const void* src, WorkDtype t, size_t n, int bits, size_t block, uint8_t* codes,
             float* scales, void* stream);
int dequantize(const uint8_t* codes, const float* scales, size_t n, int bits, size_t block,
               void* dst, WorkDtype t, void* stream);
// LoCo: kernels::quantize_with_error, bit for bit (fp32 g and err, err
// updated in place).
int quantize_with_error(const float* g, float* err, float beta, size_t n, int bits, size_t block,
                        uint8_t* codes, float* scales, void* stream);

// cudaGetErrorString of a launcher's return value.
const char* error_string(int err);

}  // namespace zs::kernels::cuda
