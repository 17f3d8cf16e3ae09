// ZS_OPTIM_MUON: the engine's Muon with its auxiliary AdamW, on real ranks.
// The Newton-Schulz iteration (impl/optim/newton_schulz.h) against the same
// algorithm written out in double; the sharded step at 1, 2 and 3 ranks
// against Muon and AdamW on full, unsharded arrays (fp32 and bf16 params,
// odd shapes, a 3-D param taken as dim 0 by the rest); the momentum through
// a checkpoint saved at 2 ranks and loaded at 3; and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "impl/common/error.h"
#include "impl/device/device.h"
#include "impl/optim/newton_schulz.h"
#include "kernels/convert.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// ---------------------------------------------------------------------------
// 1. Newton-Schulz against the algorithm in double.

using Mat = std::vector<double>;  // row-major

Mat matmul(const Mat& a, const Mat& b, int64_t m, int64_t k, int64_t n) {
  Mat c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += a[i * k + p] * b[p * n + j];
  return c;
}

Mat transpose(const Mat& a, int64_t m, int64_t n) {
  Mat t(a.size());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) t[j * m + i] = a[i * n + j];
  return t;
}

// p(R) = aI + bR + cR^2 and its pieces, as zeroshard/torch/muon.py writes them.
Mat lin(double x, const Mat& a, double y, const Mat& b) {
  Mat c(a.size());
  for (size_t i = 0; i < a.size(); ++i) c[i] = x * a[i] + y * b[i];
  return c;
}

Mat reference_ns(Mat x, int64_t rows, int64_t cols, zs::NsMethod method, int steps) {
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = rows > cols;
  if (tall) {
    x = transpose(x, rows, cols);
    std::swap(rows, cols);
  }
  double norm = 0.0;
  for (double v : x) norm += v * v;
  norm = std::sqrt(norm) + 1e-7;
  for (double& v : x) v /= norm;
  const int64_t s = rows;
  auto gram = [&](const Mat& m) { return matmul(m, transpose(m, rows, cols), rows, cols, rows); };
  if (method == zs::NsMethod::Standard || cols <= rows) {
    for (int i = 0; i < steps; ++i) {
      const Mat r = gram(x);
      const Mat z = lin(b, r, c, matmul(r, r, s, s, s));
      x = lin(a, x, 1.0, matmul(z, x, s, s, cols));
    }
  } else {
    Mat r = gram(x), q;
    for (int i = 0; i < steps; ++i) {
      if (i == 2) {
        x = matmul(q, x, s, s, cols);
        r = gram(x);
        q.clear();
      }
      const Mat z = lin(b, r, c, matmul(r, r, s, s, s));
      if (q.empty()) {
        q = z;
        for (int64_t d = 0; d < s; ++d) q[d * s + d] += a;
      } else {
        q = lin(a, q, 1.0, matmul(z, q, s, s, s));
      }
      if (i < steps - 1 && i + 1 != 2) {
        const Mat rz = lin(a, r, 1.0, matmul(z, r, s, s, s));
        r = lin(a, rz, 1.0, matmul(z, rz, s, s, s));
      }
    }
    x = matmul(q, x, s, s, cols);
  }
  return tall ? transpose(x, rows, cols) : x;
}

float wave(size_t i, int k) { return std::sin(0.37f * static_cast<float>(i) + 0.9f * static_cast<float>(k)) + 0.1f; }

struct NsCase {
  int64_t rows, cols;
  zs::NsMethod method;
  int steps;
};

class NewtonSchulz : public ::testing::TestWithParam<NsCase> {};

