// The engine's multi-tensor step (Optimizer::step gathers the fp32-master
// Adam/AdamW/SGD updates of every param and runs them in one pass,
// ops::adam_step_many / sgd_step_many) against the scalar kernels run on
// each whole, unsharded param one at a time: many params of odd sizes
// (some under, some over the kernels' parallel grain), fp32 and bf16,
// two groups with their own hyper-parameters, and params that miss a
// step's gradient, so that their step counts (Adam's bias correction,
// SGD's first step) differ within one pass; and bf16 params whose shards
// are their masters (bf16_master_weights_and_grads). Bit for bit, on 1 and
// 2 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/optim.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

const int64_t kSizes[] = {1, 2, 63, 1003, 4099, 40001, 70003, 5};
constexpr size_t kCount = sizeof(kSizes) / sizeof(kSizes[0]);

zs_dtype dtype_of(size_t i) { return i % 3 == 1 ? ZS_BFLOAT16 : ZS_FLOAT32; }
size_t esize(zs_dtype t) { return t == ZS_FLOAT32 ? 4 : 2; }
zs::kernels::WorkDtype wdt(zs_dtype t) {
  return t == ZS_FLOAT32 ? zs::kernels::WorkDtype::F32 : zs::kernels::WorkDtype::BF16;
}

float init_value(size_t p, uint64_t i) { return std::sin(static_cast<float>(i) + 0.7f * static_cast<float>(p)) * 0.5f; }
// Exact in bf16, so that a bf16 gradient wire (bf16 configs) and the
// average of two ranks' equal gradients carry them unchanged.
float grad_value(size_t p, int step, uint64_t i) {
  const float g = std::cos(static_cast<float>(i * 7 + static_cast<uint64_t>(step) + 13 * p)) * 0.1f;
  return zs::kernels::bf16_to_float(zs::kernels::float_to_bf16(g));
}

std::vector<float> values(size_t p, int step, bool grad) {
  std::vector<float> v(static_cast<size_t>(kSizes[p]));
  for (size_t i = 0; i < v.size(); ++i) v[i] = grad ? grad_value(p, step, i) : init_value(p, i);
  return v;
}

std::vector<uint8_t> encode(const std::vector<float>& v, zs_dtype t) {
  std::vector<uint8_t> out(v.size() * esize(t));
  zs::kernels::cast_from_f32(v.data(), out.data(), wdt(t), v.size());
  return out;
}

// Params 3 and 6 get no gradient on step 0, param 5 none on step 2: their
// step counts lag the others' from then on.
bool has_grad(size_t p, int step) { return !((p == 3 || p == 6) && step == 0) && !(p == 5 && step == 2); }

// The scalar kernels on one whole param; with bf16 masters
// (bf16.bf16_master_weights_and_grads) a bf16 param's master is its
// rounded value after every step.
struct Reference {
  zs_dtype t;
  bool master16 = false;
  std::vector<float> master, s1, s2;
  std::vector<uint8_t> working;
  int64_t steps = 0;
  Reference(size_t p, bool bf16_masters) : t(dtype_of(p)), master16(bf16_masters && t == ZS_BFLOAT16) {
    const size_t n = static_cast<size_t>(kSizes[p]);
    master.resize(n);
    s1.assign(n, 0.0f);
    s2.assign(n, 0.0f);
    working = encode(values(p, 0, false), t);
    zs::kernels::cast_to_f32(working.data(), wdt(t), master.data(), n);  // a 16-bit master starts rounded
  }
  void step(zs_optimizer_kind kind, const zs_optim_hparams& hp, const std::vector<float>& grad) {
    ++steps;
    if (kind == ZS_OPTIM_SGD) {
      const zs::kernels::SgdHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.momentum),
                                    static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                                    hp.nesterov != 0, steps == 1};
      zs::kernels::sgd_step_scalar(master.data(), s1.data(), grad.data(), master.size(), h, 1.0f,
                                   working.data(), wdt(t));
    } else {
      const zs::kernels::AdamHyper h{static_cast<float>(hp.lr), static_cast<float>(hp.beta1),
                                     static_cast<float>(hp.beta2), static_cast<float>(hp.eps),
                                     static_cast<float>(hp.weight_decay), kind == ZS_OPTIM_ADAMW,
                                     hp.bias_correction != 0, steps};
      zs::kernels::adam_step_scalar(master.data(), s1.data(), s2.data(), grad.data(), master.size(), h, 1.0f,
                                    working.data(), wdt(t));
    }
    if (t == ZS_FLOAT32) std::memcpy(working.data(), master.data(), working.size());
    if (master16) zs::kernels::cast_to_f32(working.data(), wdt(t), master.data(), master.size());
  }
};

