// ZS_OPTIM_EXTERNAL through the C ABI: the caller's update rule between
// zs_optimizer_step_begin and zs_optimizer_step_end, on real ranks, checked
// against the same update on full, unsharded arrays; its named states
// (zs_optimizer_named_state) through checkpoints saved at one world size and
// loaded at another; gradient clipping (the config's and
// zs_grad_clip_norm); zs_grad_pushed; two optimizers over disjoint params;
// and the misuse statuses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "kernels/convert.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::bitwise_equal;
using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Odd sizes: padded shards at 2 and 3 ranks (7 at 3 ranks: 3, 3, 1).
constexpr int64_t kSizes[] = {7, 10, 33};
constexpr int kNumParams = 3;
const char* const kNames[] = {"w7", "w10", "w33"};
constexpr const char* kBf16 = R"({"bf16": {"enabled": true}})";

size_t numel_of(int k) { return static_cast<size_t>(kSizes[k]); }

float init_value(int k, size_t i) { return 0.5f * std::sin(0.3f * static_cast<float>(i) + static_cast<float>(k)); }

// The gradient averaged over the ranks: multiples of 1/16 with small
// numerators, so every rank's term and every partial sum is exact in bf16
// and fp16 as well as fp32, and the average is what the test expects.
float grad_mean(int step, int k, size_t i) {
  const size_t n = i * 3 + static_cast<size_t>(k) * 5 + static_cast<size_t>(step) * 7;
  return static_cast<float>(static_cast<int>(n % 13) - 6) / 16.0f;
}
float grad_spread(int step, int k, size_t i) {
  const size_t n = i + static_cast<size_t>(k) + static_cast<size_t>(step);
  return static_cast<float>(static_cast<int>(n % 5) - 2) / 16.0f;
}
// Rank r's gradient: the mean plus a spread that cancels over the ranks.
std::vector<float> grad_on(const RankEnv& env, int step, int k, float scale = 1.0f) {
  std::vector<float> g(numel_of(k));
  const auto side = static_cast<float>(2 * env.rank - (env.world - 1));  // sums to 0 over the ranks
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = (grad_mean(step, k, i) + side * grad_spread(step, k, i)) * scale;
  return g;
}
std::vector<float> mean_of(int step, int k, float scale = 1.0f) {
  std::vector<float> g(numel_of(k));
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad_mean(step, k, i) * scale;
  return g;
}

// The one update rule both the ranks and the full-array reference run, so
// that they agree bit for bit on the same gradient.
float sgd(float p, float g, float lr) { return p - lr * g; }

size_t esize(zs_dtype t) { return t == ZS_FLOAT32 ? 4 : 2; }

