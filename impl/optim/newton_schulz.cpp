#include "impl/optim/newton_schulz.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "impl/device/blas.h"
#include "impl/common/copy_tally.h"
#include "impl/common/error.h"
#include "impl/device/buffer.h"

namespace zs {
namespace {

constexpr float kA = 3.4445f, kB = -4.7750f, kC = 2.0315f;
constexpr int kRestartAt = 2;  // the Gram method restarts from the matrix after this many steps

// The matrix in its wide orientation X (s x l, s <= l), as stored: X itself
// or, when tall, the transpose of the stored l x s matrix G.
struct Wide {
  Device& dev;
  int64_t s, l;
  bool tall;
  size_t numel() const { return static_cast<size_t>(s * l); }
  // r (s x s) = X X^T.
  void gram(const float* x, float* r) const {
    if (tall) blas::gemm(dev, true, false, s, s, l, 1.0f, x, s, x, s, 0.0f, r, s);
    else blas::gemm(dev, false, true, s, s, l, 1.0f, x, l, x, l, 0.0f, r, s);
  }
  // out = alpha * M X + beta * out, M s x s (a tall G: out = G M^T).
  void left(const float* m, const float* x, float alpha, float beta, float* out) const {
    if (tall) blas::gemm(dev, false, true, l, s, s, alpha, x, s, m, s, beta, out, s);
    else blas::gemm(dev, false, false, s, l, s, alpha, m, s, x, l, beta, out, l);
  }
};

// Scratch matrices from the device's pool, freed on return.
struct Scratch {
  Device& dev;
  std::vector<BufferPtr> held;
  float* take(size_t n) {
    held.push_back(std::make_shared<Buffer>(dev.device_shared(), n * sizeof(float), MemKind::Scratch));
    return static_cast<float*>(held.back()->data());
  }
};

void copy(Device& dev, float* dst, const float* src, size_t n) {
  dev.copy(dst, src, n * sizeof(float));
  copy_tally::add(CopyKind::Other, n * sizeof(float));
}

// z = b R + c R R.
void polynomial(Device& dev, const float* r, int64_t s, float* z) {
  const auto n = static_cast<size_t>(s * s);
  copy(dev, z, r, n);
  blas::gemm(dev, false, false, s, s, s, kC, r, s, r, s, kB, z, s);
}

}  // namespace

double newton_schulz_cost(int64_t rows, int64_t cols) {
  const double s = static_cast<double>(std::min(rows, cols)), l = static_cast<double>(std::max(rows, cols));
  return s * s * (l + s);
}

void newton_schulz(Device& dev, float* g, int64_t rows, int64_t cols, NsMethod method, int steps) {
  if (steps < 1) fail(Code::InvalidArgument, "Newton-Schulz steps ", steps, ": expected >= 1");
  if (rows == 0 || cols == 0) return;
  const Wide w{dev, std::min(rows, cols), std::max(rows, cols), rows > cols};
  const int64_t s = w.s;
  const auto ss = static_cast<size_t>(s * s);
  Scratch scratch{dev, {}};
  // X / (||X|| + 1e-7), the Frobenius norm (DeepSpeed's).
  const float norm = blas::nrm2(dev, w.numel(), g);
  blas::scal(dev, w.numel(), 1.0f / (norm + 1e-7f), g);
  float* x = g;
  float* other = scratch.take(w.numel());
  float* r = scratch.take(ss);
  float* z = scratch.take(ss);
  if (method == NsMethod::Standard || s == w.l) {
    // X <- a X + (b R + c R^2) X, R = X X^T.
    for (int i = 0; i < steps; ++i) {
      w.gram(x, r);
      polynomial(dev, r, s, z);
      copy(dev, other, x, w.numel());
      w.left(z, x, 1.0f, kA, other);
      std::swap(x, other);
    }
    if (x != g) copy(dev, g, x, w.numel());
    return;
  }
  // Gram: every step multiplies X on the left by p(R) = aI + z, z = bR + cR^2.
  // Q tracks the product of those factors; R moves to p(R) R p(R).
  float* q = scratch.take(ss);
  float* t = scratch.take(ss);
  std::vector<float> ones_host(static_cast<size_t>(s), 1.0f);
  float* ones = scratch.take(static_cast<size_t>(s));
  dev.copy(ones, ones_host.data(), ones_host.size() * sizeof(float));
  bool have_q = false;
  w.gram(x, r);
  for (int i = 0; i < steps; ++i) {
    if (i == kRestartAt) {
      w.left(q, x, 1.0f, 0.0f, other);  // X <- Q X
      std::swap(x, other);
      w.gram(x, r);
      have_q = false;
    }
    polynomial(dev, r, s, z);
    if (!have_q) {
      copy(dev, q, z, ss);  // Q = z + a I
      blas::axpy(dev, static_cast<size_t>(s), kA, ones, 1, q, s + 1);
      have_q = true;
    } else {
      copy(dev, t, q, ss);  // Q <- a Q + z Q
      blas::gemm(dev, false, false, s, s, s, 1.0f, z, s, t, s, kA, q, s);
    }
    if (i < steps - 1 && i + 1 != kRestartAt) {
      copy(dev, t, r, ss);  // t = a R + z R
      blas::gemm(dev, false, false, s, s, s, 1.0f, z, s, r, s, kA, t, s);
      copy(dev, r, t, ss);  // R = a t + z t
      blas::gemm(dev, false, false, s, s, s, 1.0f, z, s, t, s, kA, r, s);
    }
  }
  w.left(q, x, 1.0f, 0.0f, other);  // X <- Q X (steps >= 1: Q is made)
  if (other != g) copy(dev, g, other, w.numel());
}

}  // namespace zs
