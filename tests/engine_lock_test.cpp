// The engine lock is the engine's own: a blocking call holds it, and the
// status queries (memory, fetch and coordinator counters, the async error)
// answer from another thread without waiting for that call. Rank 1 joins
// rank 0's blocking gather only after rank 0's queries have returned, so
// a query that waited for the lock would leave rank 1 waiting in vain.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

bool wait_for_file(const std::string& path, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (access(path.c_str(), F_OK) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

zs_param register_vector(zs_context ctx, int64_t n) {
  const int64_t shape[1] = {n};
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = "w";
  o.ndim = 1;
  o.shape = shape;
  o.init = ZS_INIT_NORMAL;
  o.seed = 7;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

}  // namespace

TEST(EngineLock, StatusQueriesDoNotWaitForABlockingFetch) {
  const int port = zs::test::free_port();
  const std::string signal = "/tmp/zs_engine_lock_" + std::to_string(getpid()) + "_" + std::to_string(port);
  std::remove(signal.c_str());
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_param w = register_vector(ctx, 1001);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    if (env.rank == 1) {
      // Joins the gather only once rank 0 answered its queries.
      ASSERT_TRUE(wait_for_file(signal, std::chrono::seconds(20)))
          << "rank 0's status queries waited for its blocking zs_coord_fetch";
      ZS_ASSERT_OK(zs_coord_fetch(ctx, &w, 1));
    } else {
      std::atomic<bool> fetched{false};
      zs_status fetch_status = ZS_OK;
      std::thread blocking([&] {
        fetch_status = zs_coord_fetch(ctx, &w, 1);
        fetched = true;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the fetch holds the lock
      zs_memory_stats m = ZS_MEMORY_STATS_INIT;
      ZS_EXPECT_OK(zs_context_memory(ctx, &m));
      zs_fetch_stats f = ZS_FETCH_STATS_INIT;
      ZS_EXPECT_OK(zs_context_fetch_stats(ctx, &f));
      zs_coord_stats c = ZS_COORD_STATS_INIT;
      ZS_EXPECT_OK(zs_coord_get_stats(ctx, &c));
      ZS_EXPECT_OK(zs_context_async_error(ctx));
      EXPECT_FALSE(fetched.load()) << "the fetch ended before the queries: nothing was tested";
      EXPECT_EQ(m.num_params, 1u);
      EXPECT_GE(m.gathered_bytes, 1001u * 4) << "the gather's buffer is counted while in flight";
      EXPECT_EQ(f.gathers, 1u);
      EXPECT_EQ(c.fetch_calls, 0u) << "counters are those of the last call that returned";
      FILE* out = std::fopen(signal.c_str(), "w");
      ASSERT_NE(out, nullptr);
      std::fclose(out);
      blocking.join();
      ZS_ASSERT_OK(fetch_status);
      ZS_EXPECT_OK(zs_coord_get_stats(ctx, &c));
      EXPECT_EQ(c.fetch_calls, 1u);
    }
    ZS_ASSERT_OK(zs_coord_release(ctx, &w, 1));
    ZS_ASSERT_OK(zs_step_end(ctx));
    ZS_ASSERT_OK(zs_param_destroy(w));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
  std::remove(signal.c_str());
}
