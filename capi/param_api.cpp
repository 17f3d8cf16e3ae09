// Partitioned params: registration, fetch/release, data access, DLPack.
#include <dlpack/dlpack.h>

#include "capi/handles.h"
#include "impl/partition/freeze.h"
#include "impl/partition/register.h"
#include "impl/partition/shard_residence.h"

using namespace zs;
using namespace zs::capi;

namespace {

// Params may come from zs_param handles of one context only.
template <typename Fn>
zs_status with_param(zs_param h, Fn&& fn) {
  return guarded([&] {
    auto r = param_of(h, "param");
    fn(*r.ctx, *r.obj);
  });
}

// Keeps the gathered buffer alive for as long as the DLPack tensor lives.
struct DLPackHolder {
  BufferPtr buffer;
  std::vector<int64_t> shape;
  DLManagedTensor tensor;
};

DLDataType dl_dtype(DType t) {
  switch (t) {
    case DType::F32: return DLDataType{kDLFloat, 32, 1};
    case DType::BF16: return DLDataType{kDLBfloat, 16, 1};
    case DType::F16: return DLDataType{kDLFloat, 16, 1};
    case DType::U8: break;
  }
  return DLDataType{kDLUInt, 8, 1};
}

}  // namespace

extern "C" {

ZS_API zs_status zs_param_register(zs_param* out, zs_context h, const zs_param_options* options) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    const auto& o = checked_options(options, "options");
    auto ctx = context_of(h, "ctx");
    ParamSpec spec;
    spec.name = o.name ? o.name : "";
    spec.dtype = checked_dtype(o.dtype, true);
    if (o.ndim < 0 || o.ndim > ZS_MAX_DIMS)
      fail(Code::InvalidArgument, "param '", spec.name, "': ndim ", o.ndim, ": expected 0..",
           ZS_MAX_DIMS);
    if (o.ndim > 0 && o.shape == nullptr)
      fail(Code::InvalidArgument, "param '", spec.name, "': shape is NULL with ndim ", o.ndim);
    spec.shape.assign(o.shape, o.shape + o.ndim);
    spec.init = static_cast<InitKind>(o.init);
    spec.data = o.data;
    spec.data_bytes = o.data_bytes;
    spec.src_rank = o.src_rank;
    spec.seed = o.seed;
    spec.a = o.a;
    spec.b = o.b;
    if (o.group != nullptr) {
      auto g = group_of(o.group, "options->group");
      if (g.ctx != ctx) fail(Code::InvalidArgument, "options->group belongs to another context");
      spec.group = g.obj;
    }
    auto p = register_param(*ctx, spec);
    *out = to_handle<zs_param>(add_handle(Kind::Param, ctx->id(), std::move(p)));
  });
}

ZS_API zs_status zs_param_destroy(zs_param h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    auto r = param_of(h, "param");
    r.ctx->refuse_reentry("zs_param_destroy");  // before the handle is given up
    if (!take_handle(Kind::Param, reinterpret_cast<uintptr_t>(h), nullptr)) param_of(h, "param");
    unregister_param(*r.ctx, *r.obj);
  });
}

ZS_API zs_status zs_param_get_info(zs_param h, zs_param_info* info_out) {
  return with_param(h, [&](Context& ctx, Param& p) {
    SizedOut<zs_param_info> info(info_out, "info");
    const ParamStatus status = settle(ctx, p);
    info->name = p.name.c_str();
    info->dtype = static_cast<zs_dtype>(p.dtype);
    info->ndim = static_cast<int>(p.shape.size());
    for (int i = 0; i < ZS_MAX_DIMS; ++i)
      info->shape[i] = i < info->ndim ? p.shape[static_cast<size_t>(i)] : 0;
    info->numel = p.layout.numel;
    info->shard_numel = p.layout.shard_numel;
    info->padded_numel = p.layout.padded_numel;
    info->shard_offset = p.layout.shard_offset;
    info->shard_valid = p.layout.shard_valid;
    info->status = static_cast<zs_param_status>(status);
    const DeviceRef where = ctx.device()->ref();
    info->device_type = where.is_cuda() ? ZS_DEVICE_CUDA : ZS_DEVICE_CPU;
    info->device_id = where.ordinal;
    info->shard_version = p.shard_version;
  });
}

ZS_API zs_status zs_param_get_status(zs_param h, zs_param_status* status) {
  return with_param(h, [&](Context& ctx, Param& p) {
    checked_out(status, "status");
    *status = static_cast<zs_param_status>(settle(ctx, p));
  });
}

ZS_API zs_status zs_param_shard_data(zs_param h, void** data, uint64_t* shard_numel) {
  return with_param(h, [&](Context& ctx, Param& p) {
    checked_out(data, "data");
    *data = keep_shard_in_memory(ctx, p);
    if (shard_numel) *shard_numel = p.layout.shard_numel;
  });
}

