// The host device: plain memory and memcpy. Its pool keeps freed blocks of
// 64 KiB and more, up to ZS_HOST_CACHE_MB (default 1024) idle: a training
// step fetches and releases the same sizes over and over, and a fresh
// mapping's page faults on first touch cost as much as the network.
// The pool is bounded by its peak (see CachingPool; ZS_HOST_CACHE_BOUND=0
// lifts the bound): what it holds, in use and idle, never exceeds the most
// the process has had in use from it, so the cache adds nothing to the
// step's high-water mark; idle blocks of other sizes are released when a new
// size needs the room. Mapped blocks of 2 MiB and more are advised onto
// transparent huge pages (ZS_HOST_HUGE_PAGES=0: not), which is what makes
// the bound cheap: a block mapped again faults 512 times fewer pages. On
// bench_torch_step's wide model (2 CPU ranks, 3 alternating runs each) the
// bound saved 130 MiB of peak RSS per rank (2137 -> 2007 MiB) for a step 2%
// slower (1.21 -> 1.235 s medians); without huge pages it had cost 15%.
// Blocks of 1 MiB and more are mapped and unmapped directly: through malloc,
// freeing them would raise glibc's dynamic mmap threshold (up to 32 MiB),
// after which such blocks come from arenas that keep their pages after
// free, and the process's RSS stays at its peak.
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "impl/common/env.h"
#include "impl/common/error.h"
#include "impl/device/buffer.h"
#include "impl/device/device.h"

namespace zs {
namespace {

// Where mapped blocks start within their mapping. The kernel places large
// anonymous mappings on 2 MiB boundaries, so separate buffers (a param's
// shard, its gradient and its two Adam moments) would all start at the same
// offset within a page: element i of each then lands in the same cache set
// and the loads alias the stores (4K aliasing), which ran the AdamW step at
// half the speed of the same kernel on staggered arrays. Each new mapping
// starts a different number of 4 KiB + 256 B steps in (16 offsets, up to
// 68 KiB extra per mapping of 1 MiB or more).
class Staggers {
 public:
  size_t next() {
    std::lock_guard<std::mutex> held(mu_);
    return (count_++ % 16) * (4096 + 256);
  }
  void note(void* data, size_t stagger) {
    std::lock_guard<std::mutex> held(mu_);
    of_[data] = stagger;
  }
  size_t forget(void* data) {
    std::lock_guard<std::mutex> held(mu_);
    auto it = of_.find(data);
    if (it == of_.end()) return 0;
    const size_t stagger = it->second;
    of_.erase(it);
    return stagger;
  }

 private:
  std::mutex mu_;
  size_t count_ = 0;
  std::unordered_map<void*, size_t> of_;
};

std::shared_ptr<CachingPool> make_host_pool() {
  CachingPool::Backend b;
  b.name = "host";
  constexpr size_t kMapped = size_t{1} << 20;
  constexpr size_t kHuge = size_t{2} << 20;
  const bool huge = env_int("ZS_HOST_HUGE_PAGES", 1) != 0;
  auto staggers = std::make_shared<Staggers>();
  b.allocate = [huge, staggers](size_t size) -> void* {
    if (size < kMapped) return std::aligned_alloc(64, size);
    const size_t stagger = staggers->next();
    void* p = mmap(nullptr, size + stagger, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    if (size >= kHuge && huge) madvise(p, size + stagger, MADV_HUGEPAGE);  // advice: failure is harmless
    void* data = static_cast<char*>(p) + stagger;
    staggers->note(data, stagger);
    return data;
  };
  b.release = [staggers](void* p, size_t size) {
    if (size < kMapped) {
      std::free(p);
    } else {
      const size_t stagger = staggers->forget(p);
      munmap(static_cast<char*>(p) - stagger, size + stagger);
    }
  };
  b.alignment = 64;
  const auto limit = static_cast<uint64_t>(env_int("ZS_HOST_CACHE_MB", 1024)) << 20;
  const bool bound = env_int("ZS_HOST_CACHE_BOUND", 1) != 0;
  return std::make_shared<CachingPool>(std::move(b), 64 * 1024, limit, bound);
}

class HostDevice final : public Device {
 public:
  HostDevice() {
    pool_ = make_host_pool();
    staging_ = pool_;
  }
  DeviceRef ref() const override { return {}; }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes > 0) std::memset(p, 0, bytes);
  }
  void synchronize() override {}
  void bind_thread() override {}
  void* stream() const override { return nullptr; }
  bool owns_pointer(const void*) const override { return false; }
};

}  // namespace

std::string DeviceRef::str() const {
  return is_cuda() ? "cuda:" + std::to_string(ordinal) : "cpu";
}

bool try_parse_device(const std::string& text, DeviceRef* out) {
  if (text == "cpu" || text == "cuda") {
    *out = text == "cpu" ? DeviceRef{} : DeviceRef{DeviceKind::Cuda, 0};
    return true;
  }
  // "cuda:" and 1 to 4 digits (no device server has more GPUs).
  if (text.rfind("cuda:", 0) != 0 || text.size() < 6 || text.size() > 9 ||
      text.find_first_not_of("0123456789", 5) != std::string::npos)
    return false;
  *out = {DeviceKind::Cuda, std::stoi(text.substr(5))};
  return true;
}

DeviceRef parse_device(const std::string& text, const char* what) {
  DeviceRef ref;
  if (!try_parse_device(text, &ref))
    fail(Code::InvalidArgument, what, ": \"", text, "\": expected \"cpu\", \"cuda\" or \"cuda:N\"");
  return ref;
}

const std::shared_ptr<Device>& host_device() {
  // Leaked on purpose: buffers may be freed by static destructors.
  static auto* d = new std::shared_ptr<Device>(std::make_shared<HostDevice>());
  return *d;
}

std::shared_ptr<Device> open_device(const DeviceRef& ref) {
  return ref.is_cuda() ? cuda_device(ref.ordinal) : host_device();
}

uint64_t host_cache_bytes() { return host_device()->pool_stats().idle_bytes; }
void host_cache_trim() { host_device()->trim(); }

}  // namespace zs
