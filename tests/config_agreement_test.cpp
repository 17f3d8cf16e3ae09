// Ranks started with different configs fail at create, every one of them,
// with each differing key and both values named, instead of training on
// with silently different numbers.
#include <gtest/gtest.h>

#include <string>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

TEST(ConfigAgreement, DifferingKeysAreNamedOnEveryRank) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string config =
        env.rank == 1   ? R"({"zero_optimization": {"reduce_bucket_size": 100}})"
        : env.rank == 2 ? R"({"gradient_clipping": 1.0, "fp16": {"enabled": true}})"
                        : R"({})";
    zs_context_options o = zs::test::rank_options(env, config.c_str());
    zs_context ctx = nullptr;
    ASSERT_EQ(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG) << zs_last_error();
    EXPECT_EQ(ctx, nullptr);
    const std::string message = zs_last_error();
    for (const char* part :
         {"the ranks' effective configs differ",
          "rank 1 has zero_optimization.reduce_bucket_size = 100 where rank 0 has 20000000",
          "rank 2 has ", "fp16.enabled = true where rank 0 has false",
          "gradient_clipping = 1.0 where rank 0 has 0.0"})
      EXPECT_NE(message.find(part), std::string::npos) << "lacks '" << part << "': " << message;
  });
}

// The same config written differently (aliases, "auto", 5e8 for 500000000)
// is the same effective config; a per-rank device is allowed.
TEST(ConfigAgreement, SpellingsOfOneConfigAgree) {
  run_ranks(2, [](const RankEnv& env) {
    const std::string config =
        env.rank == 0
            ? R"({"zero_optimization": {"stage3_prefetch_bucket_size": 5e7, "reduce_bucket_size": "auto"}})"
            : R"({"device": "cpu", "zero_optimization": {"prefetch_bucket_size": 50000000}})";
    zs_context ctx = zs::test::make_context(env, config.c_str());
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}
