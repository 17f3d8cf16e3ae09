// CPU optimizer kernels: every SIMD path available on this machine against
// the scalar reference, the reference against torch's formulas computed in
// double, thread-count independence, the gradient-path reductions and casts,
// and the thread pool (including use after fork()).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/convert.h"
#include "kernels/optim.h"
#include "kernels/parallel.h"
#include "tests/support/optim_cases.h"

namespace zs::kernels {
namespace {

using zs::test::kWorks;
using zs::test::normal;
using zs::test::wdt;
using zs::test::Work;
using zs::test::work_name;

std::vector<SimdPath> available_paths() {
  std::vector<SimdPath> out;
  for (SimdPath p : {SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512})
    if (simd_path_available(p)) out.push_back(p);
  return out;
}

// Restores the SIMD path and the thread count a test changed.
struct KernelStateGuard {
  SimdPath path = simd_path_id();
  ~KernelStateGuard() {
    set_simd_path_for_testing(path);
    set_num_threads(0);
  }
};

const size_t kOddSizes[] = {0, 1, 7, 63, 64, 65, 1000};
constexpr size_t kBig = 1000003;

double rel_diff(float a, float b) {
  if (a == b) return 0.0;
  const double d = std::fabs(static_cast<double>(a) - static_cast<double>(b));
  const double m = std::max({std::fabs(static_cast<double>(a)), std::fabs(static_cast<double>(b)),
                             static_cast<double>(std::numeric_limits<float>::min())});
  return d / m;
}

// Elements whose bits differ. The vector paths do the reference's
// operations in the same order without contraction, so this is 0.
size_t bit_mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  size_t c = 0;
  for (size_t i = 0; i < a.size(); ++i) c += float_bits(a[i]) != float_bits(b[i]);
  return c;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, rel_diff(a[i], b[i]));
  return m;
}

// Distance in units in the last place between two 16-bit floats of the
// same format (both orderings map sign-magnitude onto a line).
int ulp16(uint16_t a, uint16_t b) {
  auto ord = [](uint16_t h) { return (h & 0x8000) ? -static_cast<int>(h & 0x7fff) : static_cast<int>(h); };
  return std::abs(ord(a) - ord(b));
}

uint16_t to16(float x, WorkDtype t) { return t == WorkDtype::BF16 ? float_to_bf16(x) : float_to_fp16(x); }

// A working buffer: raw bytes of n elements of the dtype.
struct WorkBuf {
  Work w;
  std::vector<uint8_t> bytes;
  WorkBuf(Work w_, size_t n) : w(w_), bytes(w_ == Work::None ? 0 : n * (w_ == Work::F32 ? 4 : 2) + 1) {}
  void* ptr() { return w == Work::None ? nullptr : bytes.data(); }
  float f32(size_t i) const {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h16(size_t i) const {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return h;
  }
};

// The working copy equals the rounding of the master it came from, and is
// within 1 ulp of the rounding of the reference master.
void expect_working(const WorkBuf& wb, const std::vector<float>& master,
                    const std::vector<float>& ref_master, const std::string& what) {
  if (wb.w == Work::None) return;
  size_t bad_own = 0, bad_ref = 0;
  for (size_t i = 0; i < master.size(); ++i) {
    if (wb.w == Work::F32) {
      bad_own += float_bits(wb.f32(i)) != float_bits(master[i]);
      bad_ref += rel_diff(wb.f32(i), ref_master[i]) > 1e-6;
    } else {
      const WorkDtype t = wdt(wb.w);
      bad_own += wb.h16(i) != to16(master[i], t);
      bad_ref += ulp16(wb.h16(i), to16(ref_master[i], t)) > 1;
    }
  }
  EXPECT_EQ(bad_own, 0u) << what << ": working copy differs from the rounding of its master";
  EXPECT_EQ(bad_ref, 0u) << what << ": working copy more than 1 ulp from the reference's";
}

using zs::test::AdamCase;
using zs::test::kAdamCases;

std::string adam_case_name(const AdamCase& c) {
  return std::string(c.adamw ? "adamw" : "adam-l2") + " wd=" + std::to_string(c.wd) +
         (c.bias ? " bias" : " no-bias") + " beta1=" + std::to_string(c.beta1);
}

// Runs `steps` updates on the current path and on the scalar reference from
// the same start, and compares.
void compare_adam(size_t n, Work w, const AdamCase& ac, int steps, float grad_scale) {
  const std::string what = "adam n=" + std::to_string(n) + " work=" + work_name(w) + " " +
                           adam_case_name(ac) + " path=" + simd_path();
  std::vector<float> p = normal(n, 1), m(n, 0.0f), v(n, 0.0f);
  std::vector<float> rp = p, rm = m, rv = v;
  WorkBuf wb(w, n), rwb(w, n);
  for (int s = 1; s <= steps; ++s) {
    const std::vector<float> g = normal(n, 100 + static_cast<uint32_t>(s), 3.0f);
    const AdamHyper h{1e-3f, ac.beta1, 0.999f, 1e-8f, ac.wd, ac.adamw, ac.bias, s};
    adam_step(p.data(), m.data(), v.data(), g.data(), n, h, grad_scale, wb.ptr(), wdt(w));
    adam_step_scalar(rp.data(), rm.data(), rv.data(), g.data(), n, h, grad_scale, rwb.ptr(), wdt(w));
  }
  EXPECT_LE(max_rel_diff(p, rp), 1e-6) << what << ": master";
  EXPECT_LE(max_rel_diff(m, rm), 1e-6) << what << ": exp_avg";
  EXPECT_LE(max_rel_diff(v, rv), 1e-6) << what << ": exp_avg_sq";
  EXPECT_EQ(bit_mismatches(p, rp) + bit_mismatches(m, rm) + bit_mismatches(v, rv), 0u) << what;
  expect_working(wb, p, rp, what);
  if (n > 0) {
    // And the update did something.
    const std::vector<float> p0 = normal(n, 1);
    EXPECT_NE(p0[0], p[0]) << what;
  }
}

using zs::test::SgdCase;
using zs::test::kSgdCases;

std::string sgd_case_name(const SgdCase& c) {
  return "mom=" + std::to_string(c.momentum) + " damp=" + std::to_string(c.dampening) +
         " wd=" + std::to_string(c.wd) + (c.nesterov ? " nesterov" : "");
}

void compare_sgd(size_t n, Work w, const SgdCase& sc, int steps, float grad_scale) {
  const std::string what = "sgd n=" + std::to_string(n) + " work=" + work_name(w) + " " +
                           sgd_case_name(sc) + " path=" + simd_path();
  std::vector<float> p = normal(n, 2), buf(n, 0.0f);
  std::vector<float> rp = p, rbuf = buf;
  WorkBuf wb(w, n), rwb(w, n);
  const bool mom = sc.momentum != 0.0f;
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> g = normal(n, 200 + static_cast<uint32_t>(s));
    const SgdHyper h{0.05f, sc.momentum, sc.dampening, sc.wd, sc.nesterov, s == 0};
    sgd_step(p.data(), mom ? buf.data() : nullptr, g.data(), n, h, grad_scale, wb.ptr(), wdt(w));
    sgd_step_scalar(rp.data(), mom ? rbuf.data() : nullptr, g.data(), n, h, grad_scale, rwb.ptr(),
                    wdt(w));
  }
  EXPECT_LE(max_rel_diff(p, rp), 1e-6) << what << ": master";
  EXPECT_LE(max_rel_diff(buf, rbuf), 1e-6) << what << ": momentum buffer";
  EXPECT_EQ(bit_mismatches(p, rp) + bit_mismatches(buf, rbuf), 0u) << what;
  expect_working(wb, p, rp, what);
}

