#include "impl/optim/shard_step.h"

#include "impl/common/error.h"
#include "impl/device/ops.h"

namespace zs {

kernels::AdamHyper adam_hyper(OptimKind kind, const Hparams& hp, int64_t updates) {
  return kernels::AdamHyper{static_cast<float>(hp.lr),   static_cast<float>(hp.beta1),
                            static_cast<float>(hp.beta2), static_cast<float>(hp.eps),
                            static_cast<float>(hp.weight_decay), kind == OptimKind::AdamW || kind == OptimKind::Muon,
                            hp.bias_correction, updates + 1};
}

kernels::SgdHyper sgd_hyper(const Hparams& hp, bool first) {
  return kernels::SgdHyper{static_cast<float>(hp.lr), static_cast<float>(hp.momentum),
                           static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                           hp.nesterov, first};
}

void step_shard(Device& dev, OptimKind kind, const Hparams& hp, const ShardBuffers& b, const float* grad,
                uint64_t n, float grad_scale, int64_t updates, bool sgd_first) {
  if (kind == OptimKind::External)
    fail(Code::Internal, "step_shard: an external optimizer's update is the caller's");
  if (b.master == nullptr) {
    // bf16 masters (and maybe bf16 moments): the shard is stepped in place.
    if (kind == OptimKind::Sgd)
      ops::sgd_step_mixed(dev, b.working, b.dtype, b.state1, b.state_dtype, grad, n, sgd_hyper(hp, sgd_first),
                          grad_scale);
    else
      ops::adam_step_mixed(dev, b.working, b.dtype, b.state1, b.state2, b.state_dtype, grad, n,
                           adam_hyper(kind, hp, updates), grad_scale);
    return;
  }
  if (b.state_dtype != DType::F32)
    fail(Code::Internal, "step_shard: bf16 moments with an fp32 master");
  if (kind == OptimKind::Sgd)
    ops::sgd_step(dev, b.master, static_cast<float*>(b.state1), grad, n, sgd_hyper(hp, sgd_first), grad_scale,
                  b.working, b.dtype);
  else
    ops::adam_step(dev, b.master, static_cast<float*>(b.state1), static_cast<float*>(b.state2), grad, n,
                   adam_hyper(kind, hp, updates), grad_scale, b.working, b.dtype);
}

}  // namespace zs
