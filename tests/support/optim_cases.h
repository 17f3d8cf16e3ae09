// The hyper-parameter cases and inputs every optimizer kernel is checked
// on, shared by the CPU tests (vector paths against the scalar reference)
// and the GPU tests (CUDA kernels against the same reference), so both
// cover the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/optim.h"

namespace zs::test {

// The working copy a step writes besides its fp32 master: none, or one of
// the kernels' working dtypes.
enum class Work { None, F32, BF16, F16 };
inline constexpr Work kWorks[] = {Work::None, Work::F32, Work::BF16, Work::F16};

inline kernels::WorkDtype wdt(Work w) {
  using kernels::WorkDtype;
  return w == Work::BF16 ? WorkDtype::BF16 : (w == Work::F16 ? WorkDtype::F16 : WorkDtype::F32);
}

inline const char* work_name(Work w) {
  switch (w) {
    case Work::None: return "none";
    case Work::F32: return "f32";
    case Work::BF16: return "bf16";
    case Work::F16: return "f16";
  }
  return "?";
}

// n normal samples, the same for a given seed in every test.
inline std::vector<float> normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct AdamCase {
  bool adamw;
  float wd;
  bool bias;
  float beta1;
};

inline constexpr AdamCase kAdamCases[] = {
    {true, 0.01f, true, 0.9f},    // AdamW
    {false, 0.01f, true, 0.9f},   // Adam with L2
    {true, 0.0f, true, 0.9f},     // no weight decay
    {true, 0.05f, false, 0.9f},   // AdamW, no bias correction
    {false, 0.02f, false, 0.9f},  // Adam L2, no bias correction
    {true, 0.01f, true, 0.3f},    // beta1 < 0.5: torch's other lerp formula
};

struct SgdCase {
  float momentum, dampening, wd;
  bool nesterov;
};

inline constexpr SgdCase kSgdCases[] = {
    {0.0f, 0.0f, 0.0f, false},   // plain
    {0.0f, 0.0f, 0.01f, false},  // plain + weight decay
    {0.9f, 0.0f, 0.0f, false},   // momentum
    {0.9f, 0.0f, 0.01f, true},   // nesterov + weight decay
    {0.8f, 0.1f, 0.0f, false},   // dampening
    {0.9f, 0.25f, 0.02f, true},  // everything
};

}  // namespace zs::test
