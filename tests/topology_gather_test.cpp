// Gathers that use the topology: hpZ secondary shards serve a step's later
// gathers within the node, and MiCS's hierarchical gather goes in two hops.
// Values stay bitwise equal to what was registered either way.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

struct Registered {
  std::vector<zs_param> params;
  std::vector<std::vector<float>> values;
};

// Odd sizes, one above the direct-path threshold, one smaller than the world.
Registered register_params(zs_context ctx) {
  Registered r;
  const std::vector<int64_t> sizes = {1, 3, 1001, 70001, 123457};
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> v(static_cast<size_t>(sizes[i]));
    std::mt19937 rng(static_cast<unsigned>(i) + 7);
    for (auto& x : v) x = static_cast<float>(rng() % 100000) / 7.0f;
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(i);
    o.name = name.c_str();
    o.ndim = 1;
    o.shape = &sizes[i];
    o.init = ZS_INIT_FROM_RANK;
    o.src_rank = 0;
    o.data = v.data();
    o.data_bytes = v.size() * 4;
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
    r.params.push_back(p);
    r.values.push_back(std::move(v));
  }
  return r;
}

void gather_and_check(zs_context ctx, const Registered& r, const char* what) {
  zs_gather g = nullptr;
  ZS_ASSERT_OK(zs_fetch(&g, ctx, r.params.data(), r.params.size()));
  ZS_ASSERT_OK(zs_gather_wait(g, 30000));
  for (size_t i = 0; i < r.params.size(); ++i) {
    std::vector<float> out(r.values[i].size());
    ZS_ASSERT_OK(zs_param_copy_to(r.params[i], out.data(), out.size() * 4));
    ASSERT_EQ(std::memcmp(out.data(), r.values[i].data(), out.size() * 4), 0) << what << ": param " << i;
  }
  ZS_ASSERT_OK(zs_release(ctx, r.params.data(), r.params.size()));
  ZS_ASSERT_OK(zs_gather_destroy(g));
}

zs_fetch_stats fetch_stats(zs_context ctx) {
  zs_fetch_stats s = ZS_FETCH_STATS_INIT;
  EXPECT_EQ(zs_context_fetch_stats(ctx, &s), ZS_OK) << zs_last_error();
  return s;
}

uint64_t secondary_bytes(zs_context ctx) {
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  EXPECT_EQ(zs_context_memory(ctx, &m), ZS_OK);
  return m.hpz_secondary_bytes;
}

TEST(Hpz, SecondaryShardsServeLaterGathersUntilTheStep) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"zero_optimization": {"zero_hpz_partition_size": 2}})");
    ASSERT_NE(ctx, nullptr);
    Registered r = register_params(ctx);
    EXPECT_EQ(secondary_bytes(ctx), 0u);
    gather_and_check(ctx, r, "first gather (world)");
    EXPECT_EQ(fetch_stats(ctx).hpz_gathers, 0u);
    // Each rank now holds 1/2 of every param: its slice within the node.
    uint64_t expect = 0;
    for (const auto& v : r.values) expect += (v.size() + 1) / 2 * 4;
    EXPECT_GE(secondary_bytes(ctx), expect);
    gather_and_check(ctx, r, "second gather (hpZ)");
    gather_and_check(ctx, r, "third gather (hpZ)");
    EXPECT_EQ(fetch_stats(ctx).hpz_gathers, 2u);

    // GatheredParameters on rank 3 changes the shards: secondaries go, the
    // next gather is a world gather, and the one after serves the new values.
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, r.params.data(), r.params.size()));
    ZS_ASSERT_OK(zs_gather_wait(g, 30000));
    for (size_t i = 0; i < r.params.size(); ++i) {
      for (auto& x : r.values[i]) x += 1.0f;
      if (env.rank == 3) {
        void* d = nullptr;
        ZS_ASSERT_OK(zs_param_data(r.params[i], &d));
        std::memcpy(d, r.values[i].data(), r.values[i].size() * 4);
      }
    }
    ZS_ASSERT_OK(zs_param_update(ctx, r.params.data(), r.params.size(), 3));
    ZS_ASSERT_OK(zs_release(ctx, r.params.data(), r.params.size()));
    ZS_ASSERT_OK(zs_gather_destroy(g));
    EXPECT_EQ(secondary_bytes(ctx), 0u);
    gather_and_check(ctx, r, "after update (world)");
    gather_and_check(ctx, r, "after update (hpZ)");
    EXPECT_EQ(fetch_stats(ctx).hpz_gathers, 4u);  // the fetch before the update was hpZ too

    // The optimizer step invalidates them as well.
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    EXPECT_EQ(secondary_bytes(ctx), 0u);
    gather_and_check(ctx, r, "after step");
    EXPECT_EQ(fetch_stats(ctx).hpz_gathers, 4u);
    zs_context_destroy(ctx);
  });
}

