// The all-to-all collective (Communicator::alltoall, collectives::all_to_all)
// on 1..5 real processes over Gloo, odd block sizes included, plain and
// staged through the host (ZS_STAGE_ALL), and the timed wrapper's bytes.
// Not in the C API: the engine's one user is qgZ (impl/grad/), so the test
// drives the C++ context directly.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "impl/core/context.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Byte i of the block rank `from` sends to rank `to`.
uint8_t pattern(int from, int to, size_t i) {
  return static_cast<uint8_t>(from * 31 + to * 7 + static_cast<int>(i % 251) * 3 + 1);
}


void exchange(const RankEnv& env) {
  auto ctx = zs::test::make_engine_context(env);
  const auto n = static_cast<size_t>(env.world);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{300007}}) {
    std::vector<uint8_t> send(bytes * n), recv(bytes * n, 0xEE);
    for (int to = 0; to < env.world; ++to)
      for (size_t i = 0; i < bytes; ++i)
        send[static_cast<size_t>(to) * bytes + i] = pattern(env.rank, to, i);
    ctx->world()->run("all-to-all test", [&](zs::Communicator& c) {
      c.alltoall(send.data(), recv.data(), bytes);
    });
    for (int from = 0; from < env.world; ++from)
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(recv[static_cast<size_t>(from) * bytes + i], pattern(from, env.rank, i))
            << "block from rank " << from << ", byte " << i << " of " << bytes;
  }
  // The timed wrapper counts what left and arrived: (n - 1) blocks each
  // way, as qgZ's quantized reduction.
  const zs::CommTotals t = ctx->comm_stats()->totals();
  EXPECT_EQ(t.sent[static_cast<int>(zs::CommKind::QuantizedReduce)], (1 + 7 + 1001 + 300007) * (n - 1));
  EXPECT_EQ(t.received[static_cast<int>(zs::CommKind::QuantizedReduce)], (1 + 7 + 1001 + 300007) * (n - 1));
}

class AllToAllWorld : public ::testing::TestWithParam<int> {};

TEST_P(AllToAllWorld, EveryBlockLandsAtItsRankOddSizes) { run_ranks(GetParam(), exchange); }

TEST_P(AllToAllWorld, StagedThroughHostGivesTheSame) {
  const zs::test::ScopedEnv stage_all("ZS_STAGE_ALL", "1");
  run_ranks(GetParam(), exchange);
}

INSTANTIATE_TEST_SUITE_P(Ranks, AllToAllWorld, ::testing::Values(1, 2, 3, 4, 5));

}  // namespace
