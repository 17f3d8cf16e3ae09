// CPU block quantization (kernels/quant.h): one pass per block for max|x|,
// one for the codes; blocks are independent, so the pool splits them.
#include "kernels/quant.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

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

// ---- AVX2: codes of fp32, bf16 and fp16, int8 and int4; LoCo ---------------
//
// The same operations as the scalar loops above, eight lanes at a time:
// max|x| as an integer max over the bits with the sign cleared; the codes
// from _mm256_div_ps / add / sub (the +1.5*2^23 rounding of quant_round),
// clamped with min/max (no NaN reaches them: a block is coded only when
// its scale is finite and > 0); dequantized values from _mm256_mul_ps and
// float_to_bf16's integer rounding or F16C's conversion (NaN lanes fixed
// up to float_to_fp16's). No FMA is used (none is enabled). Remainders of
// a block shorter than a vector, and any block whose scale is not finite
// and > 0, take the scalar formulas, so every code, scale, error and
// dequantized bit equals the scalar path's. F16C is enabled beside AVX2:
// the dispatch's AVX2 path requires it (cpu_supports, kernels/optim.cpp).
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
namespace zs::kernels {
namespace {
namespace quant_avx2 {

template <WorkDtype T>
using Elem = std::conditional_t<T == WorkDtype::F32, float, uint16_t>;

// max over i < n of |x_i|'s fp32 bits: bits8(i) gives eight lanes' bits
// (sign cleared), bits1(i) one.
template <typename V, typename S>
inline uint32_t absmax_bits32(size_t n, V bits8, S bits1) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_epu32(m0, bits8(i));
    m1 = _mm256_max_epu32(m1, bits8(i + 8));
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_epu32(m0, bits8(i));
  m0 = _mm256_max_epu32(m0, m1);
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
  uint32_t r = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  for (; i < n; ++i) {
    const uint32_t a = bits1(i);
    r = a > r ? a : r;
  }
  return r;
}

inline __m256i abs8(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

// max over the 16-bit values h & 0x7fff (bf16 or fp16 |x|).
inline uint32_t absmax16(const uint16_t* p, size_t n) {
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
  return r;
}

// The scalar loop's max of abs_bits(load(x)) over a block.
template <WorkDtype T>
inline uint32_t absmax_bits(const Elem<T>* p, size_t n) {
  if constexpr (T == WorkDtype::F32) {
    return absmax_bits32(
        n, [p](size_t i) { return abs8(_mm256_loadu_ps(p + i)); },
        [p](size_t i) { return abs_bits(p[i]); });
  } else if constexpr (T == WorkDtype::BF16) {
    return absmax16(p, n) << 16;  // |x|'s fp32 bits are (h & 0x7fff) << 16
  } else {
    // fp16_to_float is increasing in |h|'s bits (inf and NaN above every
    // finite value, as in fp32), so it commutes with the max.
    return float_bits(fp16_to_float(static_cast<uint16_t>(absmax16(p, n))));
  }
}

template <WorkDtype T>
inline __m256 load8(const Elem<T>* p) {
  if constexpr (T == WorkDtype::F32) return _mm256_loadu_ps(p);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (T == WorkDtype::BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);  // exact, as fp16_to_float (NaNs never get here)
}

// quant_round, as int32 lanes.
struct Rounder {
  __m256 scale, magic, qmax, nqmax;
  Rounder(float s, int q)
      : scale(_mm256_set1_ps(s)),
        magic(_mm256_set1_ps(12582912.0f)),
        qmax(_mm256_set1_ps(static_cast<float>(q))),
        nqmax(_mm256_set1_ps(-static_cast<float>(q))) {}
  __m256i operator()(__m256 x) const {
    const __m256 r = _mm256_div_ps(x, scale);
    __m256 t = _mm256_sub_ps(_mm256_add_ps(r, magic), magic);
    t = _mm256_min_ps(t, qmax);
    t = _mm256_max_ps(t, nqmax);
    return _mm256_cvttps_epi32(t);  // integral already: exact
  }
};

// int4: 16 int8 codes -> 8 bytes of nibble pairs (the low 8 bytes), even
// code in the low nibble. maddubs sums (q0 & 15) * 1 + (q1 & 15) * 16 per
// byte pair: at most 255, so packus keeps it.
inline __m128i pack_nibbles(__m128i q) {
  const __m128i w = _mm_maddubs_epi16(_mm_and_si128(q, _mm_set1_epi8(0x0f)), _mm_set1_epi16(0x1001));
  return _mm_packus_epi16(w, w);
}

// int4: 8 bytes (the low 8) -> 16 int8 codes.
inline __m128i unpack_nibbles(__m128i b) {
  const __m128i m = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i u = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  return _mm_sub_epi8(_mm_xor_si128(u, eight), eight);  // sign-extends 4 bits: (u ^ 8) - 8
}

// Writes a block's codes (len of them, then zero codes up to `block`):
// codes8(j) gives codes j..j+7 as int32 lanes, code1(j) code j; each is
// called once per code, in order.
template <int Bits, typename V, typename S>
inline void write_codes(uint8_t* out, size_t len, size_t block, V codes8, S code1) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t j = 0;
  for (; j + 32 <= len; j += 32) {
    const __m256i a = codes8(j), c = codes8(j + 8), d = codes8(j + 16), e = codes8(j + 24);
    // packs interleave the 128-bit lanes: dwords come out as
    // a0 c0 d0 e0 a1 c1 d1 e1 (four codes each); put them back in order.
    const __m256i q = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(a, c), _mm256_packs_epi32(d, e)), order);
    if constexpr (Bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), q);
    } else {
      const __m128i lo = pack_nibbles(_mm256_castsi256_si128(q));
      const __m128i hi = pack_nibbles(_mm256_extracti128_si256(q, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j / 2), _mm_unpacklo_epi64(lo, hi));
    }
  }
  for (; j + 8 <= len; j += 8) {
    const __m256i a = codes8(j);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i q = _mm_packs_epi16(w, w);
    if constexpr (Bits == 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), q);
    } else {
      const int32_t v = _mm_cvtsi128_si32(pack_nibbles(q));
      std::memcpy(out + j / 2, &v, 4);
    }
  }
  if constexpr (Bits == 8) {
    for (; j < len; ++j) out[j] = static_cast<uint8_t>(static_cast<int8_t>(code1(j)));
    std::memset(out + len, 0, block - len);  // padding: code 0
  } else {
    for (; j < len; j += 2) {  // an odd last code pairs with a padding 0
      const int lo = code1(j), hi = j + 1 < len ? code1(j + 1) : 0;
      out[j / 2] = static_cast<uint8_t>(nibble_of(lo) | (nibble_of(hi) << 4));
    }
    const size_t used = (len + 1) / 2;
    std::memset(out + used, 0, block / 2 - used);
  }
}

