// The engine's sharded optimizer against the scalar kernels run on the
// whole, unsharded param: every optimizer and param dtype, per-step lr,
// param groups, clipping, accumulation, and the fp16 loss scaler's skip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/convert.h"
#include "kernels/optim.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

constexpr int64_t kNumel = 1003;  // odd: padded shards on 2 and 4 ranks

float init_value(uint64_t i) { return std::sin(static_cast<float>(i)) * 0.5f; }
float grad_value(int step, uint64_t i) { return std::cos(static_cast<float>(i * 7 + static_cast<uint64_t>(step))) * 0.1f; }

size_t esize(zs_dtype t) { return t == ZS_FLOAT32 ? 4 : 2; }
zs::kernels::WorkDtype wdt(zs_dtype t) {
  return t == ZS_FLOAT32 ? zs::kernels::WorkDtype::F32
                         : (t == ZS_BFLOAT16 ? zs::kernels::WorkDtype::BF16 : zs::kernels::WorkDtype::F16);
}

std::vector<uint8_t> encode(const std::vector<float>& v, zs_dtype t) {
  std::vector<uint8_t> out(v.size() * esize(t));
  zs::kernels::cast_from_f32(v.data(), out.data(), wdt(t), v.size());
  return out;
}

zs_param make_param(zs_context ctx, zs_dtype t, const char* name) {
  std::vector<float> init(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) init[static_cast<size_t>(i)] = init_value(static_cast<uint64_t>(i));
  const auto bytes = encode(init, t);
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name;
  o.dtype = t;
  o.ndim = 1;
  o.shape = &kNumel;
  o.init = ZS_INIT_FROM_ALL;
  o.data = bytes.data();
  o.data_bytes = bytes.size();
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

std::vector<uint8_t> gathered(zs_context ctx, zs_param p, zs_dtype t) {
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  std::vector<uint8_t> out(static_cast<size_t>(kNumel) * esize(t));
  EXPECT_EQ(zs_param_copy_to(p, out.data(), out.size()), ZS_OK) << zs_last_error();
  zs_release(ctx, &p, 1);
  zs_gather_destroy(g);
  return out;
}

// The reference: the scalar kernels on the full param, one step per call.
struct Reference {
  std::vector<float> master, s1, s2;
  std::vector<uint8_t> working;
  Reference(zs_dtype t) : master(kNumel), s1(kNumel, 0.0f), s2(kNumel, 0.0f), working(static_cast<size_t>(kNumel) * esize(t)) {
    std::vector<float> init(kNumel);
    for (int64_t i = 0; i < kNumel; ++i) init[static_cast<size_t>(i)] = init_value(static_cast<uint64_t>(i));
    // A 16-bit param's master starts from its rounded value.
    const auto bytes = encode(init, t);
    zs::kernels::cast_to_f32(bytes.data(), wdt(t), master.data(), master.size());
  }
  void step(zs_optimizer_kind kind, const zs_optim_hparams& hp, const std::vector<float>& grad, int64_t n_step,
            float grad_scale, zs_dtype t) {
    if (kind == ZS_OPTIM_SGD) {
      zs::kernels::SgdHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.momentum),
                              static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                              hp.nesterov != 0, n_step == 1};
      zs::kernels::sgd_step_scalar(master.data(), s1.data(), grad.data(), master.size(), h, grad_scale,
                                   working.data(), wdt(t));
    } else {
      zs::kernels::AdamHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.beta1), static_cast<float>(hp.beta2),
                               static_cast<float>(hp.eps), static_cast<float>(hp.weight_decay),
                               kind == ZS_OPTIM_ADAMW, hp.bias_correction != 0, n_step};
      zs::kernels::adam_step_scalar(master.data(), s1.data(), s2.data(), grad.data(), master.size(), h,
                                    grad_scale, working.data(), wdt(t));
    }
    if (t == ZS_FLOAT32) std::memcpy(working.data(), master.data(), working.size());
  }
};

