// Optimizer and gradient-path kernels: the scalar reference, the AVX2 and
// AVX-512 variants, run-time dispatch and threading.
//
// The vector variants are written once (the ZS_OPTIM_PASS section at the end
// of this file) and compiled once per target: this file includes itself with
// ZS_OPTIM_PASS set, each time under that target's `#pragma GCC target`, so
// only the vector operations below differ between targets.
//
// Floating-point contraction is off for this file: a vector path performs
// exactly the scalar reference's operations in the same order, so its
// results are bit-identical to the reference (and to the order of torch's
// single-tensor implementation), whatever the compiler's default. (GCC:
// `#pragma GCC optimize("fp-contract=off")`; clang honours its pragma except
// under -ffp-contract=fast, which the tests would then report.)

#ifndef ZS_OPTIM_PASS  // ===================== common part =====================

#include "kernels/optim.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/elementwise.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace zs::kernels {

// The per-call constants (kernels/elementwise.h). Out of line, under this
// file's fp-contract=off, so the CPU kernels and the CUDA launchers derive
// the very same fp32 constants.
AdamC adam_consts(const AdamHyper& h, float grad_scale) {
  if (h.bias_correction && h.step < 1)
    throw std::invalid_argument("adam_step: step " + std::to_string(h.step) +
                                ": expected >= 1 (1-based, after increment)");
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, wd = h.weight_decay;
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(b1, static_cast<double>(h.step));
    bc2 = 1.0 - std::pow(b2, static_cast<double>(h.step));
  }
  AdamC c{};
  c.gscale = grad_scale;
  c.decay = static_cast<float>(1.0 - lr * wd);
  c.wd = h.weight_decay;
  c.w1 = static_cast<float>(1.0 - b1);
  c.omw1 = 1.0f - c.w1;
  c.b2 = h.beta2;
  c.omb2 = static_cast<float>(1.0 - b2);
  c.bc2s = static_cast<float>(std::sqrt(bc2));
  c.eps = h.eps;
  c.nstep = static_cast<float>(-(lr / bc1));
  c.has_wd = h.weight_decay != 0.0f;
  c.adamw = h.adamw;
  c.lerp_small = std::fabs(c.w1) < 0.5f;
  return c;
}

SgdC sgd_consts(const SgdHyper& h, float grad_scale) {
  SgdC c{};
  c.gscale = grad_scale;
  c.wd = h.weight_decay;
  c.mom = h.momentum;
  c.omd = static_cast<float>(1.0 - static_cast<double>(h.dampening));
  c.nlr = -h.lr;
  c.has_wd = h.weight_decay != 0.0f;
  c.has_mom = h.momentum != 0.0f;
  c.nesterov = h.nesterov;
  c.first = h.first_step;
  return c;
}

namespace {

// Elements per parallel chunk at least: inputs under 2 * kGrain (64K
// elements) run on the calling thread.
constexpr size_t kGrain = 32768;
// sum_squares adds fixed blocks in order, so its result does not depend on
// the thread count.
constexpr size_t kSumBlock = kSumBlockElements;

inline void* work_at(void* w, WorkDtype t, size_t i) {
  return w ? static_cast<char*>(w) + i * work_dtype_size(t) : nullptr;
}
inline const void* work_at(const void* w, WorkDtype t, size_t i) {
  return static_cast<const char*>(w) + i * work_dtype_size(t);
}

// ---- scalar ranges: the reference, and the vector paths' tails -------------
// The per-element operations are kernels/elementwise.h's, shared with the
// CUDA kernels.

namespace scalar_impl {

void adam(float* p, float* m, float* v, const float* g, size_t n, const AdamC& c, void* w,
          WorkDtype t) {
  for (size_t i = 0; i < n; ++i) {
    adam_elem(p[i], m[i], v[i], g[i], c);
    if (w) store_work1(w, t, i, p[i]);
  }
}

void sgd(float* p, float* buf, const float* g, size_t n, const SgdC& c, void* w, WorkDtype t) {
  for (size_t i = 0; i < n; ++i) {
    sgd_elem(p[i], buf ? buf + i : nullptr, g[i], c);
    if (w) store_work1(w, t, i, p[i]);
  }
}

// Master and moments in their own dtypes (F32 or BF16): widened, updated
// in fp32 as above, rounded once on store.
void adam_mixed(void* p, WorkDtype pt, void* m, void* v, WorkDtype st, const float* g, size_t n,
                const AdamC& c) {
  for (size_t i = 0; i < n; ++i) {
    float pi = load_work1(p, pt, i), mi = load_work1(m, st, i), vi = load_work1(v, st, i);
    adam_elem(pi, mi, vi, g[i], c);
    store_work1(m, st, i, mi);
    store_work1(v, st, i, vi);
    store_work1(p, pt, i, pi);
  }
}

void sgd_mixed(void* p, WorkDtype pt, void* buf, WorkDtype st, const float* g, size_t n, const SgdC& c) {
  for (size_t i = 0; i < n; ++i) {
    float pi = load_work1(p, pt, i);
    float bi = c.has_mom && !c.first ? load_work1(buf, st, i) : 0.0f;
    sgd_elem(pi, &bi, g[i], c);
    if (c.has_mom) store_work1(buf, st, i, bi);
    store_work1(p, pt, i, pi);
  }
}

double sumsq(const float* x, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s = d_add(s, d_square(x[i]));
  return s;
}

// One element of store_sum_squares.
template <StoreMode M>
inline float store1(float d, float s) {
  if constexpr (M == StoreMode::Add) return f_add(d, s);
  if constexpr (M == StoreMode::Assign) return f_add(0.0f, s);
  return s;
}

template <StoreMode M>
double store_sumsq_m(float* d, const float* src, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) {
    d[i] = store1<M>(d[i], src[i]);
    s = d_add(s, d_square(d[i]));
  }
  return s;
}

double store_sumsq(float* d, const float* src, size_t n, StoreMode m) {
  switch (m) {
    case StoreMode::Add: return store_sumsq_m<StoreMode::Add>(d, src, n);
    case StoreMode::Assign: return store_sumsq_m<StoreMode::Assign>(d, src, n);
    case StoreMode::Copy: break;
  }
  return store_sumsq_m<StoreMode::Copy>(d, src, n);
}

bool finite(const float* x, size_t n) {
  uint32_t mx = 0;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, abs_bits(x[i]));
  return is_finite_bits(mx);
}

void scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] = f_mul(x[i], s);
}

void from_f32(const float* src, void* dst, WorkDtype t, size_t n) {
  for (size_t i = 0; i < n; ++i) store_work1(dst, t, i, src[i]);
}

void to_f32(const void* src, WorkDtype t, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = load_work1(src, t, i);
}

void add_to(const void* src, WorkDtype t, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f_add(dst[i], load_work1(src, t, i));
}

}  // namespace scalar_impl

// One SIMD path's kernels over a range (single-threaded).
struct Impl {
  void (*adam)(float*, float*, float*, const float*, size_t, const AdamC&, void*, WorkDtype);
  void (*sgd)(float*, float*, const float*, size_t, const SgdC&, void*, WorkDtype);
  double (*sumsq)(const float*, size_t);  // called per kSumBlock block
  double (*store_sumsq)(float*, const float*, size_t, StoreMode);  // likewise
  bool (*finite)(const float*, size_t);
  void (*scale)(float*, size_t, float);
  void (*from_f32)(const float*, void*, WorkDtype, size_t);
  void (*to_f32)(const void*, WorkDtype, float*, size_t);
  void (*add_to)(const void*, WorkDtype, float*, size_t);
  void (*adam_mixed)(void*, WorkDtype, void*, void*, WorkDtype, const float*, size_t, const AdamC&);
  void (*sgd_mixed)(void*, WorkDtype, void*, WorkDtype, const float*, size_t, const SgdC&);
};

const Impl kScalarImpl = {scalar_impl::adam,     scalar_impl::sgd,         scalar_impl::sumsq,
                          scalar_impl::store_sumsq, scalar_impl::finite,   scalar_impl::scale,
                          scalar_impl::from_f32, scalar_impl::to_f32,      scalar_impl::add_to,
                          scalar_impl::adam_mixed, scalar_impl::sgd_mixed};

}  // namespace
}  // namespace zs::kernels

#if defined(__x86_64__)
#define ZS_OPTIM_PASS 1  // AVX2 + FMA + F16C
#include "optim.cpp"
#undef ZS_OPTIM_PASS
#define ZS_OPTIM_PASS 2  // AVX-512F
#include "optim.cpp"
#undef ZS_OPTIM_PASS
#endif

// ---- dispatch and the public API -------------------------------------------

