#include "impl/device/blas.h"

#include <cblas.h>

#include <climits>

#include "impl/common/error.h"
#include "kernels/parallel.h"

#ifdef ZS_WITH_CUDA
#include "impl/device/cuda/cublas_library.h"
#endif

namespace zs::blas {
namespace {

// BLAS takes int sizes (OpenBLAS built with 32-bit integers).
blasint checked_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    fail(Code::InvalidArgument, "blas: ", what, " = ", v, " is out of range for BLAS (0..", INT_MAX, ")");
  return static_cast<blasint>(v);
}

// OpenBLAS's threads follow the engine's kernel threads (kernels::
// num_threads: ZS_NUM_THREADS, else the CPUs this process may use), so
// ranks sharing a host do not each start one per core.
void match_threads() {
  static int set = 0;
  const int want = kernels::num_threads();
  if (want != set) {
    openblas_set_num_threads(want);
    set = want;
  }
}

}  // namespace

void gemm(Device& dev, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) {
    cublas_sgemm_row_major(dev, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#endif
  (void)dev;
  match_threads();
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              checked_int(m, "m"), checked_int(n, "n"), checked_int(k, "k"), alpha, a,
              checked_int(lda, "lda"), b, checked_int(ldb, "ldb"), beta, c, checked_int(ldc, "ldc"));
}

void axpy(Device& dev, size_t n, float alpha, const float* x, int64_t incx, float* y, int64_t incy) {
  if (n == 0) return;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) {
    cublas_saxpy(dev, static_cast<int64_t>(n), alpha, x, incx, y, incy);
    return;
  }
#endif
  (void)dev;
  cblas_saxpy(checked_int(static_cast<int64_t>(n), "n"), alpha, x, checked_int(incx, "incx"), y,
              checked_int(incy, "incy"));
}

void scal(Device& dev, size_t n, float alpha, float* x) {
  if (n == 0 || alpha == 1.0f) return;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) {
    cublas_sscal(dev, static_cast<int64_t>(n), alpha, x);
    return;
  }
#endif
  (void)dev;
  cblas_sscal(checked_int(static_cast<int64_t>(n), "n"), alpha, x, 1);
}

float nrm2(Device& dev, size_t n, const float* x) {
  if (n == 0) return 0.0f;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) return cublas_snrm2(dev, static_cast<int64_t>(n), x);
#endif
  (void)dev;
  return cblas_snrm2(checked_int(static_cast<int64_t>(n), "n"), x, 1);
}

}  // namespace zs::blas
