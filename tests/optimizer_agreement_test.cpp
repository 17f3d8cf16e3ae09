// Every step checks that the ranks' optimizers agree (kind, groups,
// hyper-parameters): an lr set on one rank only is an error on every rank
// naming both values, nothing is updated, and once fixed the step runs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

TEST(OptimizerAgreement, AnLrSetOnOneRankIsNamedAndNothingMoves) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
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
