// Time and bytes of the collectives a context ran, by kind, and the time
// callers spent blocked waiting for them: atomics that any thread adds to
// and the status queries read (zs_context_step_stats takes the difference
// between two optimizer steps).
#pragma once

#include <atomic>
#include <cstdint>

namespace zs {

enum class CommKind : int { Gather = 0, ReduceScatter = 1, AllReduce = 2, Other = 3 };
constexpr int kCommKinds = 4;

struct CommTotals {
  double seconds[kCommKinds] = {};
  uint64_t bytes[kCommKinds] = {};  // what this rank sent and received
  uint64_t calls[kCommKinds] = {};
  double wait_seconds = 0.0;
};

class CommStats {
 public:
  void add(CommKind kind, double seconds, uint64_t bytes) {
    const auto k = static_cast<size_t>(kind);
    nanos_[k].fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
    bytes_[k].fetch_add(bytes, std::memory_order_relaxed);
    calls_[k].fetch_add(1, std::memory_order_relaxed);
  }
  void add_wait(double seconds) {
    wait_nanos_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  }
  CommTotals totals() const {
    CommTotals t;
    for (int k = 0; k < kCommKinds; ++k) {
      t.seconds[k] = static_cast<double>(nanos_[k].load(std::memory_order_relaxed)) * 1e-9;
      t.bytes[k] = bytes_[k].load(std::memory_order_relaxed);
      t.calls[k] = calls_[k].load(std::memory_order_relaxed);
    }
    t.wait_seconds = static_cast<double>(wait_nanos_.load(std::memory_order_relaxed)) * 1e-9;
    return t;
  }

 private:
  std::atomic<uint64_t> nanos_[kCommKinds] = {};
  std::atomic<uint64_t> bytes_[kCommKinds] = {};
  std::atomic<uint64_t> calls_[kCommKinds] = {};
  std::atomic<uint64_t> wait_nanos_{0};
};

}  // namespace zs