TEST_P(NewtonSchulz, MatchesTheIterationInDouble) {
  const NsCase c = GetParam();
  const auto n = static_cast<size_t>(c.rows * c.cols);
  std::vector<float> g(n);
  Mat ref(n);
  // Pseudo-random entries in [-3, 3): a matrix of full rank (a smooth one
  // has singular values too small for five steps to lift).
  uint32_t state = 12345u + static_cast<uint32_t>(c.rows * 31 + c.cols);
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    ref[i] = g[i] = 6.0f * static_cast<float>(state >> 8) / static_cast<float>(1u << 24) - 3.0f;
  }
  ref = reference_ns(ref, c.rows, c.cols, c.method, c.steps);
  zs::newton_schulz(*zs::host_device(), g.data(), c.rows, c.cols, c.method, c.steps);
  double worst = 0.0, largest = 0.0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::abs(g[i] - ref[i]));
    largest = std::max(largest, std::abs(ref[i]));
  }
  EXPECT_LT(worst, 2e-5 * std::max(1.0, largest)) << c.rows << "x" << c.cols;
  EXPECT_GT(largest, 0.05) << "the iteration left nothing to compare";
  if (c.steps == 5 && c.rows > 1 && c.cols > 1) {
    // Five steps push every singular value into Muon's band (about 0.7 to
    // 1.2): the diagonal of X X^T (or X^T X, the small side) near 1.
    const int64_t s = std::min(c.rows, c.cols);
    Mat x(g.begin(), g.end());
    const Mat gram = c.rows <= c.cols ? matmul(x, transpose(x, c.rows, c.cols), c.rows, c.cols, c.rows)
                                      : matmul(transpose(x, c.rows, c.cols), x, c.cols, c.rows, c.cols);
    for (int64_t d = 0; d < s; ++d) {
      EXPECT_GT(gram[d * s + d], 0.3) << "row " << d;
      EXPECT_LT(gram[d * s + d], 1.6) << "row " << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, NewtonSchulz,
    ::testing::Values(NsCase{6, 17, zs::NsMethod::Gram, 5}, NsCase{17, 6, zs::NsMethod::Gram, 5},
                      NsCase{9, 9, zs::NsMethod::Gram, 5}, NsCase{5, 40, zs::NsMethod::Gram, 2},
                      NsCase{5, 40, zs::NsMethod::Gram, 3}, NsCase{6, 17, zs::NsMethod::Standard, 5},
                      NsCase{31, 12, zs::NsMethod::Standard, 5}, NsCase{1, 7, zs::NsMethod::Gram, 5}));

TEST(NewtonSchulzRefuses, NoSteps) {
  std::vector<float> g(6, 1.0f);
  try {
    zs::newton_schulz(*zs::host_device(), g.data(), 2, 3, zs::NsMethod::Gram, 0);
    FAIL() << "0 steps accepted";
  } catch (const zs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps 0"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------
// 2. The sharded step against full arrays.

struct Spec {
  const char* name;
  std::vector<int64_t> shape;
};
// Odd sizes (padded shards at 2 and 3 ranks); a 3-D param (a 4 x 6 matrix
// to Muon); a vector (AdamW: fewer than 2 dims); and "embed", a matrix in
// a use_muon 0 group (AdamW, as DeepSpeed tags embeddings).
const std::vector<Spec> kSpecs = {{"wide", {5, 9}}, {"tall", {11, 3}}, {"cube", {4, 3, 2}},
                                  {"bias", {7}},    {"embed", {6, 4}}};
constexpr size_t kEmbed = 4;
constexpr float kLr = 0.02f, kAdamLr = 3e-3f, kBeta = 0.95f, kWd = 0.1f;

size_t numel(size_t k) {
  size_t n = 1;
  for (auto d : kSpecs[k].shape) n *= static_cast<size_t>(d);
  return n;
}

float init_value(size_t k, size_t i) { return 0.3f * wave(i, static_cast<int>(k)); }
float grad_mean(int step, size_t k, size_t i) {
  const size_t n = i * 3 + k * 5 + static_cast<size_t>(step) * 7;
  return static_cast<float>(static_cast<int>(n % 13) - 6) / 16.0f;
}
std::vector<float> grad_on(const RankEnv& env, int step, size_t k) {
  std::vector<float> g(numel(k));
  const auto side = static_cast<float>(2 * env.rank - (env.world - 1));  // sums to 0 over the ranks
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = grad_mean(step, k, i) + side * static_cast<float>(static_cast<int>((i + k) % 5) - 2) / 16.0f;
  return g;
}

std::vector<float> as_dtype(const std::vector<float>& v, zs_dtype t) {
  if (t == ZS_FLOAT32) return v;
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = zs::kernels::bf16_to_float(zs::kernels::float_to_bf16(v[i]));
  return out;
}

// Muon and AdamW on the full arrays: the masters after `steps` steps.
struct Reference {
  std::vector<std::vector<float>> master, m1, m2;
  int updates = 0;
  explicit Reference(zs_dtype t) {
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      std::vector<float> v(numel(k));
      for (size_t i = 0; i < v.size(); ++i) v[i] = init_value(k, i);
      master.push_back(as_dtype(v, t));
      m1.emplace_back(v.size(), 0.0f);
      m2.emplace_back(v.size(), 0.0f);
    }
  }
  static bool muon(size_t k) { return kSpecs[k].shape.size() >= 2 && k != kEmbed; }
  void step(int s) {
    ++updates;
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      const size_t n = numel(k);
      std::vector<float> g(n);
      for (size_t i = 0; i < n; ++i) g[i] = grad_mean(s, k, i);
      if (muon(k)) {
        const int64_t rows = kSpecs[k].shape[0], cols = static_cast<int64_t>(n) / rows;
        std::vector<float> u(n);
        for (size_t i = 0; i < n; ++i) {
          m1[k][i] = kBeta * m1[k][i] + (1 - kBeta) * g[i];
          u[i] = kBeta * m1[k][i] + (1 - kBeta) * g[i];
        }
        zs::newton_schulz(*zs::host_device(), u.data(), rows, cols, zs::NsMethod::Gram, 5);
        const double scale = rows > cols ? std::sqrt(static_cast<double>(rows) / cols) : 1.0;
        for (size_t i = 0; i < n; ++i)
          master[k][i] = master[k][i] * (1 - kLr * kWd) - static_cast<float>(kLr * scale) * u[i];
      } else {
        const double b1 = 0.9, b2 = 0.95, eps = 1e-10;
        const double lr = k == kEmbed ? kAdamLr : kLr;  // "bias" steps AdamW at its group's rate
        for (size_t i = 0; i < n; ++i) {
          m1[k][i] = static_cast<float>(b1 * m1[k][i] + (1 - b1) * g[i]);
          m2[k][i] = static_cast<float>(b2 * m2[k][i] + (1 - b2) * g[i] * g[i]);
          const double mh = m1[k][i] / (1 - std::pow(b1, updates)), vh = m2[k][i] / (1 - std::pow(b2, updates));
          master[k][i] = static_cast<float>(master[k][i] * (1 - lr * kWd) - lr * mh / (std::sqrt(vh) + eps));
        }
      }
    }
  }
};

std::vector<zs_param> register_params(zs_context ctx, zs_dtype t, bool with_values) {
  std::vector<zs_param> ps;
  for (size_t k = 0; k < kSpecs.size(); ++k) {
    std::vector<float> v(numel(k));
    for (size_t i = 0; i < v.size(); ++i) v[i] = init_value(k, i);
    std::vector<uint8_t> bytes(v.size() * (t == ZS_FLOAT32 ? 4 : 2));
    for (size_t i = 0; i < v.size(); ++i) {
      if (t == ZS_FLOAT32) {
        std::memcpy(&bytes[i * 4], &v[i], 4);
      } else {
        const uint16_t h = zs::kernels::float_to_bf16(v[i]);
        std::memcpy(&bytes[i * 2], &h, 2);
      }
    }
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = kSpecs[k].name;
    o.dtype = t;
    o.ndim = kSpecs[k].shape.size();
    o.shape = kSpecs[k].shape.data();
    if (with_values) {
      o.init = ZS_INIT_FROM_ALL;
      o.data = bytes.data();
      o.data_bytes = bytes.size();
    }
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
    ps.push_back(p);
  }
  return ps;
}

// Matrices by shape in one group (use_muon -1: "bias" goes to AdamW), the
// embedding in a use_muon 0 group; AdamW at DeepSpeed's Muon defaults.
zs_optimizer make_muon(zs_context ctx, const std::vector<zs_param>& ps) {
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_MUON), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.momentum = kBeta;
  hp.weight_decay = kWd;
  hp.beta2 = 0.95;
  hp.eps = 1e-10;
  std::vector<zs_param> by_shape(ps.begin(), ps.begin() + kEmbed);
  hp.lr = kLr;
  EXPECT_EQ(zs_optimizer_add_group(opt, by_shape.data(), by_shape.size(), &hp, nullptr), ZS_OK) << zs_last_error();
  hp.lr = kAdamLr;
  hp.use_muon = 0;
  EXPECT_EQ(zs_optimizer_add_group(opt, &ps[kEmbed], 1, &hp, nullptr), ZS_OK) << zs_last_error();
  return opt;
}

