// cuBLAS, loaded with dlopen on first use (one build of the engine runs on
// machines without it, as with NCCL): the fp32 calls blas.h needs, on the
// device's engine stream, one handle per device. The library is
// ZS_CUBLAS_LIBRARY when set, else the first of libcublas.so.13, .so.12 and
// .so that loads (a process that imported torch with CUDA has it loaded
// already); none is NotSupported naming what was tried.
#pragma once

#include <cstdint>

#include "impl/device/device.h"

namespace zs {

// Row-major C = alpha * op(A) @ op(B) + beta * C (blas::gemm's contract).
void cublas_sgemm_row_major(Device& dev, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                            float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                            float beta, float* c, int64_t ldc);
void cublas_saxpy(Device& dev, int64_t n, float alpha, const float* x, int64_t incx, float* y, int64_t incy);
void cublas_sscal(Device& dev, int64_t n, float alpha, float* x);
float cublas_snrm2(Device& dev, int64_t n, const float* x);

}  // namespace zs
