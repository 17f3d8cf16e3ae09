// The fetch coordinator: step markers, coordinated fetch/release, leaves.
#include "capi/handles.h"
#include "impl/fetch/coordinator.h"

using namespace zs;
using namespace zs::capi;

namespace {

template <typename Fn>
zs_status with_coordinator(zs_context h, Fn&& fn) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    fn(*ctx, coordinator(*ctx));
  });
}

template <typename Fn>
zs_status with_params(zs_context h, const zs_param* params, size_t n, Fn&& fn) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    if (list.empty()) fail(Code::InvalidArgument, "params: the list is empty");
    fn(coordinator(*ctx), list);
  });
}

}  // namespace

extern "C" {

ZS_API zs_status zs_step_begin(zs_context h) {
  return with_coordinator(h, [](Context&, Coordinator& c) { c.step_begin(); });
}

ZS_API zs_status zs_step_end(zs_context h) {
  return with_coordinator(h, [](Context&, Coordinator& c) { c.step_end(); });
}

ZS_API zs_status zs_step_end_agree(zs_context h, uint64_t token, int* same) {
  return with_coordinator(h, [&](Context&, Coordinator& c) {
    if (same == nullptr) fail(Code::InvalidArgument, "same: NULL (where the agreement goes)");
    const std::optional<bool> agreed = c.step_end(token);
    *same = agreed ? (*agreed ? 1 : 0) : -1;
  });
}

ZS_API zs_status zs_coord_fetch(zs_context h, const zs_param* params, size_t n) {
  return with_params(h, params, n, [](Coordinator& c, const ParamList& l) { c.fetch(l); });
}

ZS_API zs_status zs_coord_release(zs_context h, const zs_param* params, size_t n) {
  return with_params(h, params, n, [](Coordinator& c, const ParamList& l) { c.release(l); });
}

ZS_API zs_status zs_leaf_group(zs_context h, const zs_param* params, size_t n) {
  return with_params(h, params, n, [](Coordinator& c, const ParamList& l) { c.add_leaf(l); });
}

ZS_API zs_status zs_coord_get_stats(zs_context h, zs_coord_stats* out_stats) {
  return with_coordinator(h, [&](Context&, Coordinator& c) {
    SizedOut<zs_coord_stats> out(out_stats, "stats");
    const CoordStats s = c.stats();
    out->steps = s.steps;
    out->fetch_calls = s.fetch_calls;
    out->demand_fetches = s.demand_fetches;
    out->prefetches = s.prefetches;
    out->blocked_waits = s.blocked_waits;
    out->reuse_hits = s.reuse_hits;
    out->kept_for_reuse = s.kept_for_reuse;
    out->persistent_params = s.persistent_params;
    out->live_elements = s.live_elements;
    out->peak_live_elements = s.peak_live_elements;
    out->trace_invalidations = s.trace_invalidations;
    out->trace_length = s.trace_length;
  });
}

ZS_API zs_status zs_context_step_stats(zs_context h, zs_step_stats* out_stats) {
  return guarded([&] {
    SizedOut<zs_step_stats> out(out_stats, "stats");
    const StepStats s = context_of(h, "ctx")->last_step();
    // A quantized kind counts with the full-precision one it replaces;
    // bytes are those this rank received (zs_context_fetch_stats has both
    // directions, kind by kind).
    const auto k = [](CommKind kind) { return static_cast<size_t>(kind); };
    const auto secs = [&](CommKind a, CommKind b) { return s.comm.seconds[k(a)] + s.comm.seconds[k(b)]; };
    const auto bytes = [&](CommKind a, CommKind b) { return s.comm.received[k(a)] + s.comm.received[k(b)]; };
    const auto calls = [&](CommKind a, CommKind b) { return s.comm.calls[k(a)] + s.comm.calls[k(b)]; };
    out->step = s.step;
    out->step_seconds = s.step_seconds;
    out->gather_seconds = secs(CommKind::Gather, CommKind::QuantizedGather);
    out->gather_bytes = bytes(CommKind::Gather, CommKind::QuantizedGather);
    out->gathers = calls(CommKind::Gather, CommKind::QuantizedGather);
    out->reduce_scatter_seconds = secs(CommKind::ReduceScatter, CommKind::QuantizedReduce);
    out->reduce_scatter_bytes = bytes(CommKind::ReduceScatter, CommKind::QuantizedReduce);
    out->reduce_scatters = calls(CommKind::ReduceScatter, CommKind::QuantizedReduce);
    out->allreduce_seconds = s.comm.seconds[k(CommKind::AllReduce)];
    out->allreduce_bytes = s.comm.received[k(CommKind::AllReduce)];
    out->other_comm_seconds = s.comm.seconds[k(CommKind::Other)];
    out->other_comm_bytes = s.comm.received[k(CommKind::Other)];
    out->wait_seconds = s.comm.wait_seconds;
    out->optimizer_seconds = s.optimizer_seconds;
    out->peer_copy_seconds = s.peer_copy_seconds;
    out->peer_copy_bytes = s.peer_copy_bytes;
    out->replay_seconds = s.replay_seconds;
  });
}

}  // extern "C"
