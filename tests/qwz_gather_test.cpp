// ZeRO++ qwZ on real processes: with zero_quantized_weights every rank's
// gathered param is bitwise dequantize(quantize(shard)) of each shard (so
// every rank holds the same bits), within the bound of kernels/quant.h of
// the registered values; on 1, 2, 3, 5 and 8 ranks, odd sizes, fp32, bf16
// and fp16, int8 and int4; with hpZ the secondary gathers hand back what
// the quantized gather left; MiCS (plain and two-hop) quantizes too; a
// consolidated export stays exact. A param whose shard is not larger than
// its packet (a few elements take a whole block) travels exact, and the
// stats count its bytes as a full-precision gather's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unistd.h>
#include <iterator>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "tests/support/multirank.h"
#include "tests/support/quant_params.h"

using zs::test::RankEnv;
using zs::test::run_ranks;
using namespace zs::test::quant;
namespace k = zs::kernels;

namespace {

std::string qwz_config(int bits, int block, const std::string& extra = "") {
  return R"({"zero_optimization": {"zero_quantized_weights": true, "zero_quantized_weights_bits": )" +
         std::to_string(bits) + R"(, "zero_quantized_weights_block_size": )" + std::to_string(block) +
         extra + "}}";
}

// shard_group: the ranks a param is partitioned over (world, or MiCS's).
void qwz_roundtrip(const RankEnv& env, int bits, int block, const std::vector<int64_t>& numels,
                   const std::string& extra = "", int shard_group = 0) {
  const std::string cfg = qwz_config(bits, block, extra);
  zs_context ctx = zs::test::make_context(env, cfg.c_str(), 60000);
  ASSERT_NE(ctx, nullptr);
  const int members = shard_group > 0 ? shard_group : env.world;
  auto ps = register_all(ctx, numels, 17);
  fetch_all(ctx, ps);
  const k::QuantSpec s{bits, static_cast<size_t>(block)};
  for (const auto& p : ps) {
    const auto got = gathered(p);
    // A group of one gathers nothing: the exact values; so do shards too
    // small to gain from a packet.
    const auto want = members == 1 ? p.values : expected_gather(p, members, s);
    EXPECT_EQ(got, want) << p.name << " on " << env.world << " ranks: not dequantize(quantize(shard))";
    expect_within_bound(p, got, bits);
    if (members > 1 && packs_smaller(p, members, s)) {
      EXPECT_NE(got, p.values) << p.name << ": gathered exact, not quantized";
    }
  }
  release_all(ctx, ps);
  for (auto& p : ps) zs_param_destroy(p.handle);
  ZS_EXPECT_OK(zs_context_destroy(ctx));
}

// Quantizing pays only between hosts (Context::quantizes). All ranks on one
// host: the gather is exact, no quantized bytes move, and the context lists
// zero_quantized_weights among the keys it does not act on, saying why.
TEST(QwzHosts, OneHostGathersExactAndSaysSo) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    expect_listed_as_one_host(ctx, "zero_quantized_weights");
    expect_exact_gathers(ctx, {257, 100003}, "one host");
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

// Two hosts of two ranks (ZS_HOST_ID): the world gather spans hosts and is
// quantized, bitwise dequantize(quantize(shard)) on every rank, and no key
// is listed as inactive; MiCS shard groups of two, each within a host,
// gather exact.
TEST(QwzHosts, TwoHostsQuantizeWhatCrossesThem) {
  run_ranks(4, [](const RankEnv& env) {
    zs::test::play_host(env.rank / 2);
    qwz_roundtrip(env, 8, 256, {7, 257, 100003});
  });
  run_ranks(4, [](const RankEnv& env) {
    zs::test::play_host(env.rank / 2);
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256, R"(, "mics_shard_size": 2)").c_str());
    ASSERT_NE(ctx, nullptr);
    const char* keys = nullptr;
    ZS_ASSERT_OK(zs_context_inactive_config_keys(ctx, &keys));
    EXPECT_EQ(std::string(keys), "[]");
    expect_exact_gathers(ctx, {257, 100003}, "a MiCS group within a host");
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

class QwzWorld : public ::testing::TestWithParam<int> {};

TEST_P(QwzWorld, Int8GatherIsDequantizedShardsWithinBoundOnEveryRank) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(GetParam(), [](const RankEnv& env) {
    qwz_roundtrip(env, 8, 256, {1, 7, 255, 257, 1000003});
  }, 180);
}

INSTANTIATE_TEST_SUITE_P(Ranks, QwzWorld, ::testing::Values(1, 2, 3, 5, 8));

// One run_ranks per context: each gets a fresh store port.
TEST(Qwz, Int4AndOtherBlockSizes) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(3, [](const RankEnv& env) { qwz_roundtrip(env, 4, 256, {0, 1, 7, 255, 257, 100003}); });
  run_ranks(3, [](const RankEnv& env) { qwz_roundtrip(env, 4, 2048, {7, 4099}); });
  run_ranks(3, [](const RankEnv& env) { qwz_roundtrip(env, 8, 2, {7, 1001}); });
}

