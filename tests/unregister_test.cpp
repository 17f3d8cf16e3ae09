// Destroying a param the engine still holds state for: its gradient waiting
// in an unflushed bucket, or its gather in flight. Every layer lets go of
// it (ParamKeeper), the collectives stay matched across ranks, and the
// params that remain get exactly their own results.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

zs_param register_zeros(zs_context ctx, const char* name, int64_t n) {
  const int64_t shape[1] = {n};
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name;
  o.ndim = 1;
  o.shape = shape;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

// Rank r pushes (r + 1) * (i + 1) for element i: the average over 2 ranks
// is 1.5 * (i + 1).
std::vector<float> grad_of(int rank, int64_t n) {
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] = static_cast<float>((rank + 1) * (i + 1));
  return g;
}

}  // namespace

TEST(Unregister, ParamWhoseGradientWaitsInABucket) {
  run_ranks(2, [](const RankEnv& env) {
    // One bucket holds all three gradients (overlap_comm off: nothing goes
    // out before sync).
    zs_context ctx = zs::test::make_context(
        env, "{\"zero_optimization\": {\"reduce_bucket_size\": 100000, \"overlap_comm\": false}}");
    const int64_t sizes[3] = {1001, 333, 64};
    zs_param p[3] = {register_zeros(ctx, "a", sizes[0]), register_zeros(ctx, "gone", sizes[1]),
                     register_zeros(ctx, "c", sizes[2])};
    for (int k = 0; k < 3; ++k) {
      const auto g = grad_of(env.rank, sizes[k]);
      ZS_ASSERT_OK(zs_grad_push(p[k], g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
    }
    ZS_ASSERT_OK(zs_param_destroy(p[1]));  // its gradient is in the open bucket
    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.num_params, 2u);
    EXPECT_EQ(m.grad_bytes, (501u + 32u) * sizeof(float)) << "the destroyed param's gradient shard is uncounted";
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    for (int k : {0, 2}) {
      float* shard = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_grad_shard_data(p[k], &shard, &n));
      zs_param_info info = ZS_PARAM_INFO_INIT;
      ZS_ASSERT_OK(zs_param_get_info(p[k], &info));
      for (uint64_t i = 0; i < info.shard_valid; ++i)
        ASSERT_EQ(shard[i], 1.5f * static_cast<float>(info.shard_offset + i + 1))
            << "param " << k << " element " << info.shard_offset + i;
    }
    ZS_ASSERT_OK(zs_context_async_error(ctx));
    ZS_ASSERT_OK(zs_param_destroy(p[0]));
    ZS_ASSERT_OK(zs_param_destroy(p[2]));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}

TEST(Unregister, ParamWhoseGatherIsInFlight) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_param p = register_zeros(ctx, "w", 4097);
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    ZS_ASSERT_OK(zs_param_destroy(p));  // waits the gather out, frees the full buffer
    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.gathered_bytes, 0u);
    EXPECT_EQ(m.num_params, 0u);
    ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    ZS_ASSERT_OK(zs_gather_destroy(g));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}
