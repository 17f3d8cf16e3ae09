// The chunk-overlap arithmetic of a re-shard (impl/checkpoint/reshard_plan.h),
// shared by checkpoint load, the offline reshard and a shrink in memory:
// every new shard's real elements come from exactly one old shard each,
// once, in order, for odd sizes and worlds 1..8 either way.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "impl/checkpoint/reshard_plan.h"
#include "impl/common/error.h"
#include "impl/partition/layout.h"

namespace {

using zs::Move;
using zs::Piece;
using zs::ShardLayout;
using zs::Span;

TEST(ReshardPlan, OverlapsGiveEachSpansPartInOrderAndSkipWhatNoneHolds) {
  // Chunks as a checkpoint stores them: [0, 5), [5, 9), a gap, [12, 20).
  const std::vector<Span> spans = {{0, 5}, {5, 4}, {12, 8}};
  const std::vector<Piece> got = zs::overlaps(spans, 3, 12);  // [3, 15)
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].source, 0u);
  EXPECT_EQ(got[0].offset, 3u);
  EXPECT_EQ(got[0].numel, 2u);
  EXPECT_EQ(got[1].source, 1u);
  EXPECT_EQ(got[1].offset, 5u);
  EXPECT_EQ(got[1].numel, 4u);
  EXPECT_EQ(got[2].source, 2u);  // [9, 12) is in no span
  EXPECT_EQ(got[2].offset, 12u);
  EXPECT_EQ(got[2].numel, 3u);
  EXPECT_TRUE(zs::overlaps(spans, 9, 3).empty());
  EXPECT_TRUE(zs::overlaps(spans, 0, 0).empty());
  EXPECT_TRUE(zs::overlaps({}, 0, 10).empty());
}

TEST(ReshardPlan, ShardSpansAreTheLayoutsRealElements) {
  const std::vector<Span> s = zs::shard_spans(10, 4);  // shards of 3: [0,3) [3,6) [6,9) [9,10)
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[3].offset, 9u);
  EXPECT_EQ(s[3].numel, 1u);
  const std::vector<Span> t = zs::shard_spans(2, 4);  // shards of 1: the last two are padding only
  EXPECT_EQ(t[1].numel, 1u);
  EXPECT_EQ(t[2].numel, 0u);
  EXPECT_EQ(t[3].numel, 0u);
  EXPECT_THROW(zs::shard_spans(10, 0), zs::Error);
}

TEST(ReshardPlan, EveryNewShardComesWholeFromTheOldShardsOnceInOrder) {
  for (const uint64_t numel : {0ull, 1ull, 2ull, 3ull, 7ull, 64ull, 1000ull, 1001ull, 4099ull}) {
    for (int from = 1; from <= 8; ++from) {
      for (int to = 1; to <= 8; ++to) {
        const std::string at = std::to_string(numel) + " elements, " + std::to_string(from) + " -> " +
                               std::to_string(to);
        const std::vector<Move> moves = zs::reshard_moves(numel, from, to);
        std::vector<uint64_t> next(static_cast<size_t>(to));  // each new shard's next element
        for (int k = 0; k < to; ++k) next[static_cast<size_t>(k)] = ShardLayout::make(numel, to, k).shard_offset;
        uint64_t moved = 0;
        int last_to = 0;
        for (const Move& m : moves) {
          ASSERT_GE(m.to, last_to) << at;
          last_to = m.to;
          ASSERT_GT(m.numel, 0u) << at;
          const ShardLayout dst = ShardLayout::make(numel, to, m.to);
          const ShardLayout src = ShardLayout::make(numel, from, m.from);
          EXPECT_EQ(m.offset, next[static_cast<size_t>(m.to)]) << at << ": a gap or overlap in new shard " << m.to;
          next[static_cast<size_t>(m.to)] = m.offset + m.numel;
          EXPECT_LE(m.offset + m.numel, dst.shard_offset + dst.shard_valid) << at;
          EXPECT_GE(m.offset, src.shard_offset) << at << ": not in old shard " << m.from;
          EXPECT_LE(m.offset + m.numel, src.shard_offset + src.shard_valid) << at << ": beyond old shard " << m.from;
          moved += m.numel;
        }
        for (int k = 0; k < to; ++k) {
          const ShardLayout dst = ShardLayout::make(numel, to, k);
          EXPECT_EQ(next[static_cast<size_t>(k)], dst.shard_offset + dst.shard_valid) << at << ": new shard " << k;
        }
        EXPECT_EQ(moved, numel) << at;
        if (from == to) {  // nothing changes hands
          for (const Move& m : moves) EXPECT_EQ(m.from, m.to) << at;
        }
      }
    }
  }
  EXPECT_THROW(zs::reshard_moves(10, 0, 2), zs::Error);
  EXPECT_THROW(zs::reshard_moves(10, 2, 0), zs::Error);
}

TEST(ReshardPlan, AShrinkByOneMovesAboutOneShardsWorthIntoEachSurvivor) {
  // 4 -> 3, 12 elements: old [0,3) [3,6) [6,9) [9,12), new [0,4) [4,8) [8,12).
  const std::vector<Move> m = zs::reshard_moves(12, 4, 3);
  ASSERT_EQ(m.size(), 6u);
  const std::vector<Move> want = {{0, 0, 0, 3}, {1, 0, 3, 1}, {1, 1, 4, 2}, {2, 1, 6, 2}, {2, 2, 8, 1}, {3, 2, 9, 3}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(m[i].from, want[i].from) << i;
    EXPECT_EQ(m[i].to, want[i].to) << i;
    EXPECT_EQ(m[i].offset, want[i].offset) << i;
    EXPECT_EQ(m[i].numel, want[i].numel) << i;
  }
}

}  // namespace
