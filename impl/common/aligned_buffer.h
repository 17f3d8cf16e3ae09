// Host memory for O_DIRECT, shared by the NVMe swapper (impl/offload/) and
// the checkpoint streams (impl/checkpoint/direct_io.h). O_DIRECT wants the
// address, the file offset and the length aligned to the logical block
// size; 4 KiB covers every block size Linux filesystems use for it.
#pragma once

#include <cstdint>

namespace zs {

inline constexpr uint64_t kIoAlign = 4096;

inline uint64_t align_up(uint64_t v, uint64_t a = kIoAlign) { return (v + a - 1) / a * a; }
inline uint64_t align_down(uint64_t v, uint64_t a = kIoAlign) { return v / a * a; }

// kIoAlign-aligned bytes, the size rounded up to kIoAlign so a direct
// transfer may cover the last block whole. Not zero-filled: callers write
// or read over it, and zero what padding they hand to the disk. Counted in
// memory_tally's IoStaging while held. A failed allocation is
// std::bad_alloc, which callers report as out of memory.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes);  // 0: no memory, data() null
  ~AlignedBuffer() { release(); }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  // Frees this buffer's memory now, not when `o` dies.
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  // Frees now and leaves the buffer empty.
  void release() noexcept;

  char* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }  // the rounded size: all of it usable

 private:
  char* data_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace zs
