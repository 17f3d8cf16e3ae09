// Gradient shards without a zeroing pass, and the global norm taken as
// they are written (partition/grad_shard.h), on real ranks: accumulation
// over micro-steps (with and without a sync between them), a param that
// gets no gradient in a step after having one (it counts as zero, not as
// its old gradient), inf/NaN skipping a step (and an old NaN not skipping
// the next), clipping, odd sizes, 1/2/3 ranks, qgZ, MiCS.
//
// Every scenario runs twice on the same context: once as a trainer does,
// once reading every gradient shard (zs_grad_shard_data) before the step,
// which zeroes the shards that got no gradient and makes the step read the
// shards again for the norm, as before the fusion. The norms of the two
// runs must be the same bits; the first run is also held against a
// reference computed here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Odd sizes: padded shards on 2 and 3 ranks, a shard smaller than a
// vector, and one that the kernels split over threads (> 64K per shard).
const int64_t kSizes[] = {7, 1003, 200003};
constexpr int kParams = 3;

float init_value(int p, uint64_t i) { return std::sin(static_cast<float>(i * 3 + static_cast<uint64_t>(p))) * 0.5f; }
float grad_value(int step, int micro, int rank, int p, uint64_t i) {
  const auto k = static_cast<float>(i * 7 + static_cast<uint64_t>(step * 131 + micro * 17 + rank * 5 + p));
  return std::cos(k) * 0.1f;
}

struct StepPlan {
  int accum;                // micro-steps, each divided by it
  std::vector<int> pushed;  // params that get a gradient
  bool sync_after_first;    // zs_grad_sync after the first micro-step
  int bad_param, bad_micro; // on the last rank, one element of this is `bad`
  float bad;
  bool skipped;
};

const StepPlan kPlan[] = {
    {3, {0, 1, 2}, true, -1, -1, 0.0f, false},
    {2, {0, 2}, false, -1, -1, 0.0f, false},  // param 1 none: zero, not last step's
    {1, {0, 1}, false, 1, 0, NAN, true},      // a NaN skips the step everywhere
    {1, {0, 2}, false, -1, -1, 0.0f, false},  // param 1's NaN is old: no skip
    {2, {0, 1, 2}, true, 2, 1, INFINITY, true},  // an inf added into an accumulating shard
    {1, {1}, false, -1, -1, 0.0f, false},
    {3, {0, 1, 2}, false, -1, -1, 0.0f, false},
};
constexpr double kClip = 10.0;  // below the norm of the steps that push param 2

std::vector<float> micro_grad(const StepPlan& s, int step, int micro, int rank, int world, int p) {
  std::vector<float> g(static_cast<size_t>(kSizes[p]));
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(step, micro, rank, p, i);
  if (p == s.bad_param && micro == s.bad_micro && rank == world - 1) g[g.size() / 2] = s.bad;
  return g;
}

// The gradient the step should see: the mean over ranks of the sum of the
// micro-steps, each divided by accum.
std::vector<double> mean_grad(const StepPlan& s, int step, int world, int p) {
  std::vector<double> m(static_cast<size_t>(kSizes[p]), 0.0);
  for (int r = 0; r < world; ++r)
    for (int k = 0; k < s.accum; ++k)
      for (size_t i = 0; i < m.size(); ++i)
        m[i] += static_cast<double>(grad_value(step, k, r, p, i)) / s.accum / world;
  return m;
}

struct Model {
  zs_context ctx = nullptr;
  zs_param params[kParams] = {};
  zs_optimizer opt = nullptr;
  std::vector<float> expect[kParams];  // this rank's shard, as the reference updates it
  zs_param_info info[kParams];
};

void make_model(Model& m, const RankEnv& env, const std::string& config) {
  m.ctx = zs::test::make_context(env, config.c_str());
  ASSERT_NE(m.ctx, nullptr);
  for (int p = 0; p < kParams; ++p) {
    std::vector<float> init(static_cast<size_t>(kSizes[p]));
    for (size_t i = 0; i < init.size(); ++i) init[i] = init_value(p, i);
    const std::string name = "p" + std::to_string(p);
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = name.c_str();
    o.dtype = ZS_FLOAT32;
    o.ndim = 1;
    o.shape = &kSizes[p];
    o.init = ZS_INIT_FROM_ALL;
    o.data = init.data();
    o.data_bytes = init.size() * 4;
    ZS_ASSERT_OK(zs_param_register(&m.params[p], m.ctx, &o));
    m.info[p] = ZS_PARAM_INFO_INIT;
    ZS_ASSERT_OK(zs_param_get_info(m.params[p], &m.info[p]));
    m.expect[p].assign(init.begin() + static_cast<int64_t>(m.info[p].shard_offset),
                       init.begin() + static_cast<int64_t>(m.info[p].shard_offset + m.info[p].shard_valid));
  }
  // SGD with lr 1 and nothing else: a step subtracts exactly the
  // (clipped) gradient the engine made.
  ZS_ASSERT_OK(zs_optimizer_create(&m.opt, m.ctx, ZS_OPTIM_SGD));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 1.0;
  hp.weight_decay = 0.0;
  ZS_ASSERT_OK(zs_optimizer_add_group(m.opt, m.params, kParams, &hp, nullptr));
}

