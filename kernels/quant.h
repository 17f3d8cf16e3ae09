// Block quantization of weights for quantized gathers (ZeRO++ qwZ).
//
// n elements of fp32, bf16 or fp16 are cut into blocks of `block` elements
// (the last one partial); each block gets one fp32 scale and one signed
// code per element, symmetric, rounded to nearest (ties to even):
//
//   qmax  = 127 (int8) or 7 (int4)
//   scale = max|x| / qmax over the block's elements (rounded up one ulp
//           where scale * qmax fell below max|x|, so no code is clamped by
//           more than rounding; 0 for an all-zero block)
//   q     = round(x / scale), in [-qmax, qmax]
//   deq   = to_dtype(q * scale)
//
// Error bound, per element of a finite block, for every dtype:
//
//   |x - deq| <= scale * (1/2 + 2^-16) + |q * scale| * u + a
//
// scale/2 from rounding to the code; 2^-16 * scale covers the fp32
// rounding of x / scale and q * scale; u and a are the target dtype's
// rounding of the result (relative u = 2^-24 fp32, 2^-8 bf16, 2^-11 fp16;
// absolute a = half its smallest subnormal: 2^-150 fp32, 2^-134 bf16,
// 2^-25 fp16). An all-zero block comes back exactly zero; one huge value makes
// its block's scale huge and the block's small values round to 0 (within
// the bound).
//
// Non-finite values: a block holding an inf or a NaN gets a NaN scale and
// all-zero codes, and dequantizes to NaN in every element of the block.
// The scale travels with the codes, so every rank that dequantizes the
// block gets the same NaNs: a loss or overflow check sees them everywhere,
// instead of one rank holding garbage (an inf is not kept as inf: the
// block's other values are lost with it either way).
//
// Layout: codes[b * block + j] (int8, two's complement) or, for int4, the
// nibble pair codes[(b * block + j) / 2] with even j in the low nibble.
// A partial last block's codes are padded with zero codes, so the codes
// take quant_code_bytes(n) bytes and every block starts on a byte. Block
// sizes are even (int4 packs pairs) in [2, kQuantMaxBlock].
//
// The per-element formulas below are shared by the CPU kernels
// (kernels/quant.cpp) and the CUDA kernels (kernels/cuda/quant.cu): both
// give the same codes, scales and dequantized bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/elementwise.h"

namespace zs::kernels {

constexpr size_t kQuantDefaultBlock = 256;
constexpr size_t kQuantMaxBlock = size_t{1} << 24;

struct QuantSpec {
  int bits = 8;  // 8 or 4
  size_t block = kQuantDefaultBlock;
};

inline bool quant_spec_valid(const QuantSpec& s) {
  return (s.bits == 8 || s.bits == 4) && s.block >= 2 && s.block % 2 == 0 &&
         s.block <= kQuantMaxBlock;
}
inline size_t quant_blocks(size_t n, const QuantSpec& s) { return (n + s.block - 1) / s.block; }
inline size_t quant_code_bytes(size_t n, const QuantSpec& s) {
  return quant_blocks(n, s) * s.block * static_cast<size_t>(s.bits) / 8;
}

// Compiled as the float helpers of kernels/elementwise.h are (contraction
// off), so GCC inlines them into these and these into the kernels' loops.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define ZS_QUANT_GCC_NO_CONTRACT 1
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

ZS_HD inline int quant_qmax(int bits) { return bits == 8 ? 127 : 7; }

// The scale of a block from max|x| and whether every element was finite.
ZS_HD inline float quant_scale(float absmax, bool finite, int qmax) {
  if (!finite) return bits_float(0x7fc00000u);  // poisons the block on every rank
  if (absmax == 0.0f) return 0.0f;
  const float q = static_cast<float>(qmax);
  float s = f_div(absmax, q);
  // Never below max|x| / qmax: else the largest element clamps at qmax
  // with an error above scale/2 (matters for subnormal scales).
  if (f_mul(s, q) < absmax) s = bits_float(float_bits(s) + 1u);
  return s;
}

// x / scale rounded to nearest even and clamped to [-qmax, qmax], as a
// float holding an integer; scale > 0.
ZS_HD inline float quant_round(float x, float scale, float qmax) {
  const float r = f_div(x, scale);
  // With |r| < 2^22, adding 1.5 * 2^23 leaves the integer part in the low
  // mantissa bits (ties to even): the same on host and device.
  float t = f_sub(f_add(r, 12582912.0f), 12582912.0f);
  t = t > qmax ? qmax : t;
  return t < -qmax ? -qmax : t;
}

// The code of x in a block of scale `scale` (0 for a zero or NaN scale).
ZS_HD inline int quant_code(float x, float scale, int qmax) {
  if (!(scale > 0.0f)) return 0;
  return static_cast<int>(quant_round(x, scale, static_cast<float>(qmax)));
}

// A NaN scale comes back quieted with its sign and payload, as x86's
// multiply (the AVX2 path) gives it; a GPU's multiply would give its
// canonical 0x7fffffff instead.
ZS_HD inline float quant_value(int q, float scale) {
  return scale == scale ? f_mul(static_cast<float>(q), scale) : bits_float(float_bits(scale) | 0x00400000u);
}

// LoCo error feedback (quantize_with_error below): the error kept for the
// next step from the old error e, the compensated value x = g + e and its
// dequantized value. A moving average, so one step's rounding is spread
// over the next ones instead of being resent whole. A poisoned (non-finite)
// block keeps no error: the loss scaler skips that step, and a NaN kept
// would poison every later one.
ZS_HD inline float loco_error(float e, float x, float deq, float beta, float one_minus_beta,
                              bool finite) {
  if (!finite) return 0.0f;
  return f_add(f_mul(beta, e), f_mul(one_minus_beta, f_sub(x, deq)));
}

// int4 nibble <-> code.
ZS_HD inline uint8_t nibble_of(int q) { return static_cast<uint8_t>(q & 0xf); }
ZS_HD inline int code_of_nibble(uint8_t v) {
  const int u = v & 0xf;
  return u >= 8 ? u - 16 : u;
}

#if defined(ZS_QUANT_GCC_NO_CONTRACT)
#pragma GCC pop_options
#undef ZS_QUANT_GCC_NO_CONTRACT
#endif

// CPU kernels, parallel over blocks (kernels/parallel.h). src/dst hold n
// elements of `t`; codes quant_code_bytes(n, s) bytes; scales
// quant_blocks(n, s) floats. The spec must be quant_spec_valid.
void quantize(const void* src, WorkDtype t, size_t n, const QuantSpec& s, uint8_t* codes,
              float* scales);
void dequantize(const uint8_t* codes, const float* scales, size_t n, const QuantSpec& s, void* dst,
                WorkDtype t);

// LoCo (Xie et al. 2024; DeepSpeed's zeropp_loco_param): quantize the fp32
// gradient g compensated by the error e of the previous step, and update
// e in place, element by element:
//
//   x     = g + e                      (fp32)
//   codes, scales = quantize(x)        (as above)
//   e     = beta * e + (1 - beta) * (x - deq(x))   (loco_error)
//
// 1 - beta is taken in fp32 once. Bit-identical to the CUDA kernel and to
// the scalar loop over these formulas.
void quantize_with_error(const float* g, float* err, float beta, size_t n, const QuantSpec& s,
                         uint8_t* codes, float* scales);

}  // namespace zs::kernels
