#include "impl/device/cuda/cublas_library.h"

#include <climits>
#include <map>
#include <mutex>
#include <string>

#include "impl/common/error.h"
#include "impl/device/dynamic_library.h"

namespace zs {
namespace {

// The few cuBLAS v2 declarations used (cublas_api.h), so that the build
// needs no cuBLAS headers or link.
using Handle = void*;
using Status = int;  // CUBLAS_STATUS_SUCCESS is 0
constexpr int kOpN = 0, kOpT = 1;

struct Api {
  Status (*create)(Handle*) = nullptr;
  Status (*set_stream)(Handle, void*) = nullptr;
  Status (*sgemm)(Handle, int, int, int, int, int, const float*, const float*, int, const float*, int,
                  const float*, float*, int) = nullptr;
  Status (*saxpy)(Handle, int, const float*, const float*, int, float*, int) = nullptr;
  Status (*sscal)(Handle, int, const float*, float*, int) = nullptr;
  Status (*snrm2)(Handle, int, const float*, int, float*) = nullptr;
};

const Api& api() {
  static std::once_flag once;
  static Api a;
  static std::string error;
  std::call_once(once, [] {
    const DynamicLibrary lib =
        open_first("ZS_CUBLAS_LIBRARY", {"libcublas.so.13", "libcublas.so.12", "libcublas.so"});
    if (lib.handle == nullptr) {
      error = "cuBLAS could not be loaded (" + lib.tried +
              "); set ZS_CUBLAS_LIBRARY to libcublas.so's path (pip's nvidia-cublas wheel has one)";
      return;
    }
    auto need = [&](const char* name, auto* out) {
      if (!lib.bind(name, out) && error.empty()) error = "cuBLAS '" + lib.path + "' has no " + name;
    };
    need("cublasCreate_v2", &a.create);
    need("cublasSetStream_v2", &a.set_stream);
    need("cublasSgemm_v2", &a.sgemm);
    need("cublasSaxpy_v2", &a.saxpy);
    need("cublasSscal_v2", &a.sscal);
    need("cublasSnrm2_v2", &a.snrm2);
  });
  if (!error.empty()) fail(Code::NotSupported, error);
  return a;
}

void check(Status s, const char* call, Device& dev) {
  if (s != 0) fail(Code::Internal, call, " on ", dev.ref().str(), ": cuBLAS status ", s);
}

// The device's handle, bound to its engine stream (made once per device).
Handle handle(Device& dev) {
  static std::mutex mu;
  static std::map<int, Handle> handles;
  const Api& a = api();
  dev.bind_thread();
  const std::lock_guard<std::mutex> lock(mu);
  Handle& h = handles[dev.ref().ordinal];
  if (h == nullptr) {
    check(a.create(&h), "cublasCreate", dev);
    check(a.set_stream(h, dev.stream()), "cublasSetStream", dev);
  }
  return h;
}

int to_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    fail(Code::InvalidArgument, "cuBLAS: ", what, " = ", v, " is out of range (0..", INT_MAX, ")");
  return static_cast<int>(v);
}

}  // namespace

void cublas_sgemm_row_major(Device& dev, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                            float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                            float beta, float* c, int64_t ldc) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
  // same memory, operands swapped.
  Handle h = handle(dev);
  check(api().sgemm(h, trans_b ? kOpT : kOpN, trans_a ? kOpT : kOpN, to_int(n, "n"), to_int(m, "m"),
                    to_int(k, "k"), &alpha, b, to_int(ldb, "ldb"), a, to_int(lda, "lda"), &beta, c,
                    to_int(ldc, "ldc")),
        "cublasSgemm", dev);
}

void cublas_saxpy(Device& dev, int64_t n, float alpha, const float* x, int64_t incx, float* y, int64_t incy) {
  Handle h = handle(dev);
  check(api().saxpy(h, to_int(n, "n"), &alpha, x, to_int(incx, "incx"), y, to_int(incy, "incy")),
        "cublasSaxpy", dev);
}

void cublas_sscal(Device& dev, int64_t n, float alpha, float* x) {
  Handle h = handle(dev);
  check(api().sscal(h, to_int(n, "n"), &alpha, x, 1), "cublasSscal", dev);
}

float cublas_snrm2(Device& dev, int64_t n, const float* x) {
  Handle h = handle(dev);
  float r = 0.0f;
  // Host pointer mode (the handle's default): the call waits for the result.
  check(api().snrm2(h, to_int(n, "n"), x, 1, &r), "cublasSnrm2", dev);
  return r;
}

}  // namespace zs
