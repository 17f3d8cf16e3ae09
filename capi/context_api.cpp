// Context lifetime, identity, config and memory queries.
#include "capi/handles.h"

using namespace zs;
using namespace zs::capi;

namespace {

std::string str_or_empty(const char* s) { return s ? s : ""; }

template <typename Fn>
zs_status query_int(zs_context h, int* out, const char* arg, Fn get) {
  return guarded([&] {
    checked_out(out, arg);
    *out = get(context_of(h, "ctx")->ranks());
  });
}

}  // namespace

extern "C" {

ZS_API zs_status zs_context_create(zs_context* out, const zs_context_options* options) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    const auto& o = checked_options(options, "options");
    ContextOptions opts;
    opts.rank = o.rank;
    opts.world_size = o.world_size;
    opts.local_rank = o.local_rank;
    opts.local_world_size = o.local_world_size;
    opts.store_host = str_or_empty(o.store_host);
    opts.store_port = o.store_port;
    opts.file_store_path = str_or_empty(o.file_store_path);
    opts.config_json = str_or_empty(o.config_json);
    opts.config_path = str_or_empty(o.config_path);
    opts.timeout_ms = o.timeout_ms;
    opts.transport_host = str_or_empty(o.transport_host);
    opts.device = str_or_empty(o.device);
    opts.backend = str_or_empty(o.backend);
    auto ctx = Context::create(opts);
    const uint64_t id = ctx->id();
    *out = to_handle<zs_context>(add_handle(Kind::Context, id, std::move(ctx)));
  });
}

ZS_API zs_status zs_context_destroy(zs_context h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    context_of(h, "ctx")->refuse_reentry("zs_context_destroy");  // from a callback of its own call
    uint64_t id = 0;
    auto obj = take_handle(Kind::Context, reinterpret_cast<uintptr_t>(h), &id);
    if (!obj) context_of(h, "ctx");  // throws the right message
    drop_context_handles(id);
  });
}

ZS_API zs_status zs_context_rank(zs_context h, int* rank) {
  return query_int(h, rank, "rank", [](const RankInfo& r) { return r.rank; });
}
ZS_API zs_status zs_context_world_size(zs_context h, int* world_size) {
  return query_int(h, world_size, "world_size", [](const RankInfo& r) { return r.world_size; });
}
ZS_API zs_status zs_context_local_rank(zs_context h, int* local_rank) {
  return query_int(h, local_rank, "local_rank", [](const RankInfo& r) { return r.local_rank; });
}
ZS_API zs_status zs_context_local_world_size(zs_context h, int* local_world_size) {
  return query_int(h, local_world_size, "local_world_size",
                   [](const RankInfo& r) { return r.local_world_size; });
}

ZS_API zs_status zs_context_async_error(zs_context h) {
  Code code = Code::Ok;
  std::string message;
  const zs_status s = guarded([&] { context_of(h, "ctx")->async_error(&code, &message); });
  if (s != ZS_OK) return s;
  return code == Code::Ok ? ZS_OK : set_error(static_cast<zs_status>(code), message);
}

ZS_API zs_status zs_context_config_json(zs_context h, const char** json) {
  return guarded([&] {
    checked_out(json, "json");
    *json = context_of(h, "ctx")->config_json().c_str();
  });
}

ZS_API zs_status zs_context_unused_config_keys(zs_context h, const char** json_array) {
  return guarded([&] {
    checked_out(json_array, "json_array");
    *json_array = context_of(h, "ctx")->unused_keys_json().c_str();
  });
}

ZS_API zs_status zs_context_inactive_config_keys(zs_context h, const char** json_array) {
  return guarded([&] {
    checked_out(json_array, "json_array");
    *json_array = context_of(h, "ctx")->inactive_keys_json().c_str();
  });
}

