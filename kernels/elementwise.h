// Per-element math shared by the CPU kernels (kernels/optim.cpp) and the
// CUDA kernels (kernels/cuda/*.cu): the fp32 <-> bf16/fp16 conversions, the
// AdamW/Adam and SGD element updates, and the small operations of the
// gradient path. Host and device run literally the same formula, so a CUDA
// kernel's results are bit-identical to the CPU scalar reference's.
//
// How the operations stay identical on both sides:
//  - every float operation goes through f_add/f_sub/f_mul/f_div/f_sqrt. On
//    the device these are the IEEE round-to-nearest intrinsics (__fadd_rn,
//    __fmul_rn, ...), which nvcc never contracts into an FMA and which are
//    exact-rounded whatever -use_fast_math/-prec-div/-prec-sqrt say (only
//    -ftz=true, not the default, would differ: it flushes subnormals). On
//    the host they are the plain operators, and contraction is off: GCC
//    through the optimize pragma below (kernels/optim.cpp, which calls
//    these, compiles with the same setting, so they inline there), clang
//    through `#pragma clang fp contract(off)` inside each helper.
//  - the per-call constants (AdamC, SgdC) are derived once, on the host, by
//    adam_consts / sgd_consts (defined in kernels/optim.cpp, one definition
//    for both sides) and handed to the CPU loop or the CUDA kernel.
//  - bit casts use memcpy on the host and __float_as_uint/__uint_as_float on
//    the device; the conversions are integer code.
//
// The header is plain C++ without nvcc; under nvcc (__CUDACC__) ZS_HD makes
// the functions __host__ __device__.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/optim.h"

#if defined(__CUDACC__)
#define ZS_HD __host__ __device__
#else
#define ZS_HD
#endif

// Contraction off for the float helpers on the host. nvcc's front end does
// not know GCC's optimize pragma (and uses the intrinsics on the device), so
// the pragma is for host compilers only.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define ZS_EW_GCC_NO_CONTRACT 1
#endif
#if defined(__clang__) && !defined(__CUDA_ARCH__)
#define ZS_EW_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define ZS_EW_NO_CONTRACT
#endif