std::vector<uint8_t> encode(const std::vector<float>& v, zs_dtype t) {
  std::vector<uint8_t> out(v.size() * esize(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == ZS_FLOAT32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const uint16_t h = t == ZS_BFLOAT16 ? zs::kernels::float_to_bf16(v[i]) : zs::kernels::float_to_fp16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

std::vector<float> decode(const std::vector<uint8_t>& b, zs_dtype t) {
  std::vector<float> out(b.size() / esize(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == ZS_FLOAT32) {
      std::memcpy(&out[i], &b[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = t == ZS_BFLOAT16 ? zs::kernels::bf16_to_float(h) : zs::kernels::fp16_to_float(h);
    }
  }
  return out;
}

// v as the param's dtype holds it.
std::vector<float> rounded(const std::vector<float>& v, zs_dtype t) { return decode(encode(v, t), t); }

std::vector<float> init_of(int k) {
  std::vector<float> v(numel_of(k));
  for (size_t i = 0; i < v.size(); ++i) v[i] = init_value(k, i);
  return v;
}

zs_param register_param(zs_context ctx, int k, zs_dtype t, const std::string& prefix = "") {
  const auto bytes = encode(init_of(k), t);
  const std::string name = prefix + kNames[k];
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name.c_str();
  o.dtype = t;
  o.ndim = 1;
  o.shape = &kSizes[k];
  o.init = ZS_INIT_FROM_ALL;
  o.data = bytes.data();
  o.data_bytes = bytes.size();
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

std::vector<zs_param> register_params(zs_context ctx, zs_dtype t) {
  std::vector<zs_param> ps;
  for (int k = 0; k < kNumParams; ++k) ps.push_back(register_param(ctx, k, t));
  return ps;
}

zs_optimizer make_optimizer(zs_context ctx, zs_optimizer_kind kind, const std::vector<zs_param>& ps,
                            double lr = 0.1, double momentum = 0.0) {
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, kind), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = lr;
  hp.weight_decay = 0.0;
  hp.momentum = momentum;
  EXPECT_EQ(zs_optimizer_add_group(opt, ps.data(), ps.size(), &hp, nullptr), ZS_OK) << zs_last_error();
  return opt;
}

zs_param_info info_of(zs_param p) {
  zs_param_info info = ZS_PARAM_INFO_INIT;
  EXPECT_EQ(zs_param_get_info(p, &info), ZS_OK) << zs_last_error();
  return info;
}

// The full values of a param (gathered), as fp32.
std::vector<float> full_param(zs_context ctx, zs_param p) {
  const zs_param_info info = info_of(p);
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  std::vector<uint8_t> raw(info.numel * esize(info.dtype));
  EXPECT_EQ(zs_param_copy_to(p, raw.data(), raw.size()), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_release(ctx, &p, 1), ZS_OK) << zs_last_error();
  zs_gather_destroy(g);
  return decode(raw, info.dtype);
}

// Every rank's shard of a per-param fp32 array (a gradient shard, a master,
// a named state), all-gathered over the world in rank order and cut to the
// param's numel: the full array. Collective: every rank calls it alike. A
// null shard counts as zeros.
std::vector<float> full_of_shards(zs_context ctx, const float* shard, uint64_t shard_numel, uint64_t numel) {
  std::vector<float> mine(shard_numel, 0.0f);
  if (shard != nullptr) std::memcpy(mine.data(), shard, shard_numel * 4);
  int world = 0;
  EXPECT_EQ(zs_context_world_size(ctx, &world), ZS_OK);
  std::vector<float> all(shard_numel * static_cast<uint64_t>(world), 0.0f);
  zs_group wg = nullptr;
  EXPECT_EQ(zs_context_group(&wg, ctx, ZS_GROUP_WORLD), ZS_OK) << zs_last_error();
  zs_work w = nullptr;
  EXPECT_EQ(zs_allgather(&w, wg, mine.data(), all.data(), shard_numel, ZS_FLOAT32), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_work_wait(w, 30000), ZS_OK) << zs_last_error();
  zs_work_destroy(w);
  zs_group_destroy(wg);
  all.resize(numel);
  return all;
}

std::vector<float> full_grad(zs_context ctx, zs_param p) {
  float* g = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(zs_grad_shard_data(p, &g, &n), ZS_OK) << zs_last_error();
  return full_of_shards(ctx, g, n, info_of(p).numel);
}

std::vector<float> full_master(zs_context ctx, zs_optimizer opt, zs_param p) {
  float* m = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(zs_optimizer_state_data(opt, p, 0, &m, &n), ZS_OK) << zs_last_error();
  return full_of_shards(ctx, m, n, info_of(p).numel);
}

// An absent named state gives an empty vector (on every rank alike).
std::vector<float> full_named(zs_context ctx, zs_optimizer opt, zs_param p, const char* name) {
  float* d = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(zs_optimizer_named_state(opt, p, name, 0, &d, &n), ZS_OK) << zs_last_error();
  if (d == nullptr) return {};
  return full_of_shards(ctx, d, n, info_of(p).numel);
}

double l2(const std::vector<std::vector<float>>& arrays) {
  double s = 0.0;
  for (const auto& a : arrays)
    for (float x : a) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

int pushed(zs_param p) {
  int v = -1;
  EXPECT_EQ(zs_grad_pushed(p, &v), ZS_OK) << zs_last_error();
  return v;
}

void expect_error(zs_status got, zs_status want, const std::string& fragment) {
  EXPECT_EQ(got, want) << "got " << zs_status_string(got) << ": " << zs_last_error();
  EXPECT_NE(std::string(zs_last_error()).find(fragment), std::string::npos)
      << "message '" << zs_last_error() << "' lacks '" << fragment << "'";
}

void destroy_all(zs_context ctx, const std::vector<zs_optimizer>& opts, const std::vector<zs_param>& ps) {
  for (auto o : opts) EXPECT_EQ(zs_optimizer_destroy(o), ZS_OK) << zs_last_error();
  for (auto p : ps) EXPECT_EQ(zs_param_destroy(p), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
}

// ---------------------------------------------------------------------------
// 1. SGD by hand, with a named state, against the full arrays.

struct ByHand {
  int world;
  zs_dtype dtype;
};

class OptimizerExternalByHand : public ::testing::TestWithParam<ByHand> {};

// Each step the ranks push different gradients whose average is known; the
// test itself applies p -= lr * g to the masters from the gradient shards
// and keeps "buf" += g in a named state. The same on the full arrays (the
// averaged gradient all-gathered from the shards) must give the same bits:
// the params, the masters and the named states; and the averaged gradient
// must be the known mean.
TEST_P(OptimizerExternalByHand, MatchesTheSameUpdateOnFullArrays) {
  const ByHand c = GetParam();
  run_ranks(c.world, [c](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, c.dtype == ZS_BFLOAT16 ? kBf16 : nullptr);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, c.dtype);
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    ASSERT_NE(opt, nullptr);
    std::vector<std::vector<float>> master(kNumParams), buf(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      master[k] = rounded(init_of(k), c.dtype);  // a 16-bit param's master starts from its value
      buf[k].assign(numel_of(k), 0.0f);
      // A named state is zeros when made, shard_numel long.
      float* d = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "buf", 0, &d, &n));
      EXPECT_EQ(d, nullptr) << "a named state before it was made";
      ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "buf", 1, &d, &n));
      ASSERT_NE(d, nullptr);
      EXPECT_EQ(n, info_of(ps[k]).shard_numel);
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(d[i], 0.0f) << i;
      float* again = nullptr;
      ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "buf", 1, &again, nullptr));
      EXPECT_EQ(again, d) << "a second request made another state";
    }
    for (int s = 0; s < 3; ++s) {
      const float lr = 0.1f / static_cast<float>(s + 1);
      for (int k = 0; k < kNumParams; ++k) {
        const auto g = grad_on(env, s, k);
        ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
      }
      zs_step_result r = ZS_STEP_RESULT_INIT;
      ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
      EXPECT_EQ(r.skipped, 0);
      std::vector<std::vector<float>> grads(kNumParams);
      for (int k = 0; k < kNumParams; ++k) {
        float* g = nullptr;
        float* m = nullptr;
        float* b = nullptr;
        uint64_t gn = 0, mn = 0, bn = 0;
        ZS_ASSERT_OK(zs_grad_shard_data(ps[k], &g, &gn));
        ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &m, &mn));
        ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "buf", 1, &b, &bn));
        ASSERT_NE(g, nullptr);
        ASSERT_EQ(gn, mn);
        ASSERT_EQ(gn, bn);
        grads[k] = full_of_shards(ctx, g, gn, numel_of(k));
        const auto want = mean_of(s, k);
        // fp32 on the wire: the average within rounding; bf16: within bf16's.
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(grads[k][i], want[i], c.dtype == ZS_FLOAT32 ? 1e-6 : 4e-3 * std::fabs(want[i]) + 1e-6)
              << "param " << k << " element " << i << " step " << s;
        for (uint64_t i = 0; i < gn; ++i) {
          m[i] = sgd(m[i], g[i], lr);
          b[i] += g[i];
        }
        for (size_t i = 0; i < numel_of(k); ++i) {
          master[k][i] = sgd(master[k][i], grads[k][i], lr);
          buf[k][i] += grads[k][i];
        }
      }
      EXPECT_NEAR(r.grad_norm, l2(grads), 1e-5 * l2(grads)) << "step " << s;
      ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
      EXPECT_EQ(r.step, s + 1);
      EXPECT_EQ(r.skipped, 0);
      EXPECT_EQ(r.loss_scale, 1.0);
      int64_t steps = 0;
      ZS_ASSERT_OK(zs_optimizer_get_step(opt, &steps));
      EXPECT_EQ(steps, s + 1);
      for (int k = 0; k < kNumParams; ++k) {
        EXPECT_TRUE(bitwise_equal(full_param(ctx, ps[k]), rounded(master[k], c.dtype)))
            << "param " << k << " step " << s;
        EXPECT_TRUE(bitwise_equal(full_master(ctx, opt, ps[k]), master[k])) << "master " << k << " step " << s;
        EXPECT_TRUE(bitwise_equal(full_named(ctx, opt, ps[k], "buf"), buf[k])) << "buf " << k << " step " << s;
      }
    }
    // The step moved the params, and every named state counts as optimizer memory.
    EXPECT_FALSE(bitwise_equal(full_param(ctx, ps[2]), rounded(init_of(2), c.dtype)));
    zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
    uint64_t shards = 0;
    for (auto p : ps) shards += info_of(p).shard_numel;
    EXPECT_EQ(mem.optimizer_bytes, shards * 4 * (c.dtype == ZS_FLOAT32 ? 1 : 2));
    ZS_ASSERT_OK(zs_optimizer_destroy(opt));
    ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
    EXPECT_EQ(mem.optimizer_bytes, 0u) << "named states outlived their optimizer in the ledger";
    destroy_all(ctx, {}, ps);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OptimizerExternalByHand,
                         ::testing::Values(ByHand{2, ZS_FLOAT32}, ByHand{3, ZS_FLOAT32}, ByHand{2, ZS_BFLOAT16},
                                           ByHand{3, ZS_BFLOAT16}),
                         [](const auto& tp) {
                           return std::to_string(tp.param.world) + "ranks_" +
                                  (tp.param.dtype == ZS_FLOAT32 ? "fp32" : "bf16");
                         });