ZS_API zs_status zs_context_memory(zs_context h, zs_memory_stats* stats_out) {
  return guarded([&] {
    SizedOut<zs_memory_stats> stats(stats_out, "stats");
    auto ctx = context_of(h, "ctx");
    const MemoryStats m = ctx->memory_snapshot();
    stats->shard_bytes = m.shard_bytes;
    stats->gathered_bytes = m.gathered_bytes;
    stats->peak_gathered_bytes = m.peak_gathered_bytes;
    stats->unsharded_bytes = m.unsharded_bytes;
    stats->num_params = m.num_params;
    stats->host_cache_bytes = host_cache_bytes();
    stats->grad_bytes = m.grad_bytes;
    stats->optimizer_bytes = m.optimizer_bytes;
    stats->hpz_secondary_bytes = m.secondary_bytes;
    const PoolStats pool = ctx->device()->pool_stats();
    stats->device_cache_bytes = pool.idle_bytes;
    stats->device_system_allocs = pool.system_allocs;
    stats->device_reuses = pool.reuses;
    stats->nvme_bytes = m.nvme_bytes;
    stats->loco_error_bytes = m.loco_error_bytes;
    // Every counted byte lives on the context's device: the host-side state
    // a CUDA context could have (offload) is refused there.
    const uint64_t engine = m.shard_bytes + m.gathered_bytes + m.grad_bytes + m.optimizer_bytes +
                            m.secondary_bytes + m.loco_error_bytes;
    stats->device_bytes = ctx->device()->is_cuda() ? engine : 0;
    stats->host_bytes = ctx->device()->is_cuda() ? 0 : engine;
    stats->host_pinned_bytes = 0;
  });
}

ZS_API zs_status zs_context_device(zs_context h, zs_device_type* type, int* device_id,
                                   const char** backend) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    const DeviceRef ref = ctx->device()->ref();
    if (type) *type = ref.is_cuda() ? ZS_DEVICE_CUDA : ZS_DEVICE_CPU;
    if (device_id) *device_id = ref.ordinal;
    if (backend) *backend = ctx->backend() == Backend::Nccl ? "nccl" : "gloo";
  });
}

ZS_API zs_status zs_cuda_device_count(int* count, const char** reason) {
  return guarded([&] {
    checked_out(count, "count");
    const char* why = "";
    *count = cuda_device_count(&why);
    if (reason) *reason = why;
  });
}

ZS_API zs_status zs_context_fetch_stats(zs_context h, zs_fetch_stats* stats_out) {
  return guarded([&] {
    SizedOut<zs_fetch_stats> stats(stats_out, "stats");
    auto ctx = context_of(h, "ctx");
    const FetchCounters c = ctx->counters_snapshot();
    stats->gathers = c.gathers;
    stats->hpz_gathers = c.hpz_gathers;
    stats->hierarchical_gathers = c.hierarchical_gathers;
    const CommTotals t = ctx->comm_stats()->totals();
    const auto sent = [&](CommKind k) { return t.sent[static_cast<size_t>(k)]; };
    const auto received = [&](CommKind k) { return t.received[static_cast<size_t>(k)]; };
    stats->gather_bytes_sent = sent(CommKind::Gather);
    stats->gather_bytes_received = received(CommKind::Gather);
    stats->quantized_gather_bytes_sent = sent(CommKind::QuantizedGather);
    stats->quantized_gather_bytes_received = received(CommKind::QuantizedGather);
    stats->reduce_scatter_bytes_sent = sent(CommKind::ReduceScatter);
    stats->reduce_scatter_bytes_received = received(CommKind::ReduceScatter);
    stats->quantized_reduce_bytes_sent = sent(CommKind::QuantizedReduce);
    stats->quantized_reduce_bytes_received = received(CommKind::QuantizedReduce);
    stats->allreduce_bytes_sent = sent(CommKind::AllReduce);
    stats->allreduce_bytes_received = received(CommKind::AllReduce);
    stats->other_bytes_sent = sent(CommKind::Other);
    stats->other_bytes_received = received(CommKind::Other);
  });
}

}  // extern "C"