std::vector<float> full_master(zs_context ctx, zs_optimizer opt, zs_param p, size_t n) {
  float* m = nullptr;
  uint64_t sn = 0;
  EXPECT_EQ(zs_optimizer_state_data(opt, p, 0, &m, &sn), ZS_OK) << zs_last_error();
  std::vector<float> mine(m, m + sn);
  int world = 0;
  EXPECT_EQ(zs_context_world_size(ctx, &world), ZS_OK);
  std::vector<float> all(sn * static_cast<uint64_t>(world));
  zs_group wg = nullptr;
  EXPECT_EQ(zs_context_group(&wg, ctx, ZS_GROUP_WORLD), ZS_OK) << zs_last_error();
  zs_work w = nullptr;
  EXPECT_EQ(zs_allgather(&w, wg, mine.data(), all.data(), sn, ZS_FLOAT32), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_work_wait(w, 30000), ZS_OK) << zs_last_error();
  zs_work_destroy(w);
  zs_group_destroy(wg);
  all.resize(n);
  return all;
}

void push_and_step(const RankEnv& env, zs_optimizer opt, const std::vector<zs_param>& ps, int s) {
  for (size_t k = 0; k < ps.size(); ++k) {
    const auto g = grad_on(env, s, k);
    ASSERT_EQ(zs_grad_push(ps[k], g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
  }
  zs_step_result r = ZS_STEP_RESULT_INIT;
  ASSERT_EQ(zs_optimizer_step(opt, &r), ZS_OK) << zs_last_error();
  EXPECT_FALSE(r.skipped);
}

void expect_masters(zs_context ctx, zs_optimizer opt, const std::vector<zs_param>& ps, const Reference& ref,
                    const std::string& where) {
  for (size_t k = 0; k < ps.size(); ++k) {
    const auto got = full_master(ctx, opt, ps[k], numel(k));
    size_t moved = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], ref.master[k][i], 1e-5) << where << ", " << kSpecs[k].name << "[" << i << "]";
      moved += got[i] != init_value(k, i);
    }
    EXPECT_GT(moved, got.size() / 2) << kSpecs[k].name << " hardly moved";
  }
}