// A shard not larger than its packet travels exact (codes fill whole
// blocks: 24 elements take a block of 256 or 2048): those params gather as
// the registered values, bitwise, while a large one is still
// dequantize(quantize(shard)); and the stats count each param's bytes under
// what it travelled as. 200 elements fall on either side with the dtype,
// bits, block and ranks.
struct SmallCase {
  int ranks, bits, block;
};
void PrintTo(const SmallCase& c, std::ostream* os) {
  *os << c.ranks << " ranks, int" << c.bits << ", blocks of " << c.block;
}
class QwzSmallParams : public ::testing::TestWithParam<SmallCase> {};

TEST_P(QwzSmallParams, TravelExactAndCountAsFullPrecisionBytes) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  const SmallCase c = GetParam();
  run_ranks(c.ranks, [c](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(c.bits, c.block).c_str());
    ASSERT_NE(ctx, nullptr);
    const k::QuantSpec s{c.bits, static_cast<size_t>(c.block)};
    auto ps = register_all(ctx, {24, 200, 5003}, 41);
    uint64_t exact = 0, packets = 0;
    for (const auto& p : ps) {
      const uint64_t shard = shard_numel(p, c.ranks);
      // Both sides of the rule in every case: 24 elements never gain from
      // a packet, 5003 always do.
      if (p.numel == 24 || p.numel == 5003) {
        EXPECT_EQ(packs_smaller(p, c.ranks, s), p.numel == 5003) << p.name;
      }
      if (packs_smaller(p, c.ranks, s)) {
        packets += packet_bytes(shard, s);
      } else {
        exact += shard * esize(p.dtype);
      }
    }
    zs_fetch_stats before = ZS_FETCH_STATS_INIT, after = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &before));
    fetch_all(ctx, ps);
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &after));
    for (const auto& p : ps) {
      const auto got = gathered(p);
      if (packs_smaller(p, c.ranks, s)) {
        EXPECT_EQ(got, expected_qwz(p, c.ranks, s)) << p.name << ": not dequantize(quantize(shard))";
        EXPECT_NE(got, p.values) << p.name << ": gathered exact, not quantized";
      } else {
        EXPECT_EQ(got, p.values) << p.name << ": quantized, though its packet is not smaller";
      }
    }
    // Ring gathers: this rank's unit to each peer, each peer's to it.
    const uint64_t peers = static_cast<uint64_t>(c.ranks - 1);
    EXPECT_EQ(after.gather_bytes_sent - before.gather_bytes_sent, exact * peers);
    EXPECT_EQ(after.gather_bytes_received - before.gather_bytes_received, exact * peers);
    EXPECT_EQ(after.quantized_gather_bytes_sent - before.quantized_gather_bytes_sent, packets * peers);
    EXPECT_EQ(after.quantized_gather_bytes_received - before.quantized_gather_bytes_received,
              packets * peers);
    release_all(ctx, ps);
    for (auto& p : ps) zs_param_destroy(p.handle);
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QwzSmallParams,
    ::testing::Values(SmallCase{2, 8, 256}, SmallCase{3, 8, 256}, SmallCase{2, 4, 256},
                      SmallCase{3, 4, 256}, SmallCase{2, 8, 2048}, SmallCase{3, 8, 2048},
                      SmallCase{2, 4, 2048}, SmallCase{3, 4, 2048}),
    [](const ::testing::TestParamInfo<SmallCase>& i) {
      return std::to_string(i.param.ranks) + "ranks_int" + std::to_string(i.param.bits) +
             "_block" + std::to_string(i.param.block);
    });