// ---------------------------------------------------------------------------
// Built-in SGD against the external one doing plain SGD.

// Three steps (lr 0.1 / (s + 1)) of plain SGD by `kind` at `world` ranks;
// the full params after them, concatenated.
std::vector<float> plain_sgd_run(int world, zs_optimizer_kind kind) {
  const std::string dir = zs::test::make_temp_dir("ext_sgd");
  run_ranks(world, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32);
    zs_optimizer opt = make_optimizer(ctx, kind, ps);
    ASSERT_NE(opt, nullptr);
    for (int s = 0; s < 3; ++s) {
      const float lr = 0.1f / static_cast<float>(s + 1);
      for (int k = 0; k < kNumParams; ++k) {
        const auto g = grad_on(env, s, k);
        ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
      }
      if (kind == ZS_OPTIM_SGD) {
        ZS_ASSERT_OK(zs_optimizer_set_lr(opt, -1, static_cast<double>(lr)));
        ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
        continue;
      }
      ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
      for (int k = 0; k < kNumParams; ++k) {
        float* g = nullptr;
        float* m = nullptr;
        uint64_t n = 0;
        ZS_ASSERT_OK(zs_grad_shard_data(ps[k], &g, &n));
        ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &m, nullptr));
        for (uint64_t i = 0; i < n; ++i) m[i] = sgd(m[i], g[i], lr);
      }
      ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    }
    std::vector<float> all;
    for (auto p : ps) {
      const auto v = full_param(ctx, p);
      all.insert(all.end(), v.begin(), v.end());
    }
    if (env.rank == 0) zs::test::write_floats(dir + "/params.bin", all);
    destroy_all(ctx, {opt}, ps);
  });
  auto out = zs::test::read_floats(dir + "/params.bin");
  std::filesystem::remove_all(dir);
  return out;
}

TEST(OptimizerExternal, PlainSgdByHandMatchesTheBuiltInSgd) {
  for (int world : {2, 3}) {
    const auto builtin = plain_sgd_run(world, ZS_OPTIM_SGD);
    const auto external = plain_sgd_run(world, ZS_OPTIM_EXTERNAL);
    ASSERT_EQ(builtin.size(), static_cast<size_t>(7 + 10 + 33)) << world << " ranks";
    ASSERT_EQ(external.size(), builtin.size()) << world << " ranks";
    std::vector<float> init;
    for (int k = 0; k < kNumParams; ++k) {
      const auto v = init_of(k);
      init.insert(init.end(), v.begin(), v.end());
    }
    size_t moved = 0;
    for (size_t i = 0; i < builtin.size(); ++i) {
      EXPECT_NEAR(external[i], builtin[i], 1e-6) << world << " ranks, element " << i;
      moved += builtin[i] != init[i];
    }
    EXPECT_GT(moved, builtin.size() / 2) << "the steps hardly moved the params";
  }
}

// ---------------------------------------------------------------------------
// 2. Clipping.

// gradient_clipping in the config: after step_begin the caller's gradient
// shards are the clipped ones (global norm = the clip value), and the
// update made from them is what lands in the params. A gradient under the
// clip value is left as it is.
TEST(OptimizerExternal, ConfigClippingActsOnTheShardsTheCallerSees) {
  run_ranks(3, [](const RankEnv& env) {
    constexpr double kClip = 0.25;
    zs_context ctx = zs::test::make_context(env, R"({"gradient_clipping": 0.25})");
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32);
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    ASSERT_NE(opt, nullptr);
    std::vector<std::vector<float>> means(kNumParams), params(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      means[k] = mean_of(0, k);
      params[k] = init_of(k);
      const auto g = grad_on(env, 0, k);
      ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    const double raw = l2(means);
    ASSERT_GT(raw, 4 * kClip);  // clipping has something to do
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    EXPECT_NEAR(r.grad_norm, raw, 1e-5 * raw) << "the norm before clipping";
    const double coef = kClip / (r.grad_norm + 1e-6);
    std::vector<std::vector<float>> clipped(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      clipped[k] = full_grad(ctx, ps[k]);
      for (size_t i = 0; i < numel_of(k); ++i)
        EXPECT_NEAR(clipped[k][i], means[k][i] * coef, 1e-6) << "param " << k << " element " << i;
    }
    EXPECT_NEAR(l2(clipped), kClip, 1e-5);
    // lr 1 by hand: the params move by exactly the clipped gradient.
    for (int k = 0; k < kNumParams; ++k) {
      float* g = nullptr;
      float* m = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_grad_shard_data(ps[k], &g, &n));
      ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &m, nullptr));
      for (uint64_t i = 0; i < n; ++i) m[i] = sgd(m[i], g[i], 1.0f);
      for (size_t i = 0; i < numel_of(k); ++i) params[k][i] = sgd(params[k][i], clipped[k][i], 1.0f);
    }
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    for (int k = 0; k < kNumParams; ++k)
      EXPECT_TRUE(bitwise_equal(full_param(ctx, ps[k]), params[k])) << "param " << k;
    // Small gradients (norm under the clip value): untouched.
    std::vector<std::vector<float>> small(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      small[k] = mean_of(1, k, 1.0f / 64);
      const auto g = grad_on(env, 1, k, 1.0f / 64);
      ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    ASSERT_LT(l2(small), kClip);
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    EXPECT_NEAR(r.grad_norm, l2(small), 1e-5 * l2(small));
    for (int k = 0; k < kNumParams; ++k) {
      const auto g = full_grad(ctx, ps[k]);
      for (size_t i = 0; i < numel_of(k); ++i) EXPECT_NEAR(g[i], small[k][i], 1e-7) << k << " " << i;
    }
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    EXPECT_EQ(r.step, 2);
    destroy_all(ctx, {opt}, ps);
  });
}

