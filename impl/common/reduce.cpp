#include "impl/common/reduce.h"

#include <algorithm>
#include <cstring>

#include "kernels/convert.h"

namespace zs {

void reduce_f32_into(float* out, const float* own, const float* incoming, size_t n, ReduceOp op,
                     float scale) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      if (scale == 1.0f) {
        for (size_t i = 0; i < n; ++i) out[i] = own[i] + incoming[i];
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = (own[i] + incoming[i]) * scale;
      }
      return;
    case ReduceOp::Max:
      for (size_t i = 0; i < n; ++i) out[i] = std::max(own[i], incoming[i]);
      return;
    case ReduceOp::Min:
      for (size_t i = 0; i < n; ++i) out[i] = std::min(own[i], incoming[i]);
      return;
  }
}

void reduce_f32(float* dst, const float* src, size_t n, ReduceOp op) {
  reduce_f32_into(dst, dst, src, n, op);
}

void reduce_u8(uint8_t* dst, const uint8_t* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: dst[i] = static_cast<uint8_t>(dst[i] + src[i]); break;
      case ReduceOp::Max: dst[i] = std::max(dst[i], src[i]); break;
      case ReduceOp::Min: dst[i] = std::min(dst[i], src[i]); break;
    }
  }
}

void widen_to_f32(const void* src, DType dtype, float* dst, size_t count) {
  const auto* h = static_cast<const uint16_t*>(src);
  switch (dtype) {
    case DType::F32:
      // Zero-size buffers may be null, and memcpy's pointers must never be
      // (UBSan, Device.StagedCollectivesOnRealRanks).
      if (count != 0) std::memcpy(dst, src, count * 4);
      return;
    case DType::BF16:
      for (size_t i = 0; i < count; ++i) dst[i] = kernels::bf16_to_float(h[i]);
      return;
    case DType::F16:
      for (size_t i = 0; i < count; ++i) dst[i] = kernels::fp16_to_float(h[i]);
      return;
    case DType::U8: break;
  }
  fail(Code::Internal, "widen_to_f32: unsupported dtype ", dtype_name(dtype));
}

void narrow_from_f32(const float* src, DType dtype, void* dst, size_t count) {
  auto* h = static_cast<uint16_t*>(dst);
  switch (dtype) {
    case DType::F32:
      if (count != 0) std::memmove(dst, src, count * 4);  // see widen_to_f32
      return;
    case DType::BF16:
      for (size_t i = 0; i < count; ++i) h[i] = kernels::float_to_bf16(src[i]);
      return;
    case DType::F16:
      for (size_t i = 0; i < count; ++i) h[i] = kernels::float_to_fp16(src[i]);
      return;
    case DType::U8: break;
  }
  fail(Code::Internal, "narrow_from_f32: unsupported dtype ", dtype_name(dtype));
}

void scale_f32(float* x, size_t n, float divisor) {
  const float inv = 1.0f / divisor;
  for (size_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace zs
