// CPU block quantization (kernels/quant.h): one pass per block for max|x|,
// one for the codes; blocks are independent, so the pool splits them.
#include "kernels/quant.h"

#include "kernels/parallel.h"

namespace zs::kernels {
namespace {

// Blocks per pool task: enough elements that a task outweighs its hand-off.
size_t block_grain(const QuantSpec& s) {
  const size_t want = size_t{1} << 16;  // elements
  return s.block >= want ? 1 : want / s.block;
}

template <WorkDtype T>
inline float load(const void* p, size_t i) {
  if constexpr (T == WorkDtype::F32) return static_cast<const float*>(p)[i];
  if constexpr (T == WorkDtype::BF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
}

template <WorkDtype T>
inline void store(void* p, size_t i, float x) {
  if constexpr (T == WorkDtype::F32) static_cast<float*>(p)[i] = x;
  if constexpr (T == WorkDtype::BF16) static_cast<uint16_t*>(p)[i] = float_to_bf16(x);
  if constexpr (T == WorkDtype::F16) static_cast<uint16_t*>(p)[i] = float_to_fp16(x);
}

template <WorkDtype T>
void quantize_blocks(const void* src, size_t n, const QuantSpec& s, uint8_t* codes, float* scales,
                     size_t b0, size_t b1) {
  const int qmax = quant_qmax(s.bits);
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    // Bitwise max of |x| over finite values equals the float max; a
    // non-finite |x| has bits >= 0x7f800000.
    uint32_t maxbits = 0;
    for (size_t j = 0; j < len; ++j) {
      const uint32_t a = abs_bits(load<T>(src, first + j));
      maxbits = a > maxbits ? a : maxbits;
    }
    const bool finite = is_finite_bits(maxbits);
    const float scale = quant_scale(bits_float(maxbits), finite, qmax);
    scales[b] = scale;
    if (s.bits == 8) {
      auto* out = reinterpret_cast<int8_t*>(codes) + first;
      for (size_t j = 0; j < len; ++j)
        out[j] = static_cast<int8_t>(quant_code(load<T>(src, first + j), scale, qmax));
      for (size_t j = len; j < s.block; ++j) out[j] = 0;
    } else {
      uint8_t* out = codes + first / 2;
      for (size_t j = 0; j < s.block; j += 2) {
        const int lo = j < len ? quant_code(load<T>(src, first + j), scale, qmax) : 0;
        const int hi = j + 1 < len ? quant_code(load<T>(src, first + j + 1), scale, qmax) : 0;
        out[j / 2] = static_cast<uint8_t>(nibble_of(lo) | (nibble_of(hi) << 4));
      }
    }
  }
}

template <WorkDtype T>
void dequantize_blocks(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s,
                       void* dst, size_t b0, size_t b1) {
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const float scale = scales[b];
    if (s.bits == 8) {
      const auto* in = reinterpret_cast<const int8_t*>(codes) + first;
      for (size_t j = 0; j < len; ++j) store<T>(dst, first + j, quant_value(in[j], scale));
    } else {
      const uint8_t* in = codes + first / 2;
      for (size_t j = 0; j < len; ++j) {
        const uint8_t pair = in[j / 2];
        const int q = code_of_nibble(j % 2 == 0 ? pair : static_cast<uint8_t>(pair >> 4));
        store<T>(dst, first + j, quant_value(q, scale));
      }
    }
  }
}

template <typename F>
void over_blocks(size_t n, const QuantSpec& s, F&& fn) {
  parallel_for(quant_blocks(n, s), block_grain(s), fn, 1);
}

}  // namespace

void quantize(const void* src, WorkDtype t, size_t n, const QuantSpec& s, uint8_t* codes,
              float* scales) {
  over_blocks(n, s, [&](size_t b0, size_t b1) {
    switch (t) {
      case WorkDtype::F32: quantize_blocks<WorkDtype::F32>(src, n, s, codes, scales, b0, b1); break;
      case WorkDtype::BF16: quantize_blocks<WorkDtype::BF16>(src, n, s, codes, scales, b0, b1); break;
      case WorkDtype::F16: quantize_blocks<WorkDtype::F16>(src, n, s, codes, scales, b0, b1); break;
    }
  });
}

void dequantize(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s, void* dst,
                WorkDtype t) {
  over_blocks(n, s, [&](size_t b0, size_t b1) {
    switch (t) {
      case WorkDtype::F32: dequantize_blocks<WorkDtype::F32>(codes, scales, n, s, dst, b0, b1); break;
      case WorkDtype::BF16: dequantize_blocks<WorkDtype::BF16>(codes, scales, n, s, dst, b0, b1); break;
      case WorkDtype::F16: dequantize_blocks<WorkDtype::F16>(codes, scales, n, s, dst, b0, b1); break;
    }
  });
}

}  // namespace zs::kernels