class KernelsOptimPath : public ::testing::TestWithParam<SimdPath> {
 protected:
  void SetUp() override { ASSERT_TRUE(set_simd_path_for_testing(GetParam())); }
  KernelStateGuard guard_;
};

TEST_P(KernelsOptimPath, AdamMatchesReferenceOddSizes) {
  for (size_t n : kOddSizes)
    for (Work w : kWorks)
      for (const AdamCase& ac : kAdamCases) compare_adam(n, w, ac, 10, 0.37f);
}

TEST_P(KernelsOptimPath, AdamMatchesReferenceLarge) {
  // Multi-threaded (n >= 64K) with a tail after the last full vector.
  compare_adam(kBig, Work::BF16, kAdamCases[0], 3, 0.37f);
  compare_adam(kBig, Work::F16, kAdamCases[4], 3, 1.0f);
  compare_adam(kBig, Work::F32, kAdamCases[1], 3, 2.5f);
  compare_adam(kBig, Work::None, kAdamCases[5], 3, 1.0f / 1024);
}

TEST_P(KernelsOptimPath, SgdMatchesReferenceOddSizes) {
  for (size_t n : kOddSizes)
    for (Work w : kWorks)
      for (const SgdCase& sc : kSgdCases) compare_sgd(n, w, sc, 10, 0.37f);
}

TEST_P(KernelsOptimPath, SgdMatchesReferenceLarge) {
  compare_sgd(kBig, Work::BF16, kSgdCases[3], 3, 0.37f);
  compare_sgd(kBig, Work::F16, kSgdCases[5], 3, 1.0f);
  compare_sgd(kBig, Work::None, kSgdCases[0], 3, 4.0f);
}

TEST_P(KernelsOptimPath, SumSquaresMatchesDoubleLoop) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{63}, size_t{64}, size_t{65},
                   size_t{1000}, size_t{70001}, kBig}) {
    const std::vector<float> x = normal(n, 3, 5.0f);
    double want = 0.0;
    for (float f : x) want += static_cast<double>(f) * f;
    const double got = sum_squares(x.data(), n);
    EXPECT_NEAR(got, want, 1e-12 * want) << "n=" << n << " path=" << simd_path();
  }
}

// The fused write + sum of squares of a gradient shard: the values each
// mode writes, and a sum with the very bits sum_squares finds over them
// afterwards (the step's norm relies on it), on one thread and on many.
TEST_P(KernelsOptimPath, StoreSumSquaresWritesAndSumsAsSumSquares) {
  for (int threads : {1, 0}) {
    set_num_threads(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17},
                     size_t{31}, size_t{33}, size_t{8191}, size_t{8193}, size_t{70001}, kBig}) {
      const std::vector<float> src = normal(n, 11, 3.0f);
      const std::vector<float> old = normal(n, 12, 2.0f);
      for (StoreMode mode : {StoreMode::Add, StoreMode::Assign, StoreMode::Copy}) {
        std::vector<float> dst = old;
        const double got = store_sum_squares(dst.data(), src.data(), n, mode);
        for (size_t i = 0; i < n; ++i) {
          const float want = mode == StoreMode::Add ? old[i] + src[i] : src[i];
          ASSERT_EQ(dst[i], want) << "n=" << n << " i=" << i << " mode=" << static_cast<int>(mode);
        }
        const double sum = sum_squares(dst.data(), n);
        EXPECT_EQ(std::memcmp(&got, &sum, sizeof got), 0)
            << "n=" << n << " mode=" << static_cast<int>(mode) << " threads=" << threads
            << " path=" << simd_path() << ": " << got << " vs " << sum;
      }
    }
  }
}

// Assign is what adding into zeros gives: -0 becomes +0 (so a shard that
// is not zeroed first ends as it would have), Copy keeps it; an inf or NaN
// anywhere, the tail included, leaves the sum non-finite.
TEST_P(KernelsOptimPath, StoreSumSquaresSignedZerosAndNonFinite) {
  for (size_t n : {size_t{1}, size_t{40}, size_t{100}}) {
    std::vector<float> src(n, -0.0f), dst(n, 5.0f);
    EXPECT_EQ(store_sum_squares(dst.data(), src.data(), n, StoreMode::Assign), 0.0);
    for (float d : dst) ASSERT_FALSE(std::signbit(d)) << "n=" << n << " path=" << simd_path();
    EXPECT_EQ(store_sum_squares(dst.data(), src.data(), n, StoreMode::Copy), 0.0);
    for (float d : dst) ASSERT_TRUE(std::signbit(d)) << "n=" << n << " path=" << simd_path();
    for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      for (size_t at : {size_t{0}, n / 2, n - 1}) {
        std::vector<float> s = normal(n, 13), d(n, 0.0f);
        s[at] = bad;
        for (StoreMode mode : {StoreMode::Add, StoreMode::Assign, StoreMode::Copy})
          EXPECT_FALSE(std::isfinite(store_sum_squares(d.data(), s.data(), n, mode)))
              << "n=" << n << " at " << at << " path=" << simd_path();
      }
    }
  }
}

