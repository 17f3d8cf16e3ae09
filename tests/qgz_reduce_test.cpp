// ZeRO++ qgZ on real processes: with zero_quantized_gradients the gradient
// shards are, bitwise, what the algorithm of impl/comm/algo/quantized_reduce.h
// computes from every rank's bucket (each destination block quantized,
// dequantized, summed in rank order, divided), and within its documented
// bound of the exact average; on 1, 2, 3 and 5 ranks, odd numels, int4 and
// int8, several block sizes, small buckets, "nodes" of one rank, MiCS;
// bitwise the same from one run to the next.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "tests/support/multirank.h"
#include "tests/support/quant_params.h"

using zs::test::RankEnv;
using zs::test::run_ranks;
namespace k = zs::kernels;

namespace {

size_t shard_of(int64_t numel, int world) {
  return (static_cast<size_t>(numel) + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
}

// Rank r's gradient of param `p`: normal values whose magnitude changes
// every 300 elements, different on every rank.
std::vector<float> grad_of(int rank, size_t p, int64_t numel) {
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + 17 * p + 5));
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> out(static_cast<size_t>(numel));
  float mag = 1.0f;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i % 300 == 0) mag = std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
    out[i] = g(rng) * mag;
  }
  return out;
}

// Rank r's bucket block j (one bucket holding every param, in push order):
// each param's shard j, padded with zeros.
std::vector<float> block_of(int rank, int j, const std::vector<int64_t>& numels, int world) {
  std::vector<float> out;
  for (size_t p = 0; p < numels.size(); ++p) {
    const auto g = grad_of(rank, p, numels[p]);
    const size_t shard = shard_of(numels[p], world);
    for (size_t i = 0; i < shard; ++i) {
      const size_t at = static_cast<size_t>(j) * shard + i;
      out.push_back(at < g.size() ? g[at] : 0.0f);
    }
  }
  return out;
}

struct Expected {
  std::vector<float> value;  // what the algorithm gives (bitwise)
  std::vector<double> exact;  // the exact average
  std::vector<double> bound;  // the documented bound per element
};

Expected expected_for(int me, const std::vector<int64_t>& numels, int world, k::QuantSpec s) {
  Expected e;
  const size_t n = static_cast<size_t>(world);
  std::vector<float> sum;
  std::vector<double> scale_sum, biggest;
  for (int r = 0; r < world; ++r) {
    const auto x = block_of(r, me, numels, world);
    const size_t count = x.size();
    if (r == 0) {
      sum.assign(count, 0.0f);
      e.exact.assign(count, 0.0);
      scale_sum.assign(count, 0.0);
      biggest.assign(count, 0.0);
    }
    std::vector<uint8_t> codes(k::quant_code_bytes(count, s));
    std::vector<float> scales(k::quant_blocks(count, s)), deq(count);
    k::quantize(x.data(), k::WorkDtype::F32, count, s, codes.data(), scales.data());
    k::dequantize(codes.data(), scales.data(), count, s, deq.data(), k::WorkDtype::F32);
    for (size_t i = 0; i < count; ++i) {
      sum[i] = r == 0 ? deq[i] : sum[i] + deq[i];
      e.exact[i] += static_cast<double>(x[i]);
      const double sc = scales[i / s.block];
      scale_sum[i] += sc;
      biggest[i] = std::max(biggest[i], std::fabs(static_cast<double>(x[i])) + sc);
    }
  }
  if (world == 1) {  // a group of one is exact
    e.value = block_of(0, 0, numels, 1);
    e.exact.assign(e.value.begin(), e.value.end());
    e.bound.assign(e.value.size(), 0.0);
    return e;
  }
  for (size_t i = 0; i < sum.size(); ++i) {
    e.value.push_back(sum[i] / static_cast<float>(world));
    e.exact[i] /= static_cast<double>(n);
    e.bound.push_back(scale_sum[i] / static_cast<double>(n) * (0.5 + 0x1p-16) +
                      static_cast<double>(n + 1) * 0x1p-24 * biggest[i] + 0x1p-149);
  }
  return e;
}

