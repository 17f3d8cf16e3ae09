// The issue "past one rack" in a test CI can afford: 8 and 32 real
// processes create a context, run a barrier and an all-reduce, and go. The
// requests rank 0's store handled (ZS_STORE_STATS) must grow as N, so a
// rank's share stays flat; bytes replied past the full mesh must grow as
// N log N at most. Counts, not time.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/multirank.h"

namespace {

struct StoreCounts {
  unsigned long long requests = 0, replied = 0;
};

// Runs `world` ranks through a context's life; returns what rank 0's store
// server says it handled as it goes.
StoreCounts run_world(int world) {
  const std::string log = ::testing::TempDir() + "zs_scale_counts_" + std::to_string(getpid()) + "_" +
                          std::to_string(world);
  {
    const zs::test::ScopedEnv stats("ZS_STORE_STATS", "1");
    zs::test::run_ranks(world, [&](const zs::test::RankEnv& env) {
      if (env.rank == 0) {
        const int fd = open(log.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
        ASSERT_GE(fd, 0);
        dup2(fd, 2);
        close(fd);
      }
      zs_context ctx = zs::test::make_context(env);
      ASSERT_NE(ctx, nullptr);
      zs_group group = nullptr;
      ZS_ASSERT_OK(zs_context_group(&group, ctx, ZS_GROUP_WORLD));
      zs_work w = nullptr;
      ZS_ASSERT_OK(zs_barrier(&w, group));
      ZS_ASSERT_OK(zs_work_wait(w, 60000));
      zs_work_destroy(w);
      float x = 1.0f;
      ZS_ASSERT_OK(zs_allreduce(&w, group, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
      ZS_ASSERT_OK(zs_work_wait(w, 60000));
      zs_work_destroy(w);
      EXPECT_EQ(x, static_cast<float>(env.world));
      ZS_EXPECT_OK(zs_group_destroy(group));
      ZS_EXPECT_OK(zs_context_destroy(ctx));
    }, 180);
  }
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(log.c_str());
  StoreCounts c;
  const std::string s = text.str();
  const size_t at = s.find("handled ");
  EXPECT_NE(at, std::string::npos) << "rank 0 printed no store stats: " << s;
  if (at != std::string::npos) {
    EXPECT_EQ(std::sscanf(s.c_str() + at, "handled %llu requests, replied %llu bytes", &c.requests, &c.replied), 2)
        << s;
  }
  return c;
}

// 8 ranks are a full mesh; 32 past ZS_FULL_MESH_MAX=8 connect 2 log N pairs
// a rank. Before the many-key calls a rank made 2 (N - 1) store requests
// for its pairs alone, and before pairs were sparse the addresses it read
// grew as N.
TEST(ScaleCounts, StoreRequestsPerRankStayFlatAndBytesGrowAsNLogN) {
  const zs::test::ScopedEnv sparse("ZS_FULL_MESH_MAX", "8");
  // The collective watch's checks (a collective that waits past 500 ms on
  // a loaded machine) would add their own requests and bytes; they are
  // bounded in CollectiveIdentity's tests, not counted here.
  const zs::test::ScopedEnv no_checks("ZS_COLLECTIVE_CHECK_MS", "60000");
  const StoreCounts small = run_world(8);
  const StoreCounts large = run_world(32);
  if (HasFailure()) return;
  const double per_rank_small = static_cast<double>(small.requests) / 8;
  const double per_rank_large = static_cast<double>(large.requests) / 32;
  std::printf("store requests per rank: %.1f at 8 ranks, %.1f at 32; bytes replied per rank: %.0f, %.0f\n",
              per_rank_small, per_rank_large, static_cast<double>(small.replied) / 8,
              static_cast<double>(large.replied) / 32);
  // Flat: 16 a rank at 8 ranks, 13 at 32 (rank 0's own share weighs less).
  EXPECT_LE(per_rank_large, per_rank_small + 2) << small.requests << " then " << large.requests;
  // A rank's bytes: about 3.6 KB at 8 ranks. At 32 they were 1.1x that
  // with 2 log N pairs, and 2.0x on a full mesh of 32 (N - 1 addresses of
  // 149 bytes each): the line between them.
  EXPECT_LE(static_cast<double>(large.replied) / 32, 1.5 * static_cast<double>(small.replied) / 8)
      << small.replied << " then " << large.replied;
}

}  // namespace