// zs_grad_clip_norm: the global L2 norm of the averaged gradient (a param
// with no gradient this step adds nothing, though its shard still holds
// the last step's), shards untouched under max_norm and scaled to it above;
// a following step sees the clipped gradients; bad max_norm values are
// INVALID_ARGUMENT.
TEST(OptimizerExternal, GradClipNormReturnsTheGlobalNormAndScalesAboveMax) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    auto ps = register_params(ctx, ZS_FLOAT32);
    ps.push_back(register_param(ctx, 1, ZS_FLOAT32, "old_"));   // a gradient last step only
    ps.push_back(register_param(ctx, 0, ZS_FLOAT32, "idle_"));  // never pushed
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    ASSERT_NE(opt, nullptr);
    {  // a step that updates nothing: "old_" keeps a gradient of the past
      const auto g = grad_on(env, 5, 1, 4.0f);
      ZS_ASSERT_OK(zs_grad_push(ps[3], g.data(), ZS_FLOAT32, g.size() * 4));
      ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
      ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    }
    std::vector<std::vector<float>> means(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      means[k] = mean_of(0, k);
      const auto g = grad_on(env, 0, k);
      ZS_ASSERT_OK(zs_grad_push(ps[static_cast<size_t>(k)], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    const double want = l2(means);
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    std::vector<std::vector<float>> before(kNumParams);
    for (int k = 0; k < kNumParams; ++k) before[k] = full_grad(ctx, ps[static_cast<size_t>(k)]);

    double norm = -1.0;
    ZS_ASSERT_OK(zs_grad_clip_norm(ctx, ps.data(), ps.size(), 1e9, &norm));
    EXPECT_NEAR(norm, want, 1e-6 * want);
    for (int k = 0; k < kNumParams; ++k)
      EXPECT_TRUE(bitwise_equal(full_grad(ctx, ps[static_cast<size_t>(k)]), before[k]))
          << "param " << k << " changed under max_norm";
    // Just the params with gradients, in another subset: their own norm.
    double norm_one = -1.0;
    ZS_ASSERT_OK(zs_grad_clip_norm(ctx, &ps[2], 1, 1e9, &norm_one));
    EXPECT_NEAR(norm_one, l2({means[2]}), 1e-6 * l2({means[2]}));

    constexpr double kMax = 0.5;
    ASSERT_GT(want, 2 * kMax);
    ZS_ASSERT_OK(zs_grad_clip_norm(ctx, ps.data(), ps.size(), kMax, &norm));
    EXPECT_NEAR(norm, want, 1e-6 * want) << "the norm before clipping";
    const double coef = kMax / (norm + 1e-6);
    std::vector<std::vector<float>> after(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      after[k] = full_grad(ctx, ps[static_cast<size_t>(k)]);
      for (size_t i = 0; i < numel_of(k); ++i)
        EXPECT_NEAR(after[k][i], before[k][i] * coef, 1e-6) << "param " << k << " element " << i;
    }
    EXPECT_NEAR(l2(after), kMax, 1e-5);

    // Refused, and nothing changes.
    expect_error(zs_grad_clip_norm(ctx, ps.data(), ps.size(), -1.0, &norm), ZS_ERR_INVALID_ARGUMENT, "max_norm");
    expect_error(zs_grad_clip_norm(ctx, ps.data(), ps.size(), std::nan(""), &norm), ZS_ERR_INVALID_ARGUMENT,
                 "max_norm");
    expect_error(zs_grad_clip_norm(ctx, ps.data(), ps.size(), 1.0, nullptr), ZS_ERR_INVALID_ARGUMENT,
                 "total_norm");
    for (int k = 0; k < kNumParams; ++k)
      EXPECT_TRUE(bitwise_equal(full_grad(ctx, ps[static_cast<size_t>(k)]), after[k])) << "param " << k;

    // The step takes its norm from the clipped shards.
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    EXPECT_NEAR(r.grad_norm, kMax, 1e-5);
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    destroy_all(ctx, {opt}, ps);
  });
}

// fp16: step_begin hands the caller unscaled gradients; an overflow on one
// rank skips the step on every rank (the caller updates nothing, step_end
// still closes it) and backs the loss scale off. zs_grad_clip_norm is
// NOT_SUPPORTED there.
TEST(OptimizerExternal, Fp16UnscalesAndSkipsOnEveryRank) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, R"({"fp16": {"enabled": true, "initial_scale_power": 4, "hysteresis": 1}})");
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT16);
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    ASSERT_NE(opt, nullptr);
    double norm = 0.0;
    expect_error(zs_grad_clip_norm(ctx, ps.data(), ps.size(), 1.0, &norm), ZS_ERR_NOT_SUPPORTED,
                 "gradient_clipping");
    std::vector<std::vector<float>> before(kNumParams);
    for (int k = 0; k < kNumParams; ++k) before[k] = full_param(ctx, ps[k]);
    // An inf on rank 1 only.
    for (int k = 0; k < kNumParams; ++k) {
      auto g = grad_on(env, 0, k, 16.0f);
      if (env.rank == 1 && k == 1) g[3] = INFINITY;
      ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    EXPECT_EQ(r.skipped, 1) << "rank " << env.rank;
    EXPECT_TRUE(std::isinf(r.grad_norm)) << r.grad_norm;
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    EXPECT_EQ(r.skipped, 1);
    EXPECT_EQ(r.step, 0);
    EXPECT_EQ(r.loss_scale, 8.0);
    for (int k = 0; k < kNumParams; ++k)
      EXPECT_TRUE(bitwise_equal(full_param(ctx, ps[k]), before[k])) << "a skipped step changed param " << k;
    // Clean, scaled by the new scale: the caller sees the unscaled mean.
    std::vector<std::vector<float>> master(kNumParams), grads(kNumParams);
    for (int k = 0; k < kNumParams; ++k) {
      master[k] = before[k];
      const auto g = grad_on(env, 1, k, 8.0f);
      ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    EXPECT_EQ(r.skipped, 0);
    for (int k = 0; k < kNumParams; ++k) {
      grads[k] = full_grad(ctx, ps[k]);
      const auto want = mean_of(1, k);
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_NEAR(grads[k][i], want[i], 1e-3 * std::fabs(want[i]) + 1e-6) << k << " " << i;
      float* g = nullptr;
      float* m = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_grad_shard_data(ps[k], &g, &n));
      ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &m, nullptr));
      for (uint64_t i = 0; i < n; ++i) m[i] = sgd(m[i], g[i], 0.1f);
      for (size_t i = 0; i < numel_of(k); ++i) master[k][i] = sgd(master[k][i], grads[k][i], 0.1f);
    }
    EXPECT_NEAR(r.grad_norm, l2(grads), 1e-5 * l2(grads)) << "the unscaled norm";
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    EXPECT_EQ(r.step, 1);
    EXPECT_EQ(r.loss_scale, 8.0);
    for (int k = 0; k < kNumParams; ++k)
      EXPECT_TRUE(bitwise_equal(full_param(ctx, ps[k]), rounded(master[k], ZS_FLOAT16))) << "param " << k;
    destroy_all(ctx, {opt}, ps);
  });
}