// Runs kPlan; read_back reads every gradient shard before each step.
// The steps' norms go to *norms. exact: the gradients are exact enough (no
// qgZ) to hold against the reference.
void run_plan(Model& m, const RankEnv& env, bool read_back, bool exact, std::vector<double>* norms) {
  for (int step = 0; step < static_cast<int>(std::size(kPlan)); ++step) {
    const StepPlan& s = kPlan[step];
    const std::string where = "step " + std::to_string(step) + (read_back ? " (read back)" : "");
    EXPECT_EQ(zs_grad_set_accumulation_steps(m.ctx, s.accum), ZS_OK) << zs_last_error();
    for (int k = 0; k < s.accum; ++k) {
      for (int p : s.pushed) {
        const auto g = micro_grad(s, step, k, env.rank, env.world, p);
        EXPECT_EQ(zs_grad_push(m.params[p], g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
      }
      if (k == 0 && s.sync_after_first) {
        EXPECT_EQ(zs_grad_sync(m.ctx), ZS_OK) << zs_last_error();
      }
    }
    std::vector<double> mean[kParams];
    double norm2 = 0.0;
    for (int p : s.pushed) {
      mean[p] = mean_grad(s, step, env.world, p);
      for (double x : mean[p]) norm2 += x * x;
    }
    if (read_back) {
      EXPECT_EQ(zs_grad_sync(m.ctx), ZS_OK) << zs_last_error();
      for (int p = 0; p < kParams; ++p) {
        float* g = nullptr;
        uint64_t n = 0;
        EXPECT_EQ(zs_grad_shard_data(m.params[p], &g, &n), ZS_OK) << zs_last_error();
        ASSERT_NE(g, nullptr);
        ASSERT_EQ(n, m.info[p].shard_numel);
        const bool pushed = !mean[p].empty();
        for (uint64_t i = 0; i < n; ++i) {
          const bool padding = i >= m.info[p].shard_valid;
          if (!pushed || padding) {
            ASSERT_EQ(g[i], 0.0f) << where << " param " << p << " element " << i
                                  << (pushed ? " (padding)" : " (no gradient this step)");
          } else if (exact && p != s.bad_param) {
            ASSERT_NEAR(g[i], mean[p][m.info[p].shard_offset + i], 1e-6) << where << " param " << p;
          }
        }
      }
    }
    zs_step_result r = ZS_STEP_RESULT_INIT;
    EXPECT_EQ(zs_optimizer_step(m.opt, &r), ZS_OK) << zs_last_error();
    EXPECT_EQ(r.skipped, s.skipped ? 1 : 0) << where;
    norms->push_back(r.grad_norm);
    if (s.skipped) continue;
    double coef = 1.0;
    if (exact) {
      EXPECT_NEAR(r.grad_norm, std::sqrt(norm2), 1e-5 * std::sqrt(norm2)) << where;
      coef = std::min(1.0, kClip / (r.grad_norm + 1e-6));
    }
    for (int p = 0; p < kParams; ++p) {
      void* data = nullptr;
      ZS_ASSERT_OK(zs_param_shard_data(m.params[p], &data, nullptr));
      const auto* x = static_cast<const float*>(data);
      auto& e = m.expect[p];
      for (size_t i = 0; i < e.size(); ++i) {
        if (!mean[p].empty()) e[i] -= static_cast<float>(coef * mean[p][m.info[p].shard_offset + i]);
        if (exact || mean[p].empty()) {
          ASSERT_NEAR(x[i], e[i], 1e-5) << where << " param " << p << " element " << i;
        }
        e[i] = x[i];  // qgZ: go on from the engine's values
      }
    }
  }
}

struct Case {
  int world;
  const char* name;
  std::string config;
  bool exact;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string with_clip(const std::string& zero) {
  return R"({"gradient_clipping": )" + std::to_string(kClip) + R"(, "zero_optimization": {)" + zero + "}}";
}

class GradFusion : public ::testing::TestWithParam<Case> {};

TEST_P(GradFusion, NormAndShardsAsIfZeroedAndReadAgain) {
  const Case c = GetParam();
  const zs::test::QuantizeWithinHost quantize_within_host;  // the qgZ cases quantize here too
  run_ranks(c.world, [c](const RankEnv& env) {
    Model m;
    make_model(m, env, c.config);
    if (::testing::Test::HasFatalFailure()) return;
    std::vector<double> fused, read;
    run_plan(m, env, false, c.exact, &fused);
    if (::testing::Test::HasFatalFailure()) return;
    run_plan(m, env, true, c.exact, &read);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(fused.size(), read.size());
    for (size_t i = 0; i < fused.size(); ++i)
      EXPECT_EQ(std::memcmp(&fused[i], &read[i], sizeof(double)), 0)
          << "step " << i << ": norm " << fused[i] << " as written, " << read[i] << " read again";
    zs_optimizer_destroy(m.opt);
    zs_context_destroy(m.ctx);
  }, 180);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, GradFusion,
    ::testing::Values(
        Case{1, "one_rank", with_clip(""), true},
        Case{2, "two_ranks", with_clip(""), true},
        Case{3, "three_ranks", with_clip(""), true},
        // Small buckets: a param's micro-steps land in several buckets of
        // one round, and buckets overlap the pushes.
        Case{3, "three_ranks_small_buckets",
             with_clip(R"("reduce_bucket_size": 3000, "overlap_comm": true)"), true},
        Case{2, "two_ranks_qgz", with_clip(R"("zero_quantized_gradients": true)"), false},
        Case{3, "three_ranks_qgz", with_clip(R"("zero_quantized_gradients": true)"), false},
        // Two shard groups of two: the replica all-reduce rewrites the shards.
        Case{4, "mics", with_clip(R"("mics_shard_size": 2)"), true}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace

// A step whose gradients are one small bucket of the world group reduces
// it in one exchange that also carries the optimizer's agreement check, and
// takes the norm from it on every rank (GradReducer::sync_fusing_locked):
// no all-reduce after the reduction. Each step runs twice from the same
// params: as a trainer does, then with zs_grad_sync before the step (the
// reduce-scatter, then the step's all-reduce). The norms, skips and
// updated params must be the same bits; where a rank doubts the fused norm
// (a param pushed twice into the bucket, a shard written through
// zs_grad_shard_data on one rank) every rank falls back to the all-reduce.
namespace {

const int64_t kTinySizes[] = {5, 77, 1001, 3};
constexpr int kTiny = 4;

struct TinyStep {
  int accum;
  std::vector<int> pushed;
  bool nan_on_last_rank;  // param 1, the last micro-step
  bool rank0_reads_param3;  // zs_grad_shard_data on rank 0 only, before the pushes
  bool fused;  // no all-reduce after the reduction
};

const TinyStep kTinyPlan[] = {
    {1, {0, 1, 2, 3}, false, false, true},
    {1, {0, 2}, false, false, true},
    {2, {0, 1, 2, 3}, false, false, false},  // each param twice in the bucket
    {1, {0, 1, 2, 3}, true, false, true},    // skipped on every rank
    {1, {0, 1, 2, 3}, false, true, false},   // rank 0's doubt, everyone's all-reduce
    {1, {2}, false, false, true},
};

std::vector<float> shard_of(zs_param p) {
  void* data = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(zs_param_shard_data(p, &data, &n), ZS_OK) << zs_last_error();
  const auto* x = static_cast<const float*>(data);
  return std::vector<float>(x, x + n);
}

void set_shard(zs_param p, const std::vector<float>& v) {
  void* data = nullptr;
  uint64_t n = 0;
  ASSERT_EQ(zs_param_shard_data(p, &data, &n), ZS_OK) << zs_last_error();
  ASSERT_EQ(n, v.size());
  std::memcpy(data, v.data(), v.size() * sizeof(float));
}

struct TinyOutcome {
  zs_step_result result = ZS_STEP_RESULT_INIT;
  zs_step_stats stats = ZS_STEP_STATS_INIT;
  std::vector<std::vector<float>> shards;
};

TinyOutcome tiny_step(zs_context ctx, zs_optimizer opt, zs_param* params, const RankEnv& env, int step,
                      bool sync_first) {
  const TinyStep& s = kTinyPlan[step];
  TinyOutcome out;
  EXPECT_EQ(zs_grad_set_accumulation_steps(ctx, s.accum), ZS_OK) << zs_last_error();
  if (s.rank0_reads_param3 && env.rank == 0) {
    float* g = nullptr;
    uint64_t n = 0;
    EXPECT_EQ(zs_grad_shard_data(params[3], &g, &n), ZS_OK) << zs_last_error();
  }
  for (int k = 0; k < s.accum; ++k)
    for (int p : s.pushed) {
      std::vector<float> g(static_cast<size_t>(kTinySizes[p]));
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(step, k, env.rank, p, i) * 40.0f;
      if (s.nan_on_last_rank && p == 1 && k == s.accum - 1 && env.rank == env.world - 1) g[3] = NAN;
      EXPECT_EQ(zs_grad_push(params[p], g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
    }
  if (sync_first) {
    EXPECT_EQ(zs_grad_sync(ctx), ZS_OK) << zs_last_error();
  }
  EXPECT_EQ(zs_optimizer_step(opt, &out.result), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_context_step_stats(ctx, &out.stats), ZS_OK) << zs_last_error();
  for (int p = 0; p < kTiny; ++p) out.shards.push_back(shard_of(params[p]));
  return out;
}

class GradFusionTiny : public ::testing::TestWithParam<int> {};

TEST_P(GradFusionTiny, OneExchangeAStepTheSameBitsAsReduceScatterAndAllReduce) {
  run_ranks(GetParam(), [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, with_clip("").c_str());
    ASSERT_NE(ctx, nullptr);
    zs_param params[kTiny] = {};
    for (int p = 0; p < kTiny; ++p) {
      std::vector<float> init(static_cast<size_t>(kTinySizes[p]));
      for (size_t i = 0; i < init.size(); ++i) init[i] = init_value(p, i);
      const std::string name = "tiny" + std::to_string(p);
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      o.name = name.c_str();
      o.dtype = ZS_FLOAT32;
      o.ndim = 1;
      o.shape = &kTinySizes[p];
      o.init = ZS_INIT_FROM_ALL;
      o.data = init.data();
      o.data_bytes = init.size() * 4;
      ZS_ASSERT_OK(zs_param_register(&params[p], ctx, &o));
    }
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = 1.0;
    hp.weight_decay = 0.0;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, params, kTiny, &hp, nullptr));
    bool clipped = false;
    for (int step = 0; step < static_cast<int>(std::size(kTinyPlan)); ++step) {
      const TinyStep& s = kTinyPlan[step];
      const std::string where = "step " + std::to_string(step);
      std::vector<std::vector<float>> before;
      for (int p = 0; p < kTiny; ++p) before.push_back(shard_of(params[p]));
      const TinyOutcome fused = tiny_step(ctx, opt, params, env, step, false);
      for (int p = 0; p < kTiny; ++p) set_shard(params[p], before[static_cast<size_t>(p)]);
      const TinyOutcome two = tiny_step(ctx, opt, params, env, step, true);
      if (::testing::Test::HasFailure()) return;
      EXPECT_EQ(fused.stats.reduce_scatters, 1u) << where;
      EXPECT_EQ(fused.stats.allreduce_bytes == 0, s.fused)
          << where << ": the fused route " << (s.fused ? "not " : "") << "taken (all-reduced "
          << fused.stats.allreduce_bytes << " bytes)";
      EXPECT_GT(two.stats.allreduce_bytes, 0u) << where;
      EXPECT_EQ(fused.result.skipped, s.nan_on_last_rank ? 1 : 0) << where;
      EXPECT_EQ(two.result.skipped, fused.result.skipped) << where;
      EXPECT_EQ(std::memcmp(&fused.result.grad_norm, &two.result.grad_norm, sizeof(double)), 0)
          << where << ": norm " << fused.result.grad_norm << " fused, " << two.result.grad_norm << " after a sync";
      clipped = clipped || (!fused.result.skipped && fused.result.grad_norm > kClip);
      for (int p = 0; p < kTiny; ++p)
        ASSERT_EQ(std::memcmp(fused.shards[static_cast<size_t>(p)].data(), two.shards[static_cast<size_t>(p)].data(),
                              two.shards[static_cast<size_t>(p)].size() * sizeof(float)),
                  0)
            << where << " param " << p << ": updated differently fused and after a sync";
    }
    EXPECT_TRUE(clipped) << "no step clipped: the plan's gradients are too small to check the clip";
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  }, 120);
}

INSTANTIATE_TEST_SUITE_P(Worlds, GradFusionTiny, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "_ranks";
                         });

}  // namespace
