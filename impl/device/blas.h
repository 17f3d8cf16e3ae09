// fp32 dense linear algebra on whichever device holds the memory: OpenBLAS
// (its cblas_* calls) on the host, cuBLAS on the device's engine stream. The
// engine's matrix work (Muon's Newton-Schulz iteration, impl/optim/
// newton_schulz.h) is written once against these calls. Matrices are
// row-major; pointers are memory of `dev`. Both libraries are loaded with
// dlopen on first use, as NCCL is: one build runs on every machine, and a
// process that never steps Muon never starts OpenBLAS's threads. The host
// one is ZS_BLAS_LIBRARY or libopenblas.so.0, cuBLAS ZS_CUBLAS_LIBRARY or
// the usual sonames; a missing one is NotSupported naming what was tried.
#pragma once

#include <cstddef>
#include <cstdint>

#include "impl/device/device.h"

namespace zs::blas {

// c (m x n, leading dimension ldc) = alpha * op(a) @ op(b) + beta * c,
// op(a) m x k, op(b) k x n; trans_* reads the stored matrix transposed.
// beta 0 ignores what c held (NaN included), as BLAS does.
void gemm(Device& dev, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// y[i * incy] += alpha * x[i * incx], i < n.
void axpy(Device& dev, size_t n, float alpha, const float* x, int64_t incx, float* y, int64_t incy);
// x *= alpha.
void scal(Device& dev, size_t n, float alpha, float* x);
// The L2 norm of x (waits for the device: the value comes back to the host).
float nrm2(Device& dev, size_t n, const float* x);

}  // namespace zs::blas
