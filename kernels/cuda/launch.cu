// Launch configuration shared by the kernels of this folder: the SM count of
// each device, queried once; and the error names of kernels/cuda/kernels.h.
#include <atomic>

#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {

namespace detail {

namespace {
constexpr int kCachedDevices = 64;
// 0: not queried yet. Racing first calls both query and store the same value.
std::atomic<int> g_sms[kCachedDevices];
}  // namespace

cudaError_t sm_count(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 0 && dev < kCachedDevices) {
    const int cached = g_sms[dev].load(std::memory_order_relaxed);
    if (cached > 0) {
      *out = cached;
      return cudaSuccess;
    }
  }
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  if (sms < 1) sms = 1;
  if (dev >= 0 && dev < kCachedDevices) g_sms[dev].store(sms, std::memory_order_relaxed);
  *out = sms;
  return cudaSuccess;
}

}  // namespace detail

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace zs::kernels::cuda
