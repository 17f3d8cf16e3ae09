// CUDA kernels (kernels/cuda/kernels.h) against their CPU twins
// (kernels/optim.h): the optimizer steps bit for bit against the scalar
// reference over several steps (host and device share the formulas of
// kernels/elementwise.h), the casts bit for bit over every 16-bit pattern
// and random fp32 bits (NaN and inf included), sum_squares to 1e-12
// relative, all_finite on every kind of non-finite value at the edges and
// inside, and batched_copy over misaligned segments of odd sizes. Odd sizes
// and misaligned pointers exercise both the vector and the scalar kernels.
//
// Every test skips when no CUDA device is visible; a build without CUDA
// compiles to one test that says so.
#include <gtest/gtest.h>

#ifdef ZS_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kernels.h"
#include "kernels/elementwise.h"
#include "kernels/optim.h"
#include "kernels/quant.h"
#include "tests/support/optim_cases.h"

namespace zs::kernels::cuda_test {
namespace {

namespace cu = zs::kernels::cuda;
using zs::test::kWorks;
using zs::test::normal;
using zs::test::wdt;
using zs::test::Work;
using zs::test::work_name;

constexpr size_t kNone = static_cast<size_t>(-1);
const size_t kOddSizes[] = {0, 1, 2, 3, 4, 5, 7, 63, 64, 65, 1000, 4099};
constexpr size_t kBig = 1000003;

const WorkDtype kDtypes[] = {WorkDtype::F32, WorkDtype::BF16, WorkDtype::F16};

size_t wsize(Work w) { return w == Work::None ? 0 : (w == Work::F32 ? 4 : 2); }
size_t dsize(WorkDtype t) { return t == WorkDtype::F32 ? 4 : 2; }
const char* dtype_name(WorkDtype t) {
  return t == WorkDtype::F32 ? "f32" : (t == WorkDtype::BF16 ? "bf16" : "f16");
}

std::string hex32(uint32_t u) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", u);
  return b;
}

bool cuda_device_present(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    cudaGetLastError();  // not sticky; clear it
    return false;
  }
  if (count == 0) {
    *why = "cudaGetDeviceCount reports 0 devices";
    return false;
  }
  return true;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ADD_FAILURE() << what << ": " << cudaGetErrorString(e);
}

// ---- data ------------------------------------------------------------------

// Every fp32 bit pattern is equally likely: NaNs (signalling and quiet, both
// signs), infs, subnormals and zeros included.
std::vector<float> random_bits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = bits_float(static_cast<uint32_t>(rng()));
  return v;
}

// Normal values with special ones sprinkled in (about 1 in 16), and values
// at the fp16/bf16 rounding and overflow boundaries.
std::vector<float> mixed(size_t n, uint32_t seed) {
  std::vector<float> v = normal(n, seed, 100.0f);
  const float specials[] = {
      std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
      bits_float(0x7f800001u) /* signalling NaN */, std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, std::numeric_limits<float>::denorm_min(),
      -1e-40f, std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), 65504.0f,
      65519.0f, 65520.0f, -65536.0f, 6.1e-5f, 5.96e-8f, 2.98e-8f, bits_float(0x3f808000u),
      bits_float(0x3f818000u), bits_float(0x3f801000u), bits_float(0x33000001u)};
  std::mt19937 rng(seed * 7 + 1);
  for (auto& x : v)
    if (rng() % 16 == 0) x = specials[rng() % (sizeof specials / sizeof specials[0])];
  return v;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// A working-dtype image of n elements: every 16-bit pattern in turn for the
// 16-bit dtypes, random fp32 bits for F32.
std::vector<uint8_t> work_patterns(WorkDtype t, size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n * dsize(t));
  if (t == WorkDtype::F32) {
    const std::vector<float> f = random_bits(n, seed);
    if (n) std::memcpy(out.data(), f.data(), n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(i * 40503u + seed);  // odd multiplier: a permutation
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// First index whose bits differ (when nan_any, any NaN equals any NaN: the
// GPU's arithmetic gives the canonical NaN where the CPU keeps an input
// NaN's bits), or kNone.
size_t first_float_diff(const std::vector<float>& a, const std::vector<float>& b, bool nan_any) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (float_bits(a[i]) == float_bits(b[i])) continue;
    if (nan_any && std::isnan(a[i]) && std::isnan(b[i])) continue;
    return i;
  }
  return kNone;
}

std::string float_diff_msg(const std::vector<float>& gpu, const std::vector<float>& cpu, size_t i) {
  if (i == kNone) return "";
  if (i >= gpu.size() || i >= cpu.size()) return "sizes differ";
  return "first difference at " + std::to_string(i) + ": gpu " + std::to_string(gpu[i]) + " (" +
         hex32(float_bits(gpu[i])) + "), cpu " + std::to_string(cpu[i]) + " (" +
         hex32(float_bits(cpu[i])) + ")";
}

size_t first_byte_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return i;
  return kNone;
}

// ---- device memory -----------------------------------------------------------

// n elements of T (cudaMalloc: 256-byte aligned), plus stream-ordered
// uploads and downloads that return when done.
template <class T>
class Dev {
 public:
  Dev(size_t n, cudaStream_t s) : n_(n), s_(s) {
    if (n_) check(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "cudaMalloc");
  }
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  T* at(size_t i) const { return p_ ? p_ + i : nullptr; }
  void put(const T* h, size_t n, size_t i = 0) {
    if (n == 0 || !p_) return;
    check(cudaMemcpyAsync(p_ + i, h, n * sizeof(T), cudaMemcpyHostToDevice, s_), "upload");
    check(cudaStreamSynchronize(s_), "upload sync");
  }
  void put(const std::vector<T>& h, size_t i = 0) { put(h.data(), h.size(), i); }
  std::vector<T> get(size_t n, size_t i = 0) const {
    std::vector<T> h(n);
    if (n == 0 || !p_) return h;
    check(cudaMemcpyAsync(h.data(), p_ + i, n * sizeof(T), cudaMemcpyDeviceToHost, s_), "download");
    check(cudaStreamSynchronize(s_), "download sync");
    return h;
  }
  void fill_bytes(int byte) {
    if (!p_) return;
    check(cudaMemsetAsync(p_, byte, n_ * sizeof(T), s_), "memset");
    check(cudaStreamSynchronize(s_), "memset sync");
  }

 private:
  size_t n_;
  cudaStream_t s_;
  T* p_ = nullptr;
};

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_device_present(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (!stream_) return;
    // A kernel that faulted shows here, if no check above saw it.
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaStreamDestroy(stream_);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  void* s() const { return stream_; }
  void sync() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  // A launcher's result must be 0; names the error otherwise.
  void ok(int err, const std::string& what) {
    EXPECT_EQ(err, 0) << what << ": " << cu::error_string(err);
  }

  void compare_adam(size_t n, Work w, bool adamw, float wd, bool bias, float beta1, int steps,
                    float grad_scale, size_t off, size_t woff);
  void compare_sgd(size_t n, Work w, float momentum, float dampening, float wd, bool nesterov,
                   int steps, float grad_scale, size_t off, size_t woff);
  void compare_adam_many(const std::vector<size_t>& sizes, int steps);
  void compare_sgd_many(const std::vector<size_t>& sizes, int steps);
  void compare_mixed_many(const std::vector<size_t>& sizes, int steps);
  // The kernel launches `enqueue` makes on the stream, counted as the nodes
  // of a graph captured from it.
  size_t launches_of(const std::function<int(void*)>& enqueue);
  void check_sum_squares(const std::vector<float>& x, const std::string& what);
  void check_all_finite(const std::vector<float>& x, size_t off, bool expect,
                        const std::string& what);

  cudaStream_t stream_ = nullptr;
};

// ---- optimizer steps -----------------------------------------------------------

