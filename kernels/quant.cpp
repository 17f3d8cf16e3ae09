// CPU block quantization (kernels/quant.h): one pass per block for max|x|,
// one for the codes; blocks are independent, so the pool splits them.
#include "kernels/quant.h"

#include <cstring>

#include "kernels/optim.h"
#include "kernels/parallel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

}  // namespace
}  // namespace zs::kernels

// ---- AVX2: int8 codes of fp32 and bf16 -------------------------------------
//
// The same operations as the scalar loops above, eight lanes at a time:
// max|x| as an integer max over the bits with the sign cleared; the codes
// from _mm256_div_ps / add / sub (the +1.5*2^23 rounding of quant_round),
// clamped with min/max (no NaN reaches them: a block is coded only when
// its scale is finite and > 0); dequantized values from _mm256_mul_ps and,
// for bf16, float_to_bf16's integer rounding. No FMA is used (none is
// enabled). Remainders of a block shorter than a vector, and any block
// whose scale is not finite and > 0, take the scalar formulas, so every
// code, scale and dequantized bit equals the scalar path's.
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
namespace zs::kernels {
namespace {
namespace quant_avx2 {

inline uint32_t absmax_bits(const float* p, size_t n) {
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)), mask));
  }
  for (; i + 8 <= n; i += 8)
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
  m0 = _mm256_max_epu32(m0, m1);
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
  uint32_t r = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  for (; i < n; ++i) {
    const uint32_t a = abs_bits(p[i]);
    r = a > r ? a : r;
  }
  return r;
}

// bf16: |x|'s fp32 bits are (h & 0x7fff) << 16, so the max is taken on
// the 16-bit values.
inline uint32_t absmax_bits(const uint16_t* p, size_t n) {
  const __m256i mask = _mm256_set1_epi16(0x7fff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
    m1 = _mm256_max_epu16(m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 16)), mask));
  }
  for (; i + 16 <= n; i += 16)
    m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mask));
  m0 = _mm256_max_epu16(m0, m1);
  __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
  h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0xb1));
  h = _mm_max_epu16(h, _mm_srli_epi32(h, 16));
  uint32_t r = static_cast<uint32_t>(_mm_cvtsi128_si32(h)) & 0xffffu;
  for (; i < n; ++i) {
    const uint32_t a = p[i] & 0x7fffu;
    r = a > r ? a : r;
  }
  return r << 16;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }

// quant_round, as int32 lanes.
struct Rounder {
  __m256 scale, magic, qmax, nqmax;
  explicit Rounder(float s)
      : scale(_mm256_set1_ps(s)),
        magic(_mm256_set1_ps(12582912.0f)),
        qmax(_mm256_set1_ps(127.0f)),
        nqmax(_mm256_set1_ps(-127.0f)) {}
  __m256i operator()(__m256 x) const {
    const __m256 r = _mm256_div_ps(x, scale);
    __m256 t = _mm256_sub_ps(_mm256_add_ps(r, magic), magic);
    t = _mm256_min_ps(t, qmax);
    t = _mm256_max_ps(t, nqmax);
    return _mm256_cvttps_epi32(t);  // integral already: exact
  }
};

template <typename E>
void quantize_blocks(const E* src, size_t n, const QuantSpec& s, uint8_t* codes, float* scales,
                     size_t b0, size_t b1) {
  constexpr WorkDtype T = sizeof(E) == 4 ? WorkDtype::F32 : WorkDtype::BF16;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const E* x = src + first;
    const uint32_t maxbits = absmax_bits(x, len);
    const float scale = quant_scale(bits_float(maxbits), is_finite_bits(maxbits), 127);
    scales[b] = scale;
    uint8_t* out = codes + first;
    if (!(scale > 0.0f)) {  // all zero, or poisoned: zero codes
      std::memset(out, 0, s.block);
      continue;
    }
    if (!is_finite_bits(abs_bits(scale))) {  // cannot happen; the scalar formulas if it does
      kernels::quantize_blocks<T>(src, n, s, codes, scales, b, b + 1);
      continue;
    }
    const Rounder rnd(scale);
    size_t j = 0;
    for (; j + 32 <= len; j += 32) {
      const __m256i a = rnd(load8(x + j)), c = rnd(load8(x + j + 8));
      const __m256i d = rnd(load8(x + j + 16)), e = rnd(load8(x + j + 24));
      // packs interleave the 128-bit lanes: dwords come out as
      // a0 c0 d0 e0 a1 c1 d1 e1 (four codes each); put them back in order.
      const __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, c), _mm256_packs_epi32(d, e));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(q, order));
    }
    for (; j + 8 <= len; j += 8) {
      const __m256i a = rnd(load8(x + j));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packs_epi16(w, w));
    }
    for (; j < len; ++j) {
      out[j] = static_cast<uint8_t>(static_cast<int8_t>(quant_round(load1(x + j), scale, 127.0f)));
    }
    if (len < s.block) std::memset(out + len, 0, s.block - len);  // padding: code 0
  }
}

