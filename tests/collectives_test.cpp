// Raw collectives on 1..5 real processes: every dtype, odd counts, every
// reduce op, sub-groups, and the MiCS / hpZ topologies from the config.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/convert.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Small integers: exact in every dtype and in any summation order.
float value(int rank, size_t i) { return static_cast<float>((rank * 7 + static_cast<int>(i) * 3) % 23 - 11); }

std::vector<uint8_t> encode(const std::vector<float>& v, zs_dtype t) {
  std::vector<uint8_t> out(v.size() * (t == ZS_FLOAT32 ? 4 : 2));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == ZS_FLOAT32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const uint16_t h = t == ZS_BFLOAT16 ? zs::kernels::float_to_bf16(v[i]) : zs::kernels::float_to_fp16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

float decode(const std::vector<uint8_t>& b, zs_dtype t, size_t i) {
  if (t == ZS_FLOAT32) {
    float f;
    std::memcpy(&f, &b[i * 4], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &b[i * 2], 2);
  return t == ZS_BFLOAT16 ? zs::kernels::bf16_to_float(h) : zs::kernels::fp16_to_float(h);
}

float reduce_expected(zs_reduce_op op, int world, size_t i) {
  float acc = value(0, i);
  for (int r = 1; r < world; ++r) {
    const float x = value(r, i);
    if (op == ZS_SUM || op == ZS_AVG) acc += x;
    if (op == ZS_MAX) acc = std::max(acc, x);
    if (op == ZS_MIN) acc = std::min(acc, x);
  }
  return op == ZS_AVG ? acc / static_cast<float>(world) : acc;
}

void wait_ok(zs_work w) {
  ZS_ASSERT_OK(zs_work_wait(w, 30000));
  ZS_ASSERT_OK(zs_work_destroy(w));
}

void all_collectives(const RankEnv& env) {
  zs_context ctx = zs::test::make_context(env);
  ASSERT_NE(ctx, nullptr);
  zs_group world = nullptr;
  ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
  int grank = -1, gsize = -1;
  ZS_ASSERT_OK(zs_group_rank(world, &grank));
  ZS_ASSERT_OK(zs_group_size(world, &gsize));
  EXPECT_EQ(grank, env.rank);
  EXPECT_EQ(gsize, env.world);
  const size_t w = static_cast<size_t>(env.world);

  for (zs_dtype t : {ZS_FLOAT32, ZS_BFLOAT16, ZS_FLOAT16}) {
    // 20011 and 70001: all-reduces past the direct path (64 KiB) take the
    // ring, with blocks of unequal length; 70001 fp32 gathers go direct.
    for (size_t count : {size_t{1}, size_t{13}, size_t{1000}, size_t{0}, size_t{20011}, size_t{70001}}) {
      // all-gather
      std::vector<float> mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = value(env.rank, i);
      auto send = encode(mine, t);
      std::vector<uint8_t> recv(send.size() * w);
      zs_work work = nullptr;
      ZS_ASSERT_OK(zs_allgather(&work, world, send.data(), recv.data(), count, t));
      wait_ok(work);
      for (int r = 0; r < env.world; ++r)
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(decode(recv, t, static_cast<size_t>(r) * count + i), value(r, i));

      for (zs_reduce_op op : {ZS_SUM, ZS_AVG, ZS_MAX, ZS_MIN}) {
        // reduce-scatter: block b of rank r holds value(r, b*count + i)
        std::vector<float> full(count * w);
        for (size_t i = 0; i < full.size(); ++i) full[i] = value(env.rank, i);
        auto rs_send = encode(full, t);
        std::vector<uint8_t> rs_recv(send.size());
        ZS_ASSERT_OK(zs_reduce_scatter(&work, world, rs_send.data(), rs_recv.data(), count, t, op));
        wait_ok(work);
        const float tol = (op == ZS_AVG && t != ZS_FLOAT32) ? 0.02f : 1e-6f;
        for (size_t i = 0; i < count; ++i)
          ASSERT_NEAR(decode(rs_recv, t, i),
                      reduce_expected(op, env.world, static_cast<size_t>(env.rank) * count + i),
                      tol * (1.0f + std::fabs(reduce_expected(op, env.world, i))))
              << "reduce-scatter op " << op << " dtype " << t << " count " << count;
        // all-reduce in place
        auto ar = send;
        ZS_ASSERT_OK(zs_allreduce(&work, world, ar.data(), ar.data(), count, t, op));
        wait_ok(work);
        for (size_t i = 0; i < count; ++i)
          ASSERT_NEAR(decode(ar, t, i), reduce_expected(op, env.world, i),
                      tol * (1.0f + std::fabs(reduce_expected(op, env.world, i))))
              << "all-reduce op " << op << " dtype " << t;
        // Every rank holds bitwise the same result.
        if (count == 0) continue;  // nothing to compare (and no memcmp of null)
        std::vector<uint8_t> all_ar(ar.size() * w);
        ZS_ASSERT_OK(zs_allgather(&work, world, ar.data(), all_ar.data(), count, t));
        wait_ok(work);
        for (size_t r = 0; r < w; ++r)
          ASSERT_EQ(std::memcmp(all_ar.data() + r * ar.size(), ar.data(), ar.size()), 0)
              << "all-reduce results differ between ranks " << r << " and " << env.rank;
      }
      // broadcast from the last rank
      auto bc = env.rank == env.world - 1 ? send : std::vector<uint8_t>(send.size(), 0);
      ZS_ASSERT_OK(zs_broadcast(&work, world, bc.data(), count, t, env.world - 1));
      wait_ok(work);
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(decode(bc, t, i), value(env.world - 1, i));
    }
  }
  zs_work b = nullptr;
  ZS_ASSERT_OK(zs_barrier(&b, world));
  wait_ok(b);
  ZS_EXPECT_OK(zs_group_destroy(world));
  ZS_EXPECT_OK(zs_context_destroy(ctx));
}

class CollectivesWorld : public ::testing::TestWithParam<int> {};
TEST_P(CollectivesWorld, EveryDtypeOpAndOddCount) { run_ranks(GetParam(), all_collectives); }
INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesWorld, ::testing::Values(1, 2, 3, 4, 5));

// fp32 reduce-scatter sums block b along the ring: rank b+1's values
// first, rank b's last, then Avg's 1/n; values of mixed magnitude make any
// other order (or a lost 1/n) show in the bits. recv may be our own block.
float ring_value(int rank, size_t i) {
  const auto k = static_cast<float>((static_cast<size_t>(rank) * 7919 + i * 104729) % 1000003);
  return (k / 1000003.0f - 0.5f) * std::ldexp(1.0f, static_cast<int>(i % 40) - 20);
}

class ReduceScatterRing : public ::testing::TestWithParam<int> {};
TEST_P(ReduceScatterRing, Fp32SumsInRingOrderBitwise) {
  run_ranks(GetParam(), [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    const int n = env.world;
    for (size_t count : {size_t{1}, size_t{1001}, size_t{300007}}) {
      for (zs_reduce_op op : {ZS_SUM, ZS_AVG, ZS_MAX}) {
        for (bool in_place : {false, true}) {
          std::vector<float> send(count * static_cast<size_t>(n));
          for (size_t i = 0; i < send.size(); ++i) send[i] = ring_value(env.rank, i);
          std::vector<float> out(count);
          float* recv = in_place ? send.data() + static_cast<size_t>(env.rank) * count : out.data();
          zs_work w = nullptr;
          ZS_ASSERT_OK(zs_reduce_scatter(&w, world, send.data(), recv, count, ZS_FLOAT32, op));
          wait_ok(w);
          for (size_t i = 0; i < count; ++i) {
            const size_t at = static_cast<size_t>(env.rank) * count + i;
            float acc = ring_value((env.rank + 1) % n, at);
            for (int k = 2; k <= n; ++k) {
              const float x = ring_value((env.rank + k) % n, at);
              acc = op == ZS_MAX ? std::max(x, acc) : x + acc;
            }
            if (op == ZS_AVG) acc *= 1.0f / static_cast<float>(n);
            uint32_t got_bits = 0, want_bits = 0;
            std::memcpy(&got_bits, &recv[i], 4);
            std::memcpy(&want_bits, &acc, 4);
            ASSERT_EQ(got_bits, want_bits) << "count " << count << " op " << op << " in_place "
                                           << in_place << " element " << i;
          }
        }
      }
    }
    zs_group_destroy(world);
    zs_context_destroy(ctx);
  });
}
INSTANTIATE_TEST_SUITE_P(Ranks, ReduceScatterRing, ::testing::Values(1, 2, 3, 5));

// An fp16 Avg reduce-scatter divides each term by n before the ring sums
// it (NCCL's PreMulSum): 49152 on every rank averages to 49152, where
// partial sums of the undivided terms (98304) overflow to inf; every partial
// sum of 49152 / n (n = 2, 3, 4) is exact in fp16.
class ReduceScatter16 : public ::testing::TestWithParam<int> {};
TEST_P(ReduceScatter16, Fp16AvgDoesNotOverflowWhereTheMeanFits) {
  run_ranks(GetParam(), [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    const size_t count = 5;
    std::vector<float> full(count * static_cast<size_t>(env.world));
    for (size_t i = 0; i < full.size(); ++i) full[i] = i % 2 == 0 ? 49152.0f : -49152.0f;
    auto send = encode(full, ZS_FLOAT16);
    std::vector<uint8_t> recv(count * 2);
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_reduce_scatter(&w, world, send.data(), recv.data(), count, ZS_FLOAT16, ZS_AVG));
    wait_ok(w);
    for (size_t i = 0; i < count; ++i)
      EXPECT_EQ(decode(recv, ZS_FLOAT16, i), full[static_cast<size_t>(env.rank) * count + i]) << i;
    zs_group_destroy(world);
    zs_context_destroy(ctx);
  });
}
INSTANTIATE_TEST_SUITE_P(Ranks, ReduceScatter16, ::testing::Values(2, 3, 4));