void push(zs_param p, int step) {
  std::vector<float> g(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) g[static_cast<size_t>(i)] = grad_value(step, static_cast<uint64_t>(i));
  ASSERT_EQ(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
}

std::vector<float> grad_of(int step) {
  std::vector<float> g(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) g[static_cast<size_t>(i)] = grad_value(step, static_cast<uint64_t>(i));
  return g;
}

// SGD with lr 1 and nothing else: a step subtracts exactly the gradient
// the engine made (averaged, clipped, unscaled), which is what tests read.
zs_optimizer unit_sgd(zs_context ctx, zs_param p) {
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 1.0;
  hp.weight_decay = 0.0;
  EXPECT_EQ(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr), ZS_OK) << zs_last_error();
  return opt;
}

struct Case {
  zs_optimizer_kind kind;
  zs_dtype dtype;
  bool nesterov;
};

class OptimizerCase : public ::testing::TestWithParam<Case> {};

// Identical gradients on every rank average to themselves exactly on 2
// ranks, so the sharded result must equal the reference bit for bit.
TEST_P(OptimizerCase, MatchesScalarReferenceOnTheWholeParam) {
  const Case c = GetParam();
  run_ranks(2, [c](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, c.dtype, "w");
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, c.kind));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = 0.05;
    hp.weight_decay = 0.1;
    if (c.kind == ZS_OPTIM_SGD) {
      hp.momentum = 0.9;
      hp.nesterov = c.nesterov ? 1 : 0;
    }
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
    Reference ref(c.dtype);
    for (int s = 0; s < 4; ++s) {
      hp.lr = 0.05 / (s + 1);  // a schedule, set per step
      ZS_ASSERT_OK(zs_optimizer_set_lr(opt, -1, hp.lr));
      push(p, s);
      zs_step_result r = ZS_STEP_RESULT_INIT;
      ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
      EXPECT_EQ(r.skipped, 0);
      EXPECT_EQ(r.step, s + 1);
      ref.step(c.kind, hp, grad_of(s), s + 1, 1.0f, c.dtype);
      const auto got = gathered(ctx, p, c.dtype);
      ASSERT_EQ(got, ref.working) << "step " << s;
    }
    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    const uint64_t shard = (kNumel + 1) / 2;
    const uint64_t states = c.kind == ZS_OPTIM_SGD ? 1 : 2;
    EXPECT_EQ(m.grad_bytes, shard * 4);
    EXPECT_EQ(m.optimizer_bytes, shard * 4 * (states + (c.dtype == ZS_FLOAT32 ? 0 : 1)));
    zs_optimizer_destroy(opt);
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.optimizer_bytes, 0u);
    zs_context_destroy(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(
    All, OptimizerCase,
    ::testing::Values(Case{ZS_OPTIM_ADAMW, ZS_FLOAT32, false}, Case{ZS_OPTIM_ADAMW, ZS_BFLOAT16, false},
                      Case{ZS_OPTIM_ADAMW, ZS_FLOAT16, false}, Case{ZS_OPTIM_ADAM, ZS_FLOAT32, false},
                      Case{ZS_OPTIM_ADAM, ZS_BFLOAT16, false}, Case{ZS_OPTIM_SGD, ZS_FLOAT32, false},
                      Case{ZS_OPTIM_SGD, ZS_FLOAT32, true}, Case{ZS_OPTIM_SGD, ZS_FLOAT16, true}));

// torch.optim.SGD makes its momentum buffer at the first step that uses
// momentum, from that step's gradient (dampening not applied); so must we
// when set_hparams switches momentum on after the group was made.
TEST(Optimizer, SgdMomentumSwitchedOnLaterStartsItsBufferThen) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, ZS_FLOAT32, "w");
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = 0.05;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.optimizer_bytes, 0u);  // fp32 without momentum: no state
    Reference ref(ZS_FLOAT32);
    for (int s = 0; s < 5; ++s) {
      if (s == 2) {
        hp.momentum = 0.9;
        hp.dampening = 0.5;  // must not touch the step that starts the buffer
        ZS_ASSERT_OK(zs_optimizer_set_hparams(opt, -1, &hp));
      }
      push(p, s);
      ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
      // The reference starts its buffer at step 3, as torch would.
      ref.step(ZS_OPTIM_SGD, hp, grad_of(s), s == 2 ? 1 : s + 1, 1.0f, ZS_FLOAT32);
      ASSERT_EQ(gathered(ctx, p, ZS_FLOAT32), ref.working) << "step " << s;
    }
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.optimizer_bytes, (kNumel + 1) / 2 * 4u);
    zs_optimizer_destroy(opt);
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.optimizer_bytes, 0u);
    zs_context_destroy(ctx);
  });
}

