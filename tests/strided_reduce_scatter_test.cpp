// The strided reduce-scatter (Communicator::reduce_scatter_strided): blocks
// `stride` elements apart, as a gradient bucket filled to less than its
// capacity holds them, reduce to the same bits as the same blocks packed,
// for every float dtype and reduction, odd counts and gaps, 1-4 ranks; the
// stats count the same bytes; a stride below the count is refused by name.
// And its last hop handed to the caller (reduce_scatter_into), which the
// gradient path stores straight into the shards.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "impl/common/error.h"
#include "impl/core/context.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {


// Values whose sums show another order or a lost 1/n in the bits; 16-bit
// dtypes take the low half of the fp32 pattern's bits as their own.
float value(int rank, size_t i) {
  const auto k = static_cast<float>((static_cast<size_t>(rank) * 7919 + i * 104729) % 1000003);
  return (k / 1000003.0f - 0.5f) * std::ldexp(1.0f, static_cast<int>(i % 24) - 12);
}

void strided_equals_packed(const RankEnv& env) {
  auto ctx = zs::test::make_engine_context(env);
  const auto n = static_cast<size_t>(env.world);
  for (zs::DType dtype : {zs::DType::F32, zs::DType::BF16, zs::DType::F16}) {
    const size_t elem = zs::dtype_size(dtype);
    for (size_t count : {size_t{1}, size_t{777}, size_t{70001}}) {
      for (size_t gap : {size_t{1}, size_t{13}}) {
        for (zs::ReduceOp op : {zs::ReduceOp::Sum, zs::ReduceOp::Avg, zs::ReduceOp::Max}) {
          const size_t stride = count + gap;
          // The same blocks, packed and `stride` apart (the gaps hold junk
          // that must not leak into the result).
          std::vector<uint8_t> packed(count * n * elem), strided(stride * n * elem, 0x7F);
          for (size_t b = 0; b < n; ++b)
            for (size_t i = 0; i < count; ++i) {
              const float f = value(env.rank, b * count + i);
              uint16_t h = 0;
              const void* src = &f;
              if (dtype == zs::DType::BF16) {
                h = static_cast<uint16_t>(0x3C00 + (i * 37 + b) % 0x700);  // finite, moderate
                src = &h;
              } else if (dtype == zs::DType::F16) {
                h = static_cast<uint16_t>(0x3000 + (i * 41 + b * 3 + static_cast<size_t>(env.rank)) % 0x800);
                src = &h;
              }
              std::memcpy(&packed[(b * count + i) * elem], src, elem);
              std::memcpy(&strided[(b * stride + i) * elem], src, elem);
            }
          std::vector<uint8_t> want(count * elem), got(count * elem, 0xEE);
          const zs::CommTotals before = ctx->comm_stats()->totals();
          ctx->world()->run("packed", [&](zs::Communicator& c) {
            c.reduce_scatter(packed.data(), want.data(), count, dtype, op);
          });
          const zs::CommTotals mid = ctx->comm_stats()->totals();
          ctx->world()->run("strided", [&](zs::Communicator& c) {
            c.reduce_scatter_strided(strided.data(), got.data(), count, stride, dtype, op);
          });
          const zs::CommTotals after = ctx->comm_stats()->totals();
          const auto rs = static_cast<int>(zs::CommKind::ReduceScatter);
          ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size()), 0)
              << zs::dtype_name(dtype) << " count " << count << " gap " << gap << " op " << static_cast<int>(op);
          EXPECT_EQ(after.sent[rs] - mid.sent[rs], mid.sent[rs] - before.sent[rs]);
          EXPECT_EQ(after.calls[rs] - mid.calls[rs], 1u);
        }
      }
    }
  }
  // A stride that cannot hold a block: refused, naming both, before any
  // exchange (every rank alike).
  std::vector<float> small(8);
  try {
    ctx->world()->run("too narrow", [&](zs::Communicator& c) {
      c.reduce_scatter_strided(small.data(), small.data(), 4, 3, zs::DType::F32, zs::ReduceOp::Sum);
    });
    ADD_FAILURE() << "a stride of 3 for blocks of 4 was accepted";
  } catch (const zs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 elements apart cannot hold 4"), std::string::npos) << e.what();
  }
}

// reduce_scatter_into: the last hop handed to the caller, whose (own + in)
// * scale is the bits reduce_scatter writes, for Sum and Avg; Max refused.
void handed_over_equals_written(const RankEnv& env) {
  auto ctx = zs::test::make_engine_context(env);
  const auto n = static_cast<size_t>(env.world);
  for (size_t count : {size_t{1}, size_t{777}, size_t{70001}}) {
    for (zs::ReduceOp op : {zs::ReduceOp::Sum, zs::ReduceOp::Avg}) {
      const size_t stride = count + 5;
      std::vector<float> packed(count * n), strided(stride * n, 1e30f);
      for (size_t b = 0; b < n; ++b)
        for (size_t i = 0; i < count; ++i)
          packed[b * count + i] = strided[b * stride + i] = value(env.rank, b * count + i);
      std::vector<float> want(count), got(count, -1.0f);
      ctx->world()->run("packed", [&](zs::Communicator& c) {
        c.reduce_scatter(packed.data(), want.data(), count, zs::DType::F32, op);
      });
      int calls = 0;
      ctx->world()->run("handed over", [&](zs::Communicator& c) {
        c.reduce_scatter_into(strided.data(), count, stride, op, [&](const float* own, const float* in, float scale) {
          ++calls;
          for (size_t i = 0; i < count; ++i) got[i] = in ? (scale == 1.0f ? own[i] + in[i] : (own[i] + in[i]) * scale)
                                                         : own[i] * scale;
        });
      });
      EXPECT_EQ(calls, 1);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), count * sizeof(float)), 0)
          << "count " << count << " op " << static_cast<int>(op);
    }
  }
  std::vector<float> small(8);
  try {
    ctx->world()->run("max", [&](zs::Communicator& c) {
      c.reduce_scatter_into(small.data(), 4, 4, zs::ReduceOp::Max, [](const float*, const float*, float) {});
    });
    ADD_FAILURE() << "Max was handed over";
  } catch (const zs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Sum or Avg only"), std::string::npos) << e.what();
  }
}

class StridedReduceScatter : public ::testing::TestWithParam<int> {};

TEST_P(StridedReduceScatter, LastHopHandedOverIsTheWrittenBits) {
  run_ranks(GetParam(), handed_over_equals_written, 120);
}

TEST_P(StridedReduceScatter, SameBitsAsPackedEveryDtypeAndOp) { run_ranks(GetParam(), strided_equals_packed, 120); }

INSTANTIATE_TEST_SUITE_P(Ranks, StridedReduceScatter, ::testing::Values(1, 2, 3, 4));

}  // namespace