// A NaN or inf in one shard poisons its block on every rank alike.
TEST(Qwz, NonFiniteValuesReachEveryRankAlike) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    P p{"w", ZS_FLOAT32, 1000, make_values(ZS_FLOAT32, 1000, 3), nullptr};
    float* f = reinterpret_cast<float*>(p.values.data());
    f[10] = std::numeric_limits<float>::infinity();
    f[700] = std::numeric_limits<float>::quiet_NaN();
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "w";
    o.ndim = 1;
    o.shape = &p.numel;
    o.init = ZS_INIT_FROM_ALL;
    o.data = p.values.data();
    o.data_bytes = p.values.size();
    ZS_ASSERT_OK(zs_param_register(&p.handle, ctx, &o));
    fetch_all(ctx, {p});
    const auto got = gathered(p);
    EXPECT_EQ(got, expected_qwz(p, 3, {8, 256}));
    const float* g = reinterpret_cast<const float*>(got.data());
    // Shards of 334: elements 0..255 (block 0 of rank 0) and 668..923
    // (block 0 of rank 2) are NaN, the rest finite.
    for (int i = 0; i < 1000; ++i) {
      const bool poisoned = i < 256 || (i >= 668 && i < 924);
      ASSERT_EQ(std::isnan(g[i]), poisoned) << i;
    }
    release_all(ctx, {p});
    zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// hpZ: the first gather of a step is quantized over the world; the later
// ones come from the secondary shards, exact copies of what it left.
TEST(Qwz, HpzSecondaryGathersReturnTheQuantizedForwardValues) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(4, [](const RankEnv& env) {
    const std::string cfg = qwz_config(8, 256, R"(, "zero_hpz_partition_size": 2)");
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {1, 7, 257, 10007}, 5);
    fetch_all(ctx, ps);
    std::vector<std::vector<uint8_t>> first;
    for (const auto& p : ps) {
      first.push_back(gathered(p));
      EXPECT_EQ(first.back(), expected_gather(p, 4, {8, 256})) << p.name;
    }
    release_all(ctx, ps);
    fetch_all(ctx, ps);  // from the secondary shards
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(gathered(ps[i]), first[i]) << ps[i].name;
    release_all(ctx, ps);
    zs_fetch_stats s = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &s));
    EXPECT_EQ(s.hpz_gathers, 1u);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

TEST(Qwz, MicsShardGroupsQuantize) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(4, [](const RankEnv& env) {
    qwz_roundtrip(env, 8, 256, {1, 7, 257, 10007}, R"(, "mics_shard_size": 2)", 2);
  });
}

// Two "nodes" of 2 per shard group (4 ranks), or three (6 ranks).
void qwz_hierarchical(int shard) {
  run_ranks(shard, [shard](const RankEnv& env) {
    const std::string cfg =
        qwz_config(4, 256, R"(, "mics_shard_size": )" + std::to_string(shard) +
                               R"(, "mics_hierarchical_params_gather": true)");
    zs_context_options o = zs::test::rank_options(env, cfg.c_str());
    o.local_world_size = 2;
    o.local_rank = env.rank % 2;
    zs_context ctx = nullptr;
    ZS_ASSERT_OK(zs_context_create(&ctx, &o));
    auto ps = register_all(ctx, {1, 7, 257, 10007}, 9);
    fetch_all(ctx, ps);
    for (const auto& p : ps) EXPECT_EQ(gathered(p), expected_gather(p, shard, {4, 256})) << p.name;
    release_all(ctx, ps);
    zs_fetch_stats s = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &s));
    EXPECT_EQ(s.hierarchical_gathers, 1u);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

TEST(Qwz, MicsHierarchicalTwoHopsQuantize) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  qwz_hierarchical(4);
}
TEST(Qwz, MicsHierarchicalOverThreeNodesQuantize) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  qwz_hierarchical(6);
}

