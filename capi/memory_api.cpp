// The memory report: bytes by kind, now and per phase (impl/common/memory_tally.h),
// and bytes copied by kind (impl/common/copy_tally.h).
#include "capi/handles.h"
#include "impl/common/copy_tally.h"
#include "impl/common/memory_tally.h"
#include "impl/core/context.h"

using namespace zs;
using namespace zs::capi;

namespace {

MemPhase checked_phase(zs_memory_phase phase) {
  if (phase < 0 || phase >= ZS_PHASE_COUNT)
    fail(Code::InvalidArgument, "memory phase ", static_cast<int>(phase),
         ": expected ZS_PHASE_CONSTRUCTION (0) .. ZS_PHASE_CHECKPOINT (4)");
  return static_cast<MemPhase>(phase);
}

}  // namespace

static_assert(ZS_MEM_KIND_COUNT == kMemKinds, "zs_memory_kind and MemKind differ");
static_assert(ZS_PHASE_COUNT == kMemPhases, "zs_memory_phase and MemPhase differ");

ZS_API zs_status zs_memory_by_kind(zs_context h, zs_memory_phase phase, uint64_t* bytes, size_t capacity,
                                   size_t* num_kinds, uint64_t* total) {
  return guarded([&] {
    context_of(h, "ctx");
    if (bytes == nullptr && capacity > 0) fail(Code::InvalidArgument, "bytes is NULL with capacity ", capacity);
    const bool now = phase == ZS_PHASE_NOW;
    const MemPhase ph = now ? MemPhase::Construction : checked_phase(phase);
    uint64_t sum = 0;
    for (int k = 0; k < kMemKinds; ++k) {
      const auto kind = static_cast<MemKind>(k);
      const uint64_t v = now ? memory_tally::current(kind) : memory_tally::peak(ph, kind);
      if (static_cast<size_t>(k) < capacity) bytes[k] = v;
      sum += v;
    }
    if (num_kinds) *num_kinds = static_cast<size_t>(kMemKinds);
    if (total) *total = now ? sum : memory_tally::peak_total(ph);
  });
}

ZS_API zs_status zs_memory_pools_in_use(zs_context h, uint64_t* bytes) {
  return guarded([&] {
    checked_out(bytes, "bytes");
    auto ctx = context_of(h, "ctx");
    uint64_t used = host_device()->pools_used_bytes();
    if (ctx->device()->is_cuda()) used += ctx->device()->pools_used_bytes();
    *bytes = used;
  });
}

ZS_API zs_status zs_memory_get_phase(zs_context h, zs_memory_phase* phase) {
  return guarded([&] {
    checked_out(phase, "phase");
    context_of(h, "ctx");
    *phase = static_cast<zs_memory_phase>(memory_tally::phase());
  });
}

ZS_API zs_status zs_memory_set_phase(zs_context h, zs_memory_phase phase) {
  return guarded([&] {
    context_of(h, "ctx");
    memory_tally::set_phase(checked_phase(phase));
  });
}

ZS_API zs_status zs_memory_reset_peaks(zs_context h) {
  return guarded([&] {
    context_of(h, "ctx");
    memory_tally::reset_peaks();
  });
}

ZS_API const char* zs_memory_kind_name(zs_memory_kind kind) {
  if (kind < 0 || kind >= ZS_MEM_KIND_COUNT) return nullptr;
  return mem_kind_name(static_cast<MemKind>(kind));
}

ZS_API const char* zs_memory_phase_name(zs_memory_phase phase) {
  if (phase < 0 || phase >= ZS_PHASE_COUNT) return nullptr;
  return mem_phase_name(static_cast<MemPhase>(phase));
}

static_assert(ZS_COPY_KIND_COUNT == kCopyKinds, "zs_copy_kind and CopyKind differ");

ZS_API zs_status zs_copied_bytes(zs_context h, zs_copy_span span, uint64_t* bytes, size_t capacity,
                                 size_t* num_kinds, uint64_t* total) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    if (bytes == nullptr && capacity > 0) fail(Code::InvalidArgument, "bytes is NULL with capacity ", capacity);
    if (span != ZS_COPIES_TOTAL && span != ZS_COPIES_LAST_STEP)
      fail(Code::InvalidArgument, "copy span ", static_cast<int>(span),
           ": expected ZS_COPIES_TOTAL (0) or ZS_COPIES_LAST_STEP (1)");
    const copy_tally::Snapshot s =
        span == ZS_COPIES_TOTAL ? ctx->copies_since_start() : ctx->copies_last_step();
    uint64_t sum = 0;
    for (int k = 0; k < kCopyKinds; ++k) {
      if (static_cast<size_t>(k) < capacity) bytes[k] = s.bytes[k];
      sum += s.bytes[k];
    }
    if (num_kinds) *num_kinds = static_cast<size_t>(kCopyKinds);
    if (total) *total = sum;
  });
}

ZS_API const char* zs_copy_kind_name(zs_copy_kind kind) {
  if (kind < 0 || kind >= ZS_COPY_KIND_COUNT) return nullptr;
  return copy_kind_name(static_cast<CopyKind>(kind));
}