TEST_P(KernelsOptimPath, AllFiniteFindsOneBadValueAnywhere) {
  const float bads[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::signaling_NaN()};
  for (size_t n : {size_t{1}, size_t{7}, size_t{31}, size_t{33}, size_t{63}, size_t{64}, size_t{65},
                   size_t{100}, kBig}) {
    std::vector<float> x = normal(n, 4);
    // Extremes that are finite.
    x[0] = std::numeric_limits<float>::max();
    if (n > 1) x[n - 1] = -std::numeric_limits<float>::max();
    if (n > 2) x[n / 2] = std::numeric_limits<float>::denorm_min();
    ASSERT_TRUE(all_finite(x.data(), n)) << "n=" << n;
    std::set<size_t> where;
    if (n <= 100) {
      for (size_t i = 0; i < n; ++i) where.insert(i);
    } else {
      for (size_t i : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{31}, size_t{32}, n / 2,
                       size_t{65535}, size_t{65536}})
        where.insert(i);
      for (size_t i = n - 70; i < n; ++i) where.insert(i);  // the last vectors and the tail
    }
    for (size_t i : where) {
      for (float bad : bads) {
        const float keep = x[i];
        x[i] = bad;
        EXPECT_FALSE(all_finite(x.data(), n)) << "n=" << n << " at " << i << " path=" << simd_path();
        x[i] = keep;
      }
    }
    EXPECT_TRUE(all_finite(x.data(), n));
  }
  EXPECT_TRUE(all_finite(nullptr, 0));
}

TEST_P(KernelsOptimPath, ScaleInplace) {
  for (size_t n : {size_t{0}, size_t{7}, size_t{65}, kBig}) {
    std::vector<float> y = normal(n, 5);
    scale_inplace(y.data(), n, 0.3f);
    const std::vector<float> y0 = normal(n, 5);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(float_bits(y[i]), float_bits(y0[i] * 0.3f)) << i;
  }
}

// Bit patterns: specials, every exponent with edge mantissas, halfway
// cases of both 16-bit formats, and a stride over all 2^32 patterns.
std::vector<float> cast_inputs() {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0xffc00000u, 0x7f800001u, 0x7fbfffffu, 0xff800001u, 0x00000001u,
                                0x807fffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x477ff001u,
                                0x33000000u, 0x33000001u, 0x387fc000u, 0x38800000u, 0x7f7fffffu};
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t m : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u, 0xfffu, 0x1000u, 0x1001u,
                       0x3000u, 0x7fffffu, 0x400000u})
      for (uint32_t s : {0u, 0x80000000u}) bits.push_back(s | (e << 23) | m);
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4093) bits.push_back(static_cast<uint32_t>(u));
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bits_float(bits[i]);
  return out;
}

TEST_P(KernelsOptimPath, CastFromF32MatchesScalarConversions) {
  const std::vector<float> x = cast_inputs();
  for (size_t n : {x.size(), size_t{1}, size_t{7}, size_t{63}, size_t{65}}) {
    std::vector<uint16_t> bf(n + 1, 0xabcd), hf(n + 1, 0xabcd);
    std::vector<float> f(n + 1, 1.5f);
    cast_from_f32(x.data(), bf.data(), WorkDtype::BF16, n);
    cast_from_f32(x.data(), hf.data(), WorkDtype::F16, n);
    cast_from_f32(x.data(), f.data(), WorkDtype::F32, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      bad += bf[i] != float_to_bf16(x[i]);
      bad += hf[i] != float_to_fp16(x[i]);
      bad += float_bits(f[i]) != float_bits(x[i]);
    }
    EXPECT_EQ(bad, 0u) << "n=" << n << " path=" << simd_path();
    EXPECT_EQ(bf[n], 0xabcd);  // nothing written past the end
    EXPECT_EQ(hf[n], 0xabcd);
    EXPECT_EQ(f[n], 1.5f);
  }
}

TEST_P(KernelsOptimPath, CastToF32AndAddToF32AllPatterns) {
  std::vector<uint16_t> h(65536 + 9);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i * 40503u);  // odd multiplier: a permutation
  const size_t n = h.size();
  for (WorkDtype t : {WorkDtype::BF16, WorkDtype::F16}) {
    std::vector<float> out(n);
    cast_to_f32(h.data(), t, out.data(), n);
    std::vector<float> acc = normal(n, 6), acc0 = acc;
    add_to_f32(h.data(), t, acc.data(), n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const float want = t == WorkDtype::BF16 ? bf16_to_float(h[i]) : fp16_to_float(h[i]);
      if (std::isnan(want)) {
        bad += !std::isnan(out[i]) + !std::isnan(acc[i]);  // hardware may quiet a signalling NaN
      } else {
        bad += float_bits(out[i]) != float_bits(want);
        bad += float_bits(acc[i]) != float_bits(acc0[i] + want);
      }
    }
    EXPECT_EQ(bad, 0u) << (t == WorkDtype::BF16 ? "bf16" : "f16") << " path=" << simd_path();
  }
  // F32 source.
  const std::vector<float> src = normal(1001, 7);
  std::vector<float> out(1001), acc = normal(1001, 8), acc0 = acc;
  cast_to_f32(src.data(), WorkDtype::F32, out.data(), 1001);
  add_to_f32(src.data(), WorkDtype::F32, acc.data(), 1001);
  for (size_t i = 0; i < 1001; ++i) {
    ASSERT_EQ(out[i], src[i]);
    ASSERT_EQ(acc[i], acc0[i] + src[i]);
  }
}

TEST_P(KernelsOptimPath, CastRoundTrips) {
  // Every non-NaN 16-bit value survives widen -> narrow; fp32 -> 16 -> fp32
  // equals the scalar rounding.
  for (WorkDtype t : {WorkDtype::BF16, WorkDtype::F16}) {
    std::vector<uint16_t> h;
    for (uint32_t u = 0; u < 65536; ++u) {
      const float f = t == WorkDtype::BF16 ? bf16_to_float(static_cast<uint16_t>(u))
                                           : fp16_to_float(static_cast<uint16_t>(u));
      if (!std::isnan(f)) h.push_back(static_cast<uint16_t>(u));
    }
    std::vector<float> f(h.size());
    std::vector<uint16_t> back(h.size());
    cast_to_f32(h.data(), t, f.data(), h.size());
    cast_from_f32(f.data(), back.data(), t, h.size());
    EXPECT_EQ(back, h) << simd_path();

    const std::vector<float> x = normal(kBig, 9, 100.0f);
    std::vector<uint16_t> mid(kBig);
    std::vector<float> y(kBig);
    cast_from_f32(x.data(), mid.data(), t, kBig);
    cast_to_f32(mid.data(), t, y.data(), kBig);
    size_t bad = 0;
    for (size_t i = 0; i < kBig; ++i) {
      const float want = t == WorkDtype::BF16 ? bf16_to_float(float_to_bf16(x[i]))
                                              : fp16_to_float(float_to_fp16(x[i]));
      bad += float_bits(y[i]) != float_bits(want);
    }
    EXPECT_EQ(bad, 0u) << simd_path();
  }
}

std::string path_param_name(const ::testing::TestParamInfo<SimdPath>& info) {
  return simd_path_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Available, KernelsOptimPath, ::testing::ValuesIn(available_paths()),
                         path_param_name);

