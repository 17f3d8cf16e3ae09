// Groups, the raw collectives on them, and their work handles.
#include "capi/handles.h"

using namespace zs;
using namespace zs::capi;

namespace {

zs_group new_group_handle(const std::shared_ptr<Context>& ctx, std::shared_ptr<Group> g) {
  return to_handle<zs_group>(add_handle(Kind::Group, ctx->id(), std::move(g)));
}

void check_buffer(const void* p, size_t count, const char* arg) {
  if (p == nullptr && count > 0) fail(Code::InvalidArgument, arg, " is NULL");
}

// The largest buffer a collective accepts (64 TiB): far above any real
// message, far below where count * element size * group size wraps.
constexpr uint64_t kMaxCollectiveBytes = uint64_t{1} << 46;

// Bytes of `count` elements of `dtype`, refused when the largest buffer the
// call implies (count * group size elements for a gathered or scattered
// side) is above kMaxCollectiveBytes, instead of wrapping.
size_t checked_bytes(const char* what, size_t count, DType dtype, const Group& g, bool per_member) {
  const uint64_t unit = dtype_size(dtype) * (per_member ? static_cast<uint64_t>(g.size()) : 1u);
  const uint64_t largest_count = kMaxCollectiveBytes / unit;
  if (count > largest_count)
    fail(Code::InvalidArgument, what, ": count ", count, " of ", dtype_name(dtype),
         per_member ? " times group size " + std::to_string(g.size()) : std::string(),
         " exceeds the largest accepted buffer of ", kMaxCollectiveBytes, " bytes (largest count ",
         largest_count, ")");
  return count * dtype_size(dtype);
}

// Validate, queue fn on the group's thread, hand out a work handle.
template <typename Fn>
zs_status submit(zs_work* out, zs_group h, const char* what, Fn&& validate_and_make) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    auto g = group_of(h, "group");
    std::function<void(Communicator&)> fn = validate_and_make(*g.obj);
    g.ctx->check_async_error();
    auto work = g.obj->submit(what, std::move(fn));
    *out = to_handle<zs_work>(add_handle(Kind::Work, g.ctx->id(), std::move(work)));
  });
}

}  // namespace

extern "C" {

ZS_API zs_status zs_context_group(zs_group* out, zs_context h, zs_group_kind kind) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    auto ctx = context_of(h, "ctx");
    std::shared_ptr<Group> g;
    switch (kind) {
      case ZS_GROUP_WORLD: g = ctx->world(); break;
      case ZS_GROUP_PARTITION: g = ctx->partition_group(); break;
      case ZS_GROUP_MICS_SHARD: g = ctx->mics_shard_group(); break;
      case ZS_GROUP_MICS_REPLICA: g = ctx->mics_replica_group(); break;
      case ZS_GROUP_HPZ: g = ctx->hpz_group(); break;
      case ZS_GROUP_MICS_INTER: g = ctx->mics_inter_group(); break;
      case ZS_GROUP_MICS_INTRA: g = ctx->mics_intra_group(); break;
      default:
        fail(Code::InvalidArgument, "group kind ", static_cast<int>(kind),
             ": expected ZS_GROUP_WORLD (0) .. ZS_GROUP_MICS_INTRA (6)");
    }
    if (!g)
      fail(Code::InvalidState, "group kind ", static_cast<int>(kind),
           " is not configured: set zero_optimization.",
           kind == ZS_GROUP_HPZ ? "zero_hpz_partition_size > 1"
           : kind >= ZS_GROUP_MICS_INTER
               ? "mics_hierarchical_params_gather with mics_shard_size above the local world size"
               : "mics_shard_size > 0",
           " in the config");
    *out = new_group_handle(ctx, std::move(g));
  });
}

ZS_API zs_status zs_group_create(zs_group* out, zs_context h, const int* ranks, int num_ranks) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    if (ranks == nullptr) fail(Code::InvalidArgument, "ranks is NULL");
    if (num_ranks <= 0) fail(Code::InvalidArgument, "num_ranks is ", num_ranks, ": expected >= 1");
    auto ctx = context_of(h, "ctx");
    auto g = ctx->create_group(std::vector<int>(ranks, ranks + num_ranks));
    *out = new_group_handle(ctx, std::move(g));
  });
}

ZS_API zs_status zs_group_destroy(zs_group h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    if (!take_handle(Kind::Group, reinterpret_cast<uintptr_t>(h), nullptr)) group_of(h, "group");
  });
}