std::string qgz_config(int bits, int block, const std::string& extra = "") {
  return R"({"zero_optimization": {"zero_quantized_gradients": true, "zero_quantized_gradients_bits": )" +
         std::to_string(bits) + R"(, "zero_quantized_gradients_block_size": )" + std::to_string(block) +
         extra + "}}";
}

// Registers the params, pushes this rank's gradients, syncs; returns the
// gradient shards laid end to end (as one bucket's block would be).
std::vector<float> reduce(zs_context ctx, int rank, const std::vector<int64_t>& numels) {
  std::vector<zs_param> hs;
  std::vector<int64_t> shapes(numels);
  for (size_t p = 0; p < numels.size(); ++p) {
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(p);
    o.name = name.c_str();
    o.dtype = ZS_FLOAT32;
    o.ndim = 1;
    o.shape = &shapes[p];
    zs_param h = nullptr;
    EXPECT_EQ(zs_param_register(&h, ctx, &o), ZS_OK) << zs_last_error();
    hs.push_back(h);
  }
  for (size_t p = 0; p < numels.size(); ++p) {
    const auto g = grad_of(rank, p, numels[p]);
    EXPECT_EQ(zs_grad_push(hs[p], g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
  }
  EXPECT_EQ(zs_grad_sync(ctx), ZS_OK) << zs_last_error();
  std::vector<float> out;
  for (zs_param h : hs) {
    float* data = nullptr;
    uint64_t n = 0;
    EXPECT_EQ(zs_grad_shard_data(h, &data, &n), ZS_OK) << zs_last_error();
    out.insert(out.end(), data, data + n);
  }
  return out;
}

void check(const std::vector<float>& got, const Expected& e, bool bitwise, const std::string& what) {
  ASSERT_EQ(got.size(), e.exact.size()) << what;
  size_t mismatches = 0, over = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (bitwise && std::memcmp(&got[i], &e.value[i], 4) != 0 && mismatches++ < 5)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << e.value[i];
    if (std::fabs(static_cast<double>(got[i]) - e.exact[i]) > e.bound[i] && over++ < 5)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", exact " << e.exact[i]
                    << ", bound " << e.bound[i];
  }
}

const std::vector<int64_t> kNumels = {1, 7, 257, 1001, 30011};

void bitwise_and_bound(const RankEnv& env, int bits, int block) {
  const std::string cfg = qgz_config(bits, block);
  zs_context ctx = zs::test::make_context(env, cfg.c_str());
  ASSERT_NE(ctx, nullptr);
  const auto got = reduce(ctx, env.rank, kNumels);
  const k::QuantSpec s{bits, static_cast<size_t>(block)};
  check(got, expected_for(env.rank, kNumels, env.world, s), true,
        "int" + std::to_string(bits) + " block " + std::to_string(block));
  zs_context_destroy(ctx);
}

class QgzWorld : public ::testing::TestWithParam<int> {};

TEST_P(QgzWorld, Int4IsTheAlgorithmBitwiseAndWithinTheBound) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(GetParam(), [](const RankEnv& env) { bitwise_and_bound(env, 4, 256); });
}

TEST_P(QgzWorld, Int8) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(GetParam(), [](const RankEnv& env) { bitwise_and_bound(env, 8, 256); });
}

// One context per run_ranks: each gets its own store port.
TEST_P(QgzWorld, Int4BlocksOfTwo) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(GetParam(), [](const RankEnv& env) { bitwise_and_bound(env, 4, 2); });
}

