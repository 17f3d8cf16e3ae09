// zs_grad_discard, torch's optimizer.zero_grad() between a backward and the
// step on real ranks: a GAN's shape, where the generator's loss reaches the
// discriminator's params and the discriminator's next step must not see
// those gradients. Two optimizers over w0 (SGD with momentum) and w1
// (AdamW): each iteration pushes both params' first gradients, steps w0's,
// discards w1's, pushes w1's second gradient and steps w1's. Against the
// same model that never pushed w1's first gradient, bit for bit, on 2 and
// 3 ranks with buckets small enough that the discarded gradient is in
// flight. A discard with nothing pushed is no collective (one rank calls
// it alone), and a param discarded and pushed nothing since is left alone
// by its step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;
using zs::test::heal::full_values;
using zs::test::heal::kNumel;

namespace {

struct Pair {  // w0 and w1 under an optimizer each
  zs_param w[2] = {nullptr, nullptr};
  zs_optimizer opt[2] = {nullptr, nullptr};
};

Pair build(zs_context ctx, const char* prefix) {
  Pair m;
  for (int i = 0; i < 2; ++i) {
    const std::string name = std::string(prefix) + ".w" + std::to_string(i);
    EXPECT_EQ(zs::test::heal::register_from_rank0(ctx, i, &kNumel[i], &m.w[i], name.c_str()), ZS_OK) << zs_last_error();
    EXPECT_EQ(zs_optimizer_create(&m.opt[i], ctx, i == 0 ? ZS_OPTIM_SGD : ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = i == 0 ? 0.05 : 0.01;
    hp.momentum = i == 0 ? 0.9 : 0.0;
    EXPECT_EQ(zs_optimizer_add_group(m.opt[i], &m.w[i], 1, &hp, nullptr), ZS_OK) << zs_last_error();
  }
  return m;
}

void destroy(Pair& m) {
  for (int i = 0; i < 2; ++i) {
    zs_optimizer_destroy(m.opt[i]);
    zs_param_destroy(m.w[i]);
  }
}

zs_status push(zs_param p, int rank, int step, int which, int i) {
  std::vector<float> g(static_cast<size_t>(kNumel[i]));
  for (size_t k = 0; k < g.size(); ++k)
    g[k] = std::cos(static_cast<float>(k * 7 + static_cast<size_t>(step * 13 + which * 29 + i * 5 + rank * 31))) * 0.1f;
  return zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * sizeof(float));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void discarded_between_backward_and_step(int ranks) {
  run_ranks(ranks, [](const RankEnv& env) {
    // 900-element buckets: w1's first gradient is still in flight (or in an
    // open bucket) when it is discarded.
    zs_context ctx = zs::test::make_context(env, R"({"zero_optimization": {"reduce_bucket_size": 900}})");
    ASSERT_NE(ctx, nullptr);
    Pair a = build(ctx, "discarding"), b = build(ctx, "reference");
    for (int step = 1; step <= 3; ++step) {
      // The discarding model: both params' first gradients (the generator's
      // loss through both), w0's step, w1's dropped, w1's second gradient.
      for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(push(a.w[i], env.rank, step, 1, i));
      ZS_ASSERT_OK(zs_optimizer_step(a.opt[0], nullptr));
      ZS_ASSERT_OK(zs_grad_discard(ctx, &a.w[1], 1));
      ZS_ASSERT_OK(push(a.w[1], env.rank, step, 2, 1));
      ZS_ASSERT_OK(zs_optimizer_step(a.opt[1], nullptr));
      // The reference never pushed w1's first gradient.
      ZS_ASSERT_OK(push(b.w[0], env.rank, step, 1, 0));
      ZS_ASSERT_OK(zs_optimizer_step(b.opt[0], nullptr));
      ZS_ASSERT_OK(push(b.w[1], env.rank, step, 2, 1));
      ZS_ASSERT_OK(zs_optimizer_step(b.opt[1], nullptr));
    }
    for (int i = 0; i < 2; ++i)
      EXPECT_TRUE(same_bits(full_values(ctx, a.w[i], kNumel[i]), full_values(ctx, b.w[i], kNumel[i])))
          << "w" << i << " on " << env.world << " ranks";

    // Nothing pushed since the steps: no collective, so one rank alone
    // returns (the others would otherwise wait in it; a later collective
    // would mismatch).
    if (env.rank == 0) ZS_ASSERT_OK(zs_grad_discard(ctx, a.w, 2));

    // A gradient pushed and discarded, none since: the step leaves w1 alone
    // (AdamW's decay would move it), as torch skips a param whose .grad is None.
    const std::vector<float> before = full_values(ctx, a.w[1], kNumel[1]);
    ZS_ASSERT_OK(push(a.w[1], env.rank, 4, 1, 1));
    ZS_ASSERT_OK(zs_grad_discard(ctx, &a.w[1], 1));
    ZS_ASSERT_OK(zs_optimizer_step(a.opt[1], nullptr));
    EXPECT_TRUE(same_bits(full_values(ctx, a.w[1], kNumel[1]), before)) << "a discarded param was stepped";

    zs_param bad = reinterpret_cast<zs_param>(uintptr_t{0xdead});
    EXPECT_EQ(zs_grad_discard(ctx, &bad, 1), ZS_ERR_INVALID_HANDLE);
    EXPECT_NE(std::string(zs_last_error()).find("params"), std::string::npos) << zs_last_error();
    EXPECT_EQ(zs_grad_discard(ctx, nullptr, 0), ZS_OK);  // an empty list: nothing to drop
    destroy(a);
    destroy(b);
    zs_context_destroy(ctx);
  });
}

}  // namespace

TEST(GradDiscard, DropsWhatWasPushedBeforeTheStepBitwiseOnTwoRanks) { discarded_between_backward_and_step(2); }
TEST(GradDiscard, DropsWhatWasPushedBeforeTheStepBitwiseOnThreeRanks) { discarded_between_backward_and_step(3); }
