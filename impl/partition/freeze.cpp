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
  // A shard not larger than its packet stays exact (quant_packet.h).
  if (ctx.config().zero_quantized_nontrainable_weights &&
      worth_quantizing(param.dtype, param.layout.shard_numel, spec))
    store_shard_as_packet(ctx, param, spec);
  param.frozen = true;
}

}  // namespace zs