namespace zs::kernels {
namespace {

const Impl* impl_for(SimdPath p) {
  switch (p) {
#if defined(__x86_64__)
    case SimdPath::Avx512: return &avx512_impl::kImpl;
    case SimdPath::Avx2: return &avx2_impl::kImpl;
#endif
    default: return &kScalarImpl;
  }
}

bool cpu_supports(SimdPath p) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (p == SimdPath::Avx2) return avx2;
  if (p == SimdPath::Avx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return p == SimdPath::Scalar;
}

SimdPath best_path() {
  if (cpu_supports(SimdPath::Avx512)) return SimdPath::Avx512;
  if (cpu_supports(SimdPath::Avx2)) return SimdPath::Avx2;
  return SimdPath::Scalar;
}

SimdPath choose_path() {
  const SimdPath best = best_path();
  const char* env = std::getenv("ZS_SIMD");
  if (env == nullptr || *env == '\0') return best;
  SimdPath want;
  if (!parse_simd_path(env, &want)) {
    std::fprintf(stderr, "zeroshard: ZS_SIMD=%s: expected scalar|avx2|avx512; using %s\n", env,
                 simd_path_name(best));
    return best;
  }
  if (!cpu_supports(want)) {
    std::fprintf(stderr, "zeroshard: ZS_SIMD=%s: not supported by this CPU; using %s\n", env,
                 simd_path_name(best));
    return best;
  }
  return want;
}

constexpr int kUnset = -1;
std::atomic<int> g_path{kUnset};

SimdPath current_path() {
  int p = g_path.load(std::memory_order_acquire);
  if (p == kUnset) {
    static const int chosen = static_cast<int>(choose_path());
    int expected = kUnset;
    g_path.compare_exchange_strong(expected, chosen, std::memory_order_acq_rel);
    p = g_path.load(std::memory_order_acquire);
  }
  return static_cast<SimdPath>(p);
}

const Impl* impl() { return impl_for(current_path()); }

}  // namespace

size_t work_dtype_size(WorkDtype t) { return t == WorkDtype::F32 ? 4 : 2; }

const char* simd_path_name(SimdPath p) {
  switch (p) {
    case SimdPath::Avx512: return "avx512";
    case SimdPath::Avx2: return "avx2";
    case SimdPath::Scalar: return "scalar";
  }
  return "scalar";
}

const char* simd_path() { return simd_path_name(current_path()); }
SimdPath simd_path_id() { return current_path(); }
bool simd_path_available(SimdPath p) { return cpu_supports(p); }

bool parse_simd_path(const char* s, SimdPath* out) {
  if (s == nullptr) return false;
  for (SimdPath p : {SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512}) {
    if (std::strcmp(s, simd_path_name(p)) == 0) {
      if (out) *out = p;
      return true;
    }
  }
  return false;
}

bool set_simd_path_for_testing(SimdPath p) {
  if (!cpu_supports(p)) return false;
  g_path.store(static_cast<int>(p), std::memory_order_release);
  return true;
}

namespace {
void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}
}  // namespace

void adam_step(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, size_t n,
               const AdamHyper& h, float grad_scale, void* working, WorkDtype working_dtype) {
  if (n == 0) return;
  require(master && exp_avg && exp_avg_sq && grad, "adam_step: null master, state or grad");
  const AdamC c = adam_consts(h, grad_scale);
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    I->adam(master + b, exp_avg + b, exp_avg_sq + b, grad + b, e - b, c,
            work_at(working, working_dtype, b), working_dtype);
  });
}

namespace {
// Calls fn(i, lo, hi) for the part [lo, hi) of tensor i that each parallel
// range reaches, the tensors' elements cut into the threads' ranges as one
// range: tensor i starts at start[i] (a multiple of 64, as a single tensor's
// ranges start), and the padding up to the next tensor is skipped.
template <class N, class F>
void many_ranges(size_t count, N&& numel, F&& fn) {
  std::vector<size_t> start(count + 1, 0);  // each tensor's first element in the one range
  for (size_t i = 0; i < count; ++i) start[i + 1] = start[i] + (numel(i) + 63) / 64 * 64;
  parallel_for(start[count], kGrain, [&](size_t b, size_t e) {
    // The last tensor starting at or before b, then each one [b, e) reaches.
    auto i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
    for (; i < count && start[i] < e; ++i) {
      const size_t lo = std::max(b, start[i]) - start[i];
      const size_t hi = std::min(e - start[i], static_cast<size_t>(numel(i)));
      if (lo < hi) fn(i, lo, hi);
    }
  });
}
}  // namespace

void adam_step_many(const AdamTensor* t, size_t count, float grad_scale) {
  if (count == 0) return;
  require(t != nullptr, "adam_step_many: null tensors");
  std::vector<AdamC> c(count);
  for (size_t i = 0; i < count; ++i) {
    require(t[i].n == 0 || (t[i].master && t[i].exp_avg && t[i].exp_avg_sq && t[i].grad),
            "adam_step_many: null master, state or grad");
    c[i] = adam_consts(t[i].h, grad_scale);
  }
  const Impl* I = impl();
  many_ranges(count, [&](size_t i) { return t[i].n; }, [&](size_t i, size_t lo, size_t hi) {
    const AdamTensor& x = t[i];
    I->adam(x.master + lo, x.exp_avg + lo, x.exp_avg_sq + lo, x.grad + lo, hi - lo, c[i],
            work_at(x.working, x.working_dtype, lo), x.working_dtype);
  });
}

void sgd_step_many(const SgdTensor* t, size_t count, float grad_scale) {
  if (count == 0) return;
  require(t != nullptr, "sgd_step_many: null tensors");
  std::vector<SgdC> c(count);
  for (size_t i = 0; i < count; ++i) {
    require(t[i].n == 0 || (t[i].master && t[i].grad), "sgd_step_many: null master or grad");
    c[i] = sgd_consts(t[i].h, grad_scale);
    require(t[i].n == 0 || !c[i].has_mom || t[i].momentum_buf,
            "sgd_step_many: momentum != 0 needs a momentum buffer");
  }
  const Impl* I = impl();
  many_ranges(count, [&](size_t i) { return t[i].n; }, [&](size_t i, size_t lo, size_t hi) {
    const SgdTensor& x = t[i];
    I->sgd(x.master + lo, c[i].has_mom ? x.momentum_buf + lo : nullptr, x.grad + lo, hi - lo, c[i],
           work_at(x.working, x.working_dtype, lo), x.working_dtype);
  });
}

