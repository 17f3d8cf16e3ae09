// Training: gradient hand-over and the sharded optimizer.
#include <cstring>

#include "capi/handles.h"
#include "impl/heal/join.h"
#include "impl/heal/peer_copy.h"
#include "impl/heal/protocol.h"
#include "impl/heal/regrow.h"
#include "impl/heal/shrink.h"
#include "impl/heal/trainer_state.h"
#include "impl/grad/grad_norm.h"
#include "impl/grad/reducer.h"

using namespace zs;
using namespace zs::capi;

namespace {

Hparams to_hparams(const zs_optim_hparams* h) {
  const auto& o = checked_options(h, "hparams");
  Hparams hp;
  hp.lr = o.lr;
  hp.beta1 = o.beta1;
  hp.beta2 = o.beta2;
  hp.eps = o.eps;
  hp.weight_decay = o.weight_decay;
  hp.momentum = o.momentum;
  hp.dampening = o.dampening;
  hp.nesterov = o.nesterov != 0;
  hp.bias_correction = o.bias_correction != 0;
  hp.use_muon = o.use_muon;
  hp.ns_method = o.ns_method;
  hp.ns_steps = o.ns_steps;
  return hp;
}

void fill_result(zs_step_result* out, const StepResult& r) {
  SizedOut<zs_step_result> result(out, "result", /*nullable=*/true);
  if (!result) return;
  result->skipped = r.skipped ? 1 : 0;
  result->grad_norm = r.grad_norm;
  result->loss_scale = r.loss_scale;
  result->step = r.step;
}

template <typename Fn>
zs_status with_optimizer(zs_optimizer h, Fn&& fn) {
  return guarded([&] {
    auto r = optimizer_of(h, "opt");
    fn(*r.ctx, *r.obj);
  });
}

}  // namespace

extern "C" {

ZS_API zs_status zs_grad_push(zs_param h, const void* grad, zs_dtype dtype, size_t grad_bytes) {
  return guarded([&] {
    auto r = param_of(h, "param");
    const DType t = checked_dtype(dtype, true);
    grads(*r.ctx).push(r.obj, grad, t, grad_bytes);
  });
}

ZS_API zs_status zs_grad_push_many(zs_context h, const zs_param* params, size_t n,
                                   const void* const* grads, const size_t* grad_bytes,
                                   zs_dtype dtype) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    if (n > 0 && (grads == nullptr || grad_bytes == nullptr))
      fail(Code::InvalidArgument, grads == nullptr ? "grads" : "grad_bytes", " is NULL");
    const DType t = checked_dtype(dtype, true);
    ::zs::grads(*ctx).push_many(params_of(ctx, params, n, "params"), grads, grad_bytes, t);
  });
}

ZS_API zs_status zs_grad_push_borrowed(uint64_t* ticket, zs_param h, const void* grad,
                                       zs_dtype dtype, size_t grad_bytes) {
  return guarded([&] {
    checked_out(ticket, "ticket");
    *ticket = 0;
    auto r = param_of(h, "param");
    const DType t = checked_dtype(dtype, true);
    *ticket = grads(*r.ctx).borrow(r.obj, grad, t, grad_bytes);
  });
}

ZS_API zs_status zs_grad_released(zs_context h, uint64_t* ticket) {
  return guarded([&] {
    checked_out(ticket, "ticket");
    auto ctx = context_of(h, "ctx");
    *ticket = grads(*ctx).released();
  });
}

ZS_API zs_status zs_grad_sync(zs_context h) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    grads(*ctx).sync();
  });
}

ZS_API zs_status zs_grad_discard(zs_context h, const zs_param* params, size_t n) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    auto list = params_of(ctx, params, n, "params");
    const auto held = ctx->lock();
    grads(*ctx).discard_locked(list);
  });
}

ZS_API zs_status zs_grad_set_accumulation_steps(zs_context h, int steps) {
  return guarded([&] {
    auto ctx = context_of(h, "ctx");
    grads(*ctx).set_accumulation_steps(steps);
  });
}