// `steps` updates on the GPU and with the CPU scalar reference from the same
// state; every bit of master, state and working copy must agree. off, woff:
// element offsets of the fp32 arrays and of the working copy from their
// (256-byte aligned) allocations (0: the vector kernel, else the scalar one).
void CudaKernels::compare_adam(size_t n, Work w, bool adamw, float wd, bool bias, float beta1,
                               int steps, float grad_scale, size_t off, size_t woff) {
  const std::string what = "adam n=" + std::to_string(n) + " work=" + work_name(w) +
                           (adamw ? " adamw" : " adam-l2") + " wd=" + std::to_string(wd) +
                           (bias ? " bias" : " no-bias") + " beta1=" + std::to_string(beta1) +
                           " off=" + std::to_string(off) + "/" + std::to_string(woff);
  std::vector<float> p = normal(n, 1), m = normal(n, 2, 0.1f), v = normal(n, 3, 0.01f);
  for (auto& x : v) x = x * x;
  const size_t ws = wsize(w);
  std::vector<uint8_t> work(n * ws, 0);

  Dev<float> dp(n + off, stream_), dm(n + off, stream_), dv(n + off, stream_), dg(n + off, stream_);
  Dev<uint8_t> dw((n + woff) * ws, stream_);
  dp.put(p, off);
  dm.put(m, off);
  dv.put(v, off);
  void* dwork = w == Work::None ? nullptr : dw.at(woff * ws);
  for (int step = 1; step <= steps; ++step) {
    const std::vector<float> g = normal(n, 100 + static_cast<uint32_t>(step), 3.0f);
    dg.put(g, off);
    const AdamHyper h{1e-3f, beta1, 0.999f, 1e-8f, wd, adamw, bias, step};
    ok(cu::adam_step(dp.at(off), dm.at(off), dv.at(off), dg.at(off), n, h, grad_scale, dwork,
                     wdt(w), s()),
       what);
    adam_step_scalar(p.data(), m.data(), v.data(), g.data(), n, h, grad_scale,
                     w == Work::None ? nullptr : work.data(), wdt(w));
    sync();
  }
  const std::vector<float> gp = dp.get(n, off), gm = dm.get(n, off), gv = dv.get(n, off);
  size_t i = first_float_diff(gp, p, false);
  EXPECT_EQ(i, kNone) << what << ": master " << float_diff_msg(gp, p, i);
  i = first_float_diff(gm, m, false);
  EXPECT_EQ(i, kNone) << what << ": exp_avg " << float_diff_msg(gm, m, i);
  i = first_float_diff(gv, v, false);
  EXPECT_EQ(i, kNone) << what << ": exp_avg_sq " << float_diff_msg(gv, v, i);
  if (w != Work::None) {
    const std::vector<uint8_t> gw = dw.get(n * ws, woff * ws);
    i = first_byte_diff(gw, work);
    EXPECT_EQ(i, kNone) << what << ": working copy differs at byte " << i;
  }
}

void CudaKernels::compare_sgd(size_t n, Work w, float momentum, float dampening, float wd,
                              bool nesterov, int steps, float grad_scale, size_t off,
                              size_t woff) {
  const std::string what = "sgd n=" + std::to_string(n) + " work=" + work_name(w) +
                           " mom=" + std::to_string(momentum) + " damp=" +
                           std::to_string(dampening) + " wd=" + std::to_string(wd) +
                           (nesterov ? " nesterov" : "") + " off=" + std::to_string(off) + "/" +
                           std::to_string(woff);
  const bool mom = momentum != 0.0f;
  std::vector<float> p = normal(n, 4), buf(n, 0.0f);
  const size_t ws = wsize(w);
  std::vector<uint8_t> work(n * ws, 0);

  Dev<float> dp(n + off, stream_), db(n + off, stream_), dg(n + off, stream_);
  Dev<uint8_t> dw((n + woff) * ws, stream_);
  dp.put(p, off);
  db.put(buf, off);
  void* dwork = w == Work::None ? nullptr : dw.at(woff * ws);
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> g = normal(n, 200 + static_cast<uint32_t>(step));
    dg.put(g, off);
    const SgdHyper h{0.05f, momentum, dampening, wd, nesterov, step == 0};
    ok(cu::sgd_step(dp.at(off), mom ? db.at(off) : nullptr, dg.at(off), n, h, grad_scale, dwork,
                    wdt(w), s()),
       what);
    sgd_step_scalar(p.data(), mom ? buf.data() : nullptr, g.data(), n, h, grad_scale,
                    w == Work::None ? nullptr : work.data(), wdt(w));
    sync();
  }
  const std::vector<float> gp = dp.get(n, off), gb = db.get(n, off);
  size_t i = first_float_diff(gp, p, false);
  EXPECT_EQ(i, kNone) << what << ": master " << float_diff_msg(gp, p, i);
  i = first_float_diff(gb, buf, false);
  EXPECT_EQ(i, kNone) << what << ": momentum buffer " << float_diff_msg(gb, buf, i);
  if (w != Work::None) {
    const std::vector<uint8_t> gw = dw.get(n * ws, woff * ws);
    i = first_byte_diff(gw, work);
    EXPECT_EQ(i, kNone) << what << ": working copy differs at byte " << i;
  }
}

using zs::test::AdamCase;
using zs::test::kAdamCases;

using zs::test::SgdCase;
using zs::test::kSgdCases;

TEST_F(CudaKernels, AdamBitIdenticalToScalarReferenceOddSizes) {
  for (size_t n : kOddSizes)
    for (Work w : kWorks)
      for (const AdamCase& c : kAdamCases)
        for (size_t off : {0, 1}) {
          compare_adam(n, w, c.adamw, c.wd, c.bias, c.beta1, 4, 0.37f, off, off);
          if (HasFailure()) return;
        }
}

TEST_F(CudaKernels, AdamBitIdenticalToScalarReferenceLarge) {
  compare_adam(kBig, Work::BF16, true, 0.01f, true, 0.9f, 3, 0.37f, 0, 0);
  compare_adam(kBig, Work::F16, false, 0.02f, false, 0.9f, 3, 1.0f, 0, 0);
  compare_adam(kBig, Work::F32, false, 0.01f, true, 0.9f, 3, 2.5f, 1, 1);
  compare_adam(kBig, Work::None, true, 0.01f, true, 0.3f, 3, 1.0f / 1024, 0, 0);
  // Aligned fp32 arrays, misaligned working copy: the scalar kernel.
  compare_adam(kBig, Work::BF16, true, 0.01f, true, 0.9f, 2, 1.0f, 0, 1);
}

TEST_F(CudaKernels, SgdBitIdenticalToScalarReferenceOddSizes) {
  for (size_t n : kOddSizes)
    for (Work w : kWorks)
      for (const SgdCase& c : kSgdCases)
        for (size_t off : {0, 1}) {
          compare_sgd(n, w, c.momentum, c.dampening, c.wd, c.nesterov, 4, 0.37f, off, off);
          if (HasFailure()) return;
        }
}

TEST_F(CudaKernels, SgdBitIdenticalToScalarReferenceLarge) {
  compare_sgd(kBig, Work::BF16, 0.9f, 0.0f, 0.01f, true, 3, 0.37f, 0, 0);
  compare_sgd(kBig, Work::F16, 0.8f, 0.1f, 0.0f, false, 3, 1.0f, 1, 1);
  compare_sgd(kBig, Work::None, 0.0f, 0.0f, 0.01f, false, 3, 2.0f, 0, 0);
  compare_sgd(kBig, Work::F32, 0.9f, 0.25f, 0.02f, true, 3, 1.0f, 0, 1);
}

// ---- multi-tensor optimizer steps ------------------------------------------------

// Where each tensor of a multi-tensor case lives: fp32 arrays in one arena
// per kind (master, moments, grads) at element offsets, working copies in
// one byte arena, each followed by a gap no step may write. Every fifth
// tensor starts one element off its 256-byte boundary (its pointers then
// allow no 4-element access: it runs one element at a time in the same
// launch as aligned ones).
struct ManyCase {
  std::vector<size_t> n, off, woff;  // elements; fp32 arena offset (elements); working offset (bytes)
  std::vector<Work> work;
  size_t total = 0, wbytes = 0;
};

// The sizes of the multi-tensor tests: odd and even, zero, around the
// kernel's 16K chunk and the vector width, a million, and 400 small ones,
// enough for more than one launch's table (kStepTensorsPerLaunch) in the
// group without a working copy.
std::vector<size_t> many_sizes() {
  std::vector<size_t> s = {0, 1, 2, 3, 4, 5, 7, 63, 64, 65, 1000, 4099, 16383, 16384, 16385, 32769, kBig, 0};
  std::mt19937 rng(5);
  for (int i = 0; i < 400; ++i) s.push_back(rng() % 3000);
  return s;
}

ManyCase many_layout(const std::vector<size_t>& sizes) {
  ManyCase c;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t mis = i % 5 == 3 ? 1 : 0;
    // The first 20 tensors cycle through the working dtypes; of the rest
    // one in eight has a working copy.
    const Work w = (i < 20 || i % 8 == 0) ? kWorks[i % 4] : Work::None;
    c.n.push_back(sizes[i]);
    c.work.push_back(w);
    c.off.push_back(c.total + mis);
    c.total += (sizes[i] + mis + 63) / 64 * 64 + 64;
    c.woff.push_back(c.wbytes + mis * wsize(w));
    c.wbytes += ((sizes[i] + mis) * wsize(w) + 255) / 256 * 256 + 256;
  }
  return c;
}