// float_to_bf16 on eight lanes, as 32-bit values below 0x10000.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

inline void store16(float* p, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
}
inline void store16(uint16_t* p, __m256 lo, __m256 hi) {
  // packus interleaves the lanes (lo0 hi0 lo1 hi1, four values each).
  const __m256i w = _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, 0xd8));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }

template <typename E>
void dequantize_blocks(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s,
                       E* dst, size_t b0, size_t b1) {
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const float scale = scales[b];
    const __m256 vs = _mm256_set1_ps(scale);
    const uint8_t* in = codes + first;
    E* out = dst + first;
    size_t j = 0;
    for (; j + 16 <= len; j += 16) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j));
      const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vs);
      const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), vs);
      store16(out + j, lo, hi);
    }
    for (; j + 8 <= len; j += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + j));
      store8(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vs));
    }
    for (; j < len; ++j) store1(out + j, quant_value(static_cast<int8_t>(in[j]), scale));
  }
}

}  // namespace quant_avx2
}  // namespace
}  // namespace zs::kernels
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // __x86_64__

namespace zs::kernels {
namespace {

// The AVX2 kernels serve int8 codes of fp32 and bf16 when the engine's SIMD
// path is a vector one (ZS_SIMD=scalar keeps the loops above).
bool quant_avx2_for(WorkDtype t, const QuantSpec& s) {
#if defined(__x86_64__)
  return s.bits == 8 && t != WorkDtype::F16 && simd_path_id() != SimdPath::Scalar;
#else
  (void)t;
  (void)s;
  return false;
#endif
}

template <typename F>
void over_blocks(size_t n, const QuantSpec& s, F&& fn) {
  parallel_for(quant_blocks(n, s), block_grain(s), fn, 1);
}

}  // namespace

void quantize(const void* src, WorkDtype t, size_t n, const QuantSpec& s, uint8_t* codes,
              float* scales) {
#if defined(__x86_64__)
  if (quant_avx2_for(t, s)) {
    over_blocks(n, s, [&](size_t b0, size_t b1) {
      if (t == WorkDtype::F32)
        quant_avx2::quantize_blocks(static_cast<const float*>(src), n, s, codes, scales, b0, b1);
      else
        quant_avx2::quantize_blocks(static_cast<const uint16_t*>(src), n, s, codes, scales, b0, b1);
    });
    return;
  }
#endif
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
#if defined(__x86_64__)
  if (quant_avx2_for(t, s)) {
    over_blocks(n, s, [&](size_t b0, size_t b1) {
      if (t == WorkDtype::F32)
        quant_avx2::dequantize_blocks(codes, scales, n, s, static_cast<float*>(dst), b0, b1);
      else
        quant_avx2::dequantize_blocks(codes, scales, n, s, static_cast<uint16_t*>(dst), b0, b1);
    });
    return;
  }
#endif
  over_blocks(n, s, [&](size_t b0, size_t b1) {
    switch (t) {
      case WorkDtype::F32: dequantize_blocks<WorkDtype::F32>(codes, scales, n, s, dst, b0, b1); break;
      case WorkDtype::BF16: dequantize_blocks<WorkDtype::BF16>(codes, scales, n, s, dst, b0, b1); break;
      case WorkDtype::F16: dequantize_blocks<WorkDtype::F16>(codes, scales, n, s, dst, b0, b1); break;
    }
  });
}

}  // namespace zs::kernels
