// Freezing a param for good: what DeepSpeed does to a param with
// requires_grad=False, made explicit. A frozen param is gathered as any
// other, but takes no gradient (a push is refused, naming it) and no
// optimizer steps it or keeps state for it. Under ZeRO++'s
// zero_quantized_nontrainable_weights its shard is also quantized once,
// at freezing (partition/quant_packet.h: zero_quantized_weights_bits and
// _block_size), and kept only as that packet: 1/4 of an fp32 shard's
// memory at int8, and gathers send the packet as it is, never
// requantizing. A shard whose packet would not be smaller (codes fill
// whole blocks, so a few elements take a block) stays exact. Freezing is
// one-way: the quantized values' exact ones are gone.
#pragma once

#include "impl/core/context.h"
#include "impl/partition/param.h"

namespace zs {

// Freezes param (a frozen param is left as it is). InvalidState if a
// gradient was pushed to it since the last optimizer step: freeze between
// steps, so no pushed gradient is silently dropped.
void freeze_param(Context& ctx, Param& param);

}  // namespace zs