TEST_P(QgzWorld, Int8BlocksOf2048) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(GetParam(), [](const RankEnv& env) { bitwise_and_bound(env, 8, 2048); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, QgzWorld, ::testing::Values(1, 2, 3, 5));

// Small buckets (params split over several, blocks smaller than a
// quantization block): within a bound that takes each rank's largest
// element as every block's scale.
TEST(Qgz, SmallBucketsStayWithinTheBound) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = qgz_config(4, 256, R"(, "reduce_bucket_size": 90)");
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const auto got = reduce(ctx, env.rank, kNumels);
    Expected e = expected_for(env.rank, kNumels, env.world, {4, 256});
    double largest = 0;
    for (int r = 0; r < env.world; ++r)
      for (float x : block_of(r, env.rank, kNumels, env.world)) largest = std::max(largest, std::fabs(double{x}));
    for (auto& b : e.bound) b = largest / 7 * (0.5 + 0x1p-16) * (1 + 1e-6) + 4 * 0x1p-24 * largest * 8 / 7 + 0x1p-149;
    check(got, e, false, "buckets of 90");
    zs_context_destroy(ctx);
  });
}

// Every rank a "node" of its own (LOCAL_WORLD_SIZE 1): the single-hop
// all-to-all serves any topology.
TEST(Qgz, OneRankPerNodeGivesTheSameBits) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = qgz_config(4, 256);
    zs_context_options o = zs::test::rank_options(env, cfg.c_str());
    o.local_rank = 0;
    o.local_world_size = 1;
    zs_context ctx = nullptr;
    ASSERT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
    check(reduce(ctx, env.rank, kNumels), expected_for(env.rank, kNumels, 3, {4, 256}), true,
          "local world 1");
    zs_context_destroy(ctx);
  });
}

// x dequantized after quantization, and the scale of each element's block.
std::vector<float> roundtrip(const std::vector<float>& x, k::QuantSpec s, std::vector<double>* scale) {
  std::vector<uint8_t> codes(k::quant_code_bytes(x.size(), s));
  std::vector<float> scales(k::quant_blocks(x.size(), s)), deq(x.size());
  k::quantize(x.data(), k::WorkDtype::F32, x.size(), s, codes.data(), scales.data());
  k::dequantize(codes.data(), scales.data(), x.size(), s, deq.data(), k::WorkDtype::F32);
  scale->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) (*scale)[i] = scales[i / s.block];
  return deq;
}