ZS_API zs_status zs_group_rank(zs_group h, int* rank) {
  return guarded([&] { *checked_out(rank, "rank") = group_of(h, "group").obj->rank(); });
}

ZS_API zs_status zs_group_size(zs_group h, int* size) {
  return guarded([&] { *checked_out(size, "size") = group_of(h, "group").obj->size(); });
}

ZS_API zs_status zs_group_world_rank(zs_group h, int group_rank, int* world_rank) {
  return guarded([&] {
    checked_out(world_rank, "world_rank");
    *world_rank = group_of(h, "group").obj->world_rank(group_rank);
  });
}

ZS_API zs_status zs_allgather(zs_work* out, zs_group h, const void* send, void* recv,
                              size_t count, zs_dtype dtype) {
  return submit(out, h, "all-gather", [&](Group& g) -> std::function<void(Communicator&)> {
    const size_t bytes = checked_bytes("all-gather", count, checked_dtype(dtype, false), g, true);
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    return [=](Communicator& c) { c.allgather(send, recv, bytes); };
  });
}

ZS_API zs_status zs_reduce_scatter(zs_work* out, zs_group h, const void* send, void* recv,
                                   size_t recv_count, zs_dtype dtype, zs_reduce_op op) {
  return submit(out, h, "reduce-scatter", [&](Group& g) -> std::function<void(Communicator&)> {
    const DType t = checked_dtype(dtype, false);
    const ReduceOp o = checked_reduce_op(op);
    check_reduction("reduce-scatter", t, o);  // here too: refused at the call, the group untouched
    checked_bytes("reduce-scatter", recv_count, t, g, true);
    check_buffer(send, recv_count, "send");
    check_buffer(recv, recv_count, "recv");
    return [=](Communicator& c) { c.reduce_scatter(send, recv, recv_count, t, o); };
  });
}

ZS_API zs_status zs_allreduce(zs_work* out, zs_group h, const void* send, void* recv,
                              size_t count, zs_dtype dtype, zs_reduce_op op) {
  return submit(out, h, "all-reduce", [&](Group& g) -> std::function<void(Communicator&)> {
    const DType t = checked_dtype(dtype, false);
    const ReduceOp o = checked_reduce_op(op);
    check_reduction("all-reduce", t, o);
    checked_bytes("all-reduce", count, t, g, false);
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    return [=](Communicator& c) { c.allreduce(send, recv, count, t, o); };
  });
}

ZS_API zs_status zs_broadcast(zs_work* out, zs_group h, void* buf, size_t count, zs_dtype dtype,
                              int root) {
  return submit(out, h, "broadcast", [&](Group& g) -> std::function<void(Communicator&)> {
    const size_t bytes = checked_bytes("broadcast", count, checked_dtype(dtype, false), g, false);
    check_buffer(buf, count, "buf");
    if (root < 0 || root >= g.size())
      fail(Code::InvalidArgument, "root ", root, " is out of range for group '", g.name(),
           "' of size ", g.size());
    return [=](Communicator& c) { c.broadcast(buf, bytes, root); };
  });
}

ZS_API zs_status zs_barrier(zs_work* out, zs_group h) {
  return submit(out, h, "barrier", [&](Group&) -> std::function<void(Communicator&)> {
    return [](Communicator& c) { c.barrier(); };
  });
}

ZS_API zs_status zs_work_wait(zs_work h, int timeout_ms) {
  return guarded([&] {
    if (timeout_ms < ZS_WAIT_FOREVER)
      fail(Code::InvalidArgument, "timeout_ms ", timeout_ms, ": expected >= 0 or ZS_WAIT_FOREVER");
    work_of(h, "work").obj->wait(timeout_ms);
  });
}

ZS_API zs_status zs_work_test(zs_work h, int* done) {
  return guarded([&] {
    checked_out(done, "done");
    auto w = work_of(h, "work").obj;
    *done = w->done() ? 1 : 0;
    w->rethrow_if_failed();
  });
}

ZS_API zs_status zs_work_destroy(zs_work h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    auto obj = take_handle(Kind::Work, reinterpret_cast<uintptr_t>(h), nullptr);
    if (!obj) work_of(h, "work");
    try {
      std::static_pointer_cast<Work>(obj)->wait(-1);  // its buffers are in use until then
    } catch (const Error&) {
      // Its failure was reported through the context's async error.
    }
  });
}

}  // extern "C"
