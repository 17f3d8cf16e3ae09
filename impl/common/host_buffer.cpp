#include "impl/common/host_buffer.h"

#include <map>
#include <mutex>

#include "impl/comm/bootstrap.h"

namespace zs {
namespace {

// Below this, malloc's own free lists are as fast as any cache.
constexpr size_t kCacheMinBytes = 64 * 1024;

size_t rounded(size_t bytes) { return (bytes + 63) & ~size_t{63}; }

class HostCache {
 public:
  HostCache() : limit_(static_cast<uint64_t>(env_int("ZS_HOST_CACHE_MB", 1024)) << 20) {}

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(bytes);
    if (it == idle_.end()) return nullptr;
    void* p = it->second;
    idle_.erase(it);
    idle_bytes_ -= bytes;
    return p;
  }

  // False when the block does not fit under the limit: the caller frees it.
  bool give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_bytes_ + bytes > limit_) return false;
    idle_.emplace(bytes, p);
    idle_bytes_ += bytes;
    return true;
  }

  uint64_t idle_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_bytes_;
  }

  void trim() {
    std::multimap<size_t, void*> idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle.swap(idle_);
      idle_bytes_ = 0;
    }
    for (auto& [bytes, p] : idle) std::free(p);
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> idle_;  // exact rounded size -> block
  uint64_t idle_bytes_ = 0;
  const uint64_t limit_;
};

// Leaked on purpose: buffers may be freed by static destructors.
HostCache& cache() {
  static HostCache* c = new HostCache();
  return *c;
}

}  // namespace

namespace detail {

void* host_alloc(size_t bytes) {
  const size_t size = rounded(bytes);
  if (size >= kCacheMinBytes) {
    if (void* p = cache().take(size)) return p;
  }
  void* p = std::aligned_alloc(64, size);
  if (!p) fail(Code::OutOfMemory, "cannot allocate ", bytes, " bytes of host memory");
  return p;
}

void host_free(void* p, size_t bytes) {
  const size_t size = rounded(bytes);
  if (size >= kCacheMinBytes && cache().give(p, size)) return;
  std::free(p);
}

}  // namespace detail

uint64_t host_cache_bytes() { return cache().idle_bytes(); }
void host_cache_trim() { cache().trim(); }

}  // namespace zs
