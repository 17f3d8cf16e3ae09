// The dtype gradients cross the wire in (grad/reducer.h,
// gradient_wire_dtype): communication_data_type, else bf16 under
// bf16.enabled and fp16 under fp16.enabled (DeepSpeed's default), else
// fp32. On 1, 2 and 3 real ranks, with odd sizes (padded shards, a shard
// smaller than a vector, a million-element param split unevenly and larger
// than a bucket, a zero-size param, and one the fp32 wire reduces on its
// direct route) and accumulation over two micro-steps (a sync after each):
// the 16-bit wire moves 2 bytes per reduced element, half the
// reduce-scatter bytes of the fp32 one; its shards are within 16-bit
// rounding of the exact mean and not equal to the fp32 wire's (which is
// exact); communication_data_type "fp32" under bf16.enabled / fp16.enabled
// gives, bit for bit, the shards of a config with neither (the fp32 wire of
// before); and an overflow on one rank still skips the step under fp16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/elementwise.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// 120000: a multiple of 2 and 3 and over a quarter of the bucket, so the
// fp32 wire reduces it alone (direct_route); the 16-bit wire buckets it.
const int64_t kSizes[] = {7, 1003, 1000003, 0, 120000};
constexpr int kParams = 5;
constexpr int kAccum = 2;

float grad_value(int micro, int rank, int p, uint64_t i) {
  return std::cos(static_cast<float>(i * 7 + static_cast<uint64_t>(micro * 17 + rank * 5 + p))) * 0.1f;
}

uint16_t to16(float x, zs_dtype t) {
  return t == ZS_BFLOAT16 ? zs::kernels::float_to_bf16(x) : zs::kernels::float_to_fp16(x);
}
float from16(uint16_t h, zs_dtype t) {
  return t == ZS_BFLOAT16 ? zs::kernels::bf16_to_float(h) : zs::kernels::fp16_to_float(h);
}

struct Result {
  std::vector<std::vector<float>> shards;  // this rank's gradient shards
  uint64_t reduce_scatter_bytes = 0;
  int skipped = -1;
};

// Pushes kAccum micro-steps of 16-bit gradients of dtype t (bad: an inf in
// the last rank's first gradient), syncs, reads the shards, steps.
Result run(const RankEnv& env, const std::string& config, zs_dtype t, bool bad = false) {
  Result out;
  zs_context ctx = zs::test::make_context(env, config.c_str());
  EXPECT_NE(ctx, nullptr);
  if (ctx == nullptr) return out;
  zs_param params[kParams] = {};
  for (int p = 0; p < kParams; ++p) {
    std::vector<uint16_t> init(static_cast<size_t>(kSizes[p]), to16(0.25f, t));
    const std::string name = "p" + std::to_string(p);
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = name.c_str();
    o.dtype = t;
    o.ndim = 1;
    o.shape = &kSizes[p];
    o.init = ZS_INIT_FROM_ALL;
    o.data = init.data();
    o.data_bytes = init.size() * 2;
    EXPECT_EQ(zs_param_register(&params[p], ctx, &o), ZS_OK) << zs_last_error();
  }
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.weight_decay = 0.0;
  EXPECT_EQ(zs_optimizer_add_group(opt, params, kParams, &hp, nullptr), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_grad_set_accumulation_steps(ctx, kAccum), ZS_OK) << zs_last_error();
  for (int k = 0; k < kAccum; ++k) {
    for (int p = 0; p < kParams; ++p) {
      std::vector<uint16_t> g(static_cast<size_t>(kSizes[p]));
      for (size_t i = 0; i < g.size(); ++i) g[i] = to16(grad_value(k, env.rank, p, i), t);
      if (bad && k == 0 && p == 1 && env.rank == env.world - 1) g[3] = to16(INFINITY, t);
      EXPECT_EQ(zs_grad_push(params[p], g.data(), t, g.size() * 2), ZS_OK) << zs_last_error();
    }
    // The end of a micro-step's backward: the second one adds to the shards.
    EXPECT_EQ(zs_grad_sync(ctx), ZS_OK) << zs_last_error();
  }
  for (int p = 0; p < kParams; ++p) {
    float* data = nullptr;
    uint64_t n = 0;
    EXPECT_EQ(zs_grad_shard_data(params[p], &data, &n), ZS_OK) << zs_last_error();
    out.shards.emplace_back(data, data + n);
  }
  zs_fetch_stats s = ZS_FETCH_STATS_INIT;
  EXPECT_EQ(zs_context_fetch_stats(ctx, &s), ZS_OK) << zs_last_error();
  out.reduce_scatter_bytes = s.reduce_scatter_bytes_sent;
  zs_step_result r = ZS_STEP_RESULT_INIT;
  EXPECT_EQ(zs_optimizer_step(opt, &r), ZS_OK) << zs_last_error();
  out.skipped = r.skipped;
  zs_optimizer_destroy(opt);
  zs_context_destroy(ctx);
  return out;
}

