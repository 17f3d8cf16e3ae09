#include "impl/fetch/quantized.h"

#include <cstring>
#include <vector>

#include "impl/device/ops.h"

namespace zs {

kernels::QuantSpec weight_quant_spec(const Config& c) {
  return {static_cast<int>(c.zero_quantized_weights_bits),
          static_cast<size_t>(c.zero_quantized_weights_block_size)};
}

bool quantizable(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

QuantPacket quant_packet(uint64_t shard_numel, const kernels::QuantSpec& s) {
  const size_t n = static_cast<size_t>(shard_numel);
  QuantPacket p;
  p.scale_bytes = kernels::quant_blocks(n, s) * sizeof(float);
  p.bytes = p.scale_bytes + (kernels::quant_code_bytes(n, s) + 3) / 4 * 4;
  return p;
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

void write_back_keeping_exact(Device& dev, void* shard, DType dtype, uint64_t shard_numel,
                              uint64_t shard_valid, const kernels::QuantSpec& s,
                              const void* fresh) {
  const size_t es = dtype_size(dtype), n = static_cast<size_t>(shard_numel),
               valid = static_cast<size_t>(shard_valid);
  std::vector<uint8_t> exact(n * es), gathered(n * es), fresh_h(valid * es),
      packet(quant_packet(shard_numel, s).bytes);
  dev.copy(exact.data(), shard, exact.size());
  dev.copy(fresh_h.data(), fresh, fresh_h.size());
  dev.synchronize();
  Device& host = *host_device();
  pack_quantized(host, exact.data(), dtype, shard_numel, s, packet.data());
  unpack_quantized(host, packet.data(), dtype, shard_numel, s, gathered.data());
  for (size_t i = 0; i < valid; ++i)
    if (std::memcmp(fresh_h.data() + i * es, gathered.data() + i * es, es) != 0)
      std::memcpy(exact.data() + i * es, fresh_h.data() + i * es, es);
  dev.copy(shard, exact.data(), valid * es);
  dev.synchronize();
}

}  // namespace zs