void adam_step_scalar(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                      size_t n, const AdamHyper& h, float grad_scale, void* working,
                      WorkDtype working_dtype) {
  if (n == 0) return;
  require(master && exp_avg && exp_avg_sq && grad, "adam_step: null master, state or grad");
  scalar_impl::adam(master, exp_avg, exp_avg_sq, grad, n, adam_consts(h, grad_scale), working,
                    working_dtype);
}

void sgd_step(float* master, float* momentum_buf, const float* grad, size_t n, const SgdHyper& h,
              float grad_scale, void* working, WorkDtype working_dtype) {
  if (n == 0) return;
  require(master && grad, "sgd_step: null master or grad");
  const SgdC c = sgd_consts(h, grad_scale);
  require(!c.has_mom || momentum_buf, "sgd_step: momentum != 0 needs a momentum buffer");
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    I->sgd(master + b, c.has_mom ? momentum_buf + b : nullptr, grad + b, e - b, c,
           work_at(working, working_dtype, b), working_dtype);
  });
}

void sgd_step_scalar(float* master, float* momentum_buf, const float* grad, size_t n,
                     const SgdHyper& h, float grad_scale, void* working,
                     WorkDtype working_dtype) {
  if (n == 0) return;
  require(master && grad, "sgd_step: null master or grad");
  const SgdC c = sgd_consts(h, grad_scale);
  require(!c.has_mom || momentum_buf, "sgd_step: momentum != 0 needs a momentum buffer");
  scalar_impl::sgd(master, c.has_mom ? momentum_buf : nullptr, grad, n, c, working,
                   working_dtype);
}

namespace {
void require_mixed_dtypes(WorkDtype master_dtype, WorkDtype state_dtype, const char* kernel) {
  const auto ok = [](WorkDtype t) { return t == WorkDtype::F32 || t == WorkDtype::BF16; };
  if (!ok(master_dtype) || !ok(state_dtype))
    throw std::invalid_argument(std::string(kernel) + ": master and state dtypes must be F32 or BF16");
}
}  // namespace

void adam_step_mixed(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                     WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                     float grad_scale) {
  if (n == 0) return;
  require(master && exp_avg && exp_avg_sq && grad, "adam_step_mixed: null master, state or grad");
  require_mixed_dtypes(master_dtype, state_dtype, "adam_step_mixed");
  const AdamC c = adam_consts(h, grad_scale);
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    I->adam_mixed(work_at(master, master_dtype, b), master_dtype, work_at(exp_avg, state_dtype, b),
                  work_at(exp_avg_sq, state_dtype, b), state_dtype, grad + b, e - b, c);
  });
}

void adam_step_mixed_many(const AdamMixedTensor* t, size_t count, float grad_scale) {
  if (count == 0) return;
  require(t != nullptr, "adam_step_mixed_many: null tensors");
  std::vector<AdamC> c(count);
  for (size_t i = 0; i < count; ++i) {
    if (t[i].n == 0) continue;
    require(t[i].master && t[i].exp_avg && t[i].exp_avg_sq && t[i].grad,
            "adam_step_mixed_many: null master, state or grad");
    require_mixed_dtypes(t[i].master_dtype, t[i].state_dtype, "adam_step_mixed_many");
    c[i] = adam_consts(t[i].h, grad_scale);
  }
  const Impl* I = impl();
  many_ranges(count, [&](size_t i) { return t[i].n; }, [&](size_t i, size_t lo, size_t hi) {
    const AdamMixedTensor& x = t[i];
    I->adam_mixed(work_at(x.master, x.master_dtype, lo), x.master_dtype, work_at(x.exp_avg, x.state_dtype, lo),
                  work_at(x.exp_avg_sq, x.state_dtype, lo), x.state_dtype, x.grad + lo, hi - lo, c[i]);
  });
}

void sgd_step_mixed_many(const SgdMixedTensor* t, size_t count, float grad_scale) {
  if (count == 0) return;
  require(t != nullptr, "sgd_step_mixed_many: null tensors");
  std::vector<SgdC> c(count);
  for (size_t i = 0; i < count; ++i) {
    if (t[i].n == 0) continue;
    require(t[i].master && t[i].grad, "sgd_step_mixed_many: null master or grad");
    require_mixed_dtypes(t[i].master_dtype, t[i].state_dtype, "sgd_step_mixed_many");
    c[i] = sgd_consts(t[i].h, grad_scale);
    require(!c[i].has_mom || t[i].momentum_buf, "sgd_step_mixed_many: momentum != 0 needs a momentum buffer");
  }
  const Impl* I = impl();
  many_ranges(count, [&](size_t i) { return t[i].n; }, [&](size_t i, size_t lo, size_t hi) {
    const SgdMixedTensor& x = t[i];
    I->sgd_mixed(work_at(x.master, x.master_dtype, lo), x.master_dtype,
                 c[i].has_mom ? work_at(x.momentum_buf, x.state_dtype, lo) : nullptr, x.state_dtype, x.grad + lo,
                 hi - lo, c[i]);
  });
}