size_t CudaKernels::launches_of(const std::function<int(void*)>& enqueue) {
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  const int err = enqueue(s());
  check(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
  EXPECT_EQ(err, 0) << cu::error_string(err);
  size_t nodes = 0;
  if (graph) {
    check(cudaGraphGetNodes(graph, nullptr, &nodes), "cudaGraphGetNodes");
    cudaGraphDestroy(graph);
  }
  return nodes;
}

// `steps` steps of every tensor: adam_step on each in turn on arenas A,
// adam_step_many over the list on arenas B, from the same state and
// gradients, each tensor its own hyper-parameters (the six kAdamCases) and
// its own step count; afterwards every byte of A and B must agree, gaps
// included.
void CudaKernels::compare_adam_many(const std::vector<size_t>& sizes, int steps) {
  const ManyCase L = many_layout(sizes);
  const size_t N = L.total;
  std::vector<float> p0 = normal(N, 11), m0 = normal(N, 12, 0.1f), v0 = normal(N, 13, 0.01f);
  for (auto& x : v0) x = x * x;
  const std::vector<uint8_t> w0 = random_bytes(L.wbytes, 14);
  Dev<float> ap(N, stream_), am(N, stream_), av(N, stream_), bp(N, stream_), bm(N, stream_), bv(N, stream_),
      dg(N, stream_);
  Dev<uint8_t> aw(L.wbytes, stream_), bw(L.wbytes, stream_);
  ap.put(p0);
  bp.put(p0);
  am.put(m0);
  bm.put(m0);
  av.put(v0);
  bv.put(v0);
  aw.put(w0);
  bw.put(w0);
  const size_t ncases = sizeof(kAdamCases) / sizeof(kAdamCases[0]);
  for (int step = 0; step < steps; ++step) {
    dg.put(normal(N, 100 + static_cast<uint32_t>(step), 3.0f));
    std::vector<AdamTensor> list;
    for (size_t i = 0; i < L.n.size(); ++i) {
      const AdamCase& c = kAdamCases[i % ncases];
      const AdamHyper h{1e-3f * static_cast<float>(1 + i % 7), c.beta1, 0.999f, 1e-8f, c.wd, c.adamw, c.bias,
                        static_cast<int64_t>(1 + i % 5 + step)};
      const size_t o = L.off[i];
      void* wa = L.work[i] == Work::None ? nullptr : aw.at(L.woff[i]);
      void* wb = L.work[i] == Work::None ? nullptr : bw.at(L.woff[i]);
      ok(cu::adam_step(ap.at(o), am.at(o), av.at(o), dg.at(o), L.n[i], h, 0.37f, wa, wdt(L.work[i]), s()),
         "adam_step tensor " + std::to_string(i));
      list.push_back({bp.at(o), bm.at(o), bv.at(o), dg.at(o), L.n[i], h, wb, wdt(L.work[i])});
    }
    ok(cu::adam_step_many(list.data(), list.size(), 0.37f, s()), "adam_step_many");
    sync();
  }
  const std::vector<float> gap = ap.get(N), gbp = bp.get(N);
  size_t i = first_float_diff(gbp, gap, false);
  EXPECT_EQ(i, kNone) << "master " << float_diff_msg(gbp, gap, i);
  const std::vector<float> gam = am.get(N), gbm = bm.get(N);
  i = first_float_diff(gbm, gam, false);
  EXPECT_EQ(i, kNone) << "exp_avg " << float_diff_msg(gbm, gam, i);
  const std::vector<float> gav = av.get(N), gbv = bv.get(N);
  i = first_float_diff(gbv, gav, false);
  EXPECT_EQ(i, kNone) << "exp_avg_sq " << float_diff_msg(gbv, gav, i);
  const std::vector<uint8_t> gaw = aw.get(L.wbytes), gbw = bw.get(L.wbytes);
  i = first_byte_diff(gbw, gaw);
  EXPECT_EQ(i, kNone) << "working copies differ at byte " << i;
  // The steps ran: every non-empty tensor's first master element moved.
  for (size_t t = 0; t < L.n.size(); ++t)
    if (L.n[t] > 0) {
      ASSERT_NE(float_bits(gbp[L.off[t]]), float_bits(p0[L.off[t]])) << "tensor " << t << " not stepped";
    }
}

// The same for SGD: each tensor its kSgdCases case (plain, weight decay,
// momentum, Nesterov, dampening), the buffer started from the gradient on
// the first step by every other tensor and read by the rest.
void CudaKernels::compare_sgd_many(const std::vector<size_t>& sizes, int steps) {
  const ManyCase L = many_layout(sizes);
  const size_t N = L.total;
  const std::vector<float> p0 = normal(N, 21), b0 = normal(N, 22, 0.1f);
  const std::vector<uint8_t> w0 = random_bytes(L.wbytes, 24);
  Dev<float> ap(N, stream_), ab(N, stream_), bp(N, stream_), bb(N, stream_), dg(N, stream_);
  Dev<uint8_t> aw(L.wbytes, stream_), bw(L.wbytes, stream_);
  ap.put(p0);
  bp.put(p0);
  ab.put(b0);
  bb.put(b0);
  aw.put(w0);
  bw.put(w0);
  const size_t ncases = sizeof(kSgdCases) / sizeof(kSgdCases[0]);
  for (int step = 0; step < steps; ++step) {
    dg.put(normal(N, 200 + static_cast<uint32_t>(step)));
    std::vector<SgdTensor> list;
    for (size_t i = 0; i < L.n.size(); ++i) {
      const SgdCase& c = kSgdCases[i % ncases];
      const SgdHyper h{0.05f * static_cast<float>(1 + i % 7), c.momentum, c.dampening, c.wd, c.nesterov,
                       step == 0 && i % 2 == 0};
      const bool mom = c.momentum != 0.0f;
      const size_t o = L.off[i];
      void* wa = L.work[i] == Work::None ? nullptr : aw.at(L.woff[i]);
      void* wb = L.work[i] == Work::None ? nullptr : bw.at(L.woff[i]);
      ok(cu::sgd_step(ap.at(o), mom ? ab.at(o) : nullptr, dg.at(o), L.n[i], h, 0.37f, wa, wdt(L.work[i]), s()),
         "sgd_step tensor " + std::to_string(i));
      list.push_back({bp.at(o), mom ? bb.at(o) : nullptr, dg.at(o), L.n[i], h, wb, wdt(L.work[i])});
    }
    ok(cu::sgd_step_many(list.data(), list.size(), 0.37f, s()), "sgd_step_many");
    sync();
  }
  const std::vector<float> gap = ap.get(N), gbp = bp.get(N);
  size_t i = first_float_diff(gbp, gap, false);
  EXPECT_EQ(i, kNone) << "master " << float_diff_msg(gbp, gap, i);
  const std::vector<float> gab = ab.get(N), gbb = bb.get(N);
  i = first_float_diff(gbb, gab, false);
  EXPECT_EQ(i, kNone) << "momentum buffer " << float_diff_msg(gbb, gab, i);
  const std::vector<uint8_t> gaw = aw.get(L.wbytes), gbw = bw.get(L.wbytes);
  i = first_byte_diff(gbw, gaw);
  EXPECT_EQ(i, kNone) << "working copies differ at byte " << i;
  for (size_t t = 0; t < L.n.size(); ++t)
    if (L.n[t] > 0) {
      ASSERT_NE(float_bits(gbp[L.off[t]]), float_bits(p0[L.off[t]])) << "tensor " << t << " not stepped";
    }
}

// The _mixed steps (masters and moments each F32 or BF16, tensor i's pair
// cycling through the four): adam_step_mixed / sgd_step_mixed on each in
// turn on arenas A against adam_step_mixed_many / sgd_step_mixed_many on
// arenas B, every byte compared, gaps included. Every fifth tensor starts
// one element off its boundary.
void CudaKernels::compare_mixed_many(const std::vector<size_t>& sizes, int steps) {
  const size_t count = sizes.size();
  auto pdt = [](size_t i) { return i % 2 ? WorkDtype::BF16 : WorkDtype::F32; };
  auto sdt = [](size_t i) { return i % 4 >= 2 ? WorkDtype::BF16 : WorkDtype::F32; };
  std::vector<size_t> poff(count), soff(count), goff(count);  // bytes, bytes, elements
  size_t pbytes = 0, sbytes = 0, gtotal = 0;
  for (size_t i = 0; i < count; ++i) {
    const size_t mis = i % 5 == 3 ? 1 : 0;
    poff[i] = pbytes + mis * dsize(pdt(i));
    pbytes += ((sizes[i] + mis) * dsize(pdt(i)) + 255) / 256 * 256 + 256;
    soff[i] = sbytes + mis * dsize(sdt(i));
    sbytes += ((sizes[i] + mis) * dsize(sdt(i)) + 255) / 256 * 256 + 256;
    goff[i] = gtotal + mis;
    gtotal += (sizes[i] + mis + 63) / 64 * 64 + 64;
  }
  // Finite values of every dtype: random normal floats' bits (bf16 reads
  // their upper halves; the squared ones stay positive for exp_avg_sq).
  auto bytes_of = [](size_t nbytes, uint32_t seed, bool positive) {
    std::vector<float> f = normal((nbytes + 3) / 4, seed, 0.5f);
    if (positive)
      for (auto& x : f) x = std::fabs(x) + 1e-3f;
    std::vector<uint8_t> out(nbytes);
    if (nbytes) std::memcpy(out.data(), f.data(), nbytes);
    return out;
  };
  const std::vector<uint8_t> p0 = bytes_of(pbytes, 41, false), m0 = bytes_of(sbytes, 42, false),
                             v0 = bytes_of(sbytes, 43, true);
  Dev<uint8_t> ap(pbytes, stream_), am(sbytes, stream_), av(sbytes, stream_), bp(pbytes, stream_),
      bm(sbytes, stream_), bv(sbytes, stream_);
  Dev<float> dg(gtotal, stream_);
  const size_t nadam = sizeof(kAdamCases) / sizeof(kAdamCases[0]);
  const size_t nsgd = sizeof(kSgdCases) / sizeof(kSgdCases[0]);
  for (int kind = 0; kind < 2; ++kind) {  // 0: Adam, 1: SGD
    ap.put(p0);
    bp.put(p0);
    am.put(m0);
    bm.put(m0);
    av.put(v0);
    bv.put(v0);
    for (int step = 0; step < steps; ++step) {
      dg.put(normal(gtotal, 300 + static_cast<uint32_t>(step)));
      std::vector<AdamMixedTensor> alist;
      std::vector<SgdMixedTensor> slist;
      for (size_t i = 0; i < count; ++i) {
        const std::string what = "tensor " + std::to_string(i);
        if (kind == 0) {
          const AdamCase& c = kAdamCases[i % nadam];
          const AdamHyper h{1e-3f * static_cast<float>(1 + i % 7), c.beta1, 0.999f, 1e-8f, c.wd, c.adamw, c.bias,
                            static_cast<int64_t>(1 + i % 5 + step)};
          ok(cu::adam_step_mixed(ap.at(poff[i]), pdt(i), am.at(soff[i]), av.at(soff[i]), sdt(i), dg.at(goff[i]),
                                 sizes[i], h, 0.37f, s()),
             "adam_step_mixed " + what);
          alist.push_back({bp.at(poff[i]), pdt(i), bm.at(soff[i]), bv.at(soff[i]), sdt(i), dg.at(goff[i]), sizes[i], h});
        } else {
          const SgdCase& c = kSgdCases[i % nsgd];
          const SgdHyper h{0.05f * static_cast<float>(1 + i % 7), c.momentum, c.dampening, c.wd, c.nesterov,
                           step == 0 && i % 2 == 0};
          const bool mom = c.momentum != 0.0f;
          ok(cu::sgd_step_mixed(ap.at(poff[i]), pdt(i), mom ? am.at(soff[i]) : nullptr, sdt(i), dg.at(goff[i]),
                                sizes[i], h, 0.37f, s()),
             "sgd_step_mixed " + what);
          slist.push_back({bp.at(poff[i]), pdt(i), mom ? bm.at(soff[i]) : nullptr, sdt(i), dg.at(goff[i]), sizes[i], h});
        }
      }
      if (kind == 0)
        ok(cu::adam_step_mixed_many(alist.data(), alist.size(), 0.37f, s()), "adam_step_mixed_many");
      else
        ok(cu::sgd_step_mixed_many(slist.data(), slist.size(), 0.37f, s()), "sgd_step_mixed_many");
      sync();
    }
    const char* name = kind == 0 ? "adam" : "sgd";
    const std::vector<uint8_t> gap = ap.get(pbytes), gbp = bp.get(pbytes);
    size_t i = first_byte_diff(gbp, gap);
    EXPECT_EQ(i, kNone) << name << ": masters differ at byte " << i;
    EXPECT_NE(first_byte_diff(gbp, p0), kNone) << name << ": nothing stepped";
    i = first_byte_diff(bm.get(sbytes), am.get(sbytes));
    EXPECT_EQ(i, kNone) << name << ": first moments differ at byte " << i;
    i = first_byte_diff(bv.get(sbytes), av.get(sbytes));
    EXPECT_EQ(i, kNone) << name << ": second moments differ at byte " << i;
  }
}

TEST_F(CudaKernels, MixedStepManyBitIdenticalToPerTensorMixedStep) { compare_mixed_many(many_sizes(), 3); }

TEST_F(CudaKernels, AdamStepManyBitIdenticalToPerTensorAdamStep) { compare_adam_many(many_sizes(), 3); }

TEST_F(CudaKernels, SgdStepManyBitIdenticalToPerTensorSgdStep) { compare_sgd_many(many_sizes(), 3); }

// One tensor alone, of each odd size: the multi-tensor kernel's edges.
TEST_F(CudaKernels, StepManyOneTensorOddSizes) {
  for (size_t n : kOddSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    compare_adam_many({n}, 2);
    compare_sgd_many({n}, 2);
    if (HasFailure()) return;
  }
}

// One launch per working dtype present (none, f32, bf16, f16), and one more
// for each further kStepTensorsPerLaunch tensors of a dtype; empty tensors
// and an empty list launch nothing.
TEST_F(CudaKernels, StepManyLaunchesOncePerWorkingDtype) {
  const size_t n = 100;
  const size_t count = cu::kStepTensorsPerLaunch + 5;
  Dev<float> p(n * count, stream_), m(n * count, stream_), v(n * count, stream_), g(n * count, stream_);
  Dev<uint16_t> w(n * count, stream_);
  p.fill_bytes(0);
  m.fill_bytes(0);
  v.fill_bytes(0);
  g.fill_bytes(0);
  const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, 1};
  const SgdHyper sh{0.1f, 0.9f, 0.0f, 0.0f, false, true};
  auto adam_list = [&](size_t k, int groups) {
    std::vector<AdamTensor> list;
    for (size_t i = 0; i < k; ++i) {
      const int grp = static_cast<int>(i) % groups;  // 0: none, 1: bf16, 2: f16
      void* work = grp == 0 ? nullptr : w.at(i * n);
      list.push_back({p.at(i * n), m.at(i * n), v.at(i * n), g.at(i * n), n, h, work,
                      grp == 2 ? WorkDtype::F16 : WorkDtype::BF16});
    }
    return list;
  };
  auto sgd_list = [&](size_t k, int groups) {
    std::vector<SgdTensor> list;
    for (size_t i = 0; i < k; ++i) {
      const int grp = static_cast<int>(i) % groups;
      void* work = grp == 0 ? nullptr : w.at(i * n);
      list.push_back({p.at(i * n), m.at(i * n), g.at(i * n), n, sh, work, grp == 2 ? WorkDtype::F16 : WorkDtype::BF16});
    }
    return list;
  };
  // Warm the launcher's per-device cache outside the capture.
  {
    auto l = adam_list(1, 1);
    ok(cu::adam_step_many(l.data(), l.size(), 1.0f, s()), "warm-up");
    sync();
  }
  for (int groups = 1; groups <= 3; ++groups) {
    auto a = adam_list(10, groups);
    EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_many(a.data(), a.size(), 1.0f, st); }),
              static_cast<size_t>(groups))
        << groups << " dtype groups";
    auto sg = sgd_list(10, groups);
    EXPECT_EQ(launches_of([&](void* st) { return cu::sgd_step_many(sg.data(), sg.size(), 1.0f, st); }),
              static_cast<size_t>(groups))
        << groups << " dtype groups (sgd)";
  }
  {
    // Mixed: one launch per (master, state) dtype pair present.
    std::vector<AdamMixedTensor> mixed;
    for (size_t i = 0; i < 12; ++i)
      mixed.push_back({p.at(i * n), i % 2 ? WorkDtype::BF16 : WorkDtype::F32, m.at(i * n), v.at(i * n),
                       i % 4 >= 2 ? WorkDtype::BF16 : WorkDtype::F32, g.at(i * n), n, h});
    EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_mixed_many(mixed.data(), mixed.size(), 1.0f, st); }),
              4u);
    mixed.resize(2);  // (f32, f32) and (bf16, f32)
    EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_mixed_many(mixed.data(), mixed.size(), 1.0f, st); }),
              2u);
  }
  auto full = adam_list(count, 1);
  EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_many(full.data(), full.size(), 1.0f, st); }), 2u)
      << count << " tensors of one dtype";
  auto sgd_full = sgd_list(count, 1);
  EXPECT_EQ(
      launches_of([&](void* st) { return cu::sgd_step_many(sgd_full.data(), sgd_full.size(), 1.0f, st); }), 2u)
      << count << " tensors of one dtype (sgd)";
  auto empty = adam_list(4, 2);
  for (auto& t : empty) t.n = 0;
  EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_many(empty.data(), empty.size(), 1.0f, st); }), 0u);
  EXPECT_EQ(launches_of([&](void* st) { return cu::adam_step_many(nullptr, 0, 1.0f, st); }), 0u);
}

