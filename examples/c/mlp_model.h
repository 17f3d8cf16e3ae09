/*
 * The two-layer MLP of train_mlp.c: synthetic regression data and a
 * hand-written forward and backward in fp32. Header-only so that the test
 * can compute the unsharded single-process reference with the same math.
 */
#ifndef ZS_EXAMPLES_MLP_MODEL_H
#define ZS_EXAMPLES_MLP_MODEL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
 * The model in the pieces a ZeRO-3 trainer runs between fetches, over
 * samples [first, first + count) of a step (row-major scratch arrays of
 * count rows):
 *   forward 1  needs fc1:  xs, ys, hs = relu(fc1(x))
 *   forward 2  needs fc2:  the mean squared error; douts = d(loss)/d(out)
 *                          times grad_scale (the fp16 loss scale)
 *   backward 2 needs fc2:  fc2's gradients and dhs = d(loss)/d(h)
 *   backward 1 needs no params: fc1's gradients from xs, hs and dhs
 * Gradients are overwritten, d(mean loss)/d(param) times grad_scale.
 */
static inline void mlp_forward1(const float* w1, const float* b1, int step, int first, int count, float* xs,
                                float* ys, float* hs) {
  for (int s = 0; s < count; ++s) {
    float* x = xs + s * MLP_IN;
    float* h = hs + s * MLP_HIDDEN;
    mlp_sample(step, first + s, x, ys + s * MLP_OUT);
    for (int i = 0; i < MLP_HIDDEN; ++i) {
      float a = b1[i];
      for (int k = 0; k < MLP_IN; ++k) a += w1[i * MLP_IN + k] * x[k];
      h[i] = a > 0.0f ? a : 0.0f;
    }
  }
}

static inline float mlp_forward2(const float* w2, const float* b2, const float* hs, const float* ys, int count,
                                 float grad_scale, float* douts) {
  float loss = 0.0f;
  const float norm = 1.0f / (float)(count * MLP_OUT);
  for (int s = 0; s < count; ++s) {
    for (int j = 0; j < MLP_OUT; ++j) {
      float a = b2[j];
      for (int i = 0; i < MLP_HIDDEN; ++i) a += w2[j * MLP_HIDDEN + i] * hs[s * MLP_HIDDEN + i];
      const float d = a - ys[s * MLP_OUT + j];
      loss += d * d * norm;
      douts[s * MLP_OUT + j] = 2.0f * d * norm * grad_scale;
    }
  }
  return loss;
}

static inline void mlp_backward2(const float* w2, const float* hs, const float* douts, int count, float* gw2,
                                 float* gb2, float* dhs) {
  memset(gw2, 0, mlp_numel(MLP_W2) * sizeof(float));
  memset(gb2, 0, mlp_numel(MLP_B2) * sizeof(float));
  for (int s = 0; s < count; ++s) {
    float* dh = dhs + s * MLP_HIDDEN;
    for (int i = 0; i < MLP_HIDDEN; ++i) dh[i] = 0.0f;
    for (int j = 0; j < MLP_OUT; ++j) {
      const float dout = douts[s * MLP_OUT + j];
      gb2[j] += dout;
      for (int i = 0; i < MLP_HIDDEN; ++i) {
        gw2[j * MLP_HIDDEN + i] += dout * hs[s * MLP_HIDDEN + i];
        dh[i] += dout * w2[j * MLP_HIDDEN + i];
      }
    }
  }
}

static inline void mlp_backward1(const float* xs, const float* hs, const float* dhs, int count, float* gw1,
                                 float* gb1) {
  memset(gw1, 0, mlp_numel(MLP_W1) * sizeof(float));
  memset(gb1, 0, mlp_numel(MLP_B1) * sizeof(float));
  for (int s = 0; s < count; ++s) {
    for (int i = 0; i < MLP_HIDDEN; ++i) {
      if (hs[s * MLP_HIDDEN + i] <= 0.0f) continue;
      const float dh = dhs[s * MLP_HIDDEN + i];
      gb1[i] += dh;
      for (int k = 0; k < MLP_IN; ++k) gw1[i * MLP_IN + k] += dh * xs[s * MLP_IN + k];
    }
  }
}

/* Scratch for `count` samples. */
typedef struct {
  float* xs;
  float* ys;
  float* hs;
  float* douts;
  float* dhs;
} mlp_scratch;

static inline mlp_scratch mlp_scratch_new(int count) {
  mlp_scratch s;
  s.xs = (float*)malloc(sizeof(float) * (size_t)count * MLP_IN);
  s.ys = (float*)malloc(sizeof(float) * (size_t)count * MLP_OUT);
  s.hs = (float*)malloc(sizeof(float) * (size_t)count * MLP_HIDDEN);
  s.douts = (float*)malloc(sizeof(float) * (size_t)count * MLP_OUT);
  s.dhs = (float*)malloc(sizeof(float) * (size_t)count * MLP_HIDDEN);
  return s;
}

static inline void mlp_scratch_free(mlp_scratch* s) {
  free(s->xs);
  free(s->ys);
  free(s->hs);
  free(s->douts);
  free(s->dhs);
}

/* The four pieces in a row, all params at hand: the unsharded reference. */
static inline float mlp_forward_backward(const float* const params[MLP_NPARAMS], int step, int first,
                                         int count, float grad_scale, float* const grads[MLP_NPARAMS]) {
  mlp_scratch s = mlp_scratch_new(count);
  mlp_forward1(params[MLP_W1], params[MLP_B1], step, first, count, s.xs, s.ys, s.hs);
  const float loss = mlp_forward2(params[MLP_W2], params[MLP_B2], s.hs, s.ys, count, grad_scale, s.douts);
  mlp_backward2(params[MLP_W2], s.hs, s.douts, count, grads[MLP_W2], grads[MLP_B2], s.dhs);
  mlp_backward1(s.xs, s.hs, s.dhs, count, grads[MLP_W1], grads[MLP_B1]);
  mlp_scratch_free(&s);
  return loss;
}

#endif