void adam_step_mixed_scalar(void* master, WorkDtype master_dtype, void* exp_avg, void* exp_avg_sq,
                            WorkDtype state_dtype, const float* grad, size_t n, const AdamHyper& h,
                            float grad_scale) {
  if (n == 0) return;
  require(master && exp_avg && exp_avg_sq && grad, "adam_step_mixed: null master, state or grad");
  require_mixed_dtypes(master_dtype, state_dtype, "adam_step_mixed");
  scalar_impl::adam_mixed(master, master_dtype, exp_avg, exp_avg_sq, state_dtype, grad, n,
                          adam_consts(h, grad_scale));
}

void sgd_step_mixed(void* master, WorkDtype master_dtype, void* momentum_buf, WorkDtype state_dtype,
                    const float* grad, size_t n, const SgdHyper& h, float grad_scale) {
  if (n == 0) return;
  require(master && grad, "sgd_step_mixed: null master or grad");
  require_mixed_dtypes(master_dtype, state_dtype, "sgd_step_mixed");
  const SgdC c = sgd_consts(h, grad_scale);
  require(!c.has_mom || momentum_buf, "sgd_step_mixed: momentum != 0 needs a momentum buffer");
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    I->sgd_mixed(work_at(master, master_dtype, b), master_dtype,
                 c.has_mom ? work_at(momentum_buf, state_dtype, b) : nullptr, state_dtype, grad + b,
                 e - b, c);
  });
}

void sgd_step_mixed_scalar(void* master, WorkDtype master_dtype, void* momentum_buf,
                           WorkDtype state_dtype, const float* grad, size_t n, const SgdHyper& h,
                           float grad_scale) {
  if (n == 0) return;
  require(master && grad, "sgd_step_mixed: null master or grad");
  require_mixed_dtypes(master_dtype, state_dtype, "sgd_step_mixed");
  const SgdC c = sgd_consts(h, grad_scale);
  require(!c.has_mom || momentum_buf, "sgd_step_mixed: momentum != 0 needs a momentum buffer");
  scalar_impl::sgd_mixed(master, master_dtype, c.has_mom ? momentum_buf : nullptr, state_dtype, grad,
                         n, c);
}

namespace {
// The sum over fixed kSumBlock blocks, block(begin, count) each, added in
// order: the same result on any thread count.
template <typename Block>
double blocked_sum(size_t n, const Block& block_at) {
  const size_t nblocks = (n + kSumBlock - 1) / kSumBlock;
  auto block = [&](size_t k) {
    const size_t b = k * kSumBlock;
    return block_at(b, std::min(n, b + kSumBlock) - b);
  };
  double total = 0.0;
  if (n < 2 * kGrain) {
    for (size_t k = 0; k < nblocks; ++k) total += block(k);
    return total;
  }
  std::vector<double> part(nblocks);
  parallel_for(
      nblocks, kGrain / kSumBlock,
      [&](size_t b, size_t e) {
        for (size_t k = b; k < e; ++k) part[k] = block(k);
      },
      1);
  for (double p : part) total += p;
  return total;
}
}  // namespace

double sum_squares(const float* x, size_t n) {
  if (n == 0) return 0.0;
  const Impl* I = impl();
  return blocked_sum(n, [&](size_t b, size_t count) { return I->sumsq(x + b, count); });
}

double store_sum_squares(float* dst, const float* src, size_t n, StoreMode mode) {
  if (n == 0) return 0.0;
  require(dst && src, "store_sum_squares: null dst or src");
  const Impl* I = impl();
  return blocked_sum(n, [&](size_t b, size_t count) { return I->store_sumsq(dst + b, src + b, count, mode); });
}

double store_sum_squares_made(float* dst, size_t n, StoreMode mode, BlockMaker make, void* ctx) {
  if (n == 0) return 0.0;
  require(dst && make, "store_sum_squares_made: null dst or make");
  const Impl* I = impl();
  return blocked_sum(n, [&](size_t b, size_t count) {
    alignas(64) float block[kSumBlock];
    make(ctx, b, count, block);
    return I->store_sumsq(dst + b, block, count, mode);
  });
}

bool all_finite(const float* x, size_t n) {
  if (n == 0) return true;
  const Impl* I = impl();
  std::atomic<bool> bad{false};
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    if (!bad.load(std::memory_order_relaxed) && !I->finite(x + b, e - b))
      bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

void scale_inplace(float* x, size_t n, float s) {
  if (n == 0) return;
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) { I->scale(x + b, e - b, s); });
}

void cast_from_f32(const float* src, void* dst, WorkDtype t, size_t n) {
  if (n == 0) return;
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) { I->from_f32(src + b, work_at(dst, t, b), t, e - b); });
}

void cast_to_f32(const void* src, WorkDtype t, float* dst, size_t n) {
  if (n == 0) return;
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) { I->to_f32(work_at(src, t, b), t, dst + b, e - b); });
}

