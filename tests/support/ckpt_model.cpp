#include "tests/support/ckpt_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace zs::test {
namespace {

struct Spec {
  const char* name;
  std::vector<int64_t> shape;
};

float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<Spec> specs(int64_t n_big) {
  std::vector<Spec> s = {{"w1", {7, 5}}, {"b1", {5}}, {"w2", {3, 11}}, {"s", {}}, {"z", {0, 3}}};
  if (n_big > 0) s.push_back({"big", {n_big}});
  return s;
}

std::vector<float> full_of(zs_param p, zs_dtype dtype, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n == 0) return out;
  if (dtype == ZS_FLOAT32) {
    EXPECT_EQ(zs_param_copy_to(p, out.data(), out.size() * 4), ZS_OK) << zs_last_error();
  } else {
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    EXPECT_EQ(zs_param_copy_to(p, raw.data(), raw.size() * 2), ZS_OK) << zs_last_error();
    for (size_t i = 0; i < raw.size(); ++i) out[i] = bf16_to_f32(raw[i]);
  }
  return out;
}

}  // namespace

CkptModel make_ckpt_model(const RankEnv& env, zs_dtype dtype, zs_optimizer_kind kind, int64_t n_big,
                          int timeout_ms, const char* config_json) {
  CkptModel m;
  m.dtype = dtype;
  m.rank = env.rank;
  m.world = env.world;
  m.ctx = make_context(env, config_json, timeout_ms);
  if (m.ctx == nullptr) return m;
  uint64_t seed = 11;
  for (const auto& s : specs(n_big)) {
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = s.name;
    o.dtype = dtype;
    o.ndim = static_cast<int>(s.shape.size());
    o.shape = s.shape.data();
    o.init = ZS_INIT_NORMAL;
    o.seed = seed++;
    o.a = 0.0;
    o.b = 0.5;
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, m.ctx, &o), ZS_OK) << zs_last_error();
    m.params.push_back(p);
  }
  EXPECT_EQ(zs_optimizer_create(&m.opt, m.ctx, kind), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.01;
  hp.momentum = 0.9;
  // Two groups, so hyper-parameters per group are saved and restored.
  EXPECT_EQ(zs_optimizer_add_group(m.opt, m.params.data(), 2, &hp, nullptr), ZS_OK) << zs_last_error();
  hp.lr = 0.02;
  hp.weight_decay = 0.0;
  EXPECT_EQ(zs_optimizer_add_group(m.opt, m.params.data() + 2, m.params.size() - 2, &hp, nullptr), ZS_OK)
      << zs_last_error();
  return m;
}

void destroy_ckpt_model(CkptModel& m) {
  zs_optimizer_destroy(m.opt);
  for (auto p : m.params) zs_param_destroy(p);
  zs_context_destroy(m.ctx);
  m = CkptModel{};
}

void push_ckpt_grads(CkptModel& m, int micro) {
  int64_t step = 0;
  ASSERT_EQ(zs_optimizer_get_step(m.opt, &step), ZS_OK);
  const float weight = 1.0f + 0.25f * static_cast<float>(micro);
  for (zs_param p : m.params) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ASSERT_EQ(zs_param_get_info(p, &info), ZS_OK);
    const int64_t n = static_cast<int64_t>(info.numel);
    zs_gather g = nullptr;
    ASSERT_EQ(zs_fetch(&g, m.ctx, &p, 1), ZS_OK) << zs_last_error();
    ASSERT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
    zs_gather_destroy(g);
    const std::vector<float> w = full_of(p, m.dtype, n);
    ASSERT_EQ(zs_release(m.ctx, &p, 1), ZS_OK);
    // This rank's samples of a global batch of 12: the mean of
    // (w - t_i) * (1 + 0.1 i) + 0.05 sin(3 w), t_i = sin(0.37 j + i + 0.1 step)
    // a per-sample target, by the angle sum so that an element costs three
    // sines and cosines whatever the samples (the tests run at -O0 under
    // ASan, where a sine per sample and element took seconds a step).
    std::vector<int> samples;
    for (int i = m.rank; i < 12; i += m.world) samples.push_back(i);
    std::vector<float> sin_i, cos_i;
    for (int i : samples) {
      sin_i.push_back(std::sin(static_cast<float>(i)));
      cos_i.push_back(std::cos(static_cast<float>(i)));
    }
    std::vector<float> grad(static_cast<size_t>(n), 0.0f);
    const int count = static_cast<int>(samples.size());
    for (int64_t j = 0; j < n; ++j) {
      const float a = 0.37f * static_cast<float>(j) + 0.1f * static_cast<float>(step);
      const float sa = std::sin(a), ca = std::cos(a);
      const float wj = w[static_cast<size_t>(j)];
      const float wave = 0.05f * std::sin(3.0f * wj);
      float sum = 0.0f;
      for (int k = 0; k < count; ++k) {
        const float t = sa * cos_i[static_cast<size_t>(k)] + ca * sin_i[static_cast<size_t>(k)];
        sum += (wj - t) * (1.0f + 0.1f * static_cast<float>(samples[static_cast<size_t>(k)])) + wave;
      }
      grad[static_cast<size_t>(j)] = sum;
    }
    for (auto& x : grad) x = x * weight / static_cast<float>(count);
    if (n == 0) continue;
    ASSERT_EQ(zs_grad_push(p, grad.data(), ZS_FLOAT32, grad.size() * 4), ZS_OK) << zs_last_error();
  }
}

void train_ckpt_model(CkptModel& m, int steps) {
  for (int k = 0; k < steps; ++k) {
    push_ckpt_grads(m, 0);
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ASSERT_EQ(zs_optimizer_step(m.opt, &r), ZS_OK) << zs_last_error();
    ASSERT_FALSE(r.skipped);
  }
}

std::vector<float> full_values(CkptModel& m) {
  std::vector<float> all;
  for (zs_param p : m.params) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    EXPECT_EQ(zs_param_get_info(p, &info), ZS_OK);
    zs_gather g = nullptr;
    EXPECT_EQ(zs_fetch(&g, m.ctx, &p, 1), ZS_OK) << zs_last_error();
    EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
    zs_gather_destroy(g);
    const auto v = full_of(p, m.dtype, static_cast<int64_t>(info.numel));
    EXPECT_EQ(zs_release(m.ctx, &p, 1), ZS_OK);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

std::vector<float> optimizer_values(CkptModel& m) {
  std::vector<float> all;
  for (zs_param p : m.params)
    for (int slot = 0; slot < 3; ++slot) {
      float* data = nullptr;
      uint64_t n = 0;
      if (zs_optimizer_state_data(m.opt, p, slot, &data, &n) == ZS_OK) all.insert(all.end(), data, data + n);
    }
  return all;
}

void write_floats(const std::string& path, const std::vector<float>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return {};
  const auto n = static_cast<size_t>(f.tellg());
  std::vector<float> v(n / 4);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n));
  return v;
}

std::vector<std::vector<float>> read_per_rank(const std::string& prefix, int world) {
  std::vector<std::vector<float>> per_rank;
  for (int r = 0; r < world; ++r) per_rank.push_back(read_floats(prefix + "." + std::to_string(r)));
  return per_rank;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

std::string make_temp_dir(const char* what) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/zs_" + what + "_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << tmpl;
  return buf.data();
}

}  // namespace zs::test