// ---- the reference against torch's formulas, in double ---------------------

struct TorchAdamRef {
  std::vector<double> p, m, v;
};

// torch.optim.Adam / AdamW single-tensor formulas, textbook form, double.
void torch_adam_double(TorchAdamRef& r, const std::vector<float>& graw, double scale, double lr,
                       double b1, double b2, double eps, double wd, bool adamw, bool bias, int step) {
  for (size_t i = 0; i < r.p.size(); ++i) {
    double g = graw[i] * scale;
    if (wd != 0.0) {
      if (adamw)
        r.p[i] *= 1.0 - lr * wd;
      else
        g += wd * r.p[i];
    }
    r.m[i] = b1 * r.m[i] + (1.0 - b1) * g;
    r.v[i] = b2 * r.v[i] + (1.0 - b2) * g * g;
    const double bc1 = bias ? 1.0 - std::pow(b1, step) : 1.0;
    const double bc2 = bias ? 1.0 - std::pow(b2, step) : 1.0;
    const double denom = std::sqrt(r.v[i]) / std::sqrt(bc2) + eps;
    r.p[i] -= lr / bc1 * r.m[i] / denom;
  }
}

void check_against_torch_adam(bool adamw, bool bias, float beta1) {
  KernelStateGuard guard;
  const std::vector<float> p0 = {0.5f, -1.25f, 2.0f, 0.0f, 3.0e-3f};
  const std::vector<std::vector<float>> grads = {{0.1f, -0.2f, 0.3f, 1.0f, -4.0f},
                                                 {0.05f, 0.2f, -0.3f, 1.0f, 2.0f},
                                                 {-0.4f, 0.0f, 0.6f, -2.0f, 1.0e-3f},
                                                 {0.7f, -0.1f, 0.2f, 0.5f, -0.5f}};
  const float lr = 1e-2f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, scale = 0.5f;
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    std::vector<float> p = p0, m(p0.size(), 0.0f), v(p0.size(), 0.0f);
    TorchAdamRef r{{p0.begin(), p0.end()}, std::vector<double>(p0.size()), std::vector<double>(p0.size())};
    for (int s = 1; s <= static_cast<int>(grads.size()); ++s) {
      const AdamHyper h{lr, beta1, b2, eps, wd, adamw, bias, s};
      adam_step(p.data(), m.data(), v.data(), grads[static_cast<size_t>(s - 1)].data(), p.size(), h,
                scale, nullptr, WorkDtype::F32);
      torch_adam_double(r, grads[static_cast<size_t>(s - 1)], scale, lr, beta1, b2, eps, wd, adamw,
                        bias, s);
      for (size_t i = 0; i < p.size(); ++i) {
        EXPECT_NEAR(p[i], r.p[i], 2e-6 * std::max(1.0, std::fabs(r.p[i])))
            << "step " << s << " i " << i << " adamw=" << adamw << " bias=" << bias << " path=" << simd_path();
        EXPECT_NEAR(m[i], r.m[i], 1e-6 * std::max(1e-3, std::fabs(r.m[i]))) << "step " << s << " i " << i;
        EXPECT_NEAR(v[i], r.v[i], 1e-6 * std::max(1e-6, std::fabs(r.v[i]))) << "step " << s << " i " << i;
      }
    }
  }
}

TEST(KernelsOptimTorch, AdamWMatchesTorchFormulas) { check_against_torch_adam(true, true, 0.9f); }
TEST(KernelsOptimTorch, AdamL2MatchesTorchFormulas) { check_against_torch_adam(false, true, 0.9f); }
TEST(KernelsOptimTorch, AdamNoBiasCorrectionMatchesFormulas) { check_against_torch_adam(true, false, 0.9f); }
TEST(KernelsOptimTorch, AdamSmallBeta1MatchesTorchFormulas) { check_against_torch_adam(false, true, 0.25f); }

TEST(KernelsOptimTorch, AdamWFirstStepIsSignTimesLr) {
  // With zero state, step 1 moves each param by lr * sign(g) (eps aside),
  // after the decoupled decay p *= 1 - lr*wd: values checked by hand.
  std::vector<float> p = {1.0f, -2.0f}, m(2, 0.0f), v(2, 0.0f);
  const std::vector<float> g = {3.0f, 0.5f};
  const AdamHyper h{0.1f, 0.9f, 0.999f, 0.0f, 0.5f, true, true, 1};
  adam_step(p.data(), m.data(), v.data(), g.data(), 2, h, 1.0f, nullptr, WorkDtype::F32);
  EXPECT_NEAR(p[0], 1.0 * 0.95 - 0.1, 1e-6);
  EXPECT_NEAR(p[1], -2.0 * 0.95 - 0.1, 1e-6);
  EXPECT_NEAR(m[0], 0.3, 1e-6);
  EXPECT_NEAR(v[1], (1.0 - static_cast<double>(0.999f)) * 0.25, 1e-12);
}

void check_against_torch_sgd(float momentum, float dampening, float wd, bool nesterov) {
  KernelStateGuard guard;
  const std::vector<float> p0 = {0.5f, -1.25f, 2.0f, 0.0f, 3.0e-3f};
  const std::vector<std::vector<float>> grads = {{0.1f, -0.2f, 0.3f, 1.0f, -4.0f},
                                                 {0.05f, 0.2f, -0.3f, 1.0f, 2.0f},
                                                 {-0.4f, 0.0f, 0.6f, -2.0f, 1.0e-3f}};
  const double lr = 0.1f, scale = 2.0f;
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    std::vector<float> p = p0, buf(p0.size(), 0.0f);
    std::vector<double> rp(p0.begin(), p0.end()), rbuf(p0.size(), 0.0);
    for (size_t s = 0; s < grads.size(); ++s) {
      const SgdHyper h{static_cast<float>(lr), momentum, dampening, wd, nesterov, s == 0};
      sgd_step(p.data(), momentum != 0.0f ? buf.data() : nullptr, grads[s].data(), p.size(), h,
               static_cast<float>(scale), nullptr, WorkDtype::F32);
      for (size_t i = 0; i < p.size(); ++i) {  // torch.optim.SGD, single tensor
        double d = grads[s][i] * scale;
        if (wd != 0.0f) d += static_cast<double>(wd) * rp[i];
        if (momentum != 0.0f) {
          rbuf[i] = s == 0 ? d : static_cast<double>(momentum) * rbuf[i] + (1.0 - dampening) * d;
          d = nesterov ? d + static_cast<double>(momentum) * rbuf[i] : rbuf[i];
        }
        rp[i] -= lr * d;
        EXPECT_NEAR(p[i], rp[i], 1e-6 * std::max(1.0, std::fabs(rp[i]))) << "step " << s << " i " << i;
        if (momentum != 0.0f) { EXPECT_NEAR(buf[i], rbuf[i], 1e-6 * std::max(1.0, std::fabs(rbuf[i]))); }
      }
    }
  }
}

