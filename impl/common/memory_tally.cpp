#include "impl/common/memory_tally.h"

#include <atomic>

namespace zs {
namespace {

struct Tally {
  std::atomic<uint64_t> current[kMemKinds] = {};
  std::atomic<uint64_t> total{0};
  std::atomic<uint64_t> peak[kMemPhases][kMemKinds] = {};
  std::atomic<uint64_t> peak_total[kMemPhases] = {};
  std::atomic<int> phase{static_cast<int>(MemPhase::Construction)};
};

Tally& tally() {
  static Tally* t = new Tally;  // leaked: allocations may be freed during static destruction
  return *t;
}

void raise(std::atomic<uint64_t>& peak, uint64_t now) {
  uint64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

// The phase's peaks take in what is held now (entering a phase: its peak is
// at least what it starts with).
void raise_all(Tally& t, int ph) {
  for (int k = 0; k < kMemKinds; ++k) raise(t.peak[ph][k], t.current[k].load(std::memory_order_relaxed));
  raise(t.peak_total[ph], t.total.load(std::memory_order_relaxed));
}

}  // namespace

const char* mem_kind_name(MemKind k) {
  switch (k) {
    case MemKind::Shards: return "shards";
    case MemKind::Masters: return "masters";
    case MemKind::OptimizerState: return "optimizer_state";
    case MemKind::Grads: return "grads";
    case MemKind::Gathered: return "gathered";
    case MemKind::Secondary: return "hpz_secondary";
    case MemKind::ReduceBuckets: return "reduce_buckets";
    case MemKind::CommStaging: return "comm_staging";
    case MemKind::Scratch: return "scratch";
    case MemKind::IoStaging: return "io_staging";
    case MemKind::Untagged: return "untagged";
    case MemKind::PeerCopies: return "peer_copies";
    case MemKind::Inboxes: return "inboxes";
    case MemKind::Count: break;
  }
  return "?";
}

const char* mem_phase_name(MemPhase p) {
  switch (p) {
    case MemPhase::Construction: return "construction";
    case MemPhase::Forward: return "forward";
    case MemPhase::Backward: return "backward";
    case MemPhase::Step: return "step";
    case MemPhase::Checkpoint: return "checkpoint";
    case MemPhase::Count: break;
  }
  return "?";
}

namespace memory_tally {

void add(MemKind kind, uint64_t bytes) {
  Tally& t = tally();
  const int k = static_cast<int>(kind), ph = t.phase.load(std::memory_order_relaxed);
  const uint64_t now = t.current[k].fetch_add(bytes, std::memory_order_relaxed) + bytes;
  const uint64_t total = t.total.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  raise(t.peak[ph][k], now);
  raise(t.peak_total[ph], total);
}

void sub(MemKind kind, uint64_t bytes) {
  Tally& t = tally();
  t.current[static_cast<int>(kind)].fetch_sub(bytes, std::memory_order_relaxed);
  t.total.fetch_sub(bytes, std::memory_order_relaxed);
}

uint64_t current(MemKind kind) { return tally().current[static_cast<int>(kind)].load(std::memory_order_relaxed); }

uint64_t peak(MemPhase phase, MemKind kind) {
  return tally().peak[static_cast<int>(phase)][static_cast<int>(kind)].load(std::memory_order_relaxed);
}

uint64_t peak_total(MemPhase phase) {
  return tally().peak_total[static_cast<int>(phase)].load(std::memory_order_relaxed);
}

void reset_peaks() {
  Tally& t = tally();
  for (int ph = 0; ph < kMemPhases; ++ph) {
    for (int k = 0; k < kMemKinds; ++k) t.peak[ph][k].store(0, std::memory_order_relaxed);
    t.peak_total[ph].store(0, std::memory_order_relaxed);
  }
  raise_all(t, t.phase.load(std::memory_order_relaxed));
}

MemPhase phase() { return static_cast<MemPhase>(tally().phase.load(std::memory_order_relaxed)); }

void set_phase(MemPhase p) {
  Tally& t = tally();
  const int ph = static_cast<int>(p);
  if (t.phase.exchange(ph, std::memory_order_relaxed) != ph) raise_all(t, ph);
}

}  // namespace memory_tally
}  // namespace zs
