#include "impl/checkpoint/reshard_plan.h"

#include <algorithm>

#include "impl/common/error.h"
#include "impl/partition/layout.h"

namespace zs {

std::vector<Piece> overlaps(const std::vector<Span>& spans, uint64_t first, uint64_t n) {
  std::vector<Piece> out;
  for (size_t i = 0; i < spans.size(); ++i) {
    const uint64_t lo = std::max(first, spans[i].offset);
    const uint64_t hi = std::min(first + n, spans[i].offset + spans[i].numel);
    if (lo < hi) out.push_back({i, lo, hi - lo});
  }
  return out;
}

std::vector<Span> shard_spans(uint64_t numel, int world) {
  if (world < 1) fail(Code::InvalidArgument, "shard spans: world size ", world, ": expected >= 1");
  std::vector<Span> spans(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const ShardLayout l = ShardLayout::make(numel, world, r);
    spans[static_cast<size_t>(r)] = {l.shard_offset, l.shard_valid};
  }
  return spans;
}

std::vector<Move> reshard_moves(uint64_t numel, int from, int to) {
  if (from < 1 || to < 1)
    fail(Code::InvalidArgument, "reshard moves: world sizes ", from, " -> ", to, ": expected >= 1");
  const std::vector<Span> old_shards = shard_spans(numel, from);
  std::vector<Move> moves;
  for (int k = 0; k < to; ++k) {
    const ShardLayout l = ShardLayout::make(numel, to, k);
    for (const Piece& p : overlaps(old_shards, l.shard_offset, l.shard_valid))
      moves.push_back({static_cast<int>(p.source), k, p.offset, p.numel});
  }
  return moves;
}

}  // namespace zs
