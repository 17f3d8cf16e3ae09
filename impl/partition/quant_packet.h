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

// The packet of one shard of shard_numel elements: scales first (4-byte
// aligned), codes after, the whole rounded up to 4 bytes so packets laid
// end to end keep their scales aligned.
struct QuantPacket {
  size_t scale_bytes = 0;
  size_t bytes = 0;
};
QuantPacket quant_packet(uint64_t shard_numel, const kernels::QuantSpec& s);

// Whether a shard of shard_numel elements of dtype is quantized, by qwZ's
// gathers and by freezing alike: a float dtype whose packet takes fewer
// bytes than the shard. Codes fill whole blocks, so a small shard (a
// norm's 24 bf16 elements, 48 bytes, would take a 256-byte block and a
// scale) stays exact: fewer bytes and no error. Every rank decides alike,
// as shard_numel is the same on all of them (the last one's is padded).
bool worth_quantizing(DType dtype, uint64_t shard_numel, const kernels::QuantSpec& s);

// shard (shard_numel elements of dtype) -> packet, on dev's stream.
void pack_quantized(Device& dev, const void* shard, DType dtype, uint64_t shard_numel,
                    const kernels::QuantSpec& s, void* packet);
// packet -> shard_numel elements of dtype at dst, on dev's stream.
void unpack_quantized(Device& dev, const void* packet, DType dtype, uint64_t shard_numel,
                      const kernels::QuantSpec& s, void* dst);

}  // namespace zs
