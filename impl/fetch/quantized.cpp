#include "impl/fetch/quantized.h"

#include <cstring>
#include <vector>

#include "impl/device/ops.h"

namespace zs {

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
  // The caller's change, as update_params' plain copies.
  copy_tally::add(CopyKind::Other, (exact.size() + fresh_h.size()) + valid * es);
}

}  // namespace zs
