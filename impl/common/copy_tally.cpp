#include "impl/common/copy_tally.h"

#include <atomic>

namespace zs {
namespace {

std::atomic<uint64_t>* counters() {
  static auto* c = new std::atomic<uint64_t>[kCopyKinds]();  // leaked, as memory_tally's
  return c;
}

}  // namespace

const char* copy_kind_name(CopyKind k) {
  switch (k) {
    case CopyKind::GradIntoBucket: return "grad_into_bucket";
    case CopyKind::BucketCompaction: return "bucket_compaction";
    case CopyKind::GradOntoDevice: return "grad_onto_device";
    case CopyKind::IntoGradShard: return "into_grad_shard";
    case CopyKind::WireWiden: return "wire_widen";
    case CopyKind::MicsReplica: return "mics_replica";
    case CopyKind::MasterRefresh: return "master_refresh";
    case CopyKind::ParamCast: return "param_cast";
    case CopyKind::GradSpill: return "grad_spill";
    case CopyKind::GroupOfOne: return "group_of_one";
    case CopyKind::GatherStaging: return "gather_staging";
    case CopyKind::CommStaging: return "comm_staging";
    case CopyKind::Other: return "other";
    case CopyKind::Count: break;
  }
  return "?";
}

namespace copy_tally {

void add(CopyKind kind, uint64_t bytes) {
  if (bytes != 0) counters()[static_cast<int>(kind)].fetch_add(bytes, std::memory_order_relaxed);
}

uint64_t total(CopyKind kind) { return counters()[static_cast<int>(kind)].load(std::memory_order_relaxed); }

Snapshot snapshot() {
  Snapshot s;
  for (int k = 0; k < kCopyKinds; ++k) s.bytes[k] = counters()[k].load(std::memory_order_relaxed);
  return s;
}

}  // namespace copy_tally
}  // namespace zs