struct Case {
  int world;
  zs_dtype dtype;
};
class OptimizerMuon : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerMuon, MatchesMuonAndAdamWOnFullArrays) {
  const Case c = GetParam();
  run_ranks(c.world, [c](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, c.dtype == ZS_BFLOAT16 ? R"({"bf16": {"enabled": true}})" : nullptr);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, c.dtype, true);
    zs_optimizer opt = make_muon(ctx, ps);
    ASSERT_NE(opt, nullptr);
    Reference ref(c.dtype);
    for (int s = 0; s < 4; ++s) {
      push_and_step(env, opt, ps, s);
      ref.step(s);
    }
    expect_masters(ctx, opt, ps, ref, std::to_string(c.world) + " ranks");
    // A Muon param keeps one moment (its momentum), an AdamW param two.
    float* d = nullptr;
    EXPECT_EQ(zs_optimizer_state_data(opt, ps[0], 1, &d, nullptr), ZS_OK) << zs_last_error();
    EXPECT_EQ(zs_optimizer_state_data(opt, ps[0], 2, &d, nullptr), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(zs_optimizer_state_data(opt, ps[3], 2, &d, nullptr), ZS_OK) << zs_last_error();
    zs_optimizer_destroy(opt);
    for (auto p : ps) zs_param_destroy(p);
    zs_context_destroy(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OptimizerMuon,
                         ::testing::Values(Case{1, ZS_FLOAT32}, Case{2, ZS_FLOAT32}, Case{3, ZS_FLOAT32},
                                           Case{3, ZS_BFLOAT16}));

// ---------------------------------------------------------------------------
// 3. Through a checkpoint: two steps at 2 ranks, saved; loaded at 3 ranks,
// two more; the masters those of four steps on full arrays.

TEST(OptimizerMuonCheckpoint, SavedAtTwoRanksContinuesAtThree) {
  const zs::test::TempDir temp("muon_ckpt");
  const std::string& dir = temp.path();
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32, true);
    zs_optimizer opt = make_muon(ctx, ps);
    for (int s = 0; s < 2; ++s) push_and_step(env, opt, ps, s);
    zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    so.tag = "muon";
    ASSERT_EQ(zs_checkpoint_save(ctx, ps.data(), ps.size(), opt, dir.c_str(), &so), ZS_OK) << zs_last_error();
    zs_optimizer_destroy(opt);
    for (auto p : ps) zs_param_destroy(p);
    zs_context_destroy(ctx);
  });
  ASSERT_FALSE(::testing::Test::HasFailure());
  run_ranks(3, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32, false);
    zs_optimizer opt = make_muon(ctx, ps);
    zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
    lo.tag = "muon";
    ASSERT_EQ(zs_checkpoint_load(ctx, ps.data(), ps.size(), opt, dir.c_str(), &lo, nullptr), ZS_OK)
        << zs_last_error();
    for (int s = 2; s < 4; ++s) push_and_step(env, opt, ps, s);
    Reference ref(ZS_FLOAT32);
    for (int s = 0; s < 4; ++s) ref.step(s);
    expect_masters(ctx, opt, ps, ref, "after the load at 3 ranks");
    zs_optimizer_destroy(opt);
    for (auto p : ps) zs_param_destroy(p);
    zs_context_destroy(ctx);
  });
}

