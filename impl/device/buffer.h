// An allocation on one device with its size: the unit in which shards,
// gathered params, gradients and optimizer state are held, so that
// dropping the last reference returns the memory (to the device's pool).
#pragma once

#include <cstddef>
#include <memory>

#include "impl/device/device.h"

namespace zs {

class Buffer {
 public:
  // `kind`: what the bytes are for (memory_tally.h).
  Buffer(std::shared_ptr<Device> device, size_t bytes, MemKind kind, bool zero = false)
      : device_(std::move(device)), bytes_(bytes), kind_(kind) {
    if (bytes == 0) return;
    data_ = device_->alloc(bytes, kind);
    if (zero) device_->zero(data_, bytes);
  }
  // Host memory.
  Buffer(size_t bytes, MemKind kind, bool zero = false) : Buffer(host_device(), bytes, kind, zero) {}
  ~Buffer() {
    if (data_) device_->free(data_, bytes_, kind_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Frees the memory now, past the pool's cache (memory nothing asks for
  // again soon); data() is null after.
  void free_to_system() {
    if (data_) device_->free_to_system(data_, bytes_, kind_);
    data_ = nullptr;
  }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device& device() const { return *device_; }
  const std::shared_ptr<Device>& device_ptr() const { return device_; }
  bool on_cuda() const { return device_->is_cuda(); }

 private:
  std::shared_ptr<Device> device_;
  void* data_ = nullptr;
  size_t bytes_;
  MemKind kind_;
};

using BufferPtr = std::shared_ptr<Buffer>;

// Idle bytes held by the host pool right now, and a way to free them.
uint64_t host_cache_bytes();
void host_cache_trim();

}  // namespace zs
