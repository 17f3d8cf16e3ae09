// Partitioned params on 1..5 real processes: what every rank gathers is
// bitwise what was registered, for every dtype, odd and zero-size shapes,
// many params in one coalesced fetch, and the status/memory bookkeeping.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "impl/common/dtype.h"
#include "impl/partition/seeded_init.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

size_t elem_size(zs_dtype t) { return t == ZS_FLOAT32 ? 4 : 2; }

struct Spec {
  std::string name;
  zs_dtype dtype;
  std::vector<int64_t> shape;
  uint64_t numel() const {
    uint64_t n = 1;
    for (auto d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
  size_t bytes() const { return numel() * elem_size(dtype); }
};

// Same list on every rank: a seed decides shapes and dtypes.
std::vector<Spec> random_specs(unsigned seed, int count, int64_t max_dim, int max_ndim = 3) {
  std::mt19937 rng(seed);
  const zs_dtype dtypes[] = {ZS_FLOAT32, ZS_BFLOAT16, ZS_FLOAT16};
  std::vector<Spec> specs;
  for (int i = 0; i < count; ++i) {
    Spec s;
    s.name = "p" + std::to_string(i);
    s.dtype = dtypes[rng() % 3];
    const int ndim = static_cast<int>(rng() % static_cast<unsigned>(max_ndim + 1));  // 0 = scalar
    for (int d = 0; d < ndim; ++d) s.shape.push_back(1 + static_cast<int64_t>(rng() % max_dim));
    specs.push_back(s);
  }
  if (max_dim >= 1000) {  // shards well above the 256 KiB direct threshold
    specs.push_back({"big", ZS_FLOAT32, {1031, 1021}});
    specs.push_back({"big16", ZS_BFLOAT16, {2053, 517}});
  }
  specs.push_back({"empty", ZS_FLOAT32, {0, 7}});
  specs.push_back({"empty16", ZS_BFLOAT16, {3, 0}});
  return specs;
}

// Arbitrary bit patterns (NaNs included): gathering must not touch bits.
std::vector<uint8_t> pattern(const Spec& s, unsigned salt) {
  std::vector<uint8_t> v(s.bytes());
  std::mt19937 rng(salt * 7919u + static_cast<unsigned>(s.bytes()));
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

zs_param register_one(zs_context ctx, const Spec& s, const std::vector<uint8_t>& data,
                      zs_init init, int src_rank) {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = s.name.c_str();
  o.dtype = s.dtype;
  o.ndim = static_cast<int>(s.shape.size());
  o.shape = s.shape.data();
  o.init = init;
  o.data = data.data();
  o.data_bytes = data.size();
  o.src_rank = src_rank;
  zs_param p = nullptr;
  const zs_status st = zs_param_register(&p, ctx, &o);
  EXPECT_EQ(st, ZS_OK) << s.name << ": " << zs_last_error();
  return p;
}

void check_gathered(zs_param p, const std::vector<uint8_t>& expected, const std::string& what) {
  void* data = nullptr;
  ASSERT_EQ(zs_param_data(p, &data), ZS_OK) << what << ": " << zs_last_error();
  if (expected.empty()) return;
  EXPECT_EQ(std::memcmp(data, expected.data(), expected.size()), 0) << what << " differs";
}

// Register with data from one source rank, fetch all in one coalesced
// gather, compare bitwise, release.
void gather_roundtrip(const RankEnv& env, unsigned seed, int count, int64_t max_dim,
                      int max_ndim = 3) {
  zs_context ctx = zs::test::make_context(env);
  ASSERT_NE(ctx, nullptr);
  const auto specs = random_specs(seed, count, max_dim, max_ndim);
  std::vector<std::vector<uint8_t>> values;
  std::vector<zs_param> params;
  const int src = env.world - 1;  // not always rank 0
  for (size_t i = 0; i < specs.size(); ++i) {
    values.push_back(pattern(specs[i], seed + static_cast<unsigned>(i)));
    // Only the source rank's data is read: others pass garbage.
    std::vector<uint8_t> mine = env.rank == src ? values.back() : std::vector<uint8_t>(values.back().size(), 0xEE);
    params.push_back(register_one(ctx, specs[i], mine, ZS_INIT_FROM_RANK, src));
  }
  zs_gather g = nullptr;
  ZS_ASSERT_OK(zs_fetch(&g, ctx, params.data(), params.size()));
  ZS_ASSERT_OK(zs_gather_wait(g, 30000));
  for (size_t i = 0; i < specs.size(); ++i) check_gathered(params[i], values[i], specs[i].name);
  ZS_ASSERT_OK(zs_gather_destroy(g));
  ZS_ASSERT_OK(zs_release(ctx, params.data(), params.size()));
  for (auto p : params) ZS_EXPECT_OK(zs_param_destroy(p));
  ZS_EXPECT_OK(zs_context_destroy(ctx));
}

class GatherWorld : public ::testing::TestWithParam<int> {};

TEST_P(GatherWorld, BitwiseEqualForEveryDtypeAndOddShape) {
  run_ranks(GetParam(), [](const RankEnv& env) { gather_roundtrip(env, 11, 40, 37); });
}

TEST_P(GatherWorld, LargeParamsTakeTheDirectPath) {
  // Shards above 256 KiB go straight from shard to destination.
  run_ranks(GetParam(), [](const RankEnv& env) { gather_roundtrip(env, 5, 6, 1100, 2); });
}

TEST_P(GatherWorld, ManyParamsInOneCoalescedFetch) {
  run_ranks(GetParam(), [](const RankEnv& env) { gather_roundtrip(env, 23, 300, 9); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GatherWorld, ::testing::Values(1, 2, 3, 4, 5));

// The layout is the reference's: pad = (W - numel % W) % W, equal shards.
TEST(Gather, ShardLayoutAndMemoryAccounting) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    Spec s{"w", ZS_FLOAT32, {10}};
    auto data = pattern(s, 1);
    zs_param p = register_one(ctx, s, data, ZS_INIT_FROM_ALL, 0);
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ZS_ASSERT_OK(zs_param_get_info(p, &info));
    EXPECT_EQ(info.numel, 10u);
    EXPECT_EQ(info.shard_numel, 4u);
    EXPECT_EQ(info.padded_numel, 12u);
    EXPECT_EQ(info.shard_offset, 4u * static_cast<uint64_t>(env.rank));
    EXPECT_EQ(info.shard_valid, env.rank == 2 ? 2u : 4u);
    EXPECT_STREQ(info.name, "w");
    EXPECT_EQ(info.status, ZS_PARAM_NOT_AVAILABLE);

    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.shard_bytes, 16u);
    EXPECT_EQ(m.unsharded_bytes, 40u);
    EXPECT_EQ(m.gathered_bytes, 0u);

    // The padding of the last shard is zero.
    void* shard = nullptr;
    uint64_t shard_numel = 0;
    ZS_ASSERT_OK(zs_param_shard_data(p, &shard, &shard_numel));
    ASSERT_EQ(shard_numel, 4u);
    if (env.rank == 2) {
      const float* f = static_cast<const float*>(shard);
      EXPECT_EQ(f[2], 0.0f);
      EXPECT_EQ(f[3], 0.0f);
    }

    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    zs_param_status st;
    ZS_ASSERT_OK(zs_param_get_status(p, &st));
    EXPECT_TRUE(st == ZS_PARAM_INFLIGHT || st == ZS_PARAM_AVAILABLE);
    ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    ZS_ASSERT_OK(zs_param_get_status(p, &st));
    EXPECT_EQ(st, ZS_PARAM_AVAILABLE);
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.gathered_bytes, 48u);  // padded full buffer
    check_gathered(p, data, "w");
    ZS_ASSERT_OK(zs_release(ctx, &p, 1));
    ZS_ASSERT_OK(zs_param_get_status(p, &st));
    EXPECT_EQ(st, ZS_PARAM_NOT_AVAILABLE);
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.gathered_bytes, 0u);
    EXPECT_EQ(m.peak_gathered_bytes, 48u);
    ZS_EXPECT_OK(zs_gather_destroy(g));
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

// Seeded initializers depend only on (seed, element): the gathered param is
// the same on any world size, and equals a local fill of the whole param.
TEST(Gather, SeededInitIsIndependentOfWorldSize) {
  for (int world : {1, 2, 3}) {
    run_ranks(world, [](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env);
      ASSERT_NE(ctx, nullptr);
      for (zs_init init : {ZS_INIT_NORMAL, ZS_INIT_UNIFORM}) {
        for (zs_dtype dt : {ZS_FLOAT32, ZS_BFLOAT16, ZS_FLOAT16}) {
          Spec s{"seeded", dt, {17, 3}};
          zs_param_options o = ZS_PARAM_OPTIONS_INIT;
          o.name = "seeded";
          o.dtype = dt;
          o.ndim = 2;
          o.shape = s.shape.data();
          o.init = init;
          o.seed = 1234;
          o.a = init == ZS_INIT_NORMAL ? 0.5 : -2.0;
          o.b = init == ZS_INIT_NORMAL ? 0.02 : 3.0;
          zs_param p = nullptr;
          ZS_ASSERT_OK(zs_param_register(&p, ctx, &o));
          std::vector<uint8_t> expected(s.bytes());
          zs::fill_seeded(expected.data(), static_cast<zs::DType>(dt), 0, s.numel(),
                          init == ZS_INIT_NORMAL ? zs::SeededDist::Normal : zs::SeededDist::Uniform,
                          1234, o.a, o.b);
          zs_gather g = nullptr;
          ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
          ZS_ASSERT_OK(zs_gather_wait(g, 30000));
          check_gathered(p, expected, "seeded");
          if (dt == ZS_FLOAT32 && init == ZS_INIT_UNIFORM) {
            void* d = nullptr;
            ZS_ASSERT_OK(zs_param_data(p, &d));
            for (uint64_t i = 0; i < s.numel(); ++i) {
              const float x = static_cast<const float*>(d)[i];
              EXPECT_GE(x, -2.0f);
              EXPECT_LT(x, 3.0f);
            }
          }
          ZS_ASSERT_OK(zs_gather_destroy(g));
          ZS_ASSERT_OK(zs_param_destroy(p));  // destroy releases a gathered param
        }
      }
      ZS_EXPECT_OK(zs_context_destroy(ctx));
    });
  }
}

// GatheredParameters: rank 1 modifies, update broadcasts and re-partitions,
// and a later fetch on every rank sees the change.
TEST(Gather, UpdateFromModifierRankSurvivesRelease) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> ps;
    const std::vector<Spec> specs = {{"a", ZS_FLOAT32, {7, 3}}, {"b", ZS_BFLOAT16, {5}}};
    for (const auto& s : specs) ps.push_back(register_one(ctx, s, {}, ZS_INIT_ZEROS, 0));
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, ps.data(), ps.size()));
    ZS_ASSERT_OK(zs_gather_wait(g, 30000));
    std::vector<std::vector<uint8_t>> want;
    for (size_t i = 0; i < specs.size(); ++i) {
      want.push_back(pattern(specs[i], 99));
      if (env.rank == 1) {
        void* d = nullptr;
        ZS_ASSERT_OK(zs_param_data(ps[i], &d));
        std::memcpy(d, want[i].data(), want[i].size());
      }
    }
    ZS_ASSERT_OK(zs_param_update(ctx, ps.data(), ps.size(), 1));
    for (size_t i = 0; i < specs.size(); ++i) check_gathered(ps[i], want[i], "after update");
    ZS_ASSERT_OK(zs_release(ctx, ps.data(), ps.size()));
    ZS_ASSERT_OK(zs_gather_destroy(g));
    ZS_ASSERT_OK(zs_fetch(&g, ctx, ps.data(), ps.size()));
    ZS_ASSERT_OK(zs_gather_wait(g, 30000));
    for (size_t i = 0; i < specs.size(); ++i) {
      std::vector<uint8_t> out(want[i].size());
      ZS_ASSERT_OK(zs_param_copy_to(ps[i], out.data(), out.size()));
      EXPECT_EQ(out, want[i]) << specs[i].name << " on rank " << env.rank;
    }
    ZS_ASSERT_OK(zs_gather_destroy(g));
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

// Fetch/release cycles many times: memory returns to zero every time.
TEST(Gather, RepeatedFetchReleaseReturnsMemory) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto specs = random_specs(3, 20, 50);
    std::vector<zs_param> ps;
    for (const auto& s : specs) ps.push_back(register_one(ctx, s, pattern(s, 5), ZS_INIT_FROM_ALL, 0));
    for (int it = 0; it < 50; ++it) {
      // Layer by layer, as a forward pass would.
      for (size_t i = 0; i < ps.size(); i += 4) {
        const size_t n = std::min<size_t>(4, ps.size() - i);
        zs_gather g = nullptr;
        ZS_ASSERT_OK(zs_fetch(&g, ctx, &ps[i], n));
        ZS_ASSERT_OK(zs_gather_wait(g, 30000));
        ZS_ASSERT_OK(zs_gather_destroy(g));
        ZS_ASSERT_OK(zs_release(ctx, &ps[i], n));
      }
      zs_memory_stats m = ZS_MEMORY_STATS_INIT;
      ZS_ASSERT_OK(zs_context_memory(ctx, &m));
      ASSERT_EQ(m.gathered_bytes, 0u);
    }
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

}  // namespace