// ---------------------------------------------------------------------------
// 3. Misuse.

TEST(OptimizerExternal, MisuseGivesClearStatuses) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    zs_param a = register_param(ctx, 0, ZS_FLOAT32), b = register_param(ctx, 1, ZS_FLOAT32);
    zs_optimizer ext = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, {a});
    zs_optimizer adamw = make_optimizer(ctx, ZS_OPTIM_ADAMW, {b});
    ASSERT_NE(ext, nullptr);
    ASSERT_NE(adamw, nullptr);

    zs_optimizer bad = nullptr;
    expect_error(zs_optimizer_create(&bad, ctx, static_cast<zs_optimizer_kind>(5)), ZS_ERR_INVALID_ARGUMENT,
                 "ZS_OPTIM_MUON (4)");
    expect_error(zs_optimizer_step(ext, nullptr), ZS_ERR_INVALID_STATE, "zs_optimizer_step_begin");
    expect_error(zs_optimizer_step_end(ext, nullptr), ZS_ERR_INVALID_STATE, "without a step_begin");
    expect_error(zs_optimizer_step_begin(adamw, nullptr), ZS_ERR_INVALID_STATE, "ZS_OPTIM_EXTERNAL");
    expect_error(zs_optimizer_step_end(adamw, nullptr), ZS_ERR_INVALID_STATE, "step_begin");

    float* d = reinterpret_cast<float*>(uintptr_t{1});
    uint64_t n = 0;
    expect_error(zs_optimizer_named_state(adamw, b, "buf", 1, &d, &n), ZS_ERR_INVALID_ARGUMENT, "external");
    EXPECT_EQ(d, nullptr);
    const std::string too_long(129, 'x');
    for (const char* name : {"", "a/b", "param", "master", "has space", " lead", "tab\there", "\xc3\xa9",
                             too_long.c_str()}) {
      d = reinterpret_cast<float*>(uintptr_t{1});
      expect_error(zs_optimizer_named_state(ext, a, name, 1, &d, &n), ZS_ERR_INVALID_ARGUMENT,
                   "named optimizer state");
      EXPECT_EQ(d, nullptr) << "name '" << name << "'";
    }
    expect_error(zs_optimizer_named_state(ext, a, nullptr, 1, &d, &n), ZS_ERR_INVALID_ARGUMENT, "name");
    expect_error(zs_optimizer_named_state(ext, a, "buf", 1, nullptr, &n), ZS_ERR_INVALID_ARGUMENT, "data");
    expect_error(zs_optimizer_named_state(ext, b, "buf", 1, &d, &n), ZS_ERR_INVALID_ARGUMENT, "no group");
    expect_error(zs_optimizer_named_state(nullptr, a, "buf", 1, &d, &n), ZS_ERR_INVALID_HANDLE, "opt");
    // Names at the limits are fine: 128 characters, punctuation.
    ZS_ASSERT_OK(zs_optimizer_named_state(ext, a, std::string(128, 'x').c_str(), 1, &d, &n));
    EXPECT_NE(d, nullptr);
    ZS_ASSERT_OK(zs_optimizer_named_state(ext, a, "exp_avg.sq-2", 1, &d, &n));
    EXPECT_NE(d, nullptr);
    ZS_ASSERT_OK(zs_optimizer_named_state(ext, a, "absent", 0, &d, &n));
    EXPECT_EQ(d, nullptr);
    // An external optimizer has slot 0 (the master) only.
    expect_error(zs_optimizer_state_data(ext, a, 1, &d, &n), ZS_ERR_INVALID_ARGUMENT, "slot 1");

    // A step's halves: twice begin, begin then zs_optimizer_step, twice end.
    std::vector<float> g = grad_on(env, 0, 0);
    ZS_ASSERT_OK(zs_grad_push(a, g.data(), ZS_FLOAT32, g.size() * 4));
    ZS_ASSERT_OK(zs_optimizer_step_begin(ext, nullptr));
    expect_error(zs_optimizer_step_begin(ext, nullptr), ZS_ERR_INVALID_STATE, "no step_end");
    expect_error(zs_optimizer_step(ext, nullptr), ZS_ERR_INVALID_STATE, "step_begin");
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step_end(ext, &r));
    EXPECT_EQ(r.step, 1);
    expect_error(zs_optimizer_step_end(ext, nullptr), ZS_ERR_INVALID_STATE, "without a step_begin");
    // The built-in one still steps after all this.
    g = grad_on(env, 0, 1);
    ZS_ASSERT_OK(zs_grad_push(b, g.data(), ZS_FLOAT32, g.size() * 4));
    ZS_ASSERT_OK(zs_optimizer_step(adamw, &r));
    EXPECT_EQ(r.step, 1);
    destroy_all(ctx, {ext, adamw}, {a, b});
  });
}

// ---------------------------------------------------------------------------
// 4. zs_grad_pushed.