ZS_API zs_status zs_grad_shard_data(zs_param h, float** data, uint64_t* shard_numel) {
  return guarded([&] {
    checked_out(data, "data");
    auto r = param_of(h, "param");
    *data = grads(*r.ctx).shard_data(*r.obj);
    if (shard_numel) *shard_numel = r.obj->layout.shard_numel;
  });
}

ZS_API zs_status zs_grad_pushed(zs_param h, int* pushed) {
  return guarded([&] {
    checked_out(pushed, "pushed");
    auto r = param_of(h, "param");
    const auto held = r.ctx->lock();
    *pushed = r.obj->grad_pushed ? 1 : 0;
  });
}

ZS_API zs_status zs_grad_clip_norm(zs_context h, const zs_param* params, size_t n, double max_norm,
                                   double* total_norm) {
  return guarded([&] {
    checked_out(total_norm, "total_norm");
    auto ctx = context_of(h, "ctx");
    *total_norm = clip_grad_norm(*ctx, params_of(ctx, params, n, "params"), max_norm);
  });
}

ZS_API zs_status zs_optimizer_create(zs_optimizer* out, zs_context h, zs_optimizer_kind kind) {
  return guarded([&] {
    checked_out(out, "out");
    *out = nullptr;
    auto ctx = context_of(h, "ctx");
    auto opt = std::make_shared<Optimizer>(*ctx, static_cast<OptimKind>(kind));
    heal::attach(*ctx, *opt);  // zeroshard.healing.peer_copy: the copy of its state in a peer
    *out = to_handle<zs_optimizer>(add_handle(Kind::Optimizer, ctx->id(), std::move(opt)));
  });
}

ZS_API zs_status zs_optimizer_destroy(zs_optimizer h) {
  if (h == nullptr) return ZS_OK;
  return guarded([&] {
    auto r = optimizer_of(h, "opt");
    r.ctx->refuse_reentry("zs_optimizer_destroy");  // before the handle is given up
    take_handle(Kind::Optimizer, reinterpret_cast<uintptr_t>(h), nullptr);
    r.obj.reset();  // frees its state under the engine lock
  });
}

ZS_API zs_status zs_optimizer_add_group(zs_optimizer h, const zs_param* params, size_t n,
                                        const zs_optim_hparams* hparams, int* group_index) {
  return guarded([&] {
    auto r = optimizer_of(h, "opt");
    const Hparams hp = to_hparams(hparams);
    auto list = params_of(r.ctx, params, n, "params");
    const int g = r.obj->add_group(list, hp);
    if (group_index) *group_index = g;
  });
}

ZS_API zs_status zs_optimizer_set_hparams(zs_optimizer h, int group, const zs_optim_hparams* hparams) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { o.set_hparams(group, to_hparams(hparams)); });
}

ZS_API zs_status zs_optimizer_set_lr(zs_optimizer h, int group, double lr) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { o.set_lr(group, lr); });
}

ZS_API zs_status zs_optimizer_step(zs_optimizer h, zs_step_result* result_out) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    fill_result(result_out, o.step());
    heal::regrow_after_step(ctx, o);  // when the step's all-reduce voted for it
  });
}

ZS_API zs_status zs_optimizer_step_begin(zs_optimizer h, zs_step_result* result) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { fill_result(result, o.step_begin()); });
}

ZS_API zs_status zs_optimizer_step_end(zs_optimizer h, zs_step_result* result) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    fill_result(result, o.step_end());
    heal::regrow_after_step(ctx, o);
  });
}

ZS_API zs_status zs_optimizer_named_state(zs_optimizer h, zs_param param, const char* name, int create,
                                          float** data, uint64_t* shard_numel) {
  return guarded([&] {
    checked_out(data, "data");
    *data = nullptr;
    if (name == nullptr) fail(Code::InvalidArgument, "name is NULL");
    auto r = optimizer_of(h, "opt");
    auto p = param_of(param, "param");
    if (p.ctx != r.ctx) fail(Code::InvalidArgument, "param belongs to another context");
    *data = r.obj->named_state(*p.obj, name, create != 0, shard_numel);
  });
}

ZS_API zs_status zs_optimizer_loss_scale(zs_optimizer h, double* scale) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { *checked_out(scale, "scale") = o.loss_scale(); });
}

