#include "impl/common/aligned_buffer.h"

#include <cstdlib>
#include <new>

#include "impl/common/memory_tally.h"

namespace zs {

AlignedBuffer::AlignedBuffer(uint64_t bytes) : bytes_(align_up(bytes)) {
  if (bytes_ == 0) return;
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlign, bytes_) != 0) throw std::bad_alloc();
  data_ = static_cast<char*>(p);
  memory_tally::add(MemKind::IoStaging, bytes_);
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void AlignedBuffer::release() noexcept {
  if (data_ == nullptr) return;
  std::free(data_);
  memory_tally::sub(MemKind::IoStaging, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace zs
