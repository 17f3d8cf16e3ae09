// A caching allocator: freed blocks are kept by size class and handed out
// again, so the fetch/release cycle of a training step reaches the system
// allocator (malloc, cudaMalloc, cudaHostAlloc) only while it warms up.
// When the system allocator fails, idle blocks are returned and the
// allocation retried once before OutOfMemory is raised.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace zs {

struct PoolStats {
  uint64_t system_allocs = 0;  // calls that reached the system allocator
  uint64_t reuses = 0;         // allocations served from idle blocks
  uint64_t idle_bytes = 0;     // held by the cache, not in use
  uint64_t used_bytes = 0;     // handed out and not yet freed (size classes)
  uint64_t peak_used_bytes = 0;  // the most used_bytes has been
  uint64_t evictions = 0;      // idle blocks released to keep within the peak
};

class CachingPool {
 public:
  struct Backend {
    std::string name;                              // "host", "cuda:0", "pinned host"
    std::function<void*(size_t)> allocate;         // null on failure
    std::function<void(void*, size_t)> release;    // with the size allocate was given
    size_t alignment;                              // size classes are multiples
  };
  // Blocks under min_cached_bytes bypass the cache (the system allocator
  // is as fast for them); at most idle_limit_bytes are kept idle.
  // bound_by_peak: the pool's footprint (used + idle) stays within the
  // most it has had in use (peak_used_bytes): an allocation that finds no
  // idle block of its class releases idle blocks of other classes, largest
  // first, until the new block fits under that bound. A workload that
  // reuses its sizes keeps its blocks; idle blocks of sizes it stopped
  // asking for do not sit on top of what it uses.
  CachingPool(Backend backend, size_t min_cached_bytes, uint64_t idle_limit_bytes,
              bool bound_by_peak = false);
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  void* alloc(size_t bytes);  // never null; OutOfMemory names bytes and the backend
  // cache false: straight back to the system allocator, whatever its size
  // (memory nothing will ask for again soon).
  void free(void* p, size_t bytes, bool cache = true);
  void trim();  // returns every idle block
  PoolStats stats() const;

  // The size class of a request: a multiple of the alignment, rounded up
  // to one of 8 steps per power of two above 1 MiB (at most 12.5% waste)
  // so that sizes that differ a little share blocks.
  size_t size_class(size_t bytes) const;

 private:
  const Backend backend_;
  const size_t min_cached_;
  const uint64_t idle_limit_;
  const bool bound_by_peak_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> idle_;
  PoolStats stats_;
};

}  // namespace zs