TEST(OptimizerExternal, GradPushedFollowsPushesAndSteps) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32);
    zs_param a = ps[0], b = ps[1], loose = ps[2];  // loose: in no optimizer
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, {a, b});
    ASSERT_NE(opt, nullptr);
    EXPECT_EQ(pushed(a), 0);
    EXPECT_EQ(pushed(b), 0);
    expect_error(zs_grad_pushed(a, nullptr), ZS_ERR_INVALID_ARGUMENT, "pushed");
    expect_error(zs_grad_pushed(nullptr, nullptr), ZS_ERR_INVALID_ARGUMENT, "");

    auto g = grad_on(env, 0, 0);
    ZS_ASSERT_OK(zs_grad_push(a, g.data(), ZS_FLOAT32, g.size() * 4));
    g = grad_on(env, 0, 2);
    ZS_ASSERT_OK(zs_grad_push(loose, g.data(), ZS_FLOAT32, g.size() * 4));
    EXPECT_EQ(pushed(a), 1);
    EXPECT_EQ(pushed(b), 0);
    EXPECT_EQ(pushed(loose), 1);
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
    EXPECT_EQ(pushed(a), 1) << "during the step";
    float* gd = reinterpret_cast<float*>(uintptr_t{1});
    uint64_t n = 0;
    ZS_ASSERT_OK(zs_grad_shard_data(b, &gd, &n));
    EXPECT_EQ(gd, nullptr) << "b has had no gradient";
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    EXPECT_EQ(pushed(a), 0) << "after the step";
    EXPECT_EQ(pushed(b), 0);
    // No optimizer stepped `loose`: its gradient stays, and the next push adds to it.
    EXPECT_EQ(pushed(loose), 1);

    const auto b_before = full_param(ctx, b);
    const auto a_before = full_param(ctx, a);
    g = grad_on(env, 1, 1);
    ZS_ASSERT_OK(zs_grad_push(b, g.data(), ZS_FLOAT32, g.size() * 4));
    g = grad_on(env, 1, 2);
    ZS_ASSERT_OK(zs_grad_push(loose, g.data(), ZS_FLOAT32, g.size() * 4));
    EXPECT_EQ(pushed(a), 0);
    EXPECT_EQ(pushed(b), 1);
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
    // a had a gradient last step, none this one: its shard reads as zeros.
    const auto ga = full_grad(ctx, a);
    for (size_t i = 0; i < ga.size(); ++i) EXPECT_EQ(ga[i], 0.0f) << i;
    const auto gb = full_grad(ctx, b);
    const auto want_b = mean_of(1, 1);
    for (size_t i = 0; i < gb.size(); ++i) EXPECT_NEAR(gb[i], want_b[i], 1e-6) << i;
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    EXPECT_EQ(pushed(b), 0);
    // Nothing was updated by hand: the params are as they were.
    EXPECT_TRUE(bitwise_equal(full_param(ctx, a), a_before));
    EXPECT_TRUE(bitwise_equal(full_param(ctx, b), b_before));
    const auto gl = full_grad(ctx, loose);
    for (size_t i = 0; i < gl.size(); ++i)
      EXPECT_NEAR(gl[i], grad_mean(0, 2, i) + grad_mean(1, 2, i), 1e-6) << "loose " << i;
    destroy_all(ctx, {opt}, ps);
  });
}

// A 16-bit param rewritten between steps (zs_param_write): step_begin reads
// its master again, so the caller's update starts from the new values.
TEST(OptimizerExternal, Bf16MasterFollowsParamWrite) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, kBf16);
    ASSERT_NE(ctx, nullptr);
    zs_param p = register_param(ctx, 2, ZS_BFLOAT16);
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, {p});
    ASSERT_NE(opt, nullptr);
    std::vector<float> fresh(numel_of(2));
    for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    const auto bytes = encode(fresh, ZS_BFLOAT16);
    // The shard's version moves on with the write (a full copy kept from
    // before is stale), not with the optimizer's step below.
    const auto version = [&] {
      zs_param_info info = ZS_PARAM_INFO_INIT;
      EXPECT_EQ(zs_param_get_info(p, &info), ZS_OK) << zs_last_error();
      return info.shard_version;
    };
    const uint64_t before = version();
    ZS_ASSERT_OK(zs_param_write(p, bytes.data(), bytes.size()));
    EXPECT_EQ(version(), before + 1);
    const auto g = grad_on(env, 0, 2);
    ZS_ASSERT_OK(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * 4));
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
    EXPECT_TRUE(bitwise_equal(full_master(ctx, opt, p), rounded(fresh, ZS_BFLOAT16)))
        << "step_begin kept the master from before the write";
    const auto gf = full_grad(ctx, p);
    float* gd = nullptr;
    float* m = nullptr;
    uint64_t n = 0;
    ZS_ASSERT_OK(zs_grad_shard_data(p, &gd, &n));
    ZS_ASSERT_OK(zs_optimizer_state_data(opt, p, 0, &m, nullptr));
    for (uint64_t i = 0; i < n; ++i) m[i] = sgd(m[i], gd[i], 0.1f);
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    EXPECT_EQ(version(), before + 1);
    auto want = rounded(fresh, ZS_BFLOAT16);
    for (size_t i = 0; i < want.size(); ++i) want[i] = sgd(want[i], gf[i], 0.1f);
    EXPECT_TRUE(bitwise_equal(full_param(ctx, p), rounded(want, ZS_BFLOAT16)));
    destroy_all(ctx, {opt}, {p});
  });
}

// ---------------------------------------------------------------------------
// 5. Two optimizers over disjoint params.

enum class Second { Sgd, External };