TEST(KernelsOptimTorch, SgdPlainMatchesTorchFormulas) { check_against_torch_sgd(0.0f, 0.0f, 0.0f, false); }
TEST(KernelsOptimTorch, SgdMomentumDampeningMatchesTorchFormulas) {
  check_against_torch_sgd(0.9f, 0.1f, 0.01f, false);
}
TEST(KernelsOptimTorch, SgdNesterovMatchesTorchFormulas) { check_against_torch_sgd(0.9f, 0.0f, 0.05f, true); }

// ---- the multi-tensor step ---------------------------------------------------

// adam_step_many over tensors of odd sizes (empty, one element, under and
// over the parallel grain, a million), each its own hyper-parameters and
// step and some with a working copy, equals adam_step on each in turn bit
// for bit, on every SIMD path and at 1, 2 and 3 threads.
TEST(KernelsOptimMany, AdamStepManyEqualsEachTensorsAdamStep) {
  KernelStateGuard guard;
  const size_t sizes[] = {0, 1, 63, 1000, 0, 32767, 65, 70001, kBig, 5};
  const size_t count = sizeof(sizes) / sizeof(sizes[0]);
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      struct T {
        std::vector<float> p, m, v, g;
        std::vector<uint16_t> w;
      };
      auto fresh = [&] {
        std::vector<T> ts;
        for (size_t i = 0; i < count; ++i) {
          const auto seed = static_cast<uint32_t>(10 * i);
          T t{normal(sizes[i], seed + 1), normal(sizes[i], seed + 2, 0.1f), normal(sizes[i], seed + 3, 0.1f),
              normal(sizes[i], seed + 4), std::vector<uint16_t>(i % 3 == 0 ? sizes[i] : 0)};
          for (auto& x : t.v) x = x * x;
          ts.push_back(std::move(t));
        }
        return ts;
      };
      auto hyper = [](size_t i) {
        const AdamCase& c = kAdamCases[i % (sizeof(kAdamCases) / sizeof(kAdamCases[0]))];
        return AdamHyper{1e-3f * static_cast<float>(i + 1), c.beta1, 0.999f, 1e-8f, c.wd, c.adamw, c.bias,
                         static_cast<int64_t>(i % 4 + 1)};
      };
      auto work = [](size_t i) { return i % 6 == 0 ? WorkDtype::BF16 : WorkDtype::F16; };
      std::vector<T> each = fresh(), many = fresh();
      std::vector<AdamTensor> list;
      for (size_t i = 0; i < count; ++i) {
        T& a = each[i];
        T& b = many[i];
        void* wa = a.w.empty() ? nullptr : a.w.data();
        adam_step(a.p.data(), a.m.data(), a.v.data(), a.g.data(), sizes[i], hyper(i), 0.37f, wa, work(i));
        list.push_back({b.p.data(), b.m.data(), b.v.data(), b.g.data(), sizes[i], hyper(i),
                        b.w.empty() ? nullptr : b.w.data(), work(i)});
      }
      adam_step_many(list.data(), list.size(), 0.37f);
      for (size_t i = 0; i < count; ++i) {
        const std::string what = "tensor " + std::to_string(i) + " of " + std::to_string(sizes[i]) +
                                 " path=" + simd_path() + " threads=" + std::to_string(threads);
        EXPECT_EQ(bit_mismatches(each[i].p, many[i].p), 0u) << what;
        EXPECT_EQ(bit_mismatches(each[i].m, many[i].m), 0u) << what;
        EXPECT_EQ(bit_mismatches(each[i].v, many[i].v), 0u) << what;
        EXPECT_EQ(each[i].w, many[i].w) << what;
        if (sizes[i] > 0) {
          EXPECT_NE(each[i].p[0], normal(sizes[i], static_cast<uint32_t>(10 * i) + 1)[0]) << what;
        }
      }
    }
  }
  EXPECT_NO_THROW(adam_step_many(nullptr, 0, 1.0f));
  AdamTensor bad{nullptr, nullptr, nullptr, nullptr, 3, AdamHyper{}, nullptr, WorkDtype::F32};
  EXPECT_THROW(adam_step_many(&bad, 1, 1.0f), std::invalid_argument);
}

