// Block quantization kernels (kernels/quant.h): the documented per-element
// error bound for every dtype, bit width, block size and odd sizes, on
// random inputs, on every 16-bit pattern, and on adversarial blocks (all
// zeros, one huge value, subnormals, ties); non-finite values poison their
// block only; int4 packing; the result does not depend on the threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/optim.h"
#include "kernels/parallel.h"
#include "kernels/quant.h"

namespace zs::kernels {
namespace {

size_t esize(WorkDtype t) { return t == WorkDtype::F32 ? 4 : 2; }
const char* dname(WorkDtype t) {
  return t == WorkDtype::F32 ? "f32" : t == WorkDtype::BF16 ? "bf16" : "f16";
}

// Values in the dtype: x rounded into t (so the input is exact in t).
std::vector<uint8_t> encode(const std::vector<float>& x, WorkDtype t) {
  std::vector<uint8_t> out(x.size() * esize(t));
  for (size_t i = 0; i < x.size(); ++i) store_work1(out.data(), t, i, x[i]);
  return out;
}

float at(const std::vector<uint8_t>& buf, WorkDtype t, size_t i) {
  return load_work1(buf.data(), t, i);
}

struct Round {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<uint8_t> deq;
};

Round round_trip(const std::vector<uint8_t>& src, WorkDtype t, size_t n, QuantSpec s) {
  Round r;
  r.codes.assign(quant_code_bytes(n, s), 0xAB);  // padding must be overwritten
  r.scales.assign(quant_blocks(n, s), -1.0f);
  r.deq.assign(n * esize(t), 0xCD);
  quantize(src.data(), t, n, s, r.codes.data(), r.scales.data());
  dequantize(r.codes.data(), r.scales.data(), n, s, r.deq.data(), t);
  return r;
}

// The documented bound (kernels/quant.h) for one element.
double bound(float scale, double deq, WorkDtype t) {
  const double u = t == WorkDtype::F32 ? std::ldexp(1.0, -24)
                   : t == WorkDtype::BF16 ? std::ldexp(1.0, -8)
                                          : std::ldexp(1.0, -11);
  const double a = t == WorkDtype::F16    ? std::ldexp(1.0, -25)
                   : t == WorkDtype::BF16 ? std::ldexp(1.0, -134)
                                          : std::ldexp(1.0, -150);
  // |q * scale| <= |deq| * (1 + u): the rounding into t moved it by at most u.
  return static_cast<double>(scale) * (0.5 + std::ldexp(1.0, -16)) + std::fabs(deq) * u * (1 + u) + a;
}

// Checks every element of a round trip: the bound where the block is
// finite, NaN everywhere in a block holding a non-finite value, a scale
// that is max|x| / qmax (never below it), and zeroed code padding.
void check(const std::vector<uint8_t>& src, WorkDtype t, size_t n, QuantSpec s, const Round& r,
           const std::string& what) {
  const int qmax = quant_qmax(s.bits);
  size_t bad = 0;
  for (size_t b = 0; b < quant_blocks(n, s); ++b) {
    const size_t first = b * s.block, len = std::min(s.block, n - first);
    bool finite = true;
    double absmax = 0;
    for (size_t j = 0; j < len; ++j) {
      const float x = at(src, t, first + j);
      finite = finite && std::isfinite(x);
      if (std::isfinite(x)) absmax = std::max(absmax, std::fabs(static_cast<double>(x)));
    }
    const float scale = r.scales[b];
    if (!finite) {
      EXPECT_TRUE(std::isnan(scale)) << what << " block " << b;
      for (size_t j = 0; j < len; ++j)
        if (!std::isnan(at(r.deq, t, first + j)) && ++bad < 5)
          ADD_FAILURE() << what << ": element " << first + j << " of a non-finite block is "
                        << at(r.deq, t, first + j) << ", expected NaN";
      continue;
    }
    if (absmax == 0) {
      EXPECT_EQ(scale, 0.0f) << what << " block " << b;
    } else {
      EXPECT_GE(static_cast<double>(scale) * qmax, absmax * (1 - 1e-7)) << what << " block " << b;
      EXPECT_LE(static_cast<double>(scale), absmax / qmax * (1 + 1e-6) + std::ldexp(1.0, -149))
          << what << " block " << b;
    }
    for (size_t j = 0; j < len; ++j) {
      const double x = at(src, t, first + j), y = at(r.deq, t, first + j);
      const double err = std::fabs(x - y);
      if (!(err <= bound(scale, y, t)) && ++bad < 5)
        ADD_FAILURE() << what << ": element " << first + j << " x=" << x << " deq=" << y
                      << " err=" << err << " > bound " << bound(scale, y, t) << " (scale "
                      << scale << ")";
    }
  }
  // Padding of the last block: zero codes.
  const size_t used = n * static_cast<size_t>(s.bits);  // bits
  for (size_t bit = used; bit < r.codes.size() * 8; bit += s.bits) {
    const uint8_t byte = r.codes[bit / 8];
    const int v = s.bits == 8 ? byte : (bit % 8 == 0 ? byte & 0xf : byte >> 4);
    if (v != 0 && ++bad < 5) ADD_FAILURE() << what << ": padding code at bit " << bit << " is " << v;
  }
  EXPECT_EQ(bad, 0u) << what;
}

constexpr WorkDtype kDtypes[] = {WorkDtype::F32, WorkDtype::BF16, WorkDtype::F16};

TEST(QuantKernels, RandomWithinBoundEveryDtypeBitsBlockAndOddSize) {
  std::mt19937 rng(1234);
  for (WorkDtype t : kDtypes)
    for (int bits : {8, 4})
      for (size_t block : {size_t{2}, size_t{6}, size_t{256}, size_t{2048}})
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{255}, size_t{256}, size_t{257},
                         size_t{1000}, size_t{4099}}) {
          // Magnitudes vary per stretch so blocks see different scales.
          std::normal_distribution<float> g(0.0f, 1.0f);
          std::vector<float> x(n);
          float mag = 1.0f;
          for (size_t i = 0; i < n; ++i) {
            if (i % 97 == 0) mag = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
            x[i] = g(rng) * mag;
          }
          const auto src = encode(x, t);
          const QuantSpec s{bits, block};
          const auto r = round_trip(src, t, n, s);
          check(src, t, n, s, r,
                std::string(dname(t)) + " int" + std::to_string(bits) + " block " +
                    std::to_string(block) + " n " + std::to_string(n));
        }
}

