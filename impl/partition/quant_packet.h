// A shard as a block-quantized packet: what a rank sends instead of its
// shard when weights are gathered quantized (ZeRO++ qwZ, fetch/gather.cpp),
// and what a frozen param keeps instead of its shard under
// zero_quantized_nontrainable_weights (partition/freeze.h). The whole
// padded shard (padding is zeros, so it never raises a block's scale) is
// quantized into one packet of [scales | codes] (kernels/quant.h); packets
// travel as opaque bytes, and every rank dequantizes every packet, its own
// included. Every rank thus holds bitwise the same values, within the
// bound of kernels/quant.h of the exact ones.
#pragma once

#include <cstddef>
#include <cstdint>

#include "impl/common/dtype.h"
#include "impl/config/config.h"
#include "impl/device/device.h"
#include "kernels/quant.h"

namespace zs {

// The quantization the config asks for weights (bits, block size): qwZ's
// gathers and frozen params' packets alike.
kernels::QuantSpec weight_quant_spec(const Config& c);

// Whether a param of this dtype is quantized (float dtypes only; anything
// else travels, and is kept, exact).
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

}  // namespace zs