// The exact mean over ranks of the micro-steps' 16-bit gradients, each
// divided by kAccum, at this rank's shard positions.
double expected(const RankEnv& env, zs_dtype t, int p, uint64_t at) {
  double m = 0.0;
  for (int r = 0; r < env.world; ++r)
    for (int k = 0; k < kAccum; ++k) m += from16(to16(grad_value(k, r, p, at), t), t);
  return m / kAccum / env.world;
}

class GradWireDtype : public ::testing::TestWithParam<int> {};

TEST_P(GradWireDtype, SixteenBitWireHalvesTheBytesWithin16BitRounding) {
  // A store port per context: contexts made one after another on one port
  // could meet the previous one's store.
  std::vector<int> ports;
  for (int i = 0; i < 6; ++i) ports.push_back(zs::test::free_port());
  run_ranks(GetParam(), [ports](const RankEnv& env) {
    size_t next = 0;
    auto on_port = [&] { RankEnv e = env; e.port = ports[next++]; return e; };
    const std::string zero = R"("zero_optimization": {"reduce_bucket_size": 60000})";
    for (zs_dtype t : {ZS_BFLOAT16, ZS_FLOAT16}) {
      const std::string section = t == ZS_BFLOAT16 ? "bf16" : "fp16";
      // A static fp16 loss scale of 1: the gradients pushed are the gradients.
      const std::string on = t == ZS_BFLOAT16 ? R"({"bf16": {"enabled": true}, )" + zero
                                              : R"({"fp16": {"enabled": true, "loss_scale": 1}, )" + zero;
      const Result narrow = run(on_port(), on + "}", t);
      const Result wide = run(on_port(), on + R"(, "communication_data_type": "fp32"})", t);
      const Result before = run(on_port(), "{" + zero + "}", t);  // neither bf16 nor fp16 enabled
      if (::testing::Test::HasFailure()) return;
      // Every rank sends (world - 1) blocks of every reduced shard element,
      // once per micro-step.
      uint64_t elements = 0;
      for (const auto& shard : narrow.shards) elements += shard.size();
      const uint64_t sent = static_cast<uint64_t>(env.world - 1) * kAccum * elements;
      EXPECT_EQ(narrow.reduce_scatter_bytes, 2 * sent) << section;
      EXPECT_EQ(wide.reduce_scatter_bytes, 4 * sent) << section;
      EXPECT_EQ(before.reduce_scatter_bytes, 4 * sent) << section;
      if (env.rank == 0)
        std::printf("%d ranks, %s: reduce-scatter bytes sent per rank per step: %llu on the %s wire, "
                    "%llu on the fp32 wire\n",
                    env.world, section.c_str(), static_cast<unsigned long long>(narrow.reduce_scatter_bytes),
                    section.c_str(), static_cast<unsigned long long>(wide.reduce_scatter_bytes));
      // A few roundings of 8 / 11 bits of partial sums of terms up to 0.1
      // in size (the mean may be far smaller: the terms cancel).
      const double tol = (t == ZS_BFLOAT16 ? 1.0 / 64 : 1.0 / 512) * 0.1;
      bool differs = false;
      for (int p = 0; p < kParams; ++p) {
        const auto& a = narrow.shards[static_cast<size_t>(p)];
        const auto& b = wide.shards[static_cast<size_t>(p)];
        ASSERT_EQ(a.size(), b.size());
        ASSERT_EQ(b.size(), before.shards[static_cast<size_t>(p)].size());
        ASSERT_TRUE(b.empty() || std::memcmp(b.data(), before.shards[static_cast<size_t>(p)].data(),
                                             b.size() * sizeof(float)) == 0)
            << section << ": communication_data_type fp32 changed param " << p << "'s shard";
        const uint64_t shard = a.size();
        for (uint64_t i = 0; i < shard; ++i) {
          const uint64_t at = static_cast<uint64_t>(env.rank) * shard + i;
          const double want = at < static_cast<uint64_t>(kSizes[p]) ? expected(env, t, p, at) : 0.0;
          ASSERT_NEAR(b[i], want, 1e-6) << section << " fp32 wire, param " << p << " element " << i;
          ASSERT_NEAR(a[i], want, tol) << section << " param " << p << " element " << i;
          differs = differs || a[i] != b[i];
        }
      }
      // One rank reduces nothing; its buckets' rounding (a halving) is exact.
      if (env.world > 1) {
        EXPECT_TRUE(differs) << section << ": the 16-bit wire gave the fp32 wire's shards";
      }
    }
  });
}

TEST_P(GradWireDtype, AnOverflowOnOneRankStillSkipsTheStepOverAnFp16Wire) {
  // A store port per context, as above.
  const std::vector<int> ports = {zs::test::free_port(), zs::test::free_port()};
  run_ranks(GetParam(), [ports](const RankEnv& env) {
    const char* config = R"({"fp16": {"enabled": true, "initial_scale_power": 4}})";
    RankEnv e = env;
    e.port = ports[0];
    const Result bad = run(e, config, ZS_FLOAT16, true);
    EXPECT_EQ(bad.skipped, 1);
    e.port = ports[1];
    const Result good = run(e, config, ZS_FLOAT16, false);  // the dynamic scaler steps
    EXPECT_EQ(good.skipped, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GradWireDtype, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "_ranks";
                         });

}  // namespace
