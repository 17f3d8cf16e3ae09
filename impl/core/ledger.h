// The context's memory and fetch counters, kept in atomics so that a status
// query (zs_context_memory, zs_context_fetch_stats) reads them from any
// thread without the engine lock: it never waits for an optimizer step or
// a blocking fetch in progress. Writers are the engine's calls, under the
// engine lock; a snapshot taken during one may see some counters of a
// change and not yet others, never a torn value.
#pragma once

#include <atomic>
#include <cstdint>

namespace zs {

struct MemoryStats {
  uint64_t shard_bytes = 0;
  uint64_t gathered_bytes = 0;
  uint64_t peak_gathered_bytes = 0;
  uint64_t unsharded_bytes = 0;
  uint64_t num_params = 0;
  uint64_t grad_bytes = 0;
  uint64_t optimizer_bytes = 0;
  uint64_t secondary_bytes = 0;
  uint64_t nvme_bytes = 0;
  uint64_t loco_error_bytes = 0;
};

// Which way fetches went (for tests and tuning).
struct FetchCounters {
  uint64_t gathers = 0;               // coalesced fetches issued
  uint64_t hpz_gathers = 0;           // served from hpZ secondary shards
  uint64_t hierarchical_gathers = 0;  // MiCS two-hop gathers
};

// Bytes the engine holds, by what they are. Nvme: swap files' bytes on
// disk, not in memory.
enum class Held { Shards, Gathered, Unsharded, Grads, Optimizer, Secondary, Nvme, LocoErrors };
enum class Fetched { Gather, HpzGather, HierarchicalGather };

class Ledger {
 public:
  void add(Held what, uint64_t bytes) {
    const uint64_t now = slot(what).fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (what != Held::Gathered) return;
    uint64_t peak = peak_gathered_.load(std::memory_order_relaxed);
    while (now > peak && !peak_gathered_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void sub(Held what, uint64_t bytes) { slot(what).fetch_sub(bytes, std::memory_order_relaxed); }
  void count_param(int delta) { num_params_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed); }
  void count(Fetched what) { fetch_slot(what).fetch_add(1, std::memory_order_relaxed); }

  MemoryStats memory() const {
    MemoryStats m;
    m.shard_bytes = get(shards_);
    m.gathered_bytes = get(gathered_);
    m.peak_gathered_bytes = get(peak_gathered_);
    m.unsharded_bytes = get(unsharded_);
    m.num_params = get(num_params_);
    m.grad_bytes = get(grads_);
    m.optimizer_bytes = get(optimizer_);
    m.secondary_bytes = get(secondary_);
    m.nvme_bytes = get(nvme_);
    m.loco_error_bytes = get(loco_errors_);
    return m;
  }
  FetchCounters fetches() const {
    return FetchCounters{get(gathers_), get(hpz_gathers_), get(hierarchical_gathers_)};
  }

 private:
  static uint64_t get(const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); }
  std::atomic<uint64_t>& slot(Held what) {
    switch (what) {
      case Held::Shards: return shards_;
      case Held::Gathered: return gathered_;
      case Held::Unsharded: return unsharded_;
      case Held::Grads: return grads_;
      case Held::Optimizer: return optimizer_;
      case Held::Nvme: return nvme_;
      case Held::LocoErrors: return loco_errors_;
      case Held::Secondary: break;
    }
    return secondary_;
  }
  std::atomic<uint64_t>& fetch_slot(Fetched what) {
    switch (what) {
      case Fetched::Gather: return gathers_;
      case Fetched::HpzGather: return hpz_gathers_;
      case Fetched::HierarchicalGather: break;
    }
    return hierarchical_gathers_;
  }

  std::atomic<uint64_t> shards_{0}, gathered_{0}, peak_gathered_{0}, unsharded_{0};
  std::atomic<uint64_t> num_params_{0}, grads_{0}, optimizer_{0}, secondary_{0};
  std::atomic<uint64_t> nvme_{0}, loco_errors_{0};
  std::atomic<uint64_t> gathers_{0}, hpz_gathers_{0}, hierarchical_gathers_{0};
};

}  // namespace zs