template <WorkDtype T, int Bits>
void quantize_blocks(const Elem<T>* src, size_t n, const QuantSpec& s, uint8_t* codes,
                     float* scales, size_t b0, size_t b1) {
  constexpr int qmax = Bits == 8 ? 127 : 7;
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const Elem<T>* x = src + first;
    const uint32_t maxbits = absmax_bits<T>(x, len);
    const float scale = quant_scale(bits_float(maxbits), is_finite_bits(maxbits), qmax);
    scales[b] = scale;
    uint8_t* out = codes + first * Bits / 8;
    if (!(scale > 0.0f)) {  // all zero, or poisoned: zero codes
      std::memset(out, 0, s.block * Bits / 8);
      continue;
    }
    if (!is_finite_bits(abs_bits(scale))) {  // cannot happen; the scalar formulas if it does
      kernels::quantize_blocks<T>(src, n, s, codes, scales, b, b + 1);
      continue;
    }
    const Rounder rnd(scale, qmax);
    write_codes<Bits>(
        out, len, s.block, [&](size_t j) { return rnd(load8<T>(x + j)); },
        [&](size_t j) {
          return static_cast<int>(quant_round(load<T>(x, j), scale, static_cast<float>(qmax)));
        });
  }
}

// float_to_bf16 on eight lanes, as 32-bit values below 0x10000.
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(abs8(v), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

// float_to_fp16 on eight lanes. F16C rounds to nearest even, overflows to
// inf and makes subnormals as float_to_fp16 does, but keeps a NaN's top
// payload bits where float_to_fp16 gives sign | 0x7e00: NaN lanes are
// replaced (rare, so only when there is one).
inline __m128i fp16_bits(__m256 v) {
  __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(nan) != 0) {
    const __m256i fix = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x8000)),
        _mm256_set1_epi32(0x7e00));
    const __m256i m = _mm256_castps_si256(nan);
    h = _mm_blendv_epi8(
        h, _mm_packus_epi32(_mm256_castsi256_si128(fix), _mm256_extracti128_si256(fix, 1)),
        _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
  }
  return h;
}

