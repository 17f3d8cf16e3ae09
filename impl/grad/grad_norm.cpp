#include "impl/grad/grad_norm.h"

#include <cmath>
#include <limits>
#include <map>

#include "impl/device/ops.h"
#include "impl/grad/reducer.h"

namespace zs {

void grad_sum_squares(Device& dev, const std::vector<const Param*>& params, double* sum, bool* finite) {
  auto range = [](const Param* p) {
    return ops::Range{static_cast<const float*>(p->grad->data()), p->layout.shard_numel};
  };
  std::vector<ops::Range> unknown;
  for (const Param* p : params)
    if (!p->grad->sum_known) unknown.push_back(range(p));
  if (unknown.size() == params.size()) {  // one pass (one synchronisation on a GPU)
    ops::sum_squares_and_finite(dev, unknown, sum, finite);
    return;
  }
  *sum = 0.0;
  *finite = true;
  for (const Param* p : params) {
    double s = p->grad->sumsq;
    // Finite squares cannot overflow a double sum: it is finite exactly
    // when every element is (as sum_squares_and_finite decides on the host).
    bool f = std::isfinite(s);
    if (!p->grad->sum_known) ops::sum_squares_and_finite(dev, {range(p)}, &s, &f);
    *sum += s;
    if (!f) *finite = false;
  }
}

double clip_grad_norm(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, double max_norm) {
  const auto held = ctx.lock();
  ctx.check_async_error();
  if (!(max_norm >= 0.0) || std::isnan(max_norm))
    fail(Code::InvalidArgument, "clip_grad_norm: max_norm ", max_norm, ": expected >= 0");
  if (ctx.config().fp16)
    fail(Code::NotSupported, "clip_grad_norm under fp16.enabled: the gradient shards carry the loss scale "
         "until the optimizer's step, so their norm is not the gradient's; set \"gradient_clipping\" in the "
         "config instead (the step clips the unscaled norm)");
  grads(ctx).sync_locked();
  // Per partition group in order of first appearance (the same on every
  // rank: the same params in the same order), whether or not this rank's
  // shard holds a gradient, so every rank issues the same all-reduces.
  std::vector<std::shared_ptr<Group>> order;
  std::map<const Group*, std::vector<const Param*>> with_grad;
  for (const auto& p : params) {
    if (!with_grad.count(p->group.get())) {
      order.push_back(p->group);
      with_grad[p->group.get()];
    }
    if (p->grad && p->grad->current) with_grad[p->group.get()].push_back(p.get());
  }
  double total = 0.0;
  bool finite = true;
  for (const auto& group : order) {
    double sum = 0.0;
    bool f = true;
    const auto& list = with_grad.at(group.get());
    if (!list.empty()) grad_sum_squares(*ctx.device(), list, &sum, &f);
    float v[2] = {static_cast<float>(sum), f ? 0.0f : 1.0f};
    if (group->size() > 1)
      group->run("clip_grad_norm", [&](Communicator& c) { c.allreduce(v, v, 2, DType::F32, ReduceOp::Sum); });
    total += v[0];
    if (v[1] > 0.0f) finite = false;
  }
  const double norm = finite ? std::sqrt(total) : std::numeric_limits<double>::infinity();
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return norm;
  const auto divisor = static_cast<float>(1.0 / coef);
  for (const auto& group : order)
    for (const Param* cp : with_grad.at(group.get())) cp->grad->divide(*ctx.device(), divisor);
  ctx.device()->synchronize();
  return norm;
}

}  // namespace zs
