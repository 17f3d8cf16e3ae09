// CPU block quantization (kernels/quant.h): one pass per block for max|x|,
// one for the codes; blocks are independent, so the pool splits them.
#include "kernels/quant.h"

#include <cstring>

#include "kernels/parallel.h"

// The float helpers of kernels/elementwise.h are compiled without
// contraction; this file matches, so they inline and the loops vectorize.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

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

// Blocks are walked in chunks of kChunk elements widened into a float
// array, so the inner loops are plain float loops the compiler vectorizes;
// they apply the formulas of kernels/quant.h element by element, hence
// the same bits as the CUDA kernels.
constexpr size_t kChunk = 256;

template <WorkDtype T>
inline void widen(const void* src, size_t first, size_t len, float* out) {
  for (size_t j = 0; j < len; ++j) out[j] = load<T>(src, first + j);
}

template <WorkDtype T>
void quantize_blocks(const void* src, size_t n, const QuantSpec& s, uint8_t* codes, float* scales,
                     size_t b0, size_t b1) {
  const int qmax = quant_qmax(s.bits);
  const float fq = static_cast<float>(qmax);
  alignas(64) float x[kChunk];
  alignas(64) int8_t q[kChunk];
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    // Bitwise max of |x|: the float max over finite values; a non-finite
    // |x| has bits >= 0x7f800000 and wins.
    uint32_t maxbits = 0;
    for (size_t c = 0; c < len; c += kChunk) {
      const size_t m = len - c < kChunk ? len - c : kChunk;
      widen<T>(src, first + c, m, x);
      for (size_t j = 0; j < m; ++j) {
        const uint32_t a = abs_bits(x[j]);
        maxbits = a > maxbits ? a : maxbits;
      }
    }
    const float scale = quant_scale(bits_float(maxbits), is_finite_bits(maxbits), qmax);
    scales[b] = scale;
    uint8_t* out = codes + first * static_cast<size_t>(s.bits) / 8;
    const size_t block_bytes = s.block * static_cast<size_t>(s.bits) / 8;
    if (!(scale > 0.0f)) {  // all zero, or poisoned: zero codes
      for (size_t j = 0; j < block_bytes; ++j) out[j] = 0;
      continue;
    }
    for (size_t c = 0; c < s.block; c += kChunk) {
      const size_t m = s.block - c < kChunk ? s.block - c : kChunk;
      const size_t valid = c >= len ? 0 : (len - c < m ? len - c : m);
      widen<T>(src, first + c, valid, x);
      for (size_t j = valid; j < m; ++j) x[j] = 0.0f;  // padding: code 0
      for (size_t j = 0; j < m; ++j) q[j] = static_cast<int8_t>(quant_round(x[j], scale, fq));
      if (s.bits == 8) {
        std::memcpy(out + c, q, m);
      } else {
        for (size_t j = 0; j < m; j += 2)
          out[(c + j) / 2] = static_cast<uint8_t>(nibble_of(q[j]) | (nibble_of(q[j + 1]) << 4));
      }
    }
  }
}

template <WorkDtype T>
void dequantize_blocks(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s,
                       void* dst, size_t b0, size_t b1) {
  alignas(64) int8_t q[kChunk];
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const float scale = scales[b];
    const uint8_t* in = codes + first * static_cast<size_t>(s.bits) / 8;
    for (size_t c = 0; c < len; c += kChunk) {
      const size_t m = len - c < kChunk ? len - c : kChunk;
      if (s.bits == 8) {
        std::memcpy(q, in + c, m);
      } else {
        // Pairs: both nibbles of each byte (the last code of an odd tail
        // is decoded too, into q's spare slot, and never stored).
        const uint8_t* pairs = in + c / 2;
        for (size_t j = 0; j < (m + 1) / 2; ++j) {
          q[2 * j] = static_cast<int8_t>(code_of_nibble(pairs[j]));
          q[2 * j + 1] = static_cast<int8_t>(code_of_nibble(static_cast<uint8_t>(pairs[j] >> 4)));
        }
      }
      for (size_t j = 0; j < m; ++j) store<T>(dst, first + c + j, quant_value(q[j], scale));
    }
  }
}

// quantize_blocks for fp32 with the error added first and updated after:
// x is recomputed in the second pass (one fp32 addition: the same bits).
void quantize_with_error_blocks(const float* g, float* err, float beta, size_t n,
                                const QuantSpec& s, uint8_t* codes, float* scales, size_t b0,
                                size_t b1) {
  const int qmax = quant_qmax(s.bits);
  const float fq = static_cast<float>(qmax);
  const float keep = f_sub(1.0f, beta);
  alignas(64) float x[kChunk];
  alignas(64) int8_t q[kChunk];
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    uint32_t maxbits = 0;
    for (size_t c = 0; c < len; c += kChunk) {
      const size_t m = len - c < kChunk ? len - c : kChunk;
      const float* gi = g + first + c;
      const float* ei = err + first + c;
      for (size_t j = 0; j < m; ++j) {
        const uint32_t a = abs_bits(f_add(gi[j], ei[j]));
        maxbits = a > maxbits ? a : maxbits;
      }
    }
    const bool finite = is_finite_bits(maxbits);
    const float scale = quant_scale(bits_float(maxbits), finite, qmax);
    scales[b] = scale;
    uint8_t* out = codes + first * static_cast<size_t>(s.bits) / 8;
    const bool coded = scale > 0.0f;
    for (size_t c = 0; c < s.block; c += kChunk) {
      const size_t m = s.block - c < kChunk ? s.block - c : kChunk;
      const size_t valid = c >= len ? 0 : (len - c < m ? len - c : m);
      const float* gi = g + first + c;
      float* ei = err + first + c;
      for (size_t j = 0; j < valid; ++j) x[j] = f_add(gi[j], ei[j]);
      for (size_t j = valid; j < m; ++j) x[j] = 0.0f;  // padding: code 0
      if (coded) {
        for (size_t j = 0; j < m; ++j) q[j] = static_cast<int8_t>(quant_round(x[j], scale, fq));
      } else {
        for (size_t j = 0; j < m; ++j) q[j] = 0;
      }
      for (size_t j = 0; j < valid; ++j)
        ei[j] = loco_error(ei[j], x[j], quant_value(q[j], scale), beta, keep, finite);
      if (s.bits == 8) {
        std::memcpy(out + c, q, m);
      } else {
        for (size_t j = 0; j < m; j += 2)
          out[(c + j) / 2] = static_cast<uint8_t>(nibble_of(q[j]) | (nibble_of(q[j + 1]) << 4));
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

void quantize_with_error(const float* g, float* err, float beta, size_t n, const QuantSpec& s,
                         uint8_t* codes, float* scales) {
  over_blocks(n, s, [&](size_t b0, size_t b1) {
    quantize_with_error_blocks(g, err, beta, n, s, codes, scales, b0, b1);
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