// sgd_step_many over tensors of odd sizes (0 included, some under and some
// over the parallel grain, a million), each its own case of kSgdCases
// (plain, weight decay, momentum, Nesterov, dampening), its own first step
// (a buffer started from the gradient, or read), a working copy of each
// dtype or none, over two steps, equals sgd_step on each in turn bit for
// bit, on every SIMD path and at 1, 2 and 3 threads.
TEST(KernelsOptimMany, SgdStepManyEqualsEachTensorsSgdStep) {
  KernelStateGuard guard;
  const size_t sizes[] = {0, 1, 63, 1000, 0, 32767, 65, 70001, kBig, 5, 4099, 3};
  const size_t count = sizeof(sizes) / sizeof(sizes[0]);
  const size_t ncases = sizeof(kSgdCases) / sizeof(kSgdCases[0]);
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      struct T {
        std::vector<float> p, buf, g;
        std::vector<uint8_t> w;
      };
      auto work = [](size_t i) { return kWorks[i % 4]; };
      auto fresh = [&] {
        std::vector<T> ts;
        for (size_t i = 0; i < count; ++i) {
          const auto seed = static_cast<uint32_t>(10 * i);
          const Work w = work(i);
          const size_t wbytes = w == Work::None ? 0 : sizes[i] * (w == Work::F32 ? 4 : 2);
          ts.push_back(T{normal(sizes[i], seed + 1), normal(sizes[i], seed + 2, 0.1f), normal(sizes[i], seed + 3),
                         std::vector<uint8_t>(wbytes)});
        }
        return ts;
      };
      // Tensor i's case; on step 0 a tensor of even i starts its buffer.
      auto hyper = [&](size_t i, int step) {
        const SgdCase& c = kSgdCases[i % ncases];
        return SgdHyper{0.05f * static_cast<float>(i + 1), c.momentum, c.dampening, c.wd, c.nesterov,
                        step == 0 && i % 2 == 0};
      };
      std::vector<T> each = fresh(), many = fresh();
      for (int step = 0; step < 2; ++step) {
        std::vector<SgdTensor> list;
        for (size_t i = 0; i < count; ++i) {
          T& a = each[i];
          T& b = many[i];
          const bool mom = kSgdCases[i % ncases].momentum != 0.0f;
          sgd_step(a.p.data(), mom ? a.buf.data() : nullptr, a.g.data(), sizes[i], hyper(i, step), 0.37f,
                   a.w.empty() ? nullptr : a.w.data(), wdt(work(i)));
          list.push_back({b.p.data(), mom ? b.buf.data() : nullptr, b.g.data(), sizes[i], hyper(i, step),
                          b.w.empty() ? nullptr : b.w.data(), wdt(work(i))});
        }
        sgd_step_many(list.data(), list.size(), 0.37f);
      }
      for (size_t i = 0; i < count; ++i) {
        const std::string what = "tensor " + std::to_string(i) + " of " + std::to_string(sizes[i]) +
                                 " work=" + work_name(work(i)) + " path=" + simd_path() +
                                 " threads=" + std::to_string(threads);
        EXPECT_EQ(bit_mismatches(each[i].p, many[i].p), 0u) << what;
        EXPECT_EQ(bit_mismatches(each[i].buf, many[i].buf), 0u) << what;
        EXPECT_EQ(each[i].w, many[i].w) << what;
        if (sizes[i] > 0) {
          EXPECT_NE(each[i].p[0], normal(sizes[i], static_cast<uint32_t>(10 * i) + 1)[0]) << what;
        }
      }
    }
  }
  EXPECT_NO_THROW(sgd_step_many(nullptr, 0, 1.0f));
  EXPECT_THROW(sgd_step_many(nullptr, 1, 1.0f), std::invalid_argument);
  SgdTensor bad{nullptr, nullptr, nullptr, 3, SgdHyper{}, nullptr, WorkDtype::F32};
  EXPECT_THROW(sgd_step_many(&bad, 1, 1.0f), std::invalid_argument);
  std::vector<float> p(3), g(3);
  SgdTensor no_buf{p.data(), nullptr, g.data(), 3, SgdHyper{0.1f, 0.9f, 0.0f, 0.0f, false, false}, nullptr,
                   WorkDtype::F32};
  EXPECT_THROW(sgd_step_many(&no_buf, 1, 1.0f), std::invalid_argument);
}

// adam_step_mixed_many / sgd_step_mixed_many over tensors of odd sizes,
// each its own (master, state) dtype pair of F32 and BF16, its own case and
// step (SGD: its own first step), over two steps, equal adam_step_mixed /
// sgd_step_mixed on each in turn bit for bit, on every SIMD path and at 1,
// 2 and 3 threads.
TEST(KernelsOptimMany, MixedStepsManyEqualEachTensorsMixedStep) {
  KernelStateGuard guard;
  const size_t sizes[] = {0, 1, 63, 1000, 32767, 65, 70001, kBig, 5, 4099, 3, 2};
  const size_t count = sizeof(sizes) / sizeof(sizes[0]);
  const size_t nadam = sizeof(kAdamCases) / sizeof(kAdamCases[0]);
  const size_t nsgd = sizeof(kSgdCases) / sizeof(kSgdCases[0]);
  auto pdt = [](size_t i) { return i % 2 ? WorkDtype::BF16 : WorkDtype::F32; };
  auto sdt = [](size_t i) { return i % 4 >= 2 ? WorkDtype::BF16 : WorkDtype::F32; };
  // n values of dtype t, from normal(n, seed, scale) rounded.
  auto image = [](size_t n, uint32_t seed, float scale, WorkDtype t, bool square) {
    std::vector<float> f = normal(n, seed, scale);
    if (square)
      for (auto& x : f) x = x * x;
    std::vector<uint8_t> out(n * work_dtype_size(t));
    cast_from_f32(f.data(), out.data(), t, n);
    return out;
  };
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      struct T {
        std::vector<uint8_t> p, m, v;
        std::vector<float> g;
      };
      auto fresh = [&] {
        std::vector<T> ts;
        for (size_t i = 0; i < count; ++i) {
          const auto seed = static_cast<uint32_t>(10 * i);
          ts.push_back(T{image(sizes[i], seed + 1, 1.0f, pdt(i), false), image(sizes[i], seed + 2, 0.1f, sdt(i), false),
                         image(sizes[i], seed + 3, 0.1f, sdt(i), true), normal(sizes[i], seed + 4)});
        }
        return ts;
      };
      const std::vector<T> start = fresh();
      std::vector<T> ae = start, am = start, se = start, sm = start;  // adam each / many, sgd each / many
      for (int step = 0; step < 2; ++step) {
        std::vector<AdamMixedTensor> alist;
        std::vector<SgdMixedTensor> slist;
        for (size_t i = 0; i < count; ++i) {
          const AdamCase& c = kAdamCases[i % nadam];
          const AdamHyper ah{1e-3f * static_cast<float>(i + 1), c.beta1, 0.999f, 1e-8f, c.wd, c.adamw, c.bias,
                             static_cast<int64_t>(i % 4 + 1 + step)};
          const SgdCase& d = kSgdCases[i % nsgd];
          const SgdHyper sh{0.05f * static_cast<float>(i + 1), d.momentum, d.dampening, d.wd, d.nesterov,
                            step == 0 && i % 2 == 0};
          const bool mom = d.momentum != 0.0f;
          adam_step_mixed(ae[i].p.data(), pdt(i), ae[i].m.data(), ae[i].v.data(), sdt(i), ae[i].g.data(), sizes[i],
                          ah, 0.37f);
          alist.push_back({am[i].p.data(), pdt(i), am[i].m.data(), am[i].v.data(), sdt(i), am[i].g.data(), sizes[i],
                           ah});
          sgd_step_mixed(se[i].p.data(), pdt(i), mom ? se[i].m.data() : nullptr, sdt(i), se[i].g.data(), sizes[i],
                         sh, 0.37f);
          slist.push_back({sm[i].p.data(), pdt(i), mom ? sm[i].m.data() : nullptr, sdt(i), sm[i].g.data(),
                           sizes[i], sh});
        }
        adam_step_mixed_many(alist.data(), alist.size(), 0.37f);
        sgd_step_mixed_many(slist.data(), slist.size(), 0.37f);
      }
      for (size_t i = 0; i < count; ++i) {
        const std::string what = "tensor " + std::to_string(i) + " of " + std::to_string(sizes[i]) +
                                 " master " + (pdt(i) == WorkDtype::BF16 ? "bf16" : "f32") + " state " +
                                 (sdt(i) == WorkDtype::BF16 ? "bf16" : "f32") + " path=" + simd_path() +
                                 " threads=" + std::to_string(threads);
        EXPECT_EQ(ae[i].p, am[i].p) << "adam master, " << what;
        EXPECT_EQ(ae[i].m, am[i].m) << "adam exp_avg, " << what;
        EXPECT_EQ(ae[i].v, am[i].v) << "adam exp_avg_sq, " << what;
        EXPECT_EQ(se[i].p, sm[i].p) << "sgd master, " << what;
        EXPECT_EQ(se[i].m, sm[i].m) << "sgd momentum, " << what;
        // (A bf16 master of one or two elements may not move: a step under
        // its rounding.)
        if (sizes[i] >= 63) {
          EXPECT_NE(am[i].p, start[i].p) << "adam did not step, " << what;
          EXPECT_NE(sm[i].p, start[i].p) << "sgd did not step, " << what;
        }
      }
    }
  }
  EXPECT_NO_THROW(adam_step_mixed_many(nullptr, 0, 1.0f));
  EXPECT_NO_THROW(sgd_step_mixed_many(nullptr, 0, 1.0f));
  std::vector<float> p(3), m(3), v(3), g(3);
  AdamMixedTensor bad{p.data(), WorkDtype::F16, m.data(), v.data(), WorkDtype::F32, g.data(), 3,
                      AdamHyper{0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1}};
  EXPECT_THROW(adam_step_mixed_many(&bad, 1, 1.0f), std::invalid_argument);
  bad.master_dtype = WorkDtype::F32;
  bad.grad = nullptr;
  EXPECT_THROW(adam_step_mixed_many(&bad, 1, 1.0f), std::invalid_argument);
  SgdMixedTensor sbad{p.data(), WorkDtype::F32, nullptr, WorkDtype::F32, g.data(), 3,
                      SgdHyper{0.1f, 0.9f, 0.0f, 0.0f, false, false}};
  EXPECT_THROW(sgd_step_mixed_many(&sbad, 1, 1.0f), std::invalid_argument);
}

