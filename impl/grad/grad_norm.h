// The global norm of gradient shards, and clipping by it: the step's norm
// (optim/optimizer.cpp) and a trainer's clip_grad_norm_ between the
// backward and the step (a torch optimizer on the shards).
#pragma once

#include <memory>
#include <vector>

#include "impl/core/context.h"
#include "impl/partition/param.h"

namespace zs {

// Sum of squares and finiteness of gradient shards, in their order: the sum
// each shard's last write took where it is known, else read from the shard.
// Added in the order one ops::sum_squares_and_finite over every shard adds
// them, so the value has the same bits whichever way each sum was found.
void grad_sum_squares(Device& dev, const std::vector<const Param*>& params, double* sum, bool* finite);

// Syncs the gradients, takes the L2 norm of params' averaged gradients over
// their partition groups (each shard counted once), and when it exceeds
// max_norm scales every gradient shard by max_norm / (norm + 1e-6), as
// torch.nn.utils.clip_grad_norm_ does. Returns the norm before clipping
// (inf or NaN, nothing scaled, when a gradient is not finite: the step
// skips it). Collective over the world: every rank passes the same params
// in the same order. Refused under fp16.enabled, whose shards carry the
// loss scale until the step (gradient_clipping clips there).
double clip_grad_norm(Context& ctx, const std::vector<std::shared_ptr<Param>>& params, double max_norm);

}  // namespace zs
