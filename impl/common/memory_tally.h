// Every byte the engine allocates, by what it is for, and the most each
// kind held in each phase of training: the report behind zs_memory_by_kind
// and zeroshard.torch.memory_report(). Device memory goes through the
// device's caching pool (device.h), tagged with its kind at allocation and
// counted here at its size class, the bytes the pool hands out, so the
// kinds other than IoStaging and Inboxes add up to the pools' bytes in use;
// those two are outside the pools, counted as they are made and freed:
// IoStaging the O_DIRECT buffers of checkpoints and the NVMe swapper,
// Inboxes the shared-memory transport's (shared_memory_rings.h).
//
// The phase is the engine's own guess, needing no call from the trainer: a
// param registered is Construction, a fetch Forward (until gradients
// arrive), a gradient pushed Backward, an optimizer step Step, a checkpoint
// save or load Checkpoint (its scope restores the phase before it). Counts
// are process-wide (the pools are), kept in relaxed atomics: a reader on
// any thread sees each counter whole.
#pragma once

#include <cstdint>

namespace zs {

enum class MemKind : int {
  Shards,          // this rank's param shards (and packed frozen ones)
  Masters,         // fp32 masters of 16-bit params
  OptimizerState,  // moments, momentum, named (caller's) state
  Grads,           // fp32 gradient shards and LoCo error feedback
  Gathered,        // full params gathered for compute
  Secondary,       // hpZ secondary shards
  ReduceBuckets,   // gradient buckets and copies in flight to the reduce-scatter
  CommStaging,     // transport staging, quantized packets, two-hop gather temporaries
  Scratch,         // the optimizer step's temporaries (Muon's matrices)
  IoStaging,       // aligned host buffers of checkpoint and NVMe I/O
  Untagged,        // an allocation no site named (should stay ~0)
  PeerCopies,      // healing: the replica of another rank's state held here, and its gradient buffer
  Inboxes,         // shared-memory inboxes of the ranks of one host (outside the pools)
  Count
};

enum class MemPhase : int { Construction, Forward, Backward, Step, Checkpoint, Count };

constexpr int kMemKinds = static_cast<int>(MemKind::Count);
constexpr int kMemPhases = static_cast<int>(MemPhase::Count);

const char* mem_kind_name(MemKind k);    // "shards", "masters", ...
const char* mem_phase_name(MemPhase p);  // "construction", "forward", ...

namespace memory_tally {

void add(MemKind kind, uint64_t bytes);
void sub(MemKind kind, uint64_t bytes);
uint64_t current(MemKind kind);
// The most `kind` held while the phase was `phase`, and the most all kinds
// together held then (not the sum of the kinds' peaks: they need not
// coincide). Since the process started or reset_peaks.
uint64_t peak(MemPhase phase, MemKind kind);
uint64_t peak_total(MemPhase phase);
// Peaks start again from what is held now.
void reset_peaks();

MemPhase phase();
void set_phase(MemPhase p);

// A phase for a scope (a checkpoint, a step), the one before restored.
class PhaseScope {
 public:
  explicit PhaseScope(MemPhase p) : before_(phase()) { set_phase(p); }
  ~PhaseScope() { set_phase(before_); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  MemPhase before_;
};

}  // namespace memory_tally
}  // namespace zs
