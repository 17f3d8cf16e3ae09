// The distributed half of the engine's Muon (ZS_OPTIM_MUON, optimizer.h):
// the momentum on each rank's shard, the whole matrix's Newton-Schulz on
// one owner rank per param, the result back on every rank's shard.
//
// Per bucket of params (in order, up to zero_optimization.
// reduce_bucket_size elements, params of one partition group): each rank
// moves its momentum toward the gradient and forms the Nesterov update on
// its shard; one coalesced all-gather gives every rank the bucket's whole
// updates; each param's owner (balanced by Newton-Schulz flops within the
// bucket, the same choice on every rank) orthogonalizes it, all owners at
// once; each owner scatters its result, a shard per rank; every rank then
// decays its master by lr * weight_decay and moves it by -lr times the
// result scaled by sqrt(max(1, rows / cols)). The bytes moved are one
// gather of the updates plus one shard each back: the same on every rank,
// whatever it owns.
#pragma once

#include <vector>

#include "impl/core/context.h"
#include "impl/optim/newton_schulz.h"
#include "impl/partition/param.h"

namespace zs {

struct MuonParam {
  Param* param;
  float* master;          // fp32, shard_numel (the shard itself for an fp32 param)
  float* momentum;        // shard_numel
  const float* grad;      // the averaged gradient shard, before grad_scale
  float lr, beta, weight_decay;  // beta: Muon's momentum
  NsMethod method;
  int ns_steps;
};

// Collective over each param's partition group: its members call with the
// same params in the same order. Under the engine lock.
void muon_step(Context& ctx, const std::vector<MuonParam>& params, float grad_scale);

}  // namespace zs
