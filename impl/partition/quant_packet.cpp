#include "impl/partition/quant_packet.h"

#include "impl/device/ops.h"

namespace zs {

kernels::QuantSpec weight_quant_spec(const Config& c) {
  return {static_cast<int>(c.zero_quantized_weights_bits),
          static_cast<size_t>(c.zero_quantized_weights_block_size)};
}

QuantPacket quant_packet(uint64_t shard_numel, const kernels::QuantSpec& s) {
  const size_t n = static_cast<size_t>(shard_numel);
  QuantPacket p;
  p.scale_bytes = kernels::quant_blocks(n, s) * sizeof(float);
  p.bytes = p.scale_bytes + (kernels::quant_code_bytes(n, s) + 3) / 4 * 4;
  return p;
}

bool worth_quantizing(DType dtype, uint64_t shard_numel, const kernels::QuantSpec& s) {
  const bool is_float = dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16;
  return is_float && quant_packet(shard_numel, s).bytes < shard_numel * dtype_size(dtype);
}

void pack_quantized(Device& dev, const void* shard, DType dtype, uint64_t shard_numel,
                    const kernels::QuantSpec& s, void* packet) {
  const QuantPacket q = quant_packet(shard_numel, s);
  auto* base = static_cast<uint8_t*>(packet);
  ops::quantize(dev, shard, dtype, static_cast<size_t>(shard_numel), s, base + q.scale_bytes,
                reinterpret_cast<float*>(base));
}

void unpack_quantized(Device& dev, const void* packet, DType dtype, uint64_t shard_numel,
                      const kernels::QuantSpec& s, void* dst) {
  const QuantPacket q = quant_packet(shard_numel, s);
  const auto* base = static_cast<const uint8_t*>(packet);
  ops::dequantize(dev, base + q.scale_bytes, reinterpret_cast<const float*>(base),
                  static_cast<size_t>(shard_numel), s, dst, dtype);
}

}  // namespace zs