template <WorkDtype T>
inline void store8(Elem<T>* p, __m256 v) {
  if constexpr (T == WorkDtype::F32) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (T == WorkDtype::BF16) {
    const __m256i r = bf16_bits(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp16_bits(v));
  }
}

template <WorkDtype T>
inline void store16(Elem<T>* p, __m256 lo, __m256 hi) {
  if constexpr (T == WorkDtype::BF16) {
    // packus interleaves the lanes (lo0 hi0 lo1 hi1, four values each).
    const __m256i w = _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(w, 0xd8));
  } else {
    store8<T>(p, lo);
    store8<T>(p + 8, hi);
  }
}

template <WorkDtype T, int Bits>
void dequantize_blocks(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s,
                       Elem<T>* dst, size_t b0, size_t b1) {
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const float scale = scales[b];
    const __m256 vs = _mm256_set1_ps(scale);
    const uint8_t* in = codes + first * Bits / 8;
    Elem<T>* out = dst + first;
    size_t j = 0;
    for (; j + 16 <= len; j += 16) {
      const __m128i q =
          Bits == 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))
                    : unpack_nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + j / 2)));
      const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vs);
      const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), vs);
      store16<T>(out + j, lo, hi);
    }
    for (; j + 8 <= len; j += 8) {
      __m128i q;
      if constexpr (Bits == 8) {
        q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + j));
      } else {
        int32_t v;
        std::memcpy(&v, in + j / 2, 4);
        q = unpack_nibbles(_mm_cvtsi32_si128(v));
      }
      store8<T>(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vs));
    }
    for (; j < len; ++j) {
      const int q = Bits == 8 ? static_cast<int8_t>(in[j])
                              : code_of_nibble(static_cast<uint8_t>(in[j / 2] >> (4 * (j & 1))));
      store<T>(out, j, quant_value(q, scale));
    }
  }
}

// LoCo: the scalar quantize_with_error_blocks, eight lanes at a time; x =
// g + e is taken once per pass, and the error is stored as each code is.
template <int Bits>
void quantize_with_error_blocks(const float* g, float* err, float beta, size_t n,
                                const QuantSpec& s, uint8_t* codes, float* scales, size_t b0,
                                size_t b1) {
  constexpr int qmax = Bits == 8 ? 127 : 7;
  const float keep = f_sub(1.0f, beta);
  const __m256 vbeta = _mm256_set1_ps(beta), vkeep = _mm256_set1_ps(keep);
  for (size_t b = b0; b < b1; ++b) {
    const size_t first = b * s.block;
    const size_t len = n - first < s.block ? n - first : s.block;
    const float* gi = g + first;
    float* ei = err + first;
    const uint32_t maxbits = absmax_bits32(
        len, [&](size_t i) { return abs8(_mm256_add_ps(_mm256_loadu_ps(gi + i), _mm256_loadu_ps(ei + i))); },
        [&](size_t i) { return abs_bits(f_add(gi[i], ei[i])); });
    const bool finite = is_finite_bits(maxbits);
    const float scale = quant_scale(bits_float(maxbits), finite, qmax);
    scales[b] = scale;
    uint8_t* out = codes + first * Bits / 8;
    if (!finite) {  // poisoned: zero codes, and no error is kept
      std::memset(out, 0, s.block * Bits / 8);
      std::fill(ei, ei + len, 0.0f);
      continue;
    }
    if (!is_finite_bits(abs_bits(scale))) {  // cannot happen; the scalar formulas if it does
      kernels::quantize_with_error_blocks(g, err, beta, n, s, codes, scales, b, b + 1);
      continue;
    }
    // An all-zero block (scale 0) has code 0 everywhere, and deq = 0 * 0.
    const bool coded = scale > 0.0f;
    const Rounder rnd(scale, qmax);
    const __m256 vs = _mm256_set1_ps(scale);
    write_codes<Bits>(
        out, len, s.block,
        [&](size_t j) {
          const __m256 e = _mm256_loadu_ps(ei + j);
          const __m256 x = _mm256_add_ps(_mm256_loadu_ps(gi + j), e);
          const __m256i q = coded ? rnd(x) : _mm256_setzero_si256();
          const __m256 deq = _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs);
          _mm256_storeu_ps(ei + j, _mm256_add_ps(_mm256_mul_ps(vbeta, e),
                                                 _mm256_mul_ps(vkeep, _mm256_sub_ps(x, deq))));
          return q;
        },
        [&](size_t j) {
          const float x = f_add(gi[j], ei[j]);
          const int q = coded ? static_cast<int>(quant_round(x, scale, static_cast<float>(qmax))) : 0;
          ei[j] = loco_error(ei[j], x, quant_value(q, scale), beta, keep, true);
          return q;
        });
  }
}