TEST(Optimizer, ParamGroupsKeepTheirOwnHyperParameters) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_param decayed = make_param(ctx, ZS_FLOAT32, "w"), plain = make_param(ctx, ZS_FLOAT32, "bias");
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = 0.1;
    hp.weight_decay = 0.5;
    int g0 = -1, g1 = -1;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &decayed, 1, &hp, &g0));
    hp.weight_decay = 0.0;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &plain, 1, &hp, &g1));
    EXPECT_EQ(g0, 0);
    EXPECT_EQ(g1, 1);
    EXPECT_EQ(zs_optimizer_add_group(opt, &plain, 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("already in group 1"), std::string::npos) << zs_last_error();
    push(decayed, 0);
    push(plain, 0);
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    const auto w = gathered(ctx, decayed, ZS_FLOAT32), b = gathered(ctx, plain, ZS_FLOAT32);
    for (uint64_t i = 0; i < 10; ++i) {
      float wi, bi;
      std::memcpy(&wi, &w[i * 4], 4);
      std::memcpy(&bi, &b[i * 4], 4);
      const float g = grad_value(0, i), x = init_value(i);
      EXPECT_FLOAT_EQ(bi, x - 0.1f * g);
      EXPECT_FLOAT_EQ(wi, x - 0.1f * (g + 0.5f * x));
    }
    EXPECT_EQ(zs_optimizer_set_lr(opt, 5, 0.1), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("optimizer group 5 does not exist"), std::string::npos);
    EXPECT_EQ(zs_optimizer_set_lr(opt, 0, -1.0), ZS_ERR_INVALID_ARGUMENT);
    zs_context_destroy(ctx);
  });
}

TEST(Optimizer, ClippingScalesToTheGlobalNorm) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"gradient_clipping": 0.25})");
    zs_param p = make_param(ctx, ZS_FLOAT32, "w");
    zs_optimizer opt = unit_sgd(ctx, p);
    ASSERT_NE(opt, nullptr);
    push(p, 0);
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
    double norm = 0.0;
    for (float g : grad_of(0)) norm += static_cast<double>(g) * g;
    norm = std::sqrt(norm);
    EXPECT_NEAR(r.grad_norm, norm, 1e-5 * norm);
    ASSERT_GT(norm, 0.25);
    const float coef = static_cast<float>(0.25 / (r.grad_norm + 1e-6));
    const auto w = gathered(ctx, p, ZS_FLOAT32);
    for (uint64_t i = 0; i < 20; ++i) {
      float wi;
      std::memcpy(&wi, &w[i * 4], 4);
      EXPECT_NEAR(wi, init_value(i) - grad_value(0, i) * coef, 1e-6);
    }
    zs_context_destroy(ctx);
  });
}

TEST(Optimizer, AccumulationAveragesMicroSteps) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_param p = make_param(ctx, ZS_FLOAT32, "w");
    ZS_ASSERT_OK(zs_grad_set_accumulation_steps(ctx, 2));
    EXPECT_EQ(zs_grad_set_accumulation_steps(ctx, 0), ZS_ERR_INVALID_ARGUMENT);
    zs_optimizer opt = unit_sgd(ctx, p);
    ASSERT_NE(opt, nullptr);
    push(p, 0);
    push(p, 1);
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    const auto w = gathered(ctx, p, ZS_FLOAT32);
    for (uint64_t i = 0; i < 20; ++i) {
      float wi;
      std::memcpy(&wi, &w[i * 4], 4);
      EXPECT_NEAR(wi, init_value(i) - 0.5f * (grad_value(0, i) + grad_value(1, i)), 1e-6);
    }
    // Wrong gradient sizes are refused before anything is bucketed.
    std::vector<float> g(10);
    EXPECT_EQ(zs_grad_push(p, g.data(), ZS_FLOAT32, 40), ZS_ERR_BUFFER_SIZE);
    EXPECT_NE(std::string(zs_last_error()).find("grad_bytes is 40, expected 4012"), std::string::npos)
        << zs_last_error();
    zs_context_destroy(ctx);
  });
}