std::vector<uint8_t> gathered(zs_context ctx, zs_param p, size_t bytes) {
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(zs_param_copy_to(p, out.data(), out.size()), ZS_OK) << zs_last_error();
  zs_release(ctx, &p, 1);
  zs_gather_destroy(g);
  return out;
}

void run_case(zs_optimizer_kind kind, int ranks, bool bf16_masters = false) {
  run_ranks(ranks, [kind, bf16_masters](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, bf16_masters ? R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}})" : nullptr);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> params(kCount);
    std::vector<Reference> refs;
    for (size_t p = 0; p < kCount; ++p) {
      const auto bytes = encode(values(p, 0, false), dtype_of(p));
      const std::string name = "p" + std::to_string(p);
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      o.name = name.c_str();
      o.dtype = dtype_of(p);
      o.ndim = 1;
      o.shape = &kSizes[p];
      o.init = ZS_INIT_FROM_ALL;
      o.data = bytes.data();
      o.data_bytes = bytes.size();
      ZS_ASSERT_OK(zs_param_register(&params[p], ctx, &o));
      refs.emplace_back(p, bf16_masters);
    }
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, kind));
    // Two groups: params 0-3 and 4-7, each its own hyper-parameters.
    zs_optim_hparams hp[2] = {ZS_OPTIM_HPARAMS_INIT, ZS_OPTIM_HPARAMS_INIT};
    hp[0].lr = 0.05;
    hp[0].weight_decay = 0.1;
    hp[1].lr = 0.02;
    hp[1].weight_decay = 0.0;
    hp[1].beta1 = 0.3;  // Adam: torch's other lerp formula
    hp[1].bias_correction = 0;
    if (kind == ZS_OPTIM_SGD) {
      hp[0].momentum = 0.9;
      hp[0].nesterov = 1;
      hp[1].momentum = 0.8;
      hp[1].dampening = 0.1;
    }
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &params[0], 4, &hp[0], nullptr));
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &params[4], kCount - 4, &hp[1], nullptr));
    for (int s = 0; s < 4; ++s) {
      for (size_t p = 0; p < kCount; ++p) {
        if (!has_grad(p, s)) continue;
        const auto g = values(p, s, true);
        ZS_ASSERT_OK(zs_grad_push(params[p], g.data(), ZS_FLOAT32, g.size() * 4));
        refs[p].step(kind, hp[p < 4 ? 0 : 1], g);
      }
      zs_step_result r = ZS_STEP_RESULT_INIT;
      ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
      ASSERT_EQ(r.skipped, 0);
      for (size_t p = 0; p < kCount; ++p)
        ASSERT_EQ(gathered(ctx, params[p], refs[p].working.size()), refs[p].working)
            << "param " << p << " (" << kSizes[p] << " elements) after step " << s;
    }
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

TEST(OptimizerMany, AdamWOverManyParamsEqualsEachParamsScalarStep) {
  run_case(ZS_OPTIM_ADAMW, 1);
  run_case(ZS_OPTIM_ADAMW, 2);
}

TEST(OptimizerMany, AdamOverManyParamsEqualsEachParamsScalarStep) { run_case(ZS_OPTIM_ADAM, 2); }

TEST(OptimizerMany, SgdOverManyParamsEqualsEachParamsScalarStep) {
  run_case(ZS_OPTIM_SGD, 1);
  run_case(ZS_OPTIM_SGD, 2);
}

// bf16.bf16_master_weights_and_grads: the bf16 params' shards are their
// masters (the _mixed_many pass), the fp32 params' as above, one step.
TEST(OptimizerMany, Bf16MastersOverManyParamsEqualEachParamsScalarStep) {
  run_case(ZS_OPTIM_ADAMW, 2, true);
  run_case(ZS_OPTIM_SGD, 2, true);
}

}  // namespace