// A bad argument anywhere in the list is cudaErrorInvalidValue and nothing
// is enqueued: the good tensors before it keep their values.
TEST_F(CudaKernels, StepManyBadArgumentsAreInvalidValueAndEnqueueNothing) {
  const int inv = static_cast<int>(cudaErrorInvalidValue);
  const size_t n = 1000;
  const std::vector<float> p0 = normal(n, 31);
  Dev<float> p(n, stream_), m(n, stream_), v(n, stream_), g(n, stream_);
  p.put(p0);
  m.fill_bytes(0);
  v.fill_bytes(0);
  g.put(normal(n, 32));
  const AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, 1};
  const AdamTensor good{p.at(0), m.at(0), v.at(0), g.at(0), n, h, nullptr, WorkDtype::F32};
  auto adam_with = [&](AdamTensor bad) {
    std::vector<AdamTensor> list = {good, bad};
    return cu::adam_step_many(list.data(), list.size(), 1.0f, s());
  };
  EXPECT_EQ(cu::adam_step_many(nullptr, 1, 1.0f, s()), inv);
  EXPECT_EQ(cu::sgd_step_many(nullptr, 1, 1.0f, s()), inv);
  EXPECT_EQ(cu::adam_step_many(nullptr, 0, 1.0f, s()), 0);
  EXPECT_EQ(cu::sgd_step_many(nullptr, 0, 1.0f, s()), 0);
  AdamTensor bad = good;
  bad.grad = nullptr;
  EXPECT_EQ(adam_with(bad), inv) << "null grad";
  bad = good;
  bad.h.step = 0;
  EXPECT_EQ(adam_with(bad), inv) << "bias correction at step 0";
  bad = good;
  bad.working = m.at(0);
  bad.working_dtype = static_cast<WorkDtype>(7);
  EXPECT_EQ(adam_with(bad), inv) << "unknown working dtype";
  sync();
  EXPECT_EQ(first_float_diff(p.get(n), p0, false), kNone) << "a refused adam_step_many changed the master";
  bad = good;
  bad.master = nullptr;
  bad.n = 0;
  EXPECT_EQ(adam_with(bad), 0) << "an empty tensor's pointers are not read";
  sync();
  EXPECT_NE(first_float_diff(p.get(n), p0, false), kNone) << "the good tensor was not stepped";
  // Reloaded: SGD's refusals must enqueue nothing either.
  p.put(p0);
  const SgdHyper sh{0.1f, 0.9f, 0.0f, 0.0f, false, false};
  const SgdTensor sgood{p.at(0), m.at(0), g.at(0), n, sh, nullptr, WorkDtype::F32};
  SgdTensor sbad = sgood;
  sbad.momentum_buf = nullptr;  // momentum 0.9 needs a buffer
  std::vector<SgdTensor> slist = {sgood, sbad};
  EXPECT_EQ(cu::sgd_step_many(slist.data(), slist.size(), 1.0f, s()), inv) << "momentum without a buffer";
  sbad = sgood;
  sbad.grad = nullptr;
  slist = {sgood, sbad};
  EXPECT_EQ(cu::sgd_step_many(slist.data(), slist.size(), 1.0f, s()), inv) << "null grad";
  AdamMixedTensor mbad{p.at(0), WorkDtype::F16, m.at(0), v.at(0), WorkDtype::F32, g.at(0), n, h};
  EXPECT_EQ(cu::adam_step_mixed_many(&mbad, 1, 1.0f, s()), inv) << "an f16 master";
  SgdMixedTensor msbad{p.at(0), WorkDtype::F32, nullptr, WorkDtype::F32, g.at(0), n, sh};
  EXPECT_EQ(cu::sgd_step_mixed_many(&msbad, 1, 1.0f, s()), inv) << "mixed momentum without a buffer";
  sync();
  const std::vector<float> after = p.get(n);
  EXPECT_EQ(first_float_diff(after, p0, false), kNone) << "a refused sgd_step_many changed the master";
}