// ---- threads ---------------------------------------------------------------

TEST(KernelsOptimThreads, ResultsIdenticalForOneAndManyThreads) {
  KernelStateGuard guard;
  const size_t n = kBig;
  for (SimdPath path : available_paths()) {
    ASSERT_TRUE(set_simd_path_for_testing(path));
    struct Out {
      std::vector<float> p, m, v, sp, sb;
      std::vector<uint16_t> w, sw;
      double ss;
    };
    auto run = [&](int threads) {
      set_num_threads(threads);
      EXPECT_EQ(num_threads(), threads);
      Out o{normal(n, 1), normal(n, 2, 0.1f), normal(n, 3, 0.1f), normal(n, 4), std::vector<float>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n), 0.0};
      for (auto& x : o.v) x = x * x;
      for (int s = 1; s <= 3; ++s) {
        const std::vector<float> g = normal(n, 10 + static_cast<uint32_t>(s));
        const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, s};
        adam_step(o.p.data(), o.m.data(), o.v.data(), g.data(), n, h, 0.5f, o.w.data(), WorkDtype::BF16);
        const SgdHyper sh{0.01f, 0.9f, 0.0f, 0.0f, true, s == 1};
        sgd_step(o.sp.data(), o.sb.data(), g.data(), n, sh, 0.5f, o.sw.data(), WorkDtype::F16);
      }
      o.ss = sum_squares(o.p.data(), n);
      return o;
    };
    const Out a = run(1), b = run(4), c = run(3);
    for (const Out* o : {&b, &c}) {
      EXPECT_EQ(0, std::memcmp(a.p.data(), o->p.data(), n * 4)) << simd_path();
      EXPECT_EQ(0, std::memcmp(a.m.data(), o->m.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(a.v.data(), o->v.data(), n * 4));
      EXPECT_EQ(a.w, o->w);
      EXPECT_EQ(0, std::memcmp(a.sp.data(), o->sp.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(a.sb.data(), o->sb.data(), n * 4));
      EXPECT_EQ(a.sw, o->sw);
      EXPECT_EQ(float_bits(static_cast<float>(a.ss)), float_bits(static_cast<float>(o->ss)));
      EXPECT_EQ(a.ss, o->ss);
    }
  }
}

TEST(KernelsParallel, CoversEveryIndexOnceInAlignedChunks) {
  KernelStateGuard guard;
  for (int threads : {1, 2, 5}) {
    set_num_threads(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{65535}, size_t{65536}, size_t{131073}, size_t{1000003}}) {
      std::vector<std::atomic<int>> hits(n);
      std::mutex mu;
      std::set<std::thread::id> ids;
      parallel_for(n, 32768, [&](size_t b, size_t e) {
        EXPECT_EQ(b % 64, 0u);
        EXPECT_LT(b, e);
        for (size_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
        std::lock_guard<std::mutex> lk(mu);
        ids.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
      if (n < 65536 || threads == 1) {
        EXPECT_LE(ids.size(), 1u);  // small work runs on the calling thread
        if (n > 0) { EXPECT_EQ(*ids.begin(), std::this_thread::get_id()); }
      }
    }
  }
}

TEST(KernelsParallel, NestedAndConcurrentCallsDoNotDeadlock) {
  KernelStateGuard guard;
  set_num_threads(3);
  std::atomic<size_t> total{0};
  auto job = [&] {
    for (int r = 0; r < 20; ++r) {
      parallel_for(1 << 18, 1 << 12, [&](size_t b, size_t e) {
        parallel_for(e - b, 64, [&](size_t b2, size_t e2) { total.fetch_add(e2 - b2); });
      });
    }
  };
  std::thread t1(job), t2(job);
  job();
  t1.join();
  t2.join();
  EXPECT_EQ(total.load(), size_t{3} * 20 * (1 << 18));
}

TEST(KernelsParallel, ExceptionReachesTheCaller) {
  KernelStateGuard guard;
  set_num_threads(2);
  EXPECT_THROW(parallel_for(1 << 20, 1 << 12,
                            [](size_t b, size_t) {
                              if (b > 0) throw std::runtime_error("chunk failed");
                            }),
               std::runtime_error);
  // The pool still works.
  std::atomic<size_t> total{0};
  parallel_for(1 << 20, 1 << 12, [&](size_t b, size_t e) { total += e - b; });
  EXPECT_EQ(total.load(), size_t{1} << 20);
}

TEST(KernelsParallel, UsableInAForkedChildWhileTheParentPoolIsBusy) {
  KernelStateGuard guard;
  set_num_threads(2);
  // Create the pool in the parent, and keep it busy from another thread
  // while forking, so its locks may be held at fork time.
  std::atomic<size_t> sink{0};
  parallel_for(1 << 20, 1 << 12, [&](size_t b, size_t e) { sink += e - b; });
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load())
      parallel_for(1 << 20, 1 << 12, [&](size_t b, size_t e) { sink += e - b; });
  });
  for (int round = 0; round < 5; ++round) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(30);  // a deadlock fails the test instead of hanging it
      const size_t n = kBig;
      std::vector<float> p = normal(n, 1), m(n, 0.0f), v(n, 0.0f), g = normal(n, 2);
      std::vector<float> rp = p, rm = m, rv = v;
      const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, 1};
      adam_step(p.data(), m.data(), v.data(), g.data(), n, h, 1.0f, nullptr, WorkDtype::F32);
      adam_step_scalar(rp.data(), rm.data(), rv.data(), g.data(), n, h, 1.0f, nullptr, WorkDtype::F32);
      std::atomic<size_t> count{0};
      std::set<std::thread::id> ids;
      std::mutex mu;
      parallel_for(n, 1024, [&](size_t b, size_t e) {
        count += e - b;
        std::lock_guard<std::mutex> lk(mu);
        ids.insert(std::this_thread::get_id());
      });
      const bool ok = max_rel_diff(p, rp) <= 1e-6 && count.load() == n && all_finite(p.data(), n);
      _exit(ok ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "child died (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                   << "): deadlock after fork?";
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  stop = true;
  busy.join();
}