TEST(Collectives, Uint8SumAndAvgRefused) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    std::vector<uint8_t> v = {1, 2, 250};
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_allreduce(&w, world, v.data(), v.data(), 3, ZS_UINT8, ZS_MAX));
    wait_ok(w);
    EXPECT_EQ(v, (std::vector<uint8_t>{1, 2, 250}));
    zs_group_destroy(world);
    zs_context_destroy(ctx);
  });
}

// Sub-groups: every rank calls with the same list; non-members get rank -1
// and their collectives are refused.
TEST(Collectives, SubGroupOfOddRanks) {
  run_ranks(5, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const int odd[] = {1, 3};
    zs_group g = nullptr;
    ZS_ASSERT_OK(zs_group_create(&g, ctx, odd, 2));
    int grank = 0;
    ZS_ASSERT_OK(zs_group_rank(g, &grank));
    float x = static_cast<float>(env.rank);
    zs_work w = nullptr;
    if (env.rank % 2 == 1) {
      EXPECT_EQ(grank, env.rank / 2);
      ZS_ASSERT_OK(zs_allreduce(&w, g, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
      wait_ok(w);
      EXPECT_EQ(x, 4.0f);
      int wr = -1;
      ZS_ASSERT_OK(zs_group_world_rank(g, 1, &wr));
      EXPECT_EQ(wr, 3);
    } else {
      EXPECT_EQ(grank, -1);
      EXPECT_EQ(zs_allreduce(&w, g, &x, &x, 1, ZS_FLOAT32, ZS_SUM), ZS_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(zs_last_error()).find("not a member"), std::string::npos);
    }
    // A second group after the first keeps working on every rank.
    const int all_but_0[] = {1, 2, 3, 4};
    zs_group g2 = nullptr;
    ZS_ASSERT_OK(zs_group_create(&g2, ctx, all_but_0, 4));
    if (env.rank > 0) {
      float y = 1.0f;
      ZS_ASSERT_OK(zs_allreduce(&w, g2, &y, &y, 1, ZS_FLOAT32, ZS_SUM));
      wait_ok(w);
      EXPECT_EQ(y, 4.0f);
    }
    const int bad[] = {0, 0};
    EXPECT_EQ(zs_group_create(&g2, ctx, bad, 2), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("appears twice"), std::string::npos);
    zs_group_destroy(g);
    zs_context_destroy(ctx);
  });
}

// MiCS: shard groups of consecutive ranks, replica groups across them; the
// partition group is the shard group, so params shard over 2, not 4.
TEST(Topology, MicsShardAndReplicaGroups) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"zero_optimization": {"stage": 3, "mics_shard_size": 2}})");
    ASSERT_NE(ctx, nullptr);
    auto members = [&](zs_group_kind kind) {
      zs_group g = nullptr;
      EXPECT_EQ(zs_context_group(&g, ctx, kind), ZS_OK) << zs_last_error();
      int size = 0;
      zs_group_size(g, &size);
      std::vector<int> out;
      for (int i = 0; i < size; ++i) {
        int wr = -1;
        zs_group_world_rank(g, i, &wr);
        out.push_back(wr);
      }
      zs_group_destroy(g);
      return out;
    };
    const int base = env.rank / 2 * 2;
    EXPECT_EQ(members(ZS_GROUP_MICS_SHARD), (std::vector<int>{base, base + 1}));
    EXPECT_EQ(members(ZS_GROUP_PARTITION), (std::vector<int>{base, base + 1}));
    EXPECT_EQ(members(ZS_GROUP_MICS_REPLICA), (std::vector<int>{env.rank % 2, env.rank % 2 + 2}));
    EXPECT_EQ(members(ZS_GROUP_WORLD), (std::vector<int>{0, 1, 2, 3}));
    zs_group none = nullptr;
    EXPECT_EQ(zs_context_group(&none, ctx, ZS_GROUP_HPZ), ZS_ERR_INVALID_STATE);

    // A param shards over the shard group and gathers correctly within it.
    std::vector<float> data(11);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i) * 0.5f;
    const int64_t shape[1] = {11};
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "mics";
    o.ndim = 1;
    o.shape = shape;
    o.init = ZS_INIT_FROM_RANK;
    o.src_rank = 1;  // group rank 1 in each shard group
    o.data = data.data();
    o.data_bytes = data.size() * 4;
    zs_param p = nullptr;
    ZS_ASSERT_OK(zs_param_register(&p, ctx, &o));
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ZS_ASSERT_OK(zs_param_get_info(p, &info));
    EXPECT_EQ(info.shard_numel, 6u);
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    ZS_ASSERT_OK(zs_gather_wait(g, 30000));
    std::vector<float> out(11);
    ZS_ASSERT_OK(zs_param_copy_to(p, out.data(), 44));
    EXPECT_EQ(out, data);
    zs_gather_destroy(g);
    zs_context_destroy(ctx);
  });
}

TEST(Topology, HpzIntraNodeGroups) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"zero_optimization": {"zero_hpz_partition_size": 2}})");
    ASSERT_NE(ctx, nullptr);
    zs_group g = nullptr;
    ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_HPZ));
    int size = 0, first = -1;
    zs_group_size(g, &size);
    zs_group_world_rank(g, 0, &first);
    EXPECT_EQ(size, 2);
    EXPECT_EQ(first, env.rank / 2 * 2);
    float x = 1.0f;
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_allreduce(&w, g, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
    wait_ok(w);
    EXPECT_EQ(x, 2.0f);
    zs_group_destroy(g);
    zs_context_destroy(ctx);
  });
}

// A topology that cannot work with the world size is refused before any
// socket opens, on every rank, with the config path in the message.
TEST(Topology, MicsNotDividingWorldRefusedUpFront) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context_options o = zs::test::rank_options(env, R"({"zero_optimization": {"mics_shard_size": 3}})");
    zs_context ctx = nullptr;
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG);
    EXPECT_NE(std::string(zs_last_error()).find("zero_optimization.mics_shard_size"), std::string::npos)
        << zs_last_error();
    EXPECT_EQ(ctx, nullptr);
  });
}

}  // namespace
