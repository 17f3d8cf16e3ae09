// ZeRO++ qwZ's write-back: GatheredParameters' edits of params gathered
// quantized (the packet format is partition/quant_packet.h).
#pragma once

#include <cstdint>

#include "impl/common/dtype.h"
#include "impl/device/device.h"
#include "impl/partition/quant_packet.h"

namespace zs {

// GatheredParameters' write-back under qwZ: `fresh` (shard_valid elements
// on dev) are the broadcast values of this rank's part of the param. An
// element still equal, bit for bit, to what the quantized gather gave
// there (dequantize(quantize(shard)), the same on every rank) was left
// alone by the modifier and keeps its exact shard value; any other takes
// the fresh value. So a partial edit does not quantize the rest for good
// (an element set to exactly its gathered value keeps the old one, within
// the bound). Through host memory: an update is rare and blocking.
void write_back_keeping_exact(Device& dev, void* shard, DType dtype, uint64_t shard_numel,
                              uint64_t shard_valid, const kernels::QuantSpec& s,
                              const void* fresh);

}  // namespace zs