void refresh_master(const void* working, WorkDtype t, float* master, size_t n) {
  if (n == 0) return;
  parallel_for(n, kGrain, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) master[i] = refreshed_master(master[i], load_work1(working, t, i), t);
  });
}

void add_to_f32(const void* src, WorkDtype t, float* dst, size_t n) {
  if (n == 0) return;
  const Impl* I = impl();
  parallel_for(n, kGrain, [&](size_t b, size_t e) { I->add_to(work_at(src, t, b), t, dst + b, e - b); });
}

}  // namespace zs::kernels

#else  // ========================= one vector target =========================

// ---- the target's vector operations ----------------------------------------

// GCC 12's AVX-512 headers initialise their "undefined" vectors from
// themselves (__Y = __Y), which -Wuninitialized reports at the inlined call
// site (GCC PR 105593); the code is fine.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if ZS_OPTIM_PASS == 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace zs::kernels {
namespace {
namespace avx2_impl {

using VF = __m256;
constexpr size_t W = 8;
inline VF ld(const float* p) { return _mm256_loadu_ps(p); }
inline void st(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF set1(float x) { return _mm256_set1_ps(x); }
inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF dvd(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm256_sqrt_ps(a); }

inline void st_bf16(void* dst, VF v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(static_cast<__m128i*>(dst), packed);
}

// vcvtps2ph rounds to nearest even like float_to_fp16; NaNs become
// sign | 0x7e00 as there.
inline __m128i fix_f16_nan(__m128i h) {
  const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
  const __m128i q = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(-32768))),
                                 _mm_set1_epi16(0x7e00));
  return _mm_blendv_epi8(h, q, nan);
}

inline void st_f16(void* dst, VF v) {
  _mm_storeu_si128(static_cast<__m128i*>(dst), fix_f16_nan(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
}

inline VF ld_bf16(const void* src) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline VF ld_f16(const void* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(src)));
}

// Sum of squares in double of n floats that x yields (x.vec(i): 8 from
// element i, x.one(i): element i): 4 accumulators over 16 elements. One
// code for reading (sum_squares) and writing (store_sum_squares) keeps
// their sums the same bits.
template <typename Src>
inline double sumsq_of(const Src& x, size_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = x.vec(i), x1 = x.vec(i + 8);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x0));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x1));
    const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));
    a0 = _mm256_fmadd_pd(d0, d0, a0);  // squares of floats are exact in double
    a1 = _mm256_fmadd_pd(d1, d1, a1);
    a2 = _mm256_fmadd_pd(d2, d2, a2);
    a3 = _mm256_fmadd_pd(d3, d3, a3);
  }
  const __m256d a = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  alignas(32) double l[4];
  _mm256_store_pd(l, a);
  double s = (l[0] + l[1]) + (l[2] + l[3]);
  for (; i < n; ++i) {
    const float f = x.one(i);
    s += static_cast<double>(f) * static_cast<double>(f);
  }
  return s;
}

// Largest |bits| of n floats >= 0x7f800000 means inf or NaN.
inline uint32_t max_abs_bits(const float* x, size_t n, size_t* done) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)), mask));
  }
  alignas(32) uint32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm256_max_epu32(m0, m1));
  *done = i;
  return *std::max_element(l, l + 8);
}

}  // namespace avx2_impl
}  // namespace
}  // namespace zs::kernels
#define ZS_NS avx2_impl

#elif ZS_OPTIM_PASS == 2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace zs::kernels {
namespace {
namespace avx512_impl {

using VF = __m512;
constexpr size_t W = 16;
inline VF ld(const float* p) { return _mm512_loadu_ps(p); }
inline void st(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF set1(float x) { return _mm512_set1_ps(x); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF dvd(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm512_sqrt_ps(a); }

inline void st_bf16(void* dst, VF v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(static_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

inline __m256i fix_f16_nan(__m256i h) {
  const __m256i nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
  const __m256i q = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(-32768))),
                                    _mm256_set1_epi16(0x7e00));
  return _mm256_blendv_epi8(h, q, nan);
}

inline void st_f16(void* dst, VF v) {
  _mm256_storeu_si256(static_cast<__m256i*>(dst), fix_f16_nan(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
}

inline VF ld_bf16(const void* src) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline VF ld_f16(const void* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
}

inline __m256 hi8(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }

// As AVX2's sumsq_of, 16 floats per x.vec(i), 4 accumulators over 32.
template <typename Src>
inline double sumsq_of(const Src& x, size_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 x0 = x.vec(i), x1 = x.vec(i + 16);
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x0));
    const __m512d d1 = _mm512_cvtps_pd(hi8(x0));
    const __m512d d2 = _mm512_cvtps_pd(_mm512_castps512_ps256(x1));
    const __m512d d3 = _mm512_cvtps_pd(hi8(x1));
    a0 = _mm512_fmadd_pd(d0, d0, a0);  // squares of floats are exact in double
    a1 = _mm512_fmadd_pd(d1, d1, a1);
    a2 = _mm512_fmadd_pd(d2, d2, a2);
    a3 = _mm512_fmadd_pd(d3, d3, a3);
  }
  const __m512d a = _mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3));
  alignas(64) double l[8];
  _mm512_store_pd(l, a);
  double s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; i < n; ++i) {
    const float f = x.one(i);
    s += static_cast<double>(f) * static_cast<double>(f);
  }
  return s;
}