// zs_param_update with rank 1 as the modifier (the gathered params hold
// its writes), then each rank's shard equals its slice of want[j].
void update_from_rank_1_expecting(zs_context ctx, std::vector<P>& ps,
                                  const std::vector<std::vector<uint8_t>>& want, int rank) {
  std::vector<zs_param> hs;
  for (const auto& p : ps) hs.push_back(p.handle);
  ZS_ASSERT_OK(zs_param_update(ctx, hs.data(), hs.size(), 1));
  release_all(ctx, ps);
  for (size_t j = 0; j < ps.size(); ++j) {
    const P& p = ps[j];
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ZS_ASSERT_OK(zs_param_get_info(p.handle, &info));
    void* shard = nullptr;
    ZS_ASSERT_OK(zs_param_shard_data(p.handle, &shard, nullptr));
    const size_t es = esize(p.dtype);
    EXPECT_EQ(0, std::memcmp(shard, want[j].data() + info.shard_offset * es, info.shard_valid * es))
        << p.name << " rank " << rank;
  }
}

// GatheredParameters(modifier_rank) under qwZ: the elements the modifier
// changed take their new values, the others keep their exact values (not
// the quantized ones the gather showed).
TEST(Qwz, UpdateKeepsUntouchedElementsExact) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {1001}, 8);
    fetch_all(ctx, ps);
    std::vector<std::vector<uint8_t>> want;
    for (const auto& p : ps) {
      want.push_back(p.values);
      const size_t es = esize(p.dtype);
      // Every 100th element changes (on every rank's shard), on rank 1.
      for (size_t i = 0; i < static_cast<size_t>(p.numel); i += 100)
        k::store_work1(want.back().data(), wd(p.dtype), i, 1000.0f + static_cast<float>(i));
      if (env.rank == 1) {
        void* d = nullptr;
        ZS_ASSERT_OK(zs_param_data(p.handle, &d));
        for (size_t i = 0; i < static_cast<size_t>(p.numel); i += 100)
          std::memcpy(static_cast<uint8_t*>(d) + i * es, want.back().data() + i * es, es);
      }
    }
    update_from_rank_1_expecting(ctx, ps, want, env.rank);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// A param gathered exact (too small for a packet) takes every element
// the modifier wrote, even one set to what quantizing would have given
// (which UpdateKeepsUntouchedElementsExact's rule would take for untouched).
TEST(Qwz, UpdateOfAParamGatheredExactTakesEveryWrite) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {24}, 12);
    fetch_all(ctx, ps);
    std::vector<std::vector<uint8_t>> want;
    for (const auto& p : ps) {
      ASSERT_FALSE(packs_smaller(p, 2, {8, 256})) << p.name;
      want.push_back(expected_qwz(p, 2, {8, 256}));
      ASSERT_NE(want.back(), p.values) << p.name << ": quantizing changes nothing here";
      if (env.rank == 1) {
        void* d = nullptr;
        ZS_ASSERT_OK(zs_param_data(p.handle, &d));
        std::memcpy(d, want.back().data(), want.back().size());
      }
    }
    update_from_rank_1_expecting(ctx, ps, want, env.rank);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// The live export writes the params' own values, never the qwZ ones.
TEST(Qwz, LiveExportIsExact) {
  const std::string file = "/tmp/zs_qwz_export_" + std::to_string(getpid()) + ".safetensors";
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qwz_config(8, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {1001}, 4);
    std::vector<zs_param> hs;
    for (const auto& p : ps) hs.push_back(p.handle);
    zs_export_options eo = ZS_EXPORT_OPTIONS_INIT;
    ZS_ASSERT_OK(zs_export_safetensors(ctx, hs.data(), hs.size(), file.c_str(), &eo));
    if (env.rank == 0) {
      std::ifstream f(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      // Tensors follow the header in registration order (fp32, bf16, fp16).
      size_t total = 0;
      for (const auto& p : ps) total += p.values.size();
      ASSERT_GE(bytes.size(), total);
      size_t at = bytes.size() - total;
      for (const auto& p : ps) {
        EXPECT_EQ(0, std::memcmp(bytes.data() + at, p.values.data(), p.values.size())) << p.name;
        at += p.values.size();
      }
    }
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
  std::remove(file.c_str());
}

}  // namespace