// ---- reductions -----------------------------------------------------------------

// The GPU's sum within 1e-12 of the CPU's (relative), the same bits at
// every alignment of the input and on a second run.
void CudaKernels::check_sum_squares(const std::vector<float>& x, const std::string& what) {
  const size_t n = x.size();
  const double cpu = sum_squares(x.data(), n);
  Dev<float> dx(n + 3, stream_);
  Dev<double> out(4, stream_);
  double first = 0.0;
  for (size_t off = 0; off < 4; ++off) {
    dx.put(x, off);
    out.fill_bytes(0x7f);  // garbage, so that a missing write shows
    ok(cu::sum_squares(dx.at(off), n, out.at(off), s()), what);
    const double gpu = out.get(1, off)[0];
    if (n == 0) {
      EXPECT_EQ(gpu, 0.0) << what;
      EXPECT_FALSE(std::signbit(gpu)) << what;
    }
    if (std::isinf(cpu)) {
      EXPECT_EQ(gpu, cpu) << what;
    } else if (std::isnan(cpu)) {
      EXPECT_TRUE(std::isnan(gpu)) << what;
    } else {
      const double rel = cpu == 0.0 ? std::fabs(gpu) : std::fabs(gpu - cpu) / cpu;
      EXPECT_LE(rel, 1e-12) << what << " off=" << off << ": gpu " << gpu << " cpu " << cpu;
    }
    if (off == 0) {
      first = gpu;
      ok(cu::sum_squares(dx.at(off), n, out.at(off), s()), what + " again");
      const double again = out.get(1, off)[0];
      EXPECT_EQ(std::memcmp(&again, &first, sizeof(double)), 0) << what << ": not deterministic";
    } else if (!std::isnan(first)) {
      EXPECT_EQ(std::memcmp(&gpu, &first, sizeof(double)), 0)
          << what << " off=" << off << ": differs from the aligned input's " << first;
    }
  }
}

TEST_F(CudaKernels, SumSquaresMatchesCpuAndIsDeterministic) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{7},
                   size_t{1000}, size_t{16383}, size_t{16384}, size_t{16385}, size_t{65537},
                   size_t{1000003}, size_t{16777259}}) {
    check_sum_squares(normal(n, 10 + static_cast<uint32_t>(n % 1000), 2.0f),
                      "sum_squares n=" + std::to_string(n));
    if (HasFailure()) return;
  }
  // Wide dynamic range, and tiny values (subnormal squares are exact in double).
  std::vector<float> x = normal(300007, 11, 1.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i % 120) - 60);
  check_sum_squares(x, "sum_squares wide range");
  std::vector<float> tiny(70001, std::numeric_limits<float>::denorm_min());
  check_sum_squares(tiny, "sum_squares subnormals");
  std::vector<float> big(70001, std::numeric_limits<float>::max());
  check_sum_squares(big, "sum_squares FLT_MAX");
  std::vector<float> inf = normal(50000, 12);
  inf[31337] = -std::numeric_limits<float>::infinity();
  check_sum_squares(inf, "sum_squares with -inf");
}

