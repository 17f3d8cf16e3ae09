// Every step checks that the ranks' optimizers agree (kind, groups,
// hyper-parameters): an lr set on one rank only is an error on every rank
// naming both values, nothing is updated, and once fixed the step runs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "impl/optim/agreement.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Ranks with an lr set on rank 1 only: every rank's step fails naming it and
// moves nothing; once rank 1 sets it back, the step runs. `config`: the
// context's (MiCS puts the gradient norm on shard groups, after the
// agreement check's world all-reduce).
void lr_on_one_rank_is_named(int ranks, const char* config) {
  run_ranks(ranks, [config](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config);
    const int64_t shape[1] = {40};
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "w";
    o.ndim = 1;
    o.shape = shape;
    o.init = ZS_INIT_NORMAL;
    o.seed = 3;
    zs_param w = nullptr;
    ZS_ASSERT_OK(zs_param_register(&w, ctx, &o));
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = 0.001;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &w, 1, &hp, nullptr));
    std::vector<float> g(40, 0.5f);
    ZS_ASSERT_OK(zs_grad_push(w, g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
    if (env.rank == 1) ZS_ASSERT_OK(zs_optimizer_set_lr(opt, 0, 0.002));
    float* shard = nullptr;
    uint64_t n = 0;
    ZS_ASSERT_OK(zs_param_shard_data(w, reinterpret_cast<void**>(&shard), &n));
    const std::vector<float> before(shard, shard + n);
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ASSERT_EQ(zs_optimizer_step(opt, &r), ZS_ERR_INVALID_ARGUMENT);
    const std::string message = zs_last_error();
    EXPECT_NE(message.find("the ranks' optimizers differ"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 1 has g0.lr=0.002 where rank 0 has g0.lr=0.001"), std::string::npos)
        << message;
    EXPECT_EQ(message.find("rank 2"), std::string::npos) << message;
    EXPECT_EQ(std::vector<float>(shard, shard + n), before) << "a refused step changed the shard";
    if (env.rank == 1) ZS_ASSERT_OK(zs_optimizer_set_lr(opt, 0, 0.001));
    ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
    EXPECT_NE(std::vector<float>(shard, shard + n), before);
    ZS_ASSERT_OK(zs_optimizer_destroy(opt));
    ZS_ASSERT_OK(zs_param_destroy(w));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}

}  // namespace

TEST(OptimizerAgreement, AnLrSetOnOneRankIsNamedAndNothingMoves) { lr_on_one_rank_is_named(3, nullptr); }

TEST(OptimizerAgreement, AnLrSetOnOneRankIsNamedUnderMics) {
  lr_on_one_rank_is_named(4, R"({"zero_optimization": {"mics_shard_size": 2}})");
}

// The check folded into the gradient norm's Sum: equal sums are not enough
// (nibbles 1 and 3 average to 2), the sums of squares tell them apart, and
// every rank gets the same verdict.
TEST(OptimizerAgreement, FusedCheckNeedsEveryRankEqual) {
  using zs::kAgreementFloats;
  std::vector<float> a(kAgreementFloats), b(kAgreementFloats), sums(kAgreementFloats);
  zs::agreement_floats({"kind=adamw", "g0.lr=0.001"}, a.data());
  zs::agreement_floats({"kind=adamw", "g0.lr=0.002"}, b.data());
  for (size_t i = 0; i < kAgreementFloats; ++i) sums[i] = a[i] + a[i] + a[i];
  EXPECT_TRUE(zs::agreement_holds(sums.data(), a.data(), 3));
  for (size_t i = 0; i < kAgreementFloats; ++i) sums[i] = a[i] + a[i] + b[i];
  EXPECT_FALSE(zs::agreement_holds(sums.data(), a.data(), 3));
  EXPECT_FALSE(zs::agreement_holds(sums.data(), b.data(), 3));
  std::vector<float> one(kAgreementFloats, 0.0f), two(kAgreementFloats, 0.0f), three(kAgreementFloats, 0.0f);
  one[0] = 1, one[16] = 1, two[0] = 2, two[16] = 4, three[0] = 3, three[16] = 9;
  for (size_t i = 0; i < kAgreementFloats; ++i) sums[i] = one[i] + two[i] + three[i];
  EXPECT_EQ(sums[0], 3 * two[0]) << "the means agree";
  EXPECT_FALSE(zs::agreement_holds(sums.data(), two.data(), 3));
  EXPECT_FALSE(zs::agreement_fusable(1));
  EXPECT_TRUE(zs::agreement_fusable(2));
  EXPECT_TRUE(zs::agreement_fusable(65536));
  EXPECT_FALSE(zs::agreement_fusable(1 << 17)) << "the sums would no longer be exact";
}