// The two hops across whole nodes (quantized_reduce.h): each node's sum of
// its ranks' dequantized blocks for `me` (or, with exact_hop1, of the
// blocks themselves: a node that is one host), in local order,
// requantized; those summed in node order and divided by the world.
Expected expected_two_hops(int me, const std::vector<int64_t>& numels, int world, int local, k::QuantSpec s,
                           bool exact_hop1 = false) {
  const int nodes = world / local;
  Expected e;
  std::vector<float> acc;
  std::vector<double> scale_sum, biggest, sc;
  for (int node = 0; node < nodes; ++node) {
    std::vector<float> partial;
    for (int l = 0; l < local; ++l) {
      const auto x = block_of(node * local + l, me, numels, world);
      auto d = x;
      if (exact_hop1)
        sc.assign(x.size(), 0.0);
      else
        d = roundtrip(x, s, &sc);
      if (partial.empty()) {
        partial = d;
        if (acc.empty()) {
          acc.assign(x.size(), 0.0f);
          e.exact.assign(x.size(), 0.0);
          scale_sum.assign(x.size(), 0.0);
          biggest.assign(x.size(), 0.0);
        }
      } else {
        for (size_t i = 0; i < d.size(); ++i) partial[i] += d[i];
      }
      for (size_t i = 0; i < x.size(); ++i) {
        e.exact[i] += x[i];
        scale_sum[i] += sc[i];
        biggest[i] = std::max(biggest[i], std::fabs(double{x[i]}) + sc[i]);
      }
    }
    const auto d = roundtrip(partial, s, &sc);
    for (size_t i = 0; i < d.size(); ++i) {
      acc[i] = node == 0 ? d[i] : acc[i] + d[i];
      scale_sum[i] += sc[i];
      biggest[i] = std::max(biggest[i], std::fabs(double{partial[i]}) + sc[i]);
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) {
    e.value.push_back(acc[i] / static_cast<float>(world));
    e.exact[i] /= world;
    e.bound.push_back(scale_sum[i] / world * (0.5 + 0x1p-16) + (world + 2) * 0x1p-24 * biggest[i] + 0x1p-149);
  }
  return e;
}

// LOCAL_WORLD_SIZE below the world: whole nodes take the two hops (2 and 3
// nodes, the odd count included); a world that is not whole nodes takes the
// single all-to-all. Either every hop quantizes (the test holds
// QuantizeWithinHost), or each node plays a host of its own and the hop
// within it stays exact; with hosts that are not whole nodes, the single
// all-to-all quantizes every pair.
enum class Hosts { One, PerNode };
void nodes_of(const RankEnv& env, int local, int bits, Hosts hosts = Hosts::One,
              const std::string& extra = "") {
  if (hosts == Hosts::PerNode) zs::test::play_host(env.rank / local);
  const std::string cfg = qgz_config(bits, 256, extra);
  zs_context_options o = zs::test::rank_options(env, cfg.c_str());
  o.local_rank = env.rank % local;
  o.local_world_size = local;
  zs_context ctx = nullptr;
  ASSERT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
  const k::QuantSpec s{bits, 256};
  const auto got = reduce(ctx, env.rank, kNumels);
  const bool exact_hop1 = hosts == Hosts::PerNode;
  const std::string what = std::to_string(env.world) + " ranks, " + std::to_string(local) + " per node" +
                           (exact_hop1 ? ", a host per node" : "");
  if (env.world % local == 0) {
    const Expected e = expected_two_hops(env.rank, kNumels, env.world, local, s, exact_hop1);
    check(got, e, true, what);
    double err = 0, mean_err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(double{got[i]} - e.exact[i]);
      err = std::max(err, d);
      mean_err += d / static_cast<double>(got.size());
    }
    // The stats count the fp32 hop as a full-precision reduction, the
    // quantized one apart.
    zs_fetch_stats st = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &st));
    EXPECT_GT(st.quantized_reduce_bytes_sent, 0u) << what;
    // Hop 1 sends each of the local - 1 peers a block per node.
    const uint64_t hop1 = e.exact.size() * 4 * static_cast<uint64_t>(env.world / local) * (local - 1);
    EXPECT_EQ(st.reduce_scatter_bytes_sent, exact_hop1 ? hop1 : 0u) << what;
    if (env.rank == 0)  // for the docs: what the exact hop within a host saves
      std::printf("%s: rank 0's shard, largest error %.3g, mean %.3g against the exact average\n", what.c_str(),
                  err, mean_err);
  } else {
    check(got, expected_for(env.rank, kNumels, env.world, s), true, what);
  }
  zs_context_destroy(ctx);
}

// All ranks on one host (no override): the gradients travel as an fp32
// reduce-scatter, nothing is quantized, the result is the exact average to
// fp32 rounding, and the context lists zero_quantized_gradients among the
// keys it does not act on, saying why.
TEST(QgzHosts, OneHostQuantizesNothingAndSaysSo) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, qgz_config(4, 256).c_str());
    ASSERT_NE(ctx, nullptr);
    zs::test::quant::expect_listed_as_one_host(ctx, "zero_quantized_gradients");
    const auto got = reduce(ctx, env.rank, kNumels);
    Expected e = expected_for(env.rank, kNumels, env.world, {4, 256});
    // fp32's rounding of the sum of 3 terms and of the division, no codes.
    e.bound.assign(e.exact.size(), 0x1p-149);
    for (int r = 0; r < env.world; ++r) {
      const auto x = block_of(r, env.rank, kNumels, env.world);
      for (size_t i = 0; i < x.size(); ++i) e.bound[i] += 4 * 0x1p-24 * std::fabs(double{x[i]});
    }
    check(got, e, false, "one host");
    zs_fetch_stats st = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &st));
    EXPECT_EQ(st.quantized_reduce_bytes_sent, 0u);
    EXPECT_GT(st.reduce_scatter_bytes_sent, 0u);
    zs_context_destroy(ctx);
  });
}

