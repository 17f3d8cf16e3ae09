// Time and bytes of the collectives a context ran, by kind, and the time
// callers spent blocked waiting for them: atomics that any thread adds to
// and the status queries read (zs_context_step_stats takes the difference
// between two optimizer steps; zs_context_fetch_stats reads the totals).
// Bytes are what this rank put on the wire and took off it, as the
// algorithms of collectives.cpp move them.
#pragma once

#include <atomic>
#include <cstdint>

namespace zs {

// Quantized kinds are qwZ's weight gathers and qgZ's all-to-all gradient
// reduction, counted apart from the full-precision ones they replace.
enum class CommKind : int {
  Gather = 0,
  ReduceScatter = 1,
  AllReduce = 2,
  Other = 3,
  QuantizedGather = 4,
  QuantizedReduce = 5,
};
constexpr int kCommKinds = 6;

struct CommTotals {
  double seconds[kCommKinds] = {};
  uint64_t sent[kCommKinds] = {};
  uint64_t received[kCommKinds] = {};
  uint64_t calls[kCommKinds] = {};
  double wait_seconds = 0.0;
};

class CommStats {
 public:
  // One call of `kind`, its time and bytes.
  void add(CommKind kind, double seconds, uint64_t sent, uint64_t received) {
    const auto k = static_cast<size_t>(kind);
    nanos_[k].fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
    calls_[k].fetch_add(1, std::memory_order_relaxed);
    add_bytes(kind, sent, received);
  }
  // Bytes of another kind moved by the same call (a coalesced gather of
  // quantized and exact params).
  void add_bytes(CommKind kind, uint64_t sent, uint64_t received) {
    const auto k = static_cast<size_t>(kind);
    sent_[k].fetch_add(sent, std::memory_order_relaxed);
    received_[k].fetch_add(received, std::memory_order_relaxed);
  }
  void add_wait(double seconds) {
    wait_nanos_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  }
  CommTotals totals() const {
    CommTotals t;
    for (int k = 0; k < kCommKinds; ++k) {
      t.seconds[k] = static_cast<double>(nanos_[k].load(std::memory_order_relaxed)) * 1e-9;
      t.sent[k] = sent_[k].load(std::memory_order_relaxed);
      t.received[k] = received_[k].load(std::memory_order_relaxed);
      t.calls[k] = calls_[k].load(std::memory_order_relaxed);
    }
    t.wait_seconds = static_cast<double>(wait_nanos_.load(std::memory_order_relaxed)) * 1e-9;
    return t;
  }

 private:
  std::atomic<uint64_t> nanos_[kCommKinds] = {};
  std::atomic<uint64_t> sent_[kCommKinds] = {};
  std::atomic<uint64_t> received_[kCommKinds] = {};
  std::atomic<uint64_t> calls_[kCommKinds] = {};
  std::atomic<uint64_t> wait_nanos_{0};
};

}  // namespace zs