ZS_API zs_status zs_param_freeze(zs_param h) {
  return with_param(h, [&](Context& ctx, Param& p) { freeze_param(ctx, p); });
}

ZS_API zs_status zs_fetch(zs_gather* out, zs_context h, const zs_param* params, size_t n) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    auto state = std::make_shared<GatherState>();
    state->work = fetch_params(*ctx, list);
    state->params = std::move(list);
    *out = to_handle<zs_gather>(add_handle(Kind::Gather, ctx->id(), std::move(state)));
  });
}

// Waiting happens without the engine lock; settle takes it to move the
// params to AVAILABLE afterwards.
ZS_API zs_status zs_gather_wait(zs_gather h, int timeout_ms) {
  return guarded([&] {
    if (timeout_ms < ZS_WAIT_FOREVER)
      fail(Code::InvalidArgument, "timeout_ms ", timeout_ms, ": expected >= 0 or ZS_WAIT_FOREVER");
    auto g = gather_of(h, "gather");
    g.obj->work->wait(timeout_ms);
    for (const auto& p : g.obj->params) settle(*g.ctx, *p);
  });
}

ZS_API zs_status zs_gather_test(zs_gather h, int* done) {
  return guarded([&] {
    checked_out(done, "done");
    auto g = gather_of(h, "gather");
    *done = g.obj->work->done() ? 1 : 0;
    if (!*done) return;
    for (const auto& p : g.obj->params) settle(*g.ctx, *p);
    g.obj->work->rethrow_if_failed();
  });
}

ZS_API zs_status zs_gather_destroy(zs_gather h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    auto g = gather_of(h, "gather");
    g.ctx->refuse_reentry("zs_gather_destroy");  // before the handle is given up
    take_handle(Kind::Gather, reinterpret_cast<uintptr_t>(h), nullptr);
    try {
      g.obj->work->wait(-1);
    } catch (const Error&) {
      // Reported through the context's async error; params fall back below.
    }
    for (const auto& p : g.obj->params) settle(*g.ctx, *p);
  });
}

ZS_API zs_status zs_param_data(zs_param h, void** data) {
  return with_param(h, [&](Context& ctx, Param& p) {
    checked_out(data, "data");
    *data = available_data(ctx, p, "zs_param_data")->data();
  });
}

ZS_API zs_status zs_param_copy_to(zs_param h, void* dst, size_t dst_bytes) {
  return with_param(h, [&](Context& ctx, Param& p) {
    if (dst == nullptr && p.full_bytes() > 0) fail(Code::InvalidArgument, "dst is NULL");
    if (dst_bytes != p.full_bytes())
      fail(Code::BufferSize, "zs_param_copy_to: ", p.describe(), ": dst_bytes is ", dst_bytes,
           ", expected ", p.full_bytes());
    const BufferPtr full = available_data(ctx, p, "zs_param_copy_to");
    copy_between(dst, full->data(), dst_bytes);
  });
}

ZS_API zs_status zs_param_to_dlpack(zs_param h, struct DLManagedTensor** out) {
  return with_param(h, [&](Context& ctx, Param& p) {
    checked_out(out, "out");
    *out = nullptr;
    auto holder = std::make_unique<DLPackHolder>();
    holder->buffer = available_data(ctx, p, "zs_param_to_dlpack");
    holder->shape = p.shape;
    DLTensor& t = holder->tensor.dl_tensor;
    t.data = holder->buffer->data();
    const DeviceRef where = holder->buffer->device().ref();
    t.device = where.is_cuda() ? DLDevice{kDLCUDA, where.ordinal} : DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(p.shape.size());
    t.dtype = dl_dtype(p.dtype);
    t.shape = holder->shape.empty() ? nullptr : holder->shape.data();
    t.strides = nullptr;  // compact row-major
    t.byte_offset = 0;
    holder->tensor.manager_ctx = holder.get();
    holder->tensor.deleter = [](DLManagedTensor* self) {
      delete static_cast<DLPackHolder*>(self->manager_ctx);
    };
    *out = &holder.release()->tensor;
  });
}

ZS_API zs_status zs_release(zs_context h, const zs_param* params, size_t n) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    release_params(*ctx, list);
  });
}

ZS_API zs_status zs_param_write(zs_param h, const void* data, size_t data_bytes) {
  return with_param(h, [&](Context& ctx, Param& p) { write_param(ctx, p, data, data_bytes); });
}

ZS_API zs_status zs_param_update(zs_context h, const zs_param* params, size_t n,
                                 int modifier_rank) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    update_params(*ctx, list, modifier_rank);
  });
}

}  // extern "C"