inline uint32_t max_abs_bits(const float* x, size_t n, size_t* done) {
  __m512i m0 = _mm512_setzero_si512(), m1 = m0;
  const __m512i mask = _mm512_set1_epi32(0x7fffffff);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), mask));
  }
  alignas(64) uint32_t l[16];
  _mm512_store_si512(l, _mm512_max_epu32(m0, m1));
  *done = i;
  return *std::max_element(l, l + 16);
}

}  // namespace avx512_impl
}  // namespace
}  // namespace zs::kernels
#define ZS_NS avx512_impl

#else
#error "unknown ZS_OPTIM_PASS"
#endif

// ---- the kernels, written once over the operations above --------------------

namespace zs::kernels {
namespace {
namespace ZS_NS {

inline void st_work(void* w, WorkDtype t, size_t i, VF p) {
  switch (t) {
    case WorkDtype::F32: st(static_cast<float*>(w) + i, p); break;
    case WorkDtype::BF16: st_bf16(static_cast<uint16_t*>(w) + i, p); break;
    case WorkDtype::F16: st_f16(static_cast<uint16_t*>(w) + i, p); break;
  }
}

inline VF ld_work(const void* w, WorkDtype t, size_t i) {
  switch (t) {
    case WorkDtype::F32: return ld(static_cast<const float*>(w) + i);
    case WorkDtype::BF16: return ld_bf16(static_cast<const uint16_t*>(w) + i);
    case WorkDtype::F16: break;
  }
  return ld_f16(static_cast<const uint16_t*>(w) + i);
}

// The order of operations is adam_elem's, one vector at a time.
void adam(float* p, float* m, float* v, const float* g, size_t n, const AdamC& c, void* w,
          WorkDtype t) {
  const VF gscale = set1(c.gscale), decay = set1(c.decay), wd = set1(c.wd), w1 = set1(c.w1),
           omw1 = set1(c.omw1), b2 = set1(c.b2), omb2 = set1(c.omb2), bc2s = set1(c.bc2s),
           eps = set1(c.eps), nstep = set1(c.nstep);
  size_t i = 0;
  for (; i + W <= n; i += W) {
    VF gi = mul(ld(g + i), gscale);
    VF pi = ld(p + i);
    if (c.has_wd) {
      if (c.adamw)
        pi = mul(pi, decay);
      else
        gi = add(gi, mul(wd, pi));
    }
    VF mi = ld(m + i);
    mi = c.lerp_small ? add(mi, mul(w1, sub(gi, mi))) : sub(gi, mul(sub(gi, mi), omw1));
    const VF vi = add(mul(ld(v + i), b2), mul(mul(omb2, gi), gi));
    const VF denom = add(dvd(vsqrt(vi), bc2s), eps);
    pi = add(pi, dvd(mul(nstep, mi), denom));
    st(m + i, mi);
    st(v + i, vi);
    st(p + i, pi);
    if (w) st_work(w, t, i, pi);
  }
  if (i < n) scalar_impl::adam(p + i, m + i, v + i, g + i, n - i, c, work_at(w, t, i), t);
}

void sgd(float* p, float* buf, const float* g, size_t n, const SgdC& c, void* w, WorkDtype t) {
  const VF gscale = set1(c.gscale), wd = set1(c.wd), mom = set1(c.mom), omd = set1(c.omd),
           nlr = set1(c.nlr);
  size_t i = 0;
  for (; i + W <= n; i += W) {
    VF gi = mul(ld(g + i), gscale);
    VF pi = ld(p + i);
    if (c.has_wd) gi = add(gi, mul(wd, pi));
    if (c.has_mom) {
      const VF b = c.first ? gi : add(mul(ld(buf + i), mom), mul(omd, gi));
      st(buf + i, b);
      gi = c.nesterov ? add(gi, mul(mom, b)) : b;
    }
    pi = add(pi, mul(nlr, gi));
    st(p + i, pi);
    if (w) st_work(w, t, i, pi);
  }
  if (i < n)
    scalar_impl::sgd(p + i, buf ? buf + i : nullptr, g + i, n - i, c, work_at(w, t, i), t);
}

// adam and sgd with the master and moments in their own dtypes (F32 or
// BF16): the same operations between a widening load and a rounding store.
void adam_mixed(void* p, WorkDtype pt, void* m, void* v, WorkDtype st, const float* g, size_t n,
                const AdamC& c) {
  const VF gscale = set1(c.gscale), decay = set1(c.decay), wd = set1(c.wd), w1 = set1(c.w1),
           omw1 = set1(c.omw1), b2 = set1(c.b2), omb2 = set1(c.omb2), bc2s = set1(c.bc2s),
           eps = set1(c.eps), nstep = set1(c.nstep);
  size_t i = 0;
  for (; i + W <= n; i += W) {
    VF gi = mul(ld(g + i), gscale);
    VF pi = ld_work(p, pt, i);
    if (c.has_wd) {
      if (c.adamw)
        pi = mul(pi, decay);
      else
        gi = add(gi, mul(wd, pi));
    }
    VF mi = ld_work(m, st, i);
    mi = c.lerp_small ? add(mi, mul(w1, sub(gi, mi))) : sub(gi, mul(sub(gi, mi), omw1));
    const VF vi = add(mul(ld_work(v, st, i), b2), mul(mul(omb2, gi), gi));
    const VF denom = add(dvd(vsqrt(vi), bc2s), eps);
    pi = add(pi, dvd(mul(nstep, mi), denom));
    st_work(m, st, i, mi);
    st_work(v, st, i, vi);
    st_work(p, pt, i, pi);
  }
  if (i < n)
    scalar_impl::adam_mixed(work_at(p, pt, i), pt, work_at(m, st, i), work_at(v, st, i), st, g + i,
                            n - i, c);
}

void sgd_mixed(void* p, WorkDtype pt, void* buf, WorkDtype st, const float* g, size_t n, const SgdC& c) {
  const VF gscale = set1(c.gscale), wd = set1(c.wd), mom = set1(c.mom), omd = set1(c.omd),
           nlr = set1(c.nlr);
  size_t i = 0;
  for (; i + W <= n; i += W) {
    VF gi = mul(ld(g + i), gscale);
    VF pi = ld_work(p, pt, i);
    if (c.has_wd) gi = add(gi, mul(wd, pi));
    if (c.has_mom) {
      const VF b = c.first ? gi : add(mul(ld_work(buf, st, i), mom), mul(omd, gi));
      st_work(buf, st, i, b);
      gi = c.nesterov ? add(gi, mul(mom, b)) : b;
    }
    pi = add(pi, mul(nlr, gi));
    st_work(p, pt, i, pi);
  }
  if (i < n)
    scalar_impl::sgd_mixed(work_at(p, pt, i), pt, buf ? work_at(buf, st, i) : nullptr, st, g + i,
                           n - i, c);
}

// Sources for sumsq_of: floats read, or floats written by store_sum_squares.
struct Loaded {
  const float* x;
  VF vec(size_t i) const { return ld(x + i); }
  float one(size_t i) const { return x[i]; }
};

template <StoreMode M>
struct Stored {
  float* d;
  const float* s;
  VF vec(size_t i) const {
    VF v = ld(s + i);
    if constexpr (M == StoreMode::Add) v = add(ld(d + i), v);
    if constexpr (M == StoreMode::Assign) v = add(set1(0.0f), v);
    st(d + i, v);
    return v;
  }
  float one(size_t i) const {
    d[i] = scalar_impl::store1<M>(d[i], s[i]);
    return d[i];
  }
};

double sumsq(const float* x, size_t n) { return sumsq_of(Loaded{x}, n); }

double store_sumsq(float* d, const float* s, size_t n, StoreMode m) {
  switch (m) {
    case StoreMode::Add: return sumsq_of(Stored<StoreMode::Add>{d, s}, n);
    case StoreMode::Assign: return sumsq_of(Stored<StoreMode::Assign>{d, s}, n);
    case StoreMode::Copy: break;
  }
  return sumsq_of(Stored<StoreMode::Copy>{d, s}, n);
}

bool finite(const float* x, size_t n) {
  size_t i = 0;
  const uint32_t mx = max_abs_bits(x, n, &i);
  return mx < 0x7f800000u && scalar_impl::finite(x + i, n - i);
}

void scale(float* x, size_t n, float s) {
  const VF sv = set1(s);
  size_t i = 0;
  for (; i + W <= n; i += W) st(x + i, mul(ld(x + i), sv));
  if (i < n) scalar_impl::scale(x + i, n - i, s);
}

void from_f32(const float* src, void* dst, WorkDtype t, size_t n) {
  size_t i = 0;
  for (; i + W <= n; i += W) st_work(dst, t, i, ld(src + i));
  if (i < n) scalar_impl::from_f32(src + i, work_at(dst, t, i), t, n - i);
}

void to_f32(const void* src, WorkDtype t, float* dst, size_t n) {
  size_t i = 0;
  for (; i + W <= n; i += W) st(dst + i, ld_work(src, t, i));
  if (i < n) scalar_impl::to_f32(work_at(src, t, i), t, dst + i, n - i);
}

void add_to(const void* src, WorkDtype t, float* dst, size_t n) {
  size_t i = 0;
  for (; i + W <= n; i += W) st(dst + i, add(ld(dst + i), ld_work(src, t, i)));
  if (i < n) scalar_impl::add_to(work_at(src, t, i), t, dst + i, n - i);
}

const Impl kImpl = {adam,   sgd,    sumsq,  store_sumsq, finite,    scale,
                    from_f32, to_f32, add_to, adam_mixed,  sgd_mixed};

}  // namespace ZS_NS
}  // namespace
}  // namespace zs::kernels

#undef ZS_NS
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif

#endif  // ZS_OPTIM_PASS
