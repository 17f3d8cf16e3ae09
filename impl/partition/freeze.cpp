#include "impl/partition/freeze.h"

#include "impl/common/error.h"
#include "impl/partition/quant_packet.h"
#include "impl/partition/shard_residence.h"

namespace zs {

void freeze_param(Context& ctx, Param& param) {
  const auto held = ctx.lock();
  ctx.check_async_error();
  if (param.frozen) return;
  if (param.grad_pushed)
    fail(Code::InvalidState, "freeze: ", param.describe(),
         " has a gradient pushed since the last optimizer step; freeze it between steps "
         "(after the step, or before the backward), so that no gradient is dropped");
  const kernels::QuantSpec spec = weight_quant_spec(ctx.config());
  // A shard smaller than its packet (codes fill whole blocks: a norm's 24
  // elements take a 256-byte block) stays exact: quantizing it would cost
  // memory and precision for nothing.
  if (ctx.config().zero_quantized_nontrainable_weights && quantizable(param.dtype) &&
      quant_packet(param.layout.shard_numel, spec).bytes < param.shard_bytes())
    store_shard_as_packet(ctx, param, spec);
  param.frozen = true;
}

}  // namespace zs
