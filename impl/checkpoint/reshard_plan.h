// Where the elements of a flat param come from when its shards are laid
// out anew: the chunk-overlap arithmetic a checkpoint load (the stored
// chunks -> this rank's shard), an offline reshard (the stored chunks ->
// each new rank's file) and a shrink or regrow in memory (the old world's
// shards -> the new world's; docs/healing.md, section 4) share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zs {

// Elements [offset, offset + numel) of a flat param.
struct Span {
  uint64_t offset = 0;
  uint64_t numel = 0;
};

// Elements [offset, offset + numel) of the flat param, held by spans[source].
struct Piece {
  size_t source = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;
};

// The parts of elements [first, first + n) that the spans hold, in the
// spans' order; elements no span holds are in no piece, and where spans
// overlap each gives its part.
std::vector<Piece> overlaps(const std::vector<Span>& spans, uint64_t first, uint64_t n);

// The real elements of each of `world` shards of a numel-element param
// (ShardLayout: padding is in no span).
std::vector<Span> shard_spans(uint64_t numel, int world);

// One piece of a re-shard from a world of `from` shards to one of `to`:
// elements [offset, offset + numel) go from old shard position `from` to
// new shard position `to`.
struct Move {
  int from = 0;
  int to = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;
};

// Every move of a numel-element param's re-shard, by new position, then
// old: each new shard's real elements, each from the one old shard holding
// it. InvalidArgument unless both worlds are at least 1.
std::vector<Move> reshard_moves(uint64_t numel, int from, int to);

}  // namespace zs