template <WorkDtype T>
void quantize(const void* src, size_t n, const QuantSpec& s, uint8_t* codes, float* scales,
              size_t b0, size_t b1) {
  const auto* x = static_cast<const Elem<T>*>(src);
  if (s.bits == 8)
    quantize_blocks<T, 8>(x, n, s, codes, scales, b0, b1);
  else
    quantize_blocks<T, 4>(x, n, s, codes, scales, b0, b1);
}

template <WorkDtype T>
void dequantize(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s, void* dst,
                size_t b0, size_t b1) {
  auto* y = static_cast<Elem<T>*>(dst);
  if (s.bits == 8)
    dequantize_blocks<T, 8>(codes, scales, n, s, y, b0, b1);
  else
    dequantize_blocks<T, 4>(codes, scales, n, s, y, b0, b1);
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

// The AVX2 kernels serve every dtype and code width when the engine's SIMD
// path is a vector one (ZS_SIMD=scalar keeps the loops above).
bool use_avx2() {
#if defined(__x86_64__)
  return simd_path_id() != SimdPath::Scalar;
#else
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
  if (use_avx2()) {
    over_blocks(n, s, [&](size_t b0, size_t b1) {
      switch (t) {
        case WorkDtype::F32: quant_avx2::quantize<WorkDtype::F32>(src, n, s, codes, scales, b0, b1); break;
        case WorkDtype::BF16: quant_avx2::quantize<WorkDtype::BF16>(src, n, s, codes, scales, b0, b1); break;
        case WorkDtype::F16: quant_avx2::quantize<WorkDtype::F16>(src, n, s, codes, scales, b0, b1); break;
      }
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
#if defined(__x86_64__)
  if (use_avx2()) {
    over_blocks(n, s, [&](size_t b0, size_t b1) {
      if (s.bits == 8)
        quant_avx2::quantize_with_error_blocks<8>(g, err, beta, n, s, codes, scales, b0, b1);
      else
        quant_avx2::quantize_with_error_blocks<4>(g, err, beta, n, s, codes, scales, b0, b1);
    });
    return;
  }
#endif
  over_blocks(n, s, [&](size_t b0, size_t b1) {
    quantize_with_error_blocks(g, err, beta, n, s, codes, scales, b0, b1);
  });
}

void dequantize(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s, void* dst,
                WorkDtype t) {
#if defined(__x86_64__)
  if (use_avx2()) {
    over_blocks(n, s, [&](size_t b0, size_t b1) {
      switch (t) {
        case WorkDtype::F32: quant_avx2::dequantize<WorkDtype::F32>(codes, scales, n, s, dst, b0, b1); break;
        case WorkDtype::BF16: quant_avx2::dequantize<WorkDtype::BF16>(codes, scales, n, s, dst, b0, b1); break;
        case WorkDtype::F16: quant_avx2::dequantize<WorkDtype::F16>(codes, scales, n, s, dst, b0, b1); break;
      }
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