ZS_API zs_status zs_optimizer_state_data(zs_optimizer h, zs_param param, int slot, float** data,
                                         uint64_t* shard_numel) {
  return guarded([&] {
    checked_out(data, "data");
    auto r = optimizer_of(h, "opt");
    auto p = param_of(param, "param");
    if (p.ctx != r.ctx) fail(Code::InvalidArgument, "param belongs to another context");
    *data = r.obj->state(*p.obj, slot, shard_numel);
  });
}

ZS_API zs_status zs_optimizer_get_step(zs_optimizer h, int64_t* step) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { *checked_out(step, "step") = o.steps(); });
}

ZS_API zs_status zs_optimizer_set_step(zs_optimizer h, int64_t step) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { o.set_steps(step); });
}

ZS_API zs_status zs_optimizer_sync_params(zs_optimizer h) {
  return with_optimizer(h, [&](Context&, Optimizer& o) { o.sync_params(); });
}

ZS_API zs_status zs_heal_state_digest(uint64_t* hash, int* source, int64_t* step, zs_optimizer h, int replica) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    checked_out(hash, "hash");
    if (replica != 0 && replica != 1)
      fail(Code::InvalidArgument, "replica ", replica, ": expected 0 (this rank's own state) or 1 (the replica it holds)");
    const auto held = ctx.lock();
    heal::PeerCopy& pc = heal::peer_copy_of(ctx, o);
    const heal::Digest d = replica == 1 ? pc.replica_digest() : pc.own_digest();
    *hash = d.hash;
    if (source) *source = d.source;
    if (step) *step = d.step;
  });
}

ZS_API zs_status zs_heal_agree(int64_t* committed_step, int* rolled_forward, zs_optimizer h) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    checked_out(committed_step, "committed_step");
    const heal::Outcome out = heal::agree(ctx, o);
    *committed_step = out.committed;
    if (rolled_forward) *rolled_forward = out.rolled_forward ? 1 : 0;
  });
}

ZS_API zs_status zs_heal_committed_result(zs_step_result* result, int* found, zs_optimizer h) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    checked_out(found, "found");
    if (result == nullptr) fail(Code::InvalidArgument, "result is NULL");
    StepResult r;
    bool there = false;
    {
      const auto held = ctx.lock();
      there = o.committed_result_locked(&r);
    }
    *found = there ? 1 : 0;
    if (there) fill_result(result, r);  // checks result->size; untouched when not found
  });
}

ZS_API zs_status zs_heal_join(int64_t* committed_step, zs_optimizer h) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    checked_out(committed_step, "committed_step");
    *committed_step = heal::join(ctx, o).committed;
  });
}

ZS_API zs_status zs_heal_shrink(int64_t* committed_step, zs_optimizer h) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) {
    checked_out(committed_step, "committed_step");
    *committed_step = heal::shrink(ctx, o).committed;
  });
}

ZS_API zs_status zs_heal_set_rank_state(zs_optimizer h, const void* data, size_t size) {
  return with_optimizer(h, [&](Context& ctx, Optimizer& o) { heal::set_rank_state(ctx, o, data, size); });
}

ZS_API zs_status zs_heal_set_shared_state(zs_context h, const void* data, size_t size) {
  return guarded([&] { heal::set_shared_state(*context_of(h, "ctx"), data, size); });
}

ZS_API zs_status zs_heal_joined_state(size_t* size, int* found, zs_context h, zs_heal_state_kind which,
                                      void* buffer, size_t capacity) {
  return guarded([&] {
    checked_out(size, "size");
    checked_out(found, "found");
    std::vector<char> bytes;
    const bool there = heal::joined_state(*context_of(h, "ctx"), static_cast<int>(which), &bytes);
    *size = bytes.size();
    *found = there ? 1 : 0;
    if (bytes.empty() || (buffer == nullptr && capacity == 0)) return;  // the size asked
    if (capacity < bytes.size())
      fail(Code::BufferSize, "zs_heal_joined_state: capacity ", capacity, " bytes, the state has ", bytes.size());
    if (buffer == nullptr) fail(Code::InvalidArgument, "buffer is NULL with capacity ", capacity);
    std::memcpy(buffer, bytes.data(), bytes.size());
  });
}

}  // extern "C"