void CudaKernels::check_all_finite(const std::vector<float>& x, size_t off, bool expect,
                                   const std::string& what) {
  const size_t n = x.size();
  EXPECT_EQ(all_finite(x.data(), n), expect) << what << ": the CPU twin";
  Dev<float> dx(n + off + 1, stream_);
  dx.put(x, off);
  // Just past the range: must not count.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  dx.put(&nan, 1, off + n);
  Dev<int> flag(1, stream_);
  flag.fill_bytes(0x5a);
  ok(cu::all_finite(dx.at(off), n, flag.at(0), s()), what);
  EXPECT_EQ(flag.get(1)[0], expect ? 1 : 0) << what << " off=" << off;
}

TEST_F(CudaKernels, AllFiniteFindsEveryKindOfBadValueAnywhere) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       -std::numeric_limits<float>::quiet_NaN(), bits_float(0x7f800001u),
                       bits_float(0xff800001u), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{16384}, size_t{16385},
                   size_t{1000003}}) {
    for (size_t off : {0, 1}) {
      std::vector<float> x = normal(n, 20, 1e30f);
      if (n > 2) {
        x[1] = std::numeric_limits<float>::max();
        x[2] = -std::numeric_limits<float>::denorm_min();
      }
      const std::string base = "all_finite n=" + std::to_string(n);
      check_all_finite(x, off, true, base + " all finite");
      if (n == 0) continue;
      size_t k = 0;
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        std::vector<float> y = x;
        y[pos] = bad[k++ % (sizeof bad / sizeof bad[0])];
        check_all_finite(y, off, false, base + " bad " + hex32(float_bits(y[pos])) + " at " +
                                            std::to_string(pos));
      }
      if (HasFailure()) return;
    }
  }
  std::vector<float> all_bad(100000, -std::numeric_limits<float>::infinity());
  check_all_finite(all_bad, 0, false, "all_finite every element -inf");
}

// ---- casts and element-wise arithmetic ------------------------------------------

TEST_F(CudaKernels, ScaleInplaceMatchesCpu) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65}, size_t{1000003}})
    for (float sc : {0.5f, 3.0f, 1.0f / 3.0f, -2.0f, 0.0f, 1e-30f})
      for (size_t off : {0, 1}) {
        const std::string what = "scale n=" + std::to_string(n) + " s=" + std::to_string(sc) +
                                 " off=" + std::to_string(off);
        std::vector<float> x = mixed(n, 30);
        Dev<float> dx(n + off, stream_);
        dx.put(x, off);
        ok(cu::scale_inplace(dx.at(off), n, sc, s()), what);
        scale_inplace(x.data(), n, sc);
        const std::vector<float> g = dx.get(n, off);
        const size_t i = first_float_diff(g, x, true);
        EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, x, i);
      }
}

TEST_F(CudaKernels, CastFromF32MatchesCpuBitForBit) {
  for (WorkDtype t : kDtypes)
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65}, size_t{1000003}})
      for (size_t off : {0, 1})
        for (int kind = 0; kind < 2; ++kind) {
          const std::string what = std::string("cast_from_f32 ") + dtype_name(t) +
                                   " n=" + std::to_string(n) + " off=" + std::to_string(off) +
                                   (kind ? " random bits" : " mixed");
          const std::vector<float> x = kind ? random_bits(n, 40) : mixed(n, 41);
          const size_t es = dsize(t);
          std::vector<uint8_t> cpu(n * es);
          cast_from_f32(x.data(), cpu.data(), t, n);
          Dev<float> dx(n + off, stream_);
          Dev<uint8_t> dd((n + off) * es, stream_);
          dx.put(x, off);
          ok(cu::cast_from_f32(dx.at(off), dd.at(off * es), t, n, s()), what);
          const std::vector<uint8_t> g = dd.get(n * es, off * es);
          const size_t i = first_byte_diff(g, cpu);
          EXPECT_EQ(i, kNone) << what << ": differs at byte " << i;
        }
}

TEST_F(CudaKernels, CastToF32AllPatternsMatchesCpuBitForBit) {
  for (WorkDtype t : kDtypes)
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65536}, size_t{1000003}})
      for (size_t off : {0, 1}) {
        const std::string what = std::string("cast_to_f32 ") + dtype_name(t) +
                                 " n=" + std::to_string(n) + " off=" + std::to_string(off);
        const size_t es = dsize(t);
        const std::vector<uint8_t> src = work_patterns(t, n, 50);
        // The shared conversion (the scalar reference) bit for bit; the CPU
        // kernel too, but for NaNs: its AVX paths' vcvtph2ps quiets a
        // signalling fp16 NaN, which the conversion keeps.
        std::vector<float> ref(n), cpu(n);
        for (size_t k = 0; k < n; ++k) ref[k] = load_work1(src.data(), t, k);
        cast_to_f32(src.data(), t, cpu.data(), n);
        Dev<uint8_t> ds((n + off) * es, stream_);
        Dev<float> dd(n + off, stream_);
        ds.put(src, off * es);
        ok(cu::cast_to_f32(ds.at(off * es), t, dd.at(off), n, s()), what);
        const std::vector<float> g = dd.get(n, off);
        size_t i = first_float_diff(g, ref, false);
        EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, ref, i);
        i = first_float_diff(g, cpu, true);
        EXPECT_EQ(i, kNone) << what << " against the CPU kernel: " << float_diff_msg(g, cpu, i);
      }
}

// widen, then a true division by the divisor (divisor 1: widen's bits).
TEST_F(CudaKernels, CastToF32ScaledIsWidenThenDivide) {
  for (WorkDtype t : kDtypes)
    for (float divisor : {1.0f, 2.0f, 3.0f, 7.5f, 1e-3f})
      for (size_t n : {size_t{1}, size_t{7}, size_t{65536}, size_t{1000003}})
        for (size_t off : {0, 1}) {
          const std::string what = std::string("cast_to_f32_scaled ") + dtype_name(t) +
                                   " divisor=" + std::to_string(divisor) +
                                   " n=" + std::to_string(n) + " off=" + std::to_string(off);
          const size_t es = dsize(t);
          const std::vector<uint8_t> src = work_patterns(t, n, 60);
          std::vector<float> cpu(n);  // the shared conversion, as above
          for (size_t k = 0; k < n; ++k) cpu[k] = load_work1(src.data(), t, k);
          if (divisor != 1.0f)
            for (auto& x : cpu) x = x / divisor;
          Dev<uint8_t> ds((n + off) * es, stream_);
          Dev<float> dd(n + off, stream_);
          ds.put(src, off * es);
          ok(cu::cast_to_f32_scaled(ds.at(off * es), t, dd.at(off), n, divisor, s()), what);
          const std::vector<float> g = dd.get(n, off);
          const size_t i = first_float_diff(g, cpu, divisor != 1.0f);
          EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, cpu, i);
        }
}

// Any working dtype into any other: widen, a true division, one rounding
// (the CPU's ops::narrow_scaled loop over the shared conversions), bit for
// bit; a NaN out of a division may be the GPU's canonical one.
TEST_F(CudaKernels, CastScaledIsWidenDivideRoundOnce) {
  for (WorkDtype st : kDtypes)
    for (WorkDtype dt : kDtypes)
      for (float divisor : {1.0f, 2.0f, 3.0f, 1e-3f})
        for (size_t n : {size_t{1}, size_t{7}, size_t{65536}, size_t{1000003}})
          for (size_t off : {0, 1}) {
            const std::string what = std::string("cast_scaled ") + dtype_name(st) + " -> " +
                                     dtype_name(dt) + " divisor=" + std::to_string(divisor) +
                                     " n=" + std::to_string(n) + " off=" + std::to_string(off);
            const size_t ss = dsize(st), ds_ = dsize(dt);
            const std::vector<uint8_t> src = work_patterns(st, n, 80);
            std::vector<uint8_t> ref_bytes(n * ds_);
            for (size_t k = 0; k < n; ++k) {
              const float x = load_work1(src.data(), st, k);
              store_work1(ref_bytes.data(), dt, k, divisor == 1.0f ? x : x / divisor);
            }
            Dev<uint8_t> ds((n + off) * ss, stream_);
            Dev<uint8_t> dd((n + off) * ds_, stream_);
            ds.put(src, off * ss);
            ok(cu::cast_scaled(ds.at(off * ss), st, dd.at(off * ds_), dt, n, divisor, s()), what);
            const std::vector<uint8_t> got = dd.get(n * ds_, off * ds_);
            std::vector<float> g(n), ref(n);  // widening is exact: equal floats, equal bits
            for (size_t k = 0; k < n; ++k) {
              g[k] = load_work1(got.data(), dt, k);
              ref[k] = load_work1(ref_bytes.data(), dt, k);
            }
            const size_t i = first_float_diff(g, ref, divisor != 1.0f);
            EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, ref, i);
          }
}