// Ranks that disagree on ZS_QUANTIZE_WITHIN_HOST would quantize different
// traffic: every rank's context creation fails, naming it.
TEST(QgzHosts, RanksThatDisagreeOnQuantizingWithinAHostAreRefused) {
  run_ranks(2, [](const RankEnv& env) {
    if (env.rank == 1) setenv("ZS_QUANTIZE_WITHIN_HOST", "1", 1);
    const std::string cfg = qgz_config(4, 256);
    zs_context_options o = zs::test::rank_options(env, cfg.c_str());
    zs_context ctx = nullptr;
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG);
    EXPECT_NE(std::string(zs_last_error()).find("ZS_QUANTIZE_WITHIN_HOST=1 (rank 0: 0)"), std::string::npos)
        << zs_last_error();
  });
}

class QgzNodes : public ::testing::TestWithParam<Hosts> {
 protected:
  // Every hop quantizes when all ranks are one host.
  void SetUp() override {
    if (GetParam() == Hosts::One) everywhere_ = std::make_unique<zs::test::QuantizeWithinHost>();
  }
  std::unique_ptr<zs::test::QuantizeWithinHost> everywhere_;
};

TEST_P(QgzNodes, TwoNodesOfTwo) {
  run_ranks(4, [h = GetParam()](const RankEnv& env) { nodes_of(env, 2, 4, h); });
}
TEST_P(QgzNodes, ThreeNodesOfTwo) {
  run_ranks(6, [h = GetParam()](const RankEnv& env) { nodes_of(env, 2, 4, h); });
}
TEST_P(QgzNodes, TwoNodesOfThreeInt8) {
  run_ranks(6, [h = GetParam()](const RankEnv& env) { nodes_of(env, 3, 8, h); });
}
// hpZ's node groups beside qgZ's (hpZ changes only the gathers).
TEST_P(QgzNodes, TwoNodesOfTwoWithHpz) {
  run_ranks(4, [h = GetParam()](const RankEnv& env) {
    nodes_of(env, 2, 4, h, R"(, "zero_hpz_partition_size": 2)");
  });
}
TEST_P(QgzNodes, NotWholeNodesTakesOneHop) {
  run_ranks(5, [h = GetParam()](const RankEnv& env) { nodes_of(env, 2, 4, h); });
}
INSTANTIATE_TEST_SUITE_P(Hosts, QgzNodes, ::testing::Values(Hosts::One, Hosts::PerNode),
                         [](const ::testing::TestParamInfo<Hosts>& i) {
                           return std::string(i.param == Hosts::One ? "AllOneHost" : "AHostPerNode");
                         });

