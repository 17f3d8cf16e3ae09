// ZeRO++ qwZ: what a rank sends instead of its shard when weights are
// gathered quantized. Each rank quantizes its whole padded shard (padding
// is zeros, so it never raises a block's scale) into one packet of
// [scales | codes] (kernels/quant.h); the packets are all-gathered as
// opaque bytes, and every rank dequantizes every packet, its own
// included, into the gathered param. Every rank thus holds bitwise the
// same values, within the bound of kernels/quant.h of the exact ones.
#pragma once

#include <cstddef>
#include <cstdint>

#include "impl/common/dtype.h"
#include "impl/config/config.h"
#include "impl/device/device.h"
#include "kernels/quant.h"

namespace zs {

// The quantization the config asks for (bits, block size).
kernels::QuantSpec weight_quant_spec(const Config& c);

// Whether a param of this dtype is gathered quantized (float dtypes only;
// anything else travels exact).
bool quantizable(DType t);

// The packet of one shard of shard_numel elements: scales first (4-byte
// aligned), codes after, the whole rounded up to 4 bytes so packets laid
// end to end keep their scales aligned.
struct QuantPacket {
  size_t scale_bytes = 0;
  size_t bytes = 0;
};
QuantPacket quant_packet(uint64_t shard_numel, const kernels::QuantSpec& s);

// shard (shard_numel elements of dtype) -> packet, on dev's stream.
void pack_quantized(Device& dev, const void* shard, DType dtype, uint64_t shard_numel,
                    const kernels::QuantSpec& s, void* packet);
// packet -> shard_numel elements of dtype at dst, on dev's stream.
void unpack_quantized(Device& dev, const void* packet, DType dtype, uint64_t shard_numel,
                      const kernels::QuantSpec& s, void* dst);

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
