// A build without CUDA: no devices, and every pointer is host memory.
#ifndef ZS_WITH_CUDA

#include "impl/common/error.h"
#include "impl/device/device.h"

namespace zs {

int cuda_device_count(const char** why) {
  if (why) *why = "this build of zeroshard has no CUDA support (configured without nvcc)";
  return 0;
}

std::shared_ptr<Device> cuda_device(int ordinal) {
  fail(Code::NotSupported, "device cuda:", ordinal,
       ": this build of zeroshard has no CUDA support (configured without nvcc)");
}

std::string cuda_device_pci_bus_id(int) { return {}; }

DeviceRef pointer_location(const void*) { return {}; }

void copy_between(void* dst, const void* src, size_t bytes) {
  host_device()->copy(dst, src, bytes);
}

}  // namespace zs

#endif
