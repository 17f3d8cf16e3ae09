// A 64-byte aligned host allocation with its size; the unit in which shards
// and gathered params are held, so that freeing one returns its memory.
//
// Large buffers come from a process-wide cache: a training step fetches
// and releases the same sizes over and over, and handing a freed block
// back out avoids the page faults a fresh mapping costs on first touch
// (which, for a gather, is as slow as the network). The cache holds at
// most ZS_HOST_CACHE_MB (default 1024) of idle blocks.
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>

#include "impl/common/error.h"

namespace zs {

// Idle bytes held by the cache right now.
uint64_t host_cache_bytes();
// Frees every idle block.
void host_cache_trim();

namespace detail {
void* host_alloc(size_t bytes);
void host_free(void* p, size_t bytes);
}  // namespace detail

class HostBuffer {
 public:
  explicit HostBuffer(size_t bytes, bool zero = false) : bytes_(bytes) {
    if (bytes == 0) return;
    data_ = detail::host_alloc(bytes);
    if (zero) std::memset(data_, 0, bytes);
  }
  ~HostBuffer() {
    if (data_) detail::host_free(data_, bytes_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

using HostBufferPtr = std::shared_ptr<HostBuffer>;

}  // namespace zs
