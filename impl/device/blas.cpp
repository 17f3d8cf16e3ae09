#include "impl/device/blas.h"

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>

#include "impl/common/error.h"
#include "impl/device/dynamic_library.h"
#include "kernels/parallel.h"

#ifdef ZS_WITH_CUDA
#include "impl/device/cuda/cublas_library.h"
#endif

namespace zs::blas {
namespace {

// The host BLAS, loaded with dlopen on first use rather than linked: the
// threaded OpenBLAS starts a worker thread when it loads, and a process
// that forks its ranks (zsrun's tests, a trainer's data loaders) must have
// none of the engine's yet. ZS_BLAS_LIBRARY names another library with the
// same cblas_* calls (MKL's libmkl_rt, BLIS); else OpenBLAS by its soname.
// Declared here (cblas.h's prototypes; row-major 101, no-trans 111, trans
// 112), so the build needs no BLAS headers.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct Api {
  void (*sgemm)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                int) = nullptr;
  void (*saxpy)(int, float, const float*, int, float*, int) = nullptr;
  void (*sscal)(int, float, float*, int) = nullptr;
  float (*snrm2)(int, const float*, int) = nullptr;
  void (*set_threads)(int) = nullptr;  // OpenBLAS's own; absent elsewhere
};

const Api& api() {
  static std::once_flag once;
  static Api a;
  static std::string error;
  std::call_once(once, [] {
    // OpenBLAS sizes its thread pool as it loads: to the engine's threads
    // unless the user chose.
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr)
      ::setenv("OPENBLAS_NUM_THREADS", std::to_string(kernels::num_threads()).c_str(), 0);
    const DynamicLibrary lib = open_first("ZS_BLAS_LIBRARY", {"libopenblas.so.0", "libopenblas.so"});
    if (lib.handle == nullptr) {
      error = "no host BLAS for the engine's matrix work (Muon's Newton-Schulz): " + lib.tried +
              ". Install OpenBLAS (apt-get install libopenblas0) or set ZS_BLAS_LIBRARY to a library "
              "with the cblas_* calls";
      return;
    }
    auto need = [&](const char* name, auto* out) {
      if (!lib.bind(name, out) && error.empty()) error = "the BLAS library '" + lib.path + "' has no " + name;
    };
    need("cblas_sgemm", &a.sgemm);
    need("cblas_saxpy", &a.saxpy);
    need("cblas_sscal", &a.sscal);
    need("cblas_snrm2", &a.snrm2);
    lib.bind("openblas_set_num_threads", &a.set_threads);  // OpenBLAS's own: may be absent
  });
  if (!error.empty()) fail(Code::NotSupported, error);
  return a;
}

// BLAS takes int sizes (LP64).
int checked_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    fail(Code::InvalidArgument, "blas: ", what, " = ", v, " is out of range for BLAS (0..", INT_MAX, ")");
  return static_cast<int>(v);
}

// OpenBLAS's threads follow the engine's kernel threads (kernels::
// num_threads: ZS_NUM_THREADS, else the CPUs this process may use), so
// ranks sharing a host do not each use every core.
void match_threads(const Api& a) {
  static int set = 0;
  const int want = kernels::num_threads();
  if (a.set_threads != nullptr && want != set) {
    a.set_threads(want);
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
  const Api& blas = api();
  match_threads(blas);
  blas.sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, checked_int(m, "m"),
             checked_int(n, "n"), checked_int(k, "k"), alpha, a, checked_int(lda, "lda"), b,
             checked_int(ldb, "ldb"), beta, c, checked_int(ldc, "ldc"));
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
  api().saxpy(checked_int(static_cast<int64_t>(n), "n"), alpha, x, checked_int(incx, "incx"), y,
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
  api().sscal(checked_int(static_cast<int64_t>(n), "n"), alpha, x, 1);
}

float nrm2(Device& dev, size_t n, const float* x) {
  if (n == 0) return 0.0f;
#ifdef ZS_WITH_CUDA
  if (dev.is_cuda()) return cublas_snrm2(dev, static_cast<int64_t>(n), x);
#endif
  (void)dev;
  return api().snrm2(checked_int(static_cast<int64_t>(n), "n"), x, 1);
}

}  // namespace zs::blas