TEST(KernelsParallel, NumThreadsSetAndReset) {
  KernelStateGuard guard;
  set_num_threads(0);
  const int def = num_threads();
  EXPECT_GE(def, 1);
  set_num_threads(7);
  EXPECT_EQ(num_threads(), 7);
  set_num_threads(-1);
  EXPECT_EQ(num_threads(), def);
}

// ---- dispatch and argument checks ------------------------------------------

TEST(KernelsOptimDispatch, PathNamesAndParsing) {
  const std::string cur = simd_path();
  EXPECT_TRUE(cur == "avx512" || cur == "avx2" || cur == "scalar") << cur;
  EXPECT_TRUE(simd_path_available(SimdPath::Scalar));
  EXPECT_TRUE(simd_path_available(simd_path_id()));
  SimdPath p = SimdPath::Scalar;
  EXPECT_TRUE(parse_simd_path("avx2", &p));
  EXPECT_EQ(p, SimdPath::Avx2);
  EXPECT_TRUE(parse_simd_path("avx512", &p));
  EXPECT_EQ(p, SimdPath::Avx512);
  EXPECT_TRUE(parse_simd_path("scalar", &p));
  EXPECT_EQ(p, SimdPath::Scalar);
  EXPECT_FALSE(parse_simd_path("sse", &p));
  EXPECT_FALSE(parse_simd_path(nullptr, &p));
  KernelStateGuard guard;
  for (SimdPath q : {SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512}) {
    const bool ok = set_simd_path_for_testing(q);
    EXPECT_EQ(ok, simd_path_available(q));
    if (ok) { EXPECT_STREQ(simd_path(), simd_path_name(q)); }
  }
  std::printf("SIMD paths available here:");
  for (SimdPath q : available_paths()) std::printf(" %s", simd_path_name(q));
  std::printf("\n");
}

// Run by the next test in a fresh process (re-executing this binary) with
// ZS_SIMD set: the first kernel call picks the path it names.
TEST(KernelsOptimDispatch, EnvSelectionProbe) {
  const char* want = std::getenv("ZS_EXPECT_SIMD");
  std::vector<float> x(100, 1.0f);
  EXPECT_EQ(sum_squares(x.data(), x.size()), 100.0);  // first kernel call selects
  if (want != nullptr) { EXPECT_STREQ(simd_path(), want); }
}

TEST(KernelsOptimDispatch, EnvironmentForcesAPathInANewProcess) {
  const std::vector<SimdPath> avail = available_paths();
  const char* best = simd_path_name(avail.back());
  const std::pair<const char*, const char*> cases[] = {
      {"scalar", "scalar"},
      {"avx2", simd_path_available(SimdPath::Avx2) ? "avx2" : best},
      {"avx512", simd_path_available(SimdPath::Avx512) ? "avx512" : best},
      {"neon", best},  // unknown: a message on stderr and the best path
  };
  for (const auto& [value, expect] : cases) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      setenv("ZS_SIMD", value, 1);
      setenv("ZS_EXPECT_SIMD", expect, 1);
      if (FILE* f = std::freopen("/dev/null", "w", stdout)) (void)f;
      execl("/proc/self/exe", "kernels_probe", "--gtest_filter=KernelsOptimDispatch.EnvSelectionProbe",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "ZS_SIMD=" << value << " should select " << expect;
  }
}

TEST(KernelsOptimArgs, BadArgumentsThrow) {
  float p = 1.0f, m = 0.0f, v = 0.0f, g = 1.0f;
  const AdamHyper step0{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 0};
  EXPECT_THROW(adam_step(&p, &m, &v, &g, 1, step0, 1.0f, nullptr, WorkDtype::F32), std::invalid_argument);
  const AdamHyper ok{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1};
  EXPECT_THROW(adam_step(&p, nullptr, &v, &g, 1, ok, 1.0f, nullptr, WorkDtype::F32), std::invalid_argument);
  const SgdHyper mom{0.1f, 0.9f, 0.0f, 0.0f, false, true};
  EXPECT_THROW(sgd_step(&p, nullptr, &g, 1, mom, 1.0f, nullptr, WorkDtype::F32), std::invalid_argument);
  // n == 0 touches nothing, null pointers allowed.
  EXPECT_NO_THROW(adam_step(nullptr, nullptr, nullptr, nullptr, 0, step0, 1.0f, nullptr, WorkDtype::F32));
  const SgdHyper plain{0.1f, 0.0f, 0.0f, 0.0f, false, true};
  sgd_step(&p, nullptr, &g, 1, plain, 1.0f, nullptr, WorkDtype::F32);
  EXPECT_FLOAT_EQ(p, 0.9f);
}

TEST(KernelsOptimArgs, NonFiniteValuesPropagateWithoutChecks) {
  // adam/sgd just compute: an inf grad makes NaN/inf params, which the
  // engine's all_finite check before the step is there to prevent.
  std::vector<float> p(100, 1.0f), m(100, 0.0f), v(100, 0.0f), g(100, 0.5f);
  g[77] = std::numeric_limits<float>::infinity();
  const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1};
  EXPECT_FALSE(all_finite(g.data(), g.size()));
  adam_step(p.data(), m.data(), v.data(), g.data(), p.size(), h, 1.0f, nullptr, WorkDtype::F32);
  EXPECT_FALSE(all_finite(p.data(), p.size()));
  EXPECT_TRUE(all_finite(p.data(), 77));
}

}  // namespace
}  // namespace zs::kernels