// ---------------------------------------------------------------------------
// 4. Refusals, each naming the value.

void expect_error(zs_status got, zs_status want, const std::string& fragment) {
  EXPECT_EQ(got, want) << "got " << zs_status_string(got) << ": " << zs_last_error();
  EXPECT_NE(std::string(zs_last_error()).find(fragment), std::string::npos)
      << "message '" << zs_last_error() << "' lacks '" << fragment << "'";
}

TEST(OptimizerMuonRefuses, WhatItCannotRun) {
  run_ranks(1, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    const auto ps = register_params(ctx, ZS_FLOAT32, true);
    zs_optimizer opt = nullptr;
    ASSERT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_MUON), ZS_OK) << zs_last_error();
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.momentum = 0.95;
    hp.use_muon = 1;  // a vector cannot step Muon
    expect_error(zs_optimizer_add_group(opt, &ps[3], 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT, "bias");
    hp.use_muon = 2;
    expect_error(zs_optimizer_add_group(opt, &ps[0], 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT, "use_muon = 2");
    hp.use_muon = -1;
    hp.ns_steps = 0;
    expect_error(zs_optimizer_add_group(opt, &ps[0], 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT, "ns_steps = 0");
    hp.ns_steps = 5;
    hp.ns_method = 3;
    expect_error(zs_optimizer_add_group(opt, &ps[0], 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT, "ns_method = 3");
    hp.ns_method = 0;
    hp.momentum = 1.0;
    expect_error(zs_optimizer_add_group(opt, &ps[0], 1, &hp, nullptr), ZS_ERR_INVALID_ARGUMENT, "momentum = 1");
    hp.momentum = 0.95;
    ASSERT_EQ(zs_optimizer_add_group(opt, ps.data(), 2, &hp, nullptr), ZS_OK) << zs_last_error();
    hp.use_muon = 0;
    expect_error(zs_optimizer_set_hparams(opt, 0, &hp), ZS_ERR_INVALID_ARGUMENT, "use_muon 0 (was -1)");
    // Muon's fields on another kind.
    zs_optimizer adamw = nullptr;
    ASSERT_EQ(zs_optimizer_create(&adamw, ctx, ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
    zs_optim_hparams other = ZS_OPTIM_HPARAMS_INIT;
    other.ns_steps = 7;
    expect_error(zs_optimizer_add_group(adamw, &ps[2], 1, &other, nullptr), ZS_ERR_INVALID_ARGUMENT,
                 "ZS_OPTIM_MUON only");
    zs_optimizer_destroy(adamw);
    zs_optimizer_destroy(opt);
    for (auto p : ps) zs_param_destroy(p);
    zs_context_destroy(ctx);
  });
  run_ranks(1, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}})");
    ASSERT_NE(ctx, nullptr);
    zs_optimizer opt = nullptr;
    expect_error(zs_optimizer_create(&opt, ctx, ZS_OPTIM_MUON), ZS_ERR_NOT_SUPPORTED,
                 "bf16_master_weights_and_grads");
    zs_context_destroy(ctx);
  });
}

}  // namespace
