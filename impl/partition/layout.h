// Where a rank's shard of a param lies. A param of numel elements over G
// ranks is padded to a multiple of G (pad = (G - numel % G) % G) and split
// into G equal shards, so the padding sits in the last shard(s).
#pragma once

#include <algorithm>
#include <cstdint>

namespace zs {

struct ShardLayout {
  uint64_t numel = 0;
  uint64_t shard_numel = 0;   // ceil(numel / G)
  uint64_t padded_numel = 0;  // shard_numel * G
  uint64_t shard_offset = 0;  // first element of this rank's shard
  uint64_t shard_valid = 0;   // elements of this shard that are real data

  static ShardLayout make(uint64_t numel, int group_size, int group_rank) {
    const auto g = static_cast<uint64_t>(group_size);
    const auto r = static_cast<uint64_t>(group_rank);
    ShardLayout l;
    l.numel = numel;
    const uint64_t pad = (g - numel % g) % g;
    l.padded_numel = numel + pad;
    l.shard_numel = l.padded_numel / g;
    l.shard_offset = r * l.shard_numel;
    l.shard_valid = valid_in(numel, l.shard_offset, l.shard_numel);
    return l;
  }

  // Real elements in the shard starting at offset.
  static uint64_t valid_in(uint64_t numel, uint64_t offset, uint64_t shard_numel) {
    if (offset >= numel) return 0;
    return std::min(shard_numel, numel - offset);
  }
};

}  // namespace zs