// SGD with momentum 0.9, lr 0.1, three steps, on params 0 and 1 (first
// optimizer, built-in SGD) and 2 (second optimizer: built-in SGD, or the
// same rule by hand with a named momentum buffer), stepping in turns
// (odd steps the second first), or all in one built-in SGD (split false).
// After the first optimizer's step, the second's params must still hold
// their gradients. The full params after the run, concatenated.
std::vector<float> momentum_run(int world, bool split, Second second) {
  const std::string dir = zs::test::make_temp_dir("ext_two");
  run_ranks(world, [&](const RankEnv& env) {
    constexpr float kLr = 0.1f, kMomentum = 0.9f;
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32);
    std::vector<zs_optimizer> opts;
    if (!split) {
      opts.push_back(make_optimizer(ctx, ZS_OPTIM_SGD, ps, kLr, kMomentum));
    } else {
      opts.push_back(make_optimizer(ctx, ZS_OPTIM_SGD, {ps[0], ps[1]}, kLr, kMomentum));
      opts.push_back(make_optimizer(ctx, second == Second::Sgd ? ZS_OPTIM_SGD : ZS_OPTIM_EXTERNAL, {ps[2]}, kLr,
                                    kMomentum));
    }
    for (auto o : opts) ASSERT_NE(o, nullptr);
    auto step_second = [&]() {
      if (second == Second::Sgd) {
        ZS_ASSERT_OK(zs_optimizer_step(opts[1], nullptr));
        return;
      }
      ZS_ASSERT_OK(zs_optimizer_step_begin(opts[1], nullptr));
      float* g = nullptr;
      float* m = nullptr;
      float* buf = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_grad_shard_data(ps[2], &g, &n));
      ZS_ASSERT_OK(zs_optimizer_state_data(opts[1], ps[2], 0, &m, nullptr));
      ZS_ASSERT_OK(zs_optimizer_named_state(opts[1], ps[2], "momentum_buffer", 1, &buf, nullptr));
      for (uint64_t i = 0; i < n; ++i) {
        buf[i] = kMomentum * buf[i] + g[i];  // the first step: g (the buffer starts at zeros)
        m[i] = sgd(m[i], buf[i], kLr);
      }
      ZS_ASSERT_OK(zs_optimizer_step_end(opts[1], nullptr));
    };
    // The gradients a step left the other optimizer: its own, as pushed.
    auto expect_grads_kept = [&](const std::vector<int>& ks, int s) {
      for (int k : ks) {
        EXPECT_EQ(pushed(ps[k]), 1) << "param " << k << " step " << s;
        const auto g = full_grad(ctx, ps[k]);
        const auto want = mean_of(s, k);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(g[i], want[i], 1e-6) << "param " << k << " element " << i << " step " << s;
      }
    };
    for (int s = 0; s < 3; ++s) {
      for (int k = 0; k < kNumParams; ++k) {
        const auto g = grad_on(env, s, k);
        ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
      }
      if (!split) {
        ZS_ASSERT_OK(zs_optimizer_step(opts[0], nullptr));
      } else if (s % 2 == 0) {
        ZS_ASSERT_OK(zs_optimizer_step(opts[0], nullptr));
        EXPECT_EQ(pushed(ps[0]), 0);
        expect_grads_kept({2}, s);
        step_second();
      } else {
        step_second();
        EXPECT_EQ(pushed(ps[2]), 0);
        expect_grads_kept({0, 1}, s);
        ZS_ASSERT_OK(zs_optimizer_step(opts[0], nullptr));
      }
    }
    std::vector<float> all;
    for (auto p : ps) {
      const auto v = full_param(ctx, p);
      all.insert(all.end(), v.begin(), v.end());
    }
    if (env.rank == 0) zs::test::write_floats(dir + "/params.bin", all);
    destroy_all(ctx, opts, ps);
  });
  auto out = zs::test::read_floats(dir + "/params.bin");
  std::filesystem::remove_all(dir);
  return out;
}

TEST(OptimizerExternal, TwoOptimizersOverDisjointParamsEachStepTheirOwn) {
  constexpr int kWorld = 3;
  const auto single = momentum_run(kWorld, false, Second::Sgd);
  ASSERT_EQ(single.size(), static_cast<size_t>(7 + 10 + 33));
  const auto both_sgd = momentum_run(kWorld, true, Second::Sgd);
  // The same kernels over the same gradients: the same bits.
  EXPECT_TRUE(bitwise_equal(both_sgd, single)) << "two built-in SGDs differ from one over all params";
  const auto with_external = momentum_run(kWorld, true, Second::External);
  ASSERT_EQ(with_external.size(), single.size());
  for (size_t i = 0; i < single.size(); ++i)
    EXPECT_NEAR(with_external[i], single[i], 1e-6) << "element " << i;
  // The params moved (a zeroed gradient would leave param 2 nearly in place).
  EXPECT_GT(std::fabs(single[17 + 5] - init_value(2, 5)), 0.01);
}

// ---------------------------------------------------------------------------
// 6. Checkpoints of named states.

struct Reshard {
  int from, to;
  zs_dtype dtype;
};

class OptimizerExternalCheckpoint : public ::testing::TestWithParam<Reshard> {};