// Every bf16 and fp16 bit pattern, in order (blocks of neighbouring
// magnitudes, subnormals, infs and NaNs included) and shuffled.
TEST(QuantKernels, EverySixteenBitPattern) {
  for (WorkDtype t : {WorkDtype::BF16, WorkDtype::F16}) {
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    for (int order = 0; order < 2; ++order) {
      if (order == 1) std::shuffle(all.begin(), all.end(), std::mt19937(7));
      std::vector<uint8_t> src(all.size() * 2);
      std::memcpy(src.data(), all.data(), src.size());
      for (int bits : {8, 4})
        for (size_t block : {size_t{2}, size_t{256}}) {
          const QuantSpec s{bits, block};
          const auto r = round_trip(src, t, all.size(), s);
          check(src, t, all.size(), s, r,
                std::string(dname(t)) + (order ? " shuffled" : " in order") + " int" +
                    std::to_string(bits) + " block " + std::to_string(block));
        }
    }
  }
}

TEST(QuantKernels, AdversarialBlocks) {
  const float fmax = std::numeric_limits<float>::max();
  const float denorm = std::numeric_limits<float>::denorm_min();
  struct Case {
    const char* name;
    std::vector<float> x;
  };
  std::vector<Case> cases = {
      {"all zeros", std::vector<float>(300, 0.0f)},
      {"negative zeros", std::vector<float>(5, -0.0f)},
      {"one huge value", {}},
      {"largest finite", {fmax, -fmax, 1.0f, fmax / 3}},
      {"subnormal only", {denorm * 190, denorm * 3, -denorm * 101, denorm}},
      {"tiny normal", {std::numeric_limits<float>::min(), 1e-38f, -2e-38f}},
      {"fp16 extremes", {65504.0f, -65504.0f, 6.1e-5f, 5.96e-8f, 1.0f}},
      {"one value", {-3.0f}},
  };
  cases[2].x.assign(513, 1e-3f);
  cases[2].x[100] = 1e30f;
  for (WorkDtype t : kDtypes)
    for (int bits : {8, 4})
      for (const Case& c : cases) {
        const auto src = encode(c.x, t);
        const QuantSpec s{bits, 256};
        const auto r = round_trip(src, t, c.x.size(), s);
        check(src, t, c.x.size(), s, r, std::string(dname(t)) + " int" + std::to_string(bits) + " " + c.name);
        if (std::string(c.name) == "all zeros" || std::string(c.name) == "negative zeros") {
          for (size_t i = 0; i < c.x.size(); ++i) ASSERT_EQ(at(r.deq, t, i), 0.0f);
        }
      }
}