// Two "nodes" of 2 ranks: local_world_size tells the engine where node
// boundaries are.
void hierarchical(const RankEnv& env, int shard) {
  const std::string cfg = R"({"zero_optimization": {"mics_shard_size": )" + std::to_string(shard) +
                          R"(, "mics_hierarchical_params_gather": true}})";
  zs_context_options o = zs::test::rank_options(env, cfg.c_str());
  o.local_world_size = 2;
  o.local_rank = env.rank % 2;
  zs_context ctx = nullptr;
  ZS_ASSERT_OK(zs_context_create(&ctx, &o));
  zs_group inter = nullptr, intra = nullptr;
  ZS_ASSERT_OK(zs_context_group(&inter, ctx, ZS_GROUP_MICS_INTER));
  ZS_ASSERT_OK(zs_context_group(&intra, ctx, ZS_GROUP_MICS_INTRA));
  int inter_size = 0, intra_size = 0, first = -1;
  zs_group_size(inter, &inter_size);
  zs_group_size(intra, &intra_size);
  zs_group_world_rank(inter, 0, &first);
  EXPECT_EQ(inter_size, shard / 2);
  EXPECT_EQ(intra_size, 2);
  EXPECT_EQ(first, env.rank / shard * shard + env.rank % 2);
  Registered r = register_params(ctx);
  gather_and_check(ctx, r, "hierarchical");
  gather_and_check(ctx, r, "hierarchical again");
  EXPECT_EQ(fetch_stats(ctx).hierarchical_gathers, 2u);
  zs_group_destroy(inter);
  zs_group_destroy(intra);
  zs_context_destroy(ctx);
}

TEST(MicsHierarchical, TwoHopsOverTwoNodesOfTwo) {
  run_ranks(4, [](const RankEnv& env) { hierarchical(env, 4); });
}

TEST(MicsHierarchical, TwoShardGroupsOfFourOnEightRanks) {
  run_ranks(8, [](const RankEnv& env) { hierarchical(env, 4); });
}

// Three nodes of two: the hops differ in size, so shard order (node-major)
// and hop 2's order (local-rank-major) differ beyond a transpose.
TEST(MicsHierarchical, TwoHopsOverThreeNodesOfTwo) {
  run_ranks(6, [](const RankEnv& env) { hierarchical(env, 6); });
}

TEST(MicsHierarchical, ShardGroupMustHoldWholeNodes) {
  run_ranks(1, [](const RankEnv&) {
    // Rank 0 of 6 alone: the topology is refused before any socket opens.
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    zs_context ctx = nullptr;
    o.rank = 0;
    o.world_size = 6;
    o.local_world_size = 2;
    o.local_rank = 0;
    o.timeout_ms = 2000;
    o.config_json = R"({"zero_optimization": {"mics_shard_size": 3, "mics_hierarchical_params_gather": true}})";
    const zs_status s = zs_context_create(&ctx, &o);
    EXPECT_EQ(s, ZS_ERR_INVALID_CONFIG) << zs_last_error();
    EXPECT_NE(std::string(zs_last_error()).find("multiple of the local world size 2"), std::string::npos)
        << zs_last_error();
  });
}

}  // namespace
