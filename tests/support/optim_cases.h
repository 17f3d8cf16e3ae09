// The hyper-parameter cases every optimizer kernel is checked on, shared by
// the CPU tests (vector paths against the scalar reference) and the GPU
// tests (CUDA kernels against the same reference), so both cover the same.
#pragma once

namespace zs::test {

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