TEST_F(CudaKernels, AddToF32AllPatternsMatchesCpu) {
  for (WorkDtype t : kDtypes)
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65536}, size_t{1000003}})
      for (size_t off : {0, 1}) {
        const std::string what = std::string("add_to_f32 ") + dtype_name(t) +
                                 " n=" + std::to_string(n) + " off=" + std::to_string(off);
        const size_t es = dsize(t);
        const std::vector<uint8_t> src = work_patterns(t, n, 70);
        std::vector<float> acc = mixed(n, 71);
        Dev<uint8_t> ds((n + off) * es, stream_);
        Dev<float> dd(n + off, stream_);
        ds.put(src, off * es);
        dd.put(acc, off);
        ok(cu::add_to_f32(ds.at(off * es), t, dd.at(off), n, s()), what);
        add_to_f32(src.data(), t, acc.data(), n);
        const std::vector<float> g = dd.get(n, off);
        const size_t i = first_float_diff(g, acc, true);
        EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, acc, i);
      }
}

TEST_F(CudaKernels, AddF32MatchesCpu) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{65}, size_t{1000003}})
    for (size_t soff : {0, 1})
      for (size_t doff : {0, 2}) {
        const std::string what = "add_f32 n=" + std::to_string(n) + " off=" +
                                 std::to_string(soff) + "/" + std::to_string(doff);
        const std::vector<float> src = mixed(n, 80);
        std::vector<float> acc = mixed(n, 81);
        Dev<float> ds(n + soff, stream_), dd(n + doff, stream_);
        ds.put(src, soff);
        dd.put(acc, doff);
        ok(cu::add_f32(dd.at(doff), ds.at(soff), n, s()), what);
        add_to_f32(src.data(), WorkDtype::F32, acc.data(), n);
        const std::vector<float> g = dd.get(n, doff);
        const size_t i = first_float_diff(g, acc, true);
        EXPECT_EQ(i, kNone) << what << ": " << float_diff_msg(g, acc, i);
      }
}

// ---- batched_copy -----------------------------------------------------------------

struct Seg {
  size_t dst_off, src_off, bytes;
};

// Segments of many sizes, laid out in dst one after another with gaps, src
// anywhere in the arena. skew < 0: offsets at random; else offsets are
// 16 * k + skew_dst (dst) and 16 * k + skew_src (src), and, when
// len_align > 1, lengths are multiples of it.
struct Layout {
  size_t count;
  int skew_dst, skew_src;
  size_t len_align;
};

std::vector<Seg> make_segments(const Layout& L, size_t arena, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const size_t sizes[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 255, 4096, 4099};
  auto place = [&](size_t at, int skew) {
    if (skew < 0) return at;
    return (at + 15) / 16 * 16 + static_cast<size_t>(skew);
  };
  std::vector<Seg> segs;
  size_t cursor = 0;
  for (size_t k = 0; k < L.count; ++k) {
    size_t bytes;
    const uint64_t r = rng() % 100;
    if (r < 60)
      bytes = sizes[rng() % (sizeof sizes / sizeof sizes[0])];
    else if (r < 97)
      bytes = rng() % 20000;
    else
      bytes = 32768 * (1 + rng() % 4) + rng() % 3 - 1;  // around whole tiles
    if (L.len_align > 1) bytes -= bytes % L.len_align;
    const size_t d = place(cursor + rng() % 64, L.skew_dst);
    if (d + bytes + 32 > arena) break;
    const size_t src = place(rng() % (arena - bytes - 32), L.skew_src);
    segs.push_back({d, src, bytes});
    cursor = d + bytes;
  }
  return segs;
}

TEST_F(CudaKernels, BatchedCopyCopiesEverySegmentAndNothingElse) {
  constexpr size_t kArena = 48 << 20;
  const std::vector<uint8_t> src = random_bytes(kArena, 90);
  Dev<uint8_t> dsrc(kArena, stream_), ddst(kArena, stream_);
  dsrc.put(src);
  const Layout layouts[] = {
      {300, 0, 0, 16},   // 16-byte words only
      {300, 3, 3, 1},    // 16-byte words with byte heads and tails
      {300, 8, 0, 1},    // dst and src share 8-byte alignment only
      {300, 4, 8, 1},    // 4
      {300, 2, 4, 1},    // 2
      {300, 1, 2, 1},    // none: bytes
      {300, -1, -1, 1},  // random
      {2500, -1, -1, 1}, // more segments than one launch takes
      {2500, 0, 0, 16},
      {1000, 0, 0, 16},  // exactly one launch
      {1001, 5, 9, 1},   // one more
  };
  uint32_t seed = 91;
  for (const Layout& L : layouts) {
    const std::string what = "batched_copy count=" + std::to_string(L.count) +
                             " skew=" + std::to_string(L.skew_dst) + "/" +
                             std::to_string(L.skew_src) + " len_align=" +
                             std::to_string(L.len_align);
    const std::vector<Seg> segs = make_segments(L, kArena, seed++);
    ASSERT_EQ(segs.size(), L.count) << what << ": the arena is too small for the test";
    std::vector<uint8_t> expect(kArena, 0xab);
    std::vector<cu::CopySegment> table;
    for (const Seg& g : segs) {
      std::memcpy(expect.data() + g.dst_off, src.data() + g.src_off, g.bytes);
      table.push_back({ddst.at(g.dst_off), dsrc.at(g.src_off), g.bytes});
    }
    ddst.fill_bytes(0xab);
    ok(cu::batched_copy(table.data(), table.size(), s()), what);
    table.assign(table.size(), cu::CopySegment{nullptr, nullptr, 0});  // the table may go at once
    const std::vector<uint8_t> got = ddst.get(kArena);
    const size_t i = first_byte_diff(got, expect);
    EXPECT_EQ(i, kNone) << what << ": differs at byte " << i;
    if (HasFailure()) return;
  }
  // Nothing to do.
  ok(cu::batched_copy(nullptr, 0, s()), "batched_copy of nothing");
  const std::vector<cu::CopySegment> empty(5, cu::CopySegment{nullptr, nullptr, 0});
  ok(cu::batched_copy(empty.data(), empty.size(), s()), "batched_copy of empty segments");
}

// ---- arguments ---------------------------------------------------------------------

