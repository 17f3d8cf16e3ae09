#include "impl/device/pool.h"

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "impl/common/error.h"

namespace zs {

CachingPool::CachingPool(Backend backend, size_t min_cached_bytes, uint64_t idle_limit_bytes,
                         bool bound_by_peak)
    : backend_(std::move(backend)),
      min_cached_(min_cached_bytes),
      idle_limit_(idle_limit_bytes),
      bound_by_peak_(bound_by_peak) {}

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
      stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, stats_.used_bytes);
      ++stats_.reuses;
      return p;
    }
  }
  if (bound_by_peak_) {
    // A miss: make room under the peak by releasing idle blocks of other
    // classes, largest first (outside the lock).
    std::vector<std::pair<size_t, void*>> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t bound = std::max(stats_.peak_used_bytes, stats_.used_bytes + size);
      while (!idle_.empty() && stats_.used_bytes + stats_.idle_bytes + size > bound) {
        auto it = std::prev(idle_.end());
        evicted.emplace_back(it->first, it->second);
        stats_.idle_bytes -= it->first;
        ++stats_.evictions;
        idle_.erase(it);
      }
    }
    for (auto& [n, q] : evicted) backend_.release(q, n);
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
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, stats_.used_bytes);
  return p;
}

void CachingPool::free(void* p, size_t bytes, bool cache) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  const size_t size = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.used_bytes -= size;
    if (cache && size >= min_cached_ && stats_.idle_bytes + size <= idle_limit_) {
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