TEST(QuantKernels, NonFiniteValuesPoisonTheirBlockOnly) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (WorkDtype t : kDtypes)
    for (int bits : {8, 4})
      for (float bad : {inf, -inf, nan}) {
        std::vector<float> x(1000);
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) - 8.0f;
        x[300] = bad;  // block 1 of 256
        const auto src = encode(x, t);
        const QuantSpec s{bits, 256};
        const auto r = round_trip(src, t, x.size(), s);
        check(src, t, x.size(), s, r, std::string(dname(t)) + " non-finite");
        EXPECT_TRUE(std::isnan(r.scales[1]));
        for (size_t b : {size_t{0}, size_t{2}, size_t{3}}) EXPECT_TRUE(std::isfinite(r.scales[b]));
        // The poisoned block dequantizes to the scale's own NaN, bit for
        // bit: a GPU's multiply would give its canonical NaN (0x7fffffff)
        // instead of 0x7fc00000 and the CUDA kernel would differ.
        const auto poison = encode({bits_float(0x7fc00000u)}, t);
        for (size_t i = 256; i < 512; ++i)
          ASSERT_EQ(0, std::memcmp(&r.deq[i * esize(t)], poison.data(), esize(t)))
              << dname(t) << " element " << i;
      }
}

// Round to nearest, ties to even, and the int4 nibble order.
TEST(QuantKernels, TiesToEvenAndNibbleOrder) {
  // max 127 -> scale 1 (int8): codes are the rounded values themselves.
  const std::vector<float> x = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, 3.49f, -126.6f};
  const QuantSpec s8{8, 8};
  std::vector<uint8_t> codes(quant_code_bytes(x.size(), s8));
  std::vector<float> scales(1);
  quantize(x.data(), WorkDtype::F32, x.size(), s8, codes.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f);
  const int want8[] = {127, 0, 2, 2, 0, -2, 3, -127};
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(static_cast<int8_t>(codes[i]), want8[i]) << i;
  // int4: max 7 -> scale 1.
  const std::vector<float> y = {7.0f, -7.0f, 2.5f, -3.0f, 0.0f};
  const QuantSpec s4{4, 6};
  std::vector<uint8_t> c4(quant_code_bytes(y.size(), s4));
  ASSERT_EQ(c4.size(), 3u);
  quantize(y.data(), WorkDtype::F32, y.size(), s4, c4.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(c4[0], 0x97);  // 7 low, -7 (0x9) high
  EXPECT_EQ(c4[1], 0xD2);  // 2 low, -3 (0xD) high
  EXPECT_EQ(c4[2], 0x00);  // 0 and the padding
}

TEST(QuantKernels, SameBitsWhateverTheThreads) {
  const size_t n = (size_t{1} << 20) + 37;
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  for (int bits : {8, 4}) {
    const QuantSpec s{bits, 256};
    set_num_threads(1);
    const auto one = round_trip(encode(x, WorkDtype::BF16), WorkDtype::BF16, n, s);
    set_num_threads(4);
    const auto four = round_trip(encode(x, WorkDtype::BF16), WorkDtype::BF16, n, s);
    set_num_threads(0);
    EXPECT_EQ(one.codes, four.codes);
    EXPECT_EQ(0, std::memcmp(one.scales.data(), four.scales.data(), one.scales.size() * 4));
    EXPECT_EQ(one.deq, four.deq);
  }
}

// The AVX2 kernels (int8 codes of fp32 and bf16) against the scalar loops,
// bit for bit: codes (padding included), scales and dequantized bytes, on
// random data over many magnitudes with subnormals, zeros, all-zero
// blocks and blocks holding an inf or a NaN; dequantize also on random
// codes with random, zero, subnormal, inf and NaN scales.
// Restores the engine's SIMD path when a test that switches it ends.
struct RestoreSimdPath {
  SimdPath p = simd_path_id();
  ~RestoreSimdPath() { set_simd_path_for_testing(p); }
};

