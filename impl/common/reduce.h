// Element-wise host loops over DType buffers, shared by the communicators,
// the device ops and the initializers: reductions (16-bit floats are widened
// to fp32 so that sums do not lose precision hop by hop) and the widening and
// narrowing casts, over the scalar conversions in kernels/convert.h.
#pragma once

#include <cstddef>
#include <vector>

#include "impl/common/dtype.h"

namespace zs {

// dst[i] = op(dst[i], src[i]) over fp32.
void reduce_f32(float* dst, const float* src, size_t n, ReduceOp op);
// out[i] = op(own[i], incoming[i]) over fp32, times `scale` for Sum and Avg
// when it is not 1 (Avg's 1/n): the same bits as reduce_f32 into a copy of
// own, then scale_f32. out may be own.
void reduce_f32_into(float* out, const float* own, const float* incoming, size_t n, ReduceOp op,
                     float scale = 1.0f);
// Same over raw bytes (ZS_UINT8).
void reduce_u8(uint8_t* dst, const uint8_t* src, size_t n, ReduceOp op);
// Widen count elements of dtype to fp32, and narrow back.
void widen_to_f32(const void* src, DType dtype, float* dst, size_t count);
void narrow_from_f32(const float* src, DType dtype, void* dst, size_t count);
// x[i] /= divisor, for ReduceOp::Avg.
void scale_f32(float* x, size_t n, float divisor);

}  // namespace zs
