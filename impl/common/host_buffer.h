// A 64-byte aligned host allocation with its size; the unit in which shards
// and gathered params are held, so that freeing one returns its memory.
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>

#include "impl/common/error.h"

namespace zs {

class HostBuffer {
 public:
  explicit HostBuffer(size_t bytes, bool zero = false) : bytes_(bytes) {
    if (bytes == 0) return;
    const size_t rounded = (bytes + 63) & ~size_t{63};
    data_ = std::aligned_alloc(64, rounded);
    if (!data_) fail(Code::OutOfMemory, "cannot allocate ", bytes, " bytes of host memory");
    if (zero) std::memset(data_, 0, bytes);
  }
  ~HostBuffer() { std::free(data_); }
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
