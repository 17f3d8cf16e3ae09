// Host memory aligned for O_DIRECT: the address, and every size the swapper
// moves through it, are multiples of kIoAlign (4 KiB covers every logical
// block size Linux filesystems use for direct I/O).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "impl/common/memory_tally.h"

namespace zs {

inline constexpr uint64_t kIoAlign = 4096;

inline uint64_t align_up(uint64_t v, uint64_t a = kIoAlign) { return (v + a - 1) / a * a; }
inline uint64_t align_down(uint64_t v, uint64_t a = kIoAlign) { return v / a * a; }

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes) : bytes_(align_up(bytes)) {
    if (bytes_ == 0) return;
    if (posix_memalign(&data_, kIoAlign, bytes_) != 0) throw std::bad_alloc();
    memory_tally::add(MemKind::IoStaging, bytes_);
  }
  ~AlignedBuffer() { release(); }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  // Frees now (counted out of memory_tally's IoStaging).
  void release() noexcept {
    if (data_ == nullptr) return;
    std::free(data_);
    memory_tally::sub(MemKind::IoStaging, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() const { return static_cast<char*>(data_); }
  uint64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace zs