// MiCS: quantized within each shard group, then the exact fp32 all-reduce
// across replicas; the average of two shard groups' results is within the
// larger of their bounds.
TEST(Qgz, MicsShardGroupsThenReplicaAverage) {
  run_ranks(4, [](const RankEnv& env) {
    const std::string cfg = qgz_config(8, 256, R"(, "mics_shard_size": 2)");
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const auto got = reduce(ctx, env.rank, kNumels);
    // The shard group {0,1} or {2,3}: position env.rank % 2 within it.
    const int pos = env.rank % 2;
    Expected e;
    for (int group = 0; group < 2; ++group) {
      // The grads of shard group `group` are those of world ranks 2g, 2g+1.
      std::vector<std::vector<float>> x;
      for (int m = 0; m < 2; ++m) x.push_back(block_of(2 * group + m, pos, kNumels, 2));
      const size_t count = x[0].size();
      if (group == 0) {
        e.exact.assign(count, 0.0);
        e.bound.assign(count, 0.0);
      }
      for (int m = 0; m < 2; ++m) {
        std::vector<uint8_t> codes(k::quant_code_bytes(count, {8, 256}));
        std::vector<float> scales(k::quant_blocks(count, {8, 256}));
        k::quantize(x[static_cast<size_t>(m)].data(), k::WorkDtype::F32, count, {8, 256}, codes.data(),
                    scales.data());
        for (size_t i = 0; i < count; ++i) {
          e.exact[i] += x[static_cast<size_t>(m)][i] / 4.0;
          const double sc = scales[i / 256];
          e.bound[i] += sc / 4 * (0.5 + 0x1p-16) + 8 * 0x1p-24 * (std::fabs(double{x[static_cast<size_t>(m)][i]}) + sc);
        }
      }
    }
    check(got, e, false, "MiCS 2 x 2");
    zs_context_destroy(ctx);
  });
}

// An inf in one rank's gradient poisons its quantization block on the
// owner (NaN in each of its elements), so an overflow check sees it; the
// other blocks stay finite.
TEST(Qgz, InfPoisonsItsBlockOnTheOwner) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(2, [](const RankEnv& env) {
    const std::string cfg = qgz_config(4, 256);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    int64_t numel = 2000;  // shards of 1000: blocks [0, 256), ... on rank 0
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "w";
    o.ndim = 1;
    o.shape = &numel;
    zs_param h = nullptr;
    ZS_ASSERT_OK(zs_param_register(&h, ctx, &o));
    std::vector<float> g(2000, 0.5f);
    if (env.rank == 1) g[300] = INFINITY;  // rank 0's shard, its second block
    ZS_ASSERT_OK(zs_grad_push(h, g.data(), ZS_FLOAT32, g.size() * 4));
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    float* data = nullptr;
    uint64_t n = 0;
    ZS_ASSERT_OK(zs_grad_shard_data(h, &data, &n));
    ASSERT_EQ(n, 1000u);
    for (uint64_t i = 0; i < n; ++i) {
      if (env.rank == 0 && i >= 256 && i < 512)
        EXPECT_TRUE(std::isnan(data[i])) << i;
      else
        EXPECT_EQ(data[i], 0.5f) << i;  // code 7 times scale 0.5 / 7 gives 0.5 back
    }
    zs_context_destroy(ctx);
  });
}

// Two runs of the same reduction give the same bits on every rank.
TEST(Qgz, BitwiseTheSameFromRunToRun) {
  char tmpl[] = "/tmp/zs_qgz_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  for (int run = 0; run < 2; ++run)
    run_ranks(5, [&](const RankEnv& env) {
      const std::string cfg = qgz_config(4, 256, R"(, "reduce_bucket_size": 5000)");
      zs_context ctx = zs::test::make_context(env, cfg.c_str());
      ASSERT_NE(ctx, nullptr);
      const auto got = reduce(ctx, env.rank, kNumels);
      std::ofstream(dir + "/" + std::to_string(run) + "_" + std::to_string(env.rank), std::ios::binary)
          .write(reinterpret_cast<const char*>(got.data()), static_cast<std::streamsize>(got.size() * 4));
      zs_context_destroy(ctx);
    });
  for (int r = 0; r < 5; ++r) {
    auto slurp = [&](int run) {
      std::ifstream f(dir + "/" + std::to_string(run) + "_" + std::to_string(r), std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    const std::string a = slurp(0), b = slurp(1);
    EXPECT_FALSE(a.empty()) << "rank " << r;
    EXPECT_EQ(a, b) << "rank " << r << " differs between runs";
    std::remove((dir + "/0_" + std::to_string(r)).c_str());
    std::remove((dir + "/1_" + std::to_string(r)).c_str());
  }
  rmdir(dir.c_str());
}

}  // namespace
