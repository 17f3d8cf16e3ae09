// Every byte the engine copies, by what the copy is for: the bytes it moves
// rather than holds (memory_tally.h counts those), behind zs_copied_bytes
// and zeroshard.torch.memory_report()["copied"]. A copy is counted at the
// bytes it writes (a gradient widened from bf16 into an fp32 bucket counts
// 4 bytes an element), where it is issued, whichever device runs it; a
// write in place (a shard scaled, a reduction straight into its output) is
// no copy, and neither is what a collective moves between ranks (its
// bytes are zs_context_fetch_stats'). Counts are process-wide, as
// memory_tally's, in relaxed atomics: copies run on the trainer's thread
// and on the groups' threads alike.
#pragma once

#include <cstdint>

namespace zs {

enum class CopyKind : int {
  GradIntoBucket,    // a gradient into its reduce bucket (widened or narrowed, divided),
                     // or into the private fp32 copy the direct route reduces from
  BucketCompaction,  // a partly filled bucket's blocks closed up before its reduce-scatter
  GradOntoDevice,    // a gradient in the other memory (host <-> device) brought over first
  IntoGradShard,     // reduced values stored (assigned or added) into an fp32 gradient shard
  WireWiden,         // a 16-bit reduce-scatter's result widened to fp32
  MicsReplica,       // MiCS: gradient shards into the replica all-reduce's buffer and back
  MasterRefresh,     // fp32 master -> 16-bit working shard after the optimizer's update
  ParamCast,         // a param's shard cast to or from its fp32 master otherwise
  GradSpill,         // gradient shards written to and read from their sink (NVMe)
  GroupOfOne,        // a one-member group's collective, done as a copy
  GatherStaging,     // around gathers: hpZ secondary slices, MiCS two-hop reorder, qwZ write-back
  CommStaging,       // transport staging (device memory over a host transport), qgZ's blocks
  Other,             // registration, param writes, packed params, Muon's temporaries
  Count
};

constexpr int kCopyKinds = static_cast<int>(CopyKind::Count);

const char* copy_kind_name(CopyKind k);  // "grad_into_bucket", ...

namespace copy_tally {

void add(CopyKind kind, uint64_t bytes);
// Bytes of `kind` copied since the process started.
uint64_t total(CopyKind kind);

// Every kind's total at one moment (each read whole; kinds copied
// meanwhile on other threads may be seen in one and not yet another).
struct Snapshot {
  uint64_t bytes[kCopyKinds] = {};
};
Snapshot snapshot();

}  // namespace copy_tally
}  // namespace zs