namespace zs::kernels {

// ---- bit casts and 16-bit float conversions (integer code) ---------------

ZS_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

ZS_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
ZS_HD inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

ZS_HD inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> fp16, round to nearest even, overflow to inf, NaN -> sign | 0x7e00.
ZS_HD inline uint16_t float_to_fp16(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (u < 0x38800000u) {  // subnormal or zero in fp16
    if (u < 0x33000000u) return static_cast<uint16_t>(sign);  // rounds to zero
    const uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(u >> 23);  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits.
  uint32_t h = ((u >> 13) - (112u << 10));
  const uint32_t rem = u & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

ZS_HD inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    int e = -1;  // normalise the subnormal
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return bits_float(sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// |x|'s bits; >= 0x7f800000 means inf or NaN.
ZS_HD inline uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }
ZS_HD inline bool is_finite_bits(uint32_t abs) { return abs < 0x7f800000u; }

// A 16-bit param's fp32 master after its working copy was rewritten: the
// master stays where the working value is still its rounding (its extra
// precision is kept), and takes the working value where that changed.
ZS_HD inline float refreshed_master(float master, float working, WorkDtype t) {
  const float rounded = t == WorkDtype::BF16   ? bf16_to_float(float_to_bf16(master))
                        : t == WorkDtype::F16 ? fp16_to_float(float_to_fp16(master))
                                              : master;
  return float_bits(rounded) == float_bits(working) ? master : working;
}

// Element i of a working-dtype buffer.
ZS_HD inline void store_work1(void* w, WorkDtype t, size_t i, float x) {
  switch (t) {
    case WorkDtype::F32: static_cast<float*>(w)[i] = x; break;
    case WorkDtype::BF16: static_cast<uint16_t*>(w)[i] = float_to_bf16(x); break;
    case WorkDtype::F16: static_cast<uint16_t*>(w)[i] = float_to_fp16(x); break;
  }
}

ZS_HD inline float load_work1(const void* w, WorkDtype t, size_t i) {
  switch (t) {
    case WorkDtype::F32: return static_cast<const float*>(w)[i];
    case WorkDtype::BF16: return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
    case WorkDtype::F16: return fp16_to_float(static_cast<const uint16_t*>(w)[i]);
  }
  return 0.0f;
}

// ---- the optimizers' per-call constants ------------------------------------

// Per-call constants of the Adam update, derived in double as torch does in
// Python, then rounded to fp32 as torch's kernels do with a Scalar.
struct AdamC {
  float gscale;  // grad multiplier
  float decay;   // AdamW: 1 - lr * wd
  float wd;      // Adam (L2): wd
  float w1;      // lerp weight 1 - beta1
  float omw1;    // 1 - w1 (fp32, as torch's lerp)
  float b2;      // beta2
  float omb2;    // 1 - beta2
  float bc2s;    // sqrt(1 - beta2^step)
  float eps;
  float nstep;   // -lr / (1 - beta1^step)
  bool has_wd;
  bool adamw;
  bool lerp_small;  // |w1| < 0.5: torch's lerp formula choice
};

struct SgdC {
  float gscale;
  float wd;
  float mom;
  float omd;  // 1 - dampening
  float nlr;  // -lr
  bool has_wd;
  bool has_mom;
  bool nesterov;
  bool first;
};

// Host only; defined in kernels/optim.cpp (one definition for the CPU and
// the CUDA kernels). adam_consts throws std::invalid_argument when
// h.bias_correction and h.step < 1.
AdamC adam_consts(const AdamHyper& h, float grad_scale);
SgdC sgd_consts(const SgdHyper& h, float grad_scale);

// ---- float operations: IEEE, round to nearest, never contracted ------------

#if defined(ZS_EW_GCC_NO_CONTRACT)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

ZS_HD inline float f_add(float a, float b) {
  ZS_EW_NO_CONTRACT
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ZS_HD inline float f_sub(float a, float b) {
  ZS_EW_NO_CONTRACT
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ZS_HD inline float f_mul(float a, float b) {
  ZS_EW_NO_CONTRACT
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ZS_HD inline float f_div(float a, float b) {
  ZS_EW_NO_CONTRACT
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ZS_HD inline float f_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

ZS_HD inline double d_add(double a, double b) {
  ZS_EW_NO_CONTRACT
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// x^2 in double: exact (a float's 24-bit significand squared fits in 53).
ZS_HD inline double d_square(float x) {
  ZS_EW_NO_CONTRACT
  const double d = static_cast<double>(x);
#if defined(__CUDA_ARCH__)
  return __dmul_rn(d, d);
#else
  return d * d;
#endif
}

// ---- the element updates ---------------------------------------------------

// One Adam/AdamW element (see kernels/optim.h for the formula).
ZS_HD inline void adam_elem(float& p, float& m, float& v, float graw, const AdamC& c) {
  float g = f_mul(graw, c.gscale);
  if (c.has_wd) {
    if (c.adamw)
      p = f_mul(p, c.decay);
    else
      g = f_add(g, f_mul(c.wd, p));
  }
  m = c.lerp_small ? f_add(m, f_mul(c.w1, f_sub(g, m))) : f_sub(g, f_mul(f_sub(g, m), c.omw1));
  v = f_add(f_mul(v, c.b2), f_mul(f_mul(c.omb2, g), g));
  const float denom = f_add(f_div(f_sqrt(v), c.bc2s), c.eps);
  p = f_add(p, f_div(f_mul(c.nstep, m), denom));
}

// One SGD element; buf is read and written only when c.has_mom.
ZS_HD inline void sgd_elem(float& p, float* buf, float graw, const SgdC& c) {
  float g = f_mul(graw, c.gscale);
  if (c.has_wd) g = f_add(g, f_mul(c.wd, p));
  if (c.has_mom) {
    const float b = c.first ? g : f_add(f_mul(*buf, c.mom), f_mul(c.omd, g));
    *buf = b;
    g = c.nesterov ? f_add(g, f_mul(c.mom, b)) : b;
  }
  p = f_add(p, f_mul(c.nlr, g));
}

#if defined(ZS_EW_GCC_NO_CONTRACT)
#pragma GCC pop_options
#undef ZS_EW_GCC_NO_CONTRACT
#endif
#undef ZS_EW_NO_CONTRACT

}  // namespace zs::kernels
