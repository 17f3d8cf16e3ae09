// CUDA devices: memory from a caching pool over cudaMalloc, pinned staging
// memory over cudaHostAlloc, and one engine stream per device. The engine
// stream is a blocking stream on purpose: it orders itself after work the
// trainer queued on the legacy default stream (PyTorch's default), so a
// gradient computed there is complete before the engine reads it, without
// a host synchronisation.
#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "impl/common/env.h"
#include "impl/device/cuda/cuda_check.h"
#include "impl/device/device.h"

namespace zs {
namespace {

struct Availability {
  int count = 0;
  std::string why;
};

const Availability& availability() {
  static const Availability a = [] {
    Availability r;
    const cudaError_t e = cudaGetDeviceCount(&r.count);
    if (e != cudaSuccess) {
      cudaGetLastError();
      r.count = 0;
      r.why = std::string("CUDA is not usable here: ") + cudaGetErrorString(e);
    } else if (r.count == 0) {
      r.why = "no CUDA device is visible";
    }
    return r;
  }();
  return a;
}

std::shared_ptr<CachingPool> make_device_pool(int ordinal) {
  CachingPool::Backend b;
  b.name = "cuda:" + std::to_string(ordinal);
  b.allocate = [ordinal](size_t size) -> void* {
    void* p = nullptr;
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaMalloc(&p, size) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  b.release = [ordinal](void* p, size_t) {
    cudaSetDevice(ordinal);
    cudaFree(p);
  };
  b.alignment = 256;
  // cudaMalloc synchronises the device and costs far more than malloc, so
  // every size is cached; ZS_CUDA_CACHE_MB caps the idle bytes (default:
  // no cap; idle blocks are returned when an allocation fails).
  const int mb = env_int("ZS_CUDA_CACHE_MB", -1);
  const uint64_t limit = mb < 0 ? UINT64_MAX : static_cast<uint64_t>(mb) << 20;
  return std::make_shared<CachingPool>(std::move(b), 0, limit);
}

std::shared_ptr<CachingPool> make_pinned_pool(int ordinal) {
  CachingPool::Backend b;
  b.name = "pinned host (for cuda:" + std::to_string(ordinal) + ")";
  // Pinned memory is portable across devices, but the runtime call still
  // needs a context: select ours first, or a thread that never chose a
  // device (a group's worker) creates one on device 0.
  b.allocate = [ordinal](size_t size) -> void* {
    void* p = nullptr;
    if (cudaSetDevice(ordinal) != cudaSuccess ||
        cudaHostAlloc(&p, size, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  b.release = [ordinal](void* p, size_t) {
    cudaSetDevice(ordinal);
    cudaFreeHost(p);
  };
  b.alignment = 64;
  const auto limit = static_cast<uint64_t>(env_int("ZS_HOST_CACHE_MB", 1024)) << 20;
  return std::make_shared<CachingPool>(std::move(b), 0, limit);
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {
    check_cuda(cudaSetDevice(ordinal), "select cuda:", ordinal);
    check_cuda(cudaStreamCreate(&stream_), "create the engine stream on cuda:", ordinal);
    pool_ = make_device_pool(ordinal);
    staging_ = make_pinned_pool(ordinal);
  }
  // Never destroyed (see cuda_device): the driver may be torn down first.

  DeviceRef ref() const override { return {DeviceKind::Cuda, ordinal_}; }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    bind_thread();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "copy of ", bytes,
               " bytes on cuda:", ordinal_);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes == 0) return;
    bind_thread();
    check_cuda(cudaMemsetAsync(p, 0, bytes, stream_), "zero ", bytes, " bytes on cuda:", ordinal_);
  }
  void synchronize() override {
    bind_thread();
    check_cuda(cudaStreamSynchronize(stream_), "engine stream of cuda:", ordinal_);
  }
  void bind_thread() override {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == ordinal_) return;
    check_cuda(cudaSetDevice(ordinal_), "select cuda:", ordinal_);
  }
  void* stream() const override { return stream_; }
  bool owns_pointer(const void* p) const override {
    const DeviceRef where = pointer_location(p);
    return where.is_cuda() && where.ordinal == ordinal_;
  }

 private:
  const int ordinal_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

int cuda_device_count(const char** why) {
  const Availability& a = availability();
  if (why) *why = a.why.c_str();
  return a.count;
}

std::shared_ptr<Device> cuda_device(int ordinal) {
  const char* why = "";
  const int count = cuda_device_count(&why);
  if (count == 0) fail(Code::NotSupported, "device cuda:", ordinal, ": ", why);
  if (ordinal < 0 || ordinal >= count)
    fail(Code::NotSupported, "device cuda:", ordinal, ": out of range, ", count,
         " CUDA device(s) visible");
  static std::mutex mu;
  // Leaked on purpose, like the host device: buffers outlive static
  // destruction order, and the CUDA runtime may already be shut down.
  static auto* devices = new std::vector<std::shared_ptr<Device>>(static_cast<size_t>(count));
  std::lock_guard<std::mutex> lock(mu);
  auto& d = (*devices)[static_cast<size_t>(ordinal)];
  if (!d) d = std::make_shared<CudaDevice>(ordinal);
  return d;
}

std::string cuda_device_pci_bus_id(int ordinal) {
  if (cuda_device_count() == 0) return {};
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof id, ordinal) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return id;
}

DeviceRef pointer_location(const void* p) {
  if (p == nullptr || cuda_device_count() == 0) return {};
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)
    return {DeviceKind::Cuda, attr.device};
  return {};
}

void copy_between(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  DeviceRef where = pointer_location(dst);
  if (!where.is_cuda()) where = pointer_location(src);
  if (!where.is_cuda()) return host_device()->copy(dst, src, bytes);
  auto dev = cuda_device(where.ordinal);
  dev->copy(dst, src, bytes);
  dev->synchronize();
}

}  // namespace zs
