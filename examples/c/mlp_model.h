/*
 * The two-layer MLP of train_mlp.c: synthetic regression data and a
 * hand-written forward and backward in fp32. Header-only so that the test
 * can compute the unsharded single-process reference with the same math.
 */
#ifndef ZS_EXAMPLES_MLP_MODEL_H
#define ZS_EXAMPLES_MLP_MODEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { MLP_IN = 16, MLP_HIDDEN = 33, MLP_OUT = 5 };

/* Parameters in registration order, with their shapes. */
enum { MLP_W1, MLP_B1, MLP_W2, MLP_B2, MLP_NPARAMS };
static const int64_t mlp_shapes[MLP_NPARAMS][2] = {
    {MLP_HIDDEN, MLP_IN}, {MLP_HIDDEN, 1}, {MLP_OUT, MLP_HIDDEN}, {MLP_OUT, 1}};
static const int mlp_ndims[MLP_NPARAMS] = {2, 1, 2, 1};
static const char* const mlp_names[MLP_NPARAMS] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

static inline uint64_t mlp_numel(int p) {
  return (uint64_t)mlp_shapes[p][0] * (uint64_t)(mlp_ndims[p] == 2 ? mlp_shapes[p][1] : 1);
}

/* Deterministic value in [-1, 1) from a counter. */
static inline float mlp_noise(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (float)((double)(x >> 11) * 0x1.0p-52 - 1.0);
}

/* Sample `index` of step `step`: input x and the teacher's target y. */
static inline void mlp_sample(int step, int index, float* x, float* y) {
  for (int k = 0; k < MLP_IN; ++k) x[k] = mlp_noise(((uint64_t)step << 32) ^ ((uint64_t)index << 8) ^ (uint64_t)k);
  for (int j = 0; j < MLP_OUT; ++j) {
    float s = 0.0f;
    for (int k = 0; k < MLP_IN; ++k) s += mlp_noise(0xabcdull + (uint64_t)(j * MLP_IN + k)) * x[k];
    y[j] = sinf(s);
  }
}

/*
 * Forward and backward over samples [first, first + count) of a step.
 * Returns the mean squared error over those samples and outputs; grads
 * (same layout as params, fp32) receive d(mean loss)/d(param) times
 * grad_scale (the fp16 loss scale), overwritten.
 */
static inline float mlp_forward_backward(const float* const params[MLP_NPARAMS], int step, int first,
                                         int count, float grad_scale, float* const grads[MLP_NPARAMS]) {
  const float* w1 = params[MLP_W1];
  const float* b1 = params[MLP_B1];
  const float* w2 = params[MLP_W2];
  const float* b2 = params[MLP_B2];
  for (int p = 0; p < MLP_NPARAMS; ++p) memset(grads[p], 0, mlp_numel(p) * sizeof(float));
  float loss = 0.0f;
  const float norm = 1.0f / (float)(count * MLP_OUT);
  for (int s = 0; s < count; ++s) {
    float x[MLP_IN], y[MLP_OUT], h[MLP_HIDDEN], dout[MLP_OUT], dh[MLP_HIDDEN];
    mlp_sample(step, first + s, x, y);
    for (int i = 0; i < MLP_HIDDEN; ++i) {
      float a = b1[i];
      for (int k = 0; k < MLP_IN; ++k) a += w1[i * MLP_IN + k] * x[k];
      h[i] = a > 0.0f ? a : 0.0f;
    }
    for (int j = 0; j < MLP_OUT; ++j) {
      float a = b2[j];
      for (int i = 0; i < MLP_HIDDEN; ++i) a += w2[j * MLP_HIDDEN + i] * h[i];
      const float d = a - y[j];
      loss += d * d * norm;
      dout[j] = 2.0f * d * norm * grad_scale;
    }
    for (int i = 0; i < MLP_HIDDEN; ++i) dh[i] = 0.0f;
    for (int j = 0; j < MLP_OUT; ++j) {
      grads[MLP_B2][j] += dout[j];
      for (int i = 0; i < MLP_HIDDEN; ++i) {
        grads[MLP_W2][j * MLP_HIDDEN + i] += dout[j] * h[i];
        dh[i] += dout[j] * w2[j * MLP_HIDDEN + i];
      }
    }
    for (int i = 0; i < MLP_HIDDEN; ++i) {
      if (h[i] <= 0.0f) continue;
      grads[MLP_B1][i] += dh[i];
      for (int k = 0; k < MLP_IN; ++k) grads[MLP_W1][i * MLP_IN + k] += dh[i] * x[k];
    }
  }
  return loss;
}

#endif