// fp16: an inf on one rank skips the step everywhere and backs the scale
// off; a clean step then unscales by the new scale.
TEST(Optimizer, Fp16OverflowSkipsTheStepOnEveryRank) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, R"({"fp16": {"enabled": true, "initial_scale_power": 4, "hysteresis": 1}})");
    zs_param p = make_param(ctx, ZS_FLOAT16, "w");
    zs_optimizer opt = unit_sgd(ctx, p);
    ASSERT_NE(opt, nullptr);
    double scale = 0.0;
    ZS_ASSERT_OK(zs_optimizer_loss_scale(opt, &scale));
    EXPECT_EQ(scale, 16.0);
    const auto before = gathered(ctx, p, ZS_FLOAT16);
    std::vector<float> g = grad_of(0);
    if (env.rank == 1) g[17] = INFINITY;
    ASSERT_EQ(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK);
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
    EXPECT_EQ(r.skipped, 1);
    EXPECT_EQ(r.loss_scale, 8.0);
    EXPECT_EQ(r.step, 0);
    EXPECT_EQ(gathered(ctx, p, ZS_FLOAT16), before) << "a skipped step changed the param";
    // Clean: the pushed gradient carries the scale, the step removes it.
    std::vector<float> scaled = grad_of(1);
    for (auto& x : scaled) x *= 8.0f;
    ASSERT_EQ(zs_grad_push(p, scaled.data(), ZS_FLOAT32, scaled.size() * 4), ZS_OK);
    ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
    EXPECT_EQ(r.skipped, 0);
    const auto after = gathered(ctx, p, ZS_FLOAT16);
    for (uint64_t i = 0; i < 20; ++i) {
      uint16_t h;
      std::memcpy(&h, &after[i * 2], 2);
      uint16_t h0;
      std::memcpy(&h0, &before[i * 2], 2);
      const float expect = zs::kernels::fp16_to_float(h0) - grad_value(1, i);
      EXPECT_NEAR(zs::kernels::fp16_to_float(h), expect, 1e-3);
    }
    zs_context_destroy(ctx);
  });
}

// fp16: an overflow with the scale already at min_loss_scale and no
// hysteresis left cannot be absorbed: as DeepSpeed ends the run there, the
// step fails on every rank alike, naming the floor, and the params and the
// scale stay as they were (the step was skipped).
TEST(Optimizer, Fp16OverflowAtTheMinimumScaleFailsTheStepOnEveryRank) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, R"({"fp16": {"enabled": true, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 2}})");
    zs_param p = make_param(ctx, ZS_FLOAT16, "w");
    zs_optimizer opt = unit_sgd(ctx, p);
    ASSERT_NE(opt, nullptr);
    const auto before = gathered(ctx, p, ZS_FLOAT16);
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::vector<float> g = grad_of(0);
      if (env.rank == 1) g[3] = INFINITY;
      ASSERT_EQ(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK);
      zs_step_result r = ZS_STEP_RESULT_INIT;
      const zs_status st = zs_optimizer_step(opt, &r);
      if (attempt == 0) {  // 4 -> 2: the floor
        ZS_ASSERT_OK(st);
        EXPECT_EQ(r.loss_scale, 2.0);
        continue;
      }
      EXPECT_EQ(st, ZS_ERR_INVALID_STATE);
      EXPECT_NE(std::string(zs_last_error()).find("already at min_loss_scale (2)"), std::string::npos)
          << zs_last_error();
    }
    double scale = 0.0;
    ZS_ASSERT_OK(zs_optimizer_loss_scale(opt, &scale));
    EXPECT_EQ(scale, 2.0);
    EXPECT_EQ(gathered(ctx, p, ZS_FLOAT16), before) << "a skipped step changed the param";
    zs_context_destroy(ctx);
  });
}

}  // namespace