// Saved at `from` ranks: named states "buf" (every param) and "sq" (the last
// param only), after two steps by hand. Loaded at `to` ranks into an
// optimizer that holds other named states: the saved ones come back
// exactly (their full arrays, from every rank's shard), the others are
// dropped; masters, params and the step count come back too. Loading into
// an ADAMW optimizer first fails naming both kinds, and changes nothing.
TEST_P(OptimizerExternalCheckpoint, NamedStatesReshardAndReplaceTheLoadedOnes) {
  const Reshard c = GetParam();
  const char* config = c.dtype == ZS_BFLOAT16 ? kBf16 : nullptr;
  const std::string dir = zs::test::make_temp_dir("ext_ckpt");
  auto file = [&](const std::string& what, int k) { return dir + "/" + what + "." + std::to_string(k) + ".bin"; };
  run_ranks(c.from, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, c.dtype);
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    ASSERT_NE(opt, nullptr);
    for (int s = 0; s < 2; ++s) {
      for (int k = 0; k < kNumParams; ++k) {
        const auto g = grad_on(env, s, k);
        ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
      }
      ZS_ASSERT_OK(zs_optimizer_step_begin(opt, nullptr));
      for (int k = 0; k < kNumParams; ++k) {
        float* g = nullptr;
        float* m = nullptr;
        float* buf = nullptr;
        float* sq = nullptr;
        uint64_t n = 0;
        ZS_ASSERT_OK(zs_grad_shard_data(ps[k], &g, &n));
        ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &m, nullptr));
        ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "buf", 1, &buf, nullptr));
        if (k == 2) ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[k], "sq", 1, &sq, nullptr));
        for (uint64_t i = 0; i < n; ++i) {
          buf[i] = 0.5f * buf[i] + g[i];
          if (sq) sq[i] += g[i] * g[i] + 1.0f;
          m[i] = sgd(m[i], buf[i], 0.05f);
        }
      }
      ZS_ASSERT_OK(zs_optimizer_step_end(opt, nullptr));
    }
    zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    so.tag = "ext";
    ZS_ASSERT_OK(zs_checkpoint_save(ctx, ps.data(), ps.size(), opt, dir.c_str(), &so));
    for (int k = 0; k < kNumParams; ++k) {
      const auto buf = full_named(ctx, opt, ps[k], "buf");
      const auto sq = full_named(ctx, opt, ps[k], "sq");
      const auto master = full_master(ctx, opt, ps[k]);
      const auto param = full_param(ctx, ps[k]);
      ASSERT_EQ(buf.size(), numel_of(k));
      ASSERT_EQ(sq.size(), k == 2 ? numel_of(k) : 0u);
      if (env.rank == 0) {
        zs::test::write_floats(file("buf", k), buf);
        if (k == 2) zs::test::write_floats(file("sq", k), sq);
        zs::test::write_floats(file("master", k), master);
        zs::test::write_floats(file("param", k), param);
      }
    }
    destroy_all(ctx, {opt}, ps);
  });
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), "ext", nullptr, nullptr), ZS_OK) << zs_last_error();

  run_ranks(c.to, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> ps;
    for (int k = 0; k < kNumParams; ++k) {  // zeros: the load must bring the values
      const std::string name = kNames[k];
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      o.name = name.c_str();
      o.dtype = c.dtype;
      o.ndim = 1;
      o.shape = &kSizes[k];
      zs_param p = nullptr;
      ZS_ASSERT_OK(zs_param_register(&p, ctx, &o));
      ps.push_back(p);
    }
    zs_optimizer opt = make_optimizer(ctx, ZS_OPTIM_EXTERNAL, ps);
    zs_optimizer adamw = make_optimizer(ctx, ZS_OPTIM_ADAMW, ps);
    ASSERT_NE(opt, nullptr);
    ASSERT_NE(adamw, nullptr);
    // Named states the load must replace ("buf", with other values) or drop.
    auto fill = [&](int k, const char* name, float v) {
      float* d = nullptr;
      uint64_t n = 0;
      ASSERT_EQ(zs_optimizer_named_state(opt, ps[k], name, 1, &d, &n), ZS_OK) << zs_last_error();
      for (uint64_t i = 0; i < n; ++i) d[i] = v;
    };
    for (int k = 0; k < kNumParams; ++k) fill(k, "buf", 7.0f);
    fill(0, "sq", 3.0f);     // saved for param 2 only
    fill(1, "stale", 1.0f);  // never saved

    zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
    lo.tag = "ext";
    const zs_status st = zs_checkpoint_load(ctx, ps.data(), ps.size(), adamw, dir.c_str(), &lo, nullptr);
    EXPECT_EQ(st, ZS_ERR_INVALID_ARGUMENT) << zs_status_string(st) << ": " << zs_last_error();
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("external"), std::string::npos) << msg;
    EXPECT_NE(msg.find("adamw"), std::string::npos) << msg;
    // Nothing changed.
    EXPECT_EQ(full_named(ctx, opt, ps[1], "stale"), std::vector<float>(numel_of(1), 1.0f));
    EXPECT_EQ(full_param(ctx, ps[0]), std::vector<float>(numel_of(0), 0.0f));

    zs_checkpoint_info info = ZS_CHECKPOINT_INFO_INIT;
    ZS_ASSERT_OK(zs_checkpoint_load(ctx, ps.data(), ps.size(), opt, dir.c_str(), &lo, &info));
    EXPECT_EQ(info.step, 2);
    int64_t steps = 0;
    ZS_ASSERT_OK(zs_optimizer_get_step(opt, &steps));
    EXPECT_EQ(steps, 2);
    for (int k = 0; k < kNumParams; ++k) {
      EXPECT_TRUE(bitwise_equal(full_named(ctx, opt, ps[k], "buf"), zs::test::read_floats(file("buf", k))))
          << "buf of param " << k;
      EXPECT_TRUE(bitwise_equal(full_master(ctx, opt, ps[k]), zs::test::read_floats(file("master", k))))
          << "master of param " << k;
      EXPECT_TRUE(bitwise_equal(full_param(ctx, ps[k]), zs::test::read_floats(file("param", k))))
          << "param " << k;
    }
    EXPECT_TRUE(bitwise_equal(full_named(ctx, opt, ps[2], "sq"), zs::test::read_floats(file("sq", 2))));
    // Not in the checkpoint: dropped, so create=0 finds nothing.
    float* d = reinterpret_cast<float*>(uintptr_t{1});
    ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[0], "sq", 0, &d, nullptr));
    EXPECT_EQ(d, nullptr) << "'sq' of param 0 survived a load of a checkpoint without it";
    d = reinterpret_cast<float*>(uintptr_t{1});
    ZS_ASSERT_OK(zs_optimizer_named_state(opt, ps[1], "stale", 0, &d, nullptr));
    EXPECT_EQ(d, nullptr) << "'stale' survived the load";
    // Memory: masters (16-bit), buf x3, sq x1 of the external one; AdamW's own.
    zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
    uint64_t shards = 0;
    for (auto p : ps) shards += info_of(p).shard_numel;
    const uint64_t masters = c.dtype == ZS_FLOAT32 ? 0 : shards;
    const uint64_t external = masters + shards + info_of(ps[2]).shard_numel;
    const uint64_t adam = masters + 2 * shards;
    EXPECT_EQ(mem.optimizer_bytes, 4 * (external + adam));
    // And a step goes on from the loaded state.
    for (int k = 0; k < kNumParams; ++k) {
      const auto g = grad_on(env, 2, k);
      ZS_ASSERT_OK(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step_begin(opt, &r));
    ZS_ASSERT_OK(zs_optimizer_step_end(opt, &r));
    EXPECT_EQ(r.step, 3);
    destroy_all(ctx, {opt, adamw}, ps);
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, OptimizerExternalCheckpoint,
                         ::testing::Values(Reshard{2, 3, ZS_FLOAT32}, Reshard{3, 2, ZS_FLOAT32},
                                           Reshard{2, 3, ZS_BFLOAT16}, Reshard{3, 2, ZS_BFLOAT16}),
                         [](const auto& tp) {
                           return std::to_string(tp.param.from) + "to" + std::to_string(tp.param.to) + "_" +
                                  (tp.param.dtype == ZS_FLOAT32 ? "fp32" : "bf16");
                         });

}  // namespace
