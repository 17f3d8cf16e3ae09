// One shard's update, as both its owner (Optimizer::update) and the holder
// of its replica (impl/heal/peer_copy.cpp) run it: the same function on the
// same inputs, so a replica follows its source bit for bit.
#pragma once

#include <cstdint>

#include "impl/common/dtype.h"
#include "impl/device/device.h"
#include "kernels/optim.h"

namespace zs {

enum class OptimKind : int { AdamW = 0, Adam = 1, Sgd = 2, External = 3, Muon = 4 };

struct Hparams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false, bias_correction = true;
  // Muon only (the defaults on every other kind): whether the group's
  // params step Muon (1), AdamW (0), or by shape (-1: 2 or more dims Muon);
  // the Newton-Schulz method (NsMethod) and its steps.
  int use_muon = -1;
  int ns_method = 0;
  int ns_steps = 5;
};

// Where one shard's state is.
struct ShardBuffers {
  // The fp32 master; null when the param's bf16 working shard is its own
  // master, stepped in place (bf16.bf16_master_weights_and_grads).
  float* master = nullptr;
  // The working shard in `dtype`: written from the master as it goes (a
  // 16-bit param with an fp32 master), or the master itself (master null);
  // null for an fp32 param, whose master is its shard.
  void* working = nullptr;
  DType dtype = DType::F32;
  void* state1 = nullptr;  // Adam's exp_avg, SGD's momentum (null: none)
  void* state2 = nullptr;  // Adam's exp_avg_sq
  DType state_dtype = DType::F32;
};

// The kernels' hyper-parameters of one step: `updates` is how many steps
// updated the param before this one (Adam's bias correction); `first`,
// whether SGD's momentum buffer starts from this gradient.
kernels::AdamHyper adam_hyper(OptimKind kind, const Hparams& hp, int64_t updates);
kernels::SgdHyper sgd_hyper(const Hparams& hp, bool first);

// AdamW, Adam or SGD (a Muon optimizer's non-matrix params step AdamW) over
// the shard's n elements, the gradient times grad_scale.
void step_shard(Device& dev, OptimKind kind, const Hparams& hp, const ShardBuffers& b, const float* grad,
                uint64_t n, float grad_scale, int64_t updates, bool sgd_first);

}  // namespace zs