TEST_F(CudaKernels, BadArgumentsAreInvalidValueAndEnqueueNothing) {
  const int inval = static_cast<int>(cudaErrorInvalidValue);
  Dev<float> a(64, stream_), b(64, stream_), c(64, stream_), g(64, stream_);
  Dev<uint8_t> wb(256, stream_);
  const AdamHyper adam{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1};
  EXPECT_EQ(cu::adam_step(nullptr, b.at(0), c.at(0), g.at(0), 4, adam, 1.0f, nullptr,
                          WorkDtype::F32, s()),
            inval);
  EXPECT_EQ(cu::adam_step(a.at(0), b.at(0), nullptr, g.at(0), 4, adam, 1.0f, nullptr,
                          WorkDtype::F32, s()),
            inval);
  AdamHyper step0 = adam;
  step0.step = 0;
  EXPECT_EQ(cu::adam_step(a.at(0), b.at(0), c.at(0), g.at(0), 4, step0, 1.0f, nullptr,
                          WorkDtype::F32, s()),
            inval);
  EXPECT_EQ(cu::adam_step(a.at(0), b.at(0), c.at(0), g.at(0), 4, adam, 1.0f, wb.at(0),
                          static_cast<WorkDtype>(7), s()),
            inval);
  EXPECT_EQ(cu::adam_step(nullptr, nullptr, nullptr, nullptr, 0, step0, 1.0f, nullptr,
                          WorkDtype::F32, s()),
            0);
  const SgdHyper sgd{0.1f, 0.9f, 0.0f, 0.0f, false, false};
  EXPECT_EQ(cu::sgd_step(a.at(0), nullptr, g.at(0), 4, sgd, 1.0f, nullptr, WorkDtype::F32, s()),
            inval);
  const SgdHyper plain{0.1f, 0.0f, 0.0f, 0.0f, false, false};
  EXPECT_EQ(cu::sgd_step(a.at(0), nullptr, g.at(0), 4, plain, 1.0f, nullptr, WorkDtype::F32, s()),
            0);
  EXPECT_EQ(cu::sum_squares(a.at(0), 4, nullptr, s()), inval);
  EXPECT_EQ(cu::all_finite(a.at(0), 4, nullptr, s()), inval);
  EXPECT_EQ(cu::scale_inplace(nullptr, 4, 2.0f, s()), inval);
  EXPECT_EQ(cu::cast_from_f32(nullptr, wb.at(0), WorkDtype::BF16, 4, s()), inval);
  EXPECT_EQ(cu::cast_to_f32(wb.at(0), WorkDtype::BF16, nullptr, 4, s()), inval);
  EXPECT_EQ(cu::cast_to_f32_scaled(nullptr, WorkDtype::F16, a.at(0), 4, 2.0f, s()), inval);
  EXPECT_EQ(cu::cast_scaled(nullptr, WorkDtype::F32, wb.at(0), WorkDtype::BF16, 4, 2.0f, s()), inval);
  EXPECT_EQ(cu::cast_scaled(a.at(0), WorkDtype::F32, wb.at(0), static_cast<WorkDtype>(9), 4, 2.0f, s()),
            inval);
  EXPECT_EQ(cu::add_to_f32(wb.at(0), static_cast<WorkDtype>(9), a.at(0), 4, s()), inval);
  EXPECT_EQ(cu::add_f32(a.at(0), nullptr, 4, s()), inval);
  // n == 0: nothing to do, pointers unchecked.
  EXPECT_EQ(cu::scale_inplace(nullptr, 0, 2.0f, s()), 0);
  EXPECT_EQ(cu::cast_from_f32(nullptr, nullptr, WorkDtype::BF16, 0, s()), 0);
  EXPECT_EQ(cu::add_f32(nullptr, nullptr, 0, s()), 0);

  // A bad segment anywhere in the table: nothing is copied, not even the
  // good segments before it.
  b.fill_bytes(0);
  a.fill_bytes(0x11);
  const cu::CopySegment segs[] = {{b.at(0), a.at(0), 64}, {nullptr, a.at(0), 4}};
  EXPECT_EQ(cu::batched_copy(segs, 2, s()), inval);
  EXPECT_EQ(cu::batched_copy(nullptr, 3, s()), inval);
  sync();
  const std::vector<float> bb = b.get(64);
  EXPECT_TRUE(std::all_of(bb.begin(), bb.end(), [](float x) { return float_bits(x) == 0; }));

  // The result scalars of an empty reduction are still written.
  Dev<double> sum(1, stream_);
  Dev<int> flag(1, stream_);
  sum.fill_bytes(0x7f);
  flag.fill_bytes(0);
  ok(cu::sum_squares(nullptr, 0, sum.at(0), s()), "sum_squares n=0");
  ok(cu::all_finite(nullptr, 0, flag.at(0), s()), "all_finite n=0");
  EXPECT_EQ(sum.get(1)[0], 0.0);
  EXPECT_EQ(flag.get(1)[0], 1);
  EXPECT_STRNE(cu::error_string(inval), "");
}

// qwZ block quantization: codes, scales and dequantized values bit for
// bit as the CPU kernels (kernels/quant.h), NaN and inf blocks included.
TEST_F(CudaKernels, QuantizeDequantizeBitIdenticalToCpu) {
  for (WorkDtype t : kDtypes)
    for (int bits : {8, 4})
      for (size_t block : {size_t{2}, size_t{256}, size_t{2048}})
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{255}, size_t{257}, kBig}) {
          const std::string what = std::string("quantize ") + dtype_name(t) + " int" +
                                   std::to_string(bits) + " block " + std::to_string(block) +
                                   " n=" + std::to_string(n);
          const QuantSpec q{bits, block};
          const size_t es = dsize(t);
          // Random bits (NaN and inf among them), values with specials
          // sprinkled in, or plain normal values.
          const std::vector<float> f = n == 7 ? random_bits(n, 50)
                                       : n == 1 || n == 255 ? mixed(n, 51)
                                                            : normal(n, 52, 3.0f);
          std::vector<uint8_t> x(n * es);
          if (t == WorkDtype::F32) {
            if (n) std::memcpy(x.data(), f.data(), n * 4);
          } else {
            cast_from_f32(f.data(), x.data(), t, n);
          }
          std::vector<uint8_t> codes(quant_code_bytes(n, q)), deq(n * es);
          std::vector<float> scales(quant_blocks(n, q));
          quantize(x.data(), t, n, q, codes.data(), scales.data());
          dequantize(codes.data(), scales.data(), n, q, deq.data(), t);
          Dev<uint8_t> dx(x.size(), stream_), dc(codes.size(), stream_), dd(deq.size(), stream_);
          Dev<float> dsc(scales.size(), stream_);
          dx.put(x);
          dc.fill_bytes(0xAB);
          ok(cu::quantize(dx.at(0), t, n, bits, block, dc.at(0), dsc.at(0), s()), what);
          ok(cu::dequantize(dc.at(0), dsc.at(0), n, bits, block, dd.at(0), t, s()), what);
          EXPECT_EQ(first_byte_diff(dc.get(codes.size()), codes), kNone) << what << ": codes";
          const std::vector<float> gs = dsc.get(scales.size());
          EXPECT_EQ(0, scales.empty() ? 0 : std::memcmp(gs.data(), scales.data(), scales.size() * 4))
              << what << ": scales";
          EXPECT_EQ(first_byte_diff(dd.get(deq.size()), deq), kNone) << what << ": dequantized";
        }
  // Bad arguments enqueue nothing.
  EXPECT_EQ(cu::quantize(nullptr, WorkDtype::F32, 1, 8, 256, nullptr, nullptr, s()),
            static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(cu::dequantize(nullptr, nullptr, 8, 4, 3, nullptr, WorkDtype::F32, s()),
            static_cast<int>(cudaErrorInvalidValue));
}

// LoCo's fused quantize-with-error: codes, scales and the updated error
// bit for bit as the CPU kernel, over three steps (the error carries), odd
// sizes, int8 and int4, an inf block included.
TEST_F(CudaKernels, QuantizeWithErrorBitIdenticalToCpu) {
  for (int bits : {8, 4})
    for (size_t block : {size_t{2}, size_t{256}, size_t{2048}})
      for (size_t n : {size_t{1}, size_t{7}, size_t{257}, kBig}) {
        const std::string what = "quantize_with_error int" + std::to_string(bits) + " block " +
                                 std::to_string(block) + " n=" + std::to_string(n);
        const QuantSpec q{bits, block};
        std::vector<float> err = normal(n, 60, 0.05f);
        Dev<float> dg(n, stream_), de(n, stream_), dsc(quant_blocks(n, q), stream_);
        Dev<uint8_t> dc(quant_code_bytes(n, q), stream_);
        de.put(err);
        for (int step = 0; step < 3; ++step) {
          std::vector<float> g = normal(n, 61 + static_cast<unsigned>(step), 1.0f);
          if (step == 1) g[n / 2] = INFINITY;
          std::vector<uint8_t> codes(quant_code_bytes(n, q));
          std::vector<float> scales(quant_blocks(n, q));
          quantize_with_error(g.data(), err.data(), 0.8f, n, q, codes.data(), scales.data());
          dg.put(g);
          dc.fill_bytes(0xAB);
          ok(cu::quantize_with_error(dg.at(0), de.at(0), 0.8f, n, bits, block, dc.at(0), dsc.at(0), s()), what);
          EXPECT_EQ(first_byte_diff(dc.get(codes.size()), codes), kNone) << what << ": codes";
          const std::vector<float> gs = dsc.get(scales.size()), ge = de.get(n);
          EXPECT_EQ(0, std::memcmp(gs.data(), scales.data(), scales.size() * 4)) << what << ": scales";
          EXPECT_EQ(0, std::memcmp(ge.data(), err.data(), n * 4)) << what << ": errors";
        }
      }
  EXPECT_EQ(cu::quantize_with_error(nullptr, nullptr, 0.8f, 1, 8, 256, nullptr, nullptr, s()),
            static_cast<int>(cudaErrorInvalidValue));
}

}  // namespace
}  // namespace zs::kernels::cuda_test

#else  // !ZS_WITH_CUDA

TEST(CudaKernels, SkippedWithoutCuda) {
  GTEST_SKIP() << "this build has no CUDA (ZS_WITH_CUDA is not defined): the CUDA kernels are "
                  "not compiled in";
}

#endif  // ZS_WITH_CUDA