// Inputs for the AVX2-vs-scalar tests: each block gets its own magnitude
// (subnormal to near overflow), some are all zero, and a few values are
// subnormal, zero, inf or NaN (with payloads).
struct BlockGen {
  std::mt19937 rng{11};
  std::uniform_real_distribution<float> mant{-1.0f, 1.0f};
  std::uniform_int_distribution<int> kind{0, 99};
  std::uniform_int_distribution<uint32_t> word;

  // Magnitudes 2^lo to 2^hi.
  std::vector<float> values(size_t n, size_t block, int lo = -149, int hi = 128) {
    std::uniform_int_distribution<int> expo(lo, hi);
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> x(n);
    for (size_t first = 0; first < n; first += block) {
      const int e = expo(rng);
      const int bk = kind(rng);
      const size_t len = std::min(block, n - first);
      for (size_t j = 0; j < len; ++j) {
        float v = std::ldexp(mant(rng), e);
        if (bk < 5) v = 0.0f;  // all-zero block
        const int k = kind(rng);
        if (k == 0) v = std::ldexp(mant(rng), -140);  // fp32 subnormal
        if (k == 1) v = std::ldexp(mant(rng), -20);   // fp16 subnormal for small blocks
        if (k == 2) v = -0.0f;
        if (bk >= 95 && k == 3) v = inf;
        if (bk >= 95 && k == 4) v = bits_float(0x7f800000u | (word(rng) & 0x7fffffu) | 1u);  // NaN
        if (bk >= 95 && k == 5) v = -inf;
        x[j + first] = v;
      }
    }
    return x;
  }
  // Scales for dequantize on its own: zero, subnormal, inf, NaNs of both
  // signs with payloads, any magnitude.
  std::vector<float> scales(size_t nb) {
    std::vector<float> out(nb);
    for (auto& v : out) {
      const int k = kind(rng);
      v = k < 3    ? 0.0f
          : k < 6  ? std::ldexp(mant(rng), -140)
          : k < 8  ? std::numeric_limits<float>::infinity()
          : k < 10 ? bits_float(0x7f800000u | (word(rng) & 0x807fffffu) | 1u)
                   : std::ldexp(mant(rng), std::uniform_int_distribution<int>(-149, 128)(rng));
    }
    return out;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  // memcmp of an empty vector's null data is undefined
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

const size_t kBitwiseBlocks[] = {2, 4, 6, 8, 30, 256, 2048};
const size_t kBitwiseSizes[] = {0, 1, 7, 29, 255, 256, 257, 1000003};

// The AVX2 kernels (every dtype, int8 and int4) give the scalar loops'
// codes, scales and dequantized bits.
TEST(QuantKernels, Avx2MatchesScalarBitwise) {
  if (!simd_path_available(SimdPath::Avx2))
    GTEST_SKIP() << "the AVX2 path is not available on this machine";
  RestoreSimdPath restore;
  BlockGen gen;
  std::uniform_int_distribution<int> byte(0, 255);
  size_t cases = 0;
  for (const WorkDtype t : {WorkDtype::F32, WorkDtype::BF16, WorkDtype::F16}) {
    for (const int bits : {8, 4}) {
      for (const size_t block : kBitwiseBlocks) {
        for (const size_t n : kBitwiseSizes) {
          const QuantSpec s{bits, block};
          const size_t nb = quant_blocks(n, s);
          // fp16: mostly magnitudes it holds, subnormal to overflow.
          auto src = encode(t == WorkDtype::F16 ? gen.values(n, block, -28, 17) : gen.values(n, block), t);
          // 16-bit NaNs and infs with payloads the conversion from fp32 cannot make.
          if (t != WorkDtype::F32) {
            for (size_t i = 0; i + 97 < n; i += 4099) {
              const uint16_t h = t == WorkDtype::F16 ? 0x7c01 + i % 0x3ff : 0x7f81 + i % 0x7f;
              const uint16_t sign = (i & 1) ? 0x8000 : 0;
              const uint16_t v = static_cast<uint16_t>(sign | (i % 3 == 0 ? h & 0xfc00 : h));
              std::memcpy(src.data() + 2 * i, &v, 2);
            }
          }
          // Random codes and scales for dequantize on its own.
          std::vector<uint8_t> rcodes(quant_code_bytes(n, s));
          for (auto& c : rcodes) c = static_cast<uint8_t>(byte(gen.rng));
          const std::vector<float> rscales = gen.scales(nb);
          Round r[2];
          std::vector<uint8_t> rdeq[2];
          const SimdPath paths[2] = {SimdPath::Scalar, SimdPath::Avx2};
          for (int p = 0; p < 2; ++p) {
            ASSERT_TRUE(set_simd_path_for_testing(paths[p]));
            r[p] = round_trip(src, t, n, s);
            rdeq[p].assign(n * esize(t), 0xCD);
            dequantize(rcodes.data(), rscales.data(), n, s, rdeq[p].data(), t);
          }
          const std::string what = std::string(dname(t)) + " int" + std::to_string(bits) +
                                   " block " + std::to_string(block) + " n " + std::to_string(n);
          EXPECT_EQ(r[0].codes, r[1].codes) << what;
          EXPECT_TRUE(same_bits(r[0].scales, r[1].scales)) << what;
          EXPECT_EQ(r[0].deq, r[1].deq) << what;
          EXPECT_EQ(rdeq[0], rdeq[1]) << what << " (random codes and scales)";
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 3u * 2u * std::size(kBitwiseBlocks) * std::size(kBitwiseSizes));
}

// The AVX2 LoCo kernel gives the scalar loop's codes, scales and errors.
TEST(QuantKernels, Avx2LocoMatchesScalarBitwise) {
  if (!simd_path_available(SimdPath::Avx2))
    GTEST_SKIP() << "the AVX2 path is not available on this machine";
  RestoreSimdPath restore;
  BlockGen gen;
  const float betas[] = {0.9f, 0.0f, 1.0f, 0.37f};
  size_t cases = 0;
  for (const int bits : {8, 4}) {
    for (const size_t block : kBitwiseBlocks) {
      for (const size_t n : kBitwiseSizes) {
        const QuantSpec s{bits, block};
        const float beta = betas[cases % std::size(betas)];
        const std::vector<float> g = gen.values(n, block);
        std::vector<float> e0 = gen.values(n, block);
        // Errors small beside the gradient, as after a step, except in
        // every third case where they are of any size.
        if (cases % 3 != 0)
          for (size_t i = 0; i < n; ++i) e0[i] = f_mul(e0[i], 0x1p-8f);
        std::vector<uint8_t> codes[2];
        std::vector<float> scales[2], err[2];
        const SimdPath paths[2] = {SimdPath::Scalar, SimdPath::Avx2};
        for (int p = 0; p < 2; ++p) {
          ASSERT_TRUE(set_simd_path_for_testing(paths[p]));
          codes[p].assign(quant_code_bytes(n, s), 0xAB);
          scales[p].assign(quant_blocks(n, s), -1.0f);
          err[p] = e0;
          quantize_with_error(g.data(), err[p].data(), beta, n, s, codes[p].data(),
                              scales[p].data());
        }
        const std::string what = "int" + std::to_string(bits) + " block " +
                                 std::to_string(block) + " n " + std::to_string(n);
        EXPECT_EQ(codes[0], codes[1]) << what;
        EXPECT_TRUE(same_bits(scales[0], scales[1])) << what;
        EXPECT_TRUE(same_bits(err[0], err[1])) << what;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 2u * std::size(kBitwiseBlocks) * std::size(kBitwiseSizes));
}

TEST(QuantKernels, SpecValidity) {
  EXPECT_TRUE(quant_spec_valid({8, 256}));
  EXPECT_TRUE(quant_spec_valid({4, 2048}));
  EXPECT_TRUE(quant_spec_valid({4, 2}));
  EXPECT_FALSE(quant_spec_valid({4, 3}));
  EXPECT_FALSE(quant_spec_valid({8, 0}));
  EXPECT_FALSE(quant_spec_valid({2, 256}));
  EXPECT_FALSE(quant_spec_valid({16, 256}));
  EXPECT_EQ(quant_code_bytes(257, {8, 256}), 512u);
  EXPECT_EQ(quant_code_bytes(257, {4, 256}), 256u);
  EXPECT_EQ(quant_blocks(0, {8, 256}), 0u);
}

}  // namespace
}  // namespace zs::kernels
