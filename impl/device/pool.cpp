#include "impl/device/pool.h"

#include <vector>

#include "impl/common/error.h"

namespace zs {

CachingPool::CachingPool(Backend backend, size_t min_cached_bytes, uint64_t idle_limit_bytes)
    : backend_(std::move(backend)), min_cached_(min_cached_bytes), idle_limit_(idle_limit_bytes) {}

CachingPool::~CachingPool() { trim(); }

size_t CachingPool::size_class(size_t bytes) const {
  const size_t a = backend_.alignment;
  size_t size = (bytes + a - 1) / a * a;
  constexpr size_t kMiB = size_t{1} << 20;
  if (size <= kMiB) return size;
  size_t top = kMiB;  // highest power of two <= size
  while (top <= size / 2) top *= 2;
  const size_t step = top / 8;
  return (size + step - 1) / step * step;
}

void* CachingPool::alloc(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t size = size_class(bytes);
  if (size >= min_cached_) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(size);
    if (it != idle_.end()) {
      void* p = it->second;
      idle_.erase(it);
      stats_.idle_bytes -= size;
      stats_.used_bytes += size;
      ++stats_.reuses;
      return p;
    }
  }
  void* p = backend_.allocate(size);
  if (!p) {
    trim();  // the cache may hold what the system allocator lacks
    p = backend_.allocate(size);
  }
  if (!p)
    fail(Code::OutOfMemory, "cannot allocate ", bytes, " bytes of ", backend_.name, " memory");
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.system_allocs;
  stats_.used_bytes += size;
  return p;
}

void CachingPool::free(void* p, size_t bytes) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  const size_t size = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.used_bytes -= size;
    if (size >= min_cached_ && stats_.idle_bytes + size <= idle_limit_) {
      idle_.emplace(size, p);
      stats_.idle_bytes += size;
      return;
    }
  }
  backend_.release(p, size);
}

void CachingPool::trim() {
  std::multimap<size_t, void*> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle.swap(idle_);
    stats_.idle_bytes = 0;
  }
  for (auto& [size, p] : idle) backend_.release(p, size);
}

PoolStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace zs
