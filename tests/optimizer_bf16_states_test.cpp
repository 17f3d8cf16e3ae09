// bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states (DeepSpeed
// 0.19): a bf16 param without an fp32 master (its bf16 shard is stepped in
// place) and, with the second key, its moments in bf16.
//
// - The engine on 2 and 3 real ranks, params of odd sizes (7, 33, 1000),
//   AdamW and SGD with Nesterov momentum, bit for bit against a reference
//   on the whole param: the pre-existing fp32 scalar kernels, then the
//   param (and with bf16 states the moments) rounded to bf16 after each step.
// - The mixed kernels on every SIMD path against the same reference, and
//   (where a GPU is visible) the CUDA kernels and a CUDA context.
// - The ledger: optimizer bytes per shard element 12 -> 8 -> 4 (AdamW),
//   8 -> 4 -> 2 (SGD with momentum), gradient shards fp32 throughout.
// - Config errors, the keys no longer listed as inactive, the External
//   optimizer's and NVMe's refusals, NVMe with bf16 masters alone.
// - Checkpoints: bf16 states saved at 2 ranks as bf16 chunks without a
//   master, loaded at 3 into fp32-state and bf16-state optimizers; fp32
//   masters and moments loaded at 3 into a bf16-state optimizer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "impl/config/config.h"
#include "kernels/elementwise.h"
#include "kernels/optim.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/io_uring_probe.h"
#include "tests/support/multirank.h"
#include "tests/support/optim_cases.h"
#include "tests/support/swap_dir.h"

#ifdef ZS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/kernels.h"
#endif

using zs::test::RankEnv;
using zs::test::run_ranks;
using zs::kernels::WorkDtype;

namespace {

constexpr int kParams = 3;
constexpr int64_t kSizes[kParams] = {7, 33, 1000};  // odd: padded shards at 2 and 3 ranks
const char* const kNames[kParams] = {"a", "b", "c"};

uint16_t bf16(float x) { return zs::kernels::float_to_bf16(x); }
float widen(uint16_t h) { return zs::kernels::bf16_to_float(h); }
float round_bf16(float x) { return widen(bf16(x)); }

float init_value(int k, uint64_t i) {
  return std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(k)) * 0.5f;
}

// q / 256 with |q| <= 63: a bf16 value whose sum over 2 or 3 ranks is exact
// in bf16 (3 * 63 < 256), so the average the reduce-scatter makes over the
// bf16 wire is this value exactly, whatever the world size.
float grad_value(int step, int k, uint64_t i) {
  const auto h = static_cast<uint32_t>(i * 2654435761u + static_cast<uint32_t>(step) * 40503u +
                                       static_cast<uint32_t>(k) * 977u);
  const int q = static_cast<int>((h >> 9) % 127u) - 63;
  return static_cast<float>(q) / 256.0f;
}

std::vector<float> grads_of(int step, int k) {
  std::vector<float> g(static_cast<size_t>(kSizes[k]));
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(step, k, i);
  return g;
}

std::string config(bool masters, bool states) {
  return std::string(R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": )") +
         (masters ? "true" : "false") + R"(, "bf16_optimizer_states": )" + (states ? "true" : "false") +
         "}}";
}

zs_optim_hparams hparams(zs_optimizer_kind kind) {
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  if (kind == ZS_OPTIM_SGD) {
    hp.lr = 0.05;
    hp.momentum = 0.9;
    hp.nesterov = 1;
    hp.weight_decay = 0.01;
  } else {
    hp.lr = 0.01;
    hp.weight_decay = 0.1;
  }
  return hp;
}

double lr_at(zs_optimizer_kind kind, int step) { return hparams(kind).lr / (1 + step); }

// The whole param and its state, stepped as the engine must.
struct Ref {
  int k = 0;
  bool master16 = false, states16 = false;
  std::vector<float> master, m, v;  // master: fp32, or the bf16 value when master16
  std::vector<uint16_t> working;

  Ref(int k_, bool master16_, bool states16_) : k(k_), master16(master16_), states16(states16_) {
    const auto n = static_cast<size_t>(kSizes[k]);
    working.resize(n);
    master.resize(n);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
      working[i] = bf16(init_value(k, i));
      master[i] = widen(working[i]);
    }
  }
  // One step of the fp32 kernels that predate the keys, then the rounding
  // the keys ask for: the param once (the working copy is the rounded
  // master), with bf16 states the moments once.
  void step(zs_optimizer_kind kind, double lr, int64_t n_step, const std::vector<float>& g) {
    const zs_optim_hparams hp = hparams(kind);
    if (kind == ZS_OPTIM_SGD) {
      zs::kernels::SgdHyper h{static_cast<float>(lr), static_cast<float>(hp.momentum),
                              static_cast<float>(hp.dampening), static_cast<float>(hp.weight_decay),
                              hp.nesterov != 0, n_step == 1};
      zs::kernels::sgd_step_scalar(master.data(), m.data(), g.data(), master.size(), h, 1.0f,
                                   working.data(), WorkDtype::BF16);
    } else {
      zs::kernels::AdamHyper h{static_cast<float>(lr),   static_cast<float>(hp.beta1),
                               static_cast<float>(hp.beta2), static_cast<float>(hp.eps),
                               static_cast<float>(hp.weight_decay), kind == ZS_OPTIM_ADAMW,
                               hp.bias_correction != 0, n_step};
      zs::kernels::adam_step_scalar(master.data(), m.data(), v.data(), g.data(), master.size(), h, 1.0f,
                                    working.data(), WorkDtype::BF16);
    }
    for (size_t i = 0; i < master.size(); ++i) {
      if (master16) master[i] = widen(working[i]);
      if (states16) {
        m[i] = round_bf16(m[i]);
        v[i] = round_bf16(v[i]);
      }
    }
  }
};

std::vector<Ref> refs(bool master16, bool states16) {
  std::vector<Ref> r;
  for (int k = 0; k < kParams; ++k) r.emplace_back(k, master16, states16);
  return r;
}

struct Model {
  zs_context ctx = nullptr;
  std::vector<zs_param> params;
  zs_optimizer opt = nullptr;
};

Model make_model(const RankEnv& env, const std::string& cfg, zs_optimizer_kind kind) {
  Model m;
  m.ctx = zs::test::make_context(env, cfg.c_str());
  if (m.ctx == nullptr) return m;
  for (int k = 0; k < kParams; ++k) {
    std::vector<uint16_t> init(static_cast<size_t>(kSizes[k]));
    for (size_t i = 0; i < init.size(); ++i) init[i] = bf16(init_value(k, i));
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = kNames[k];
    o.dtype = ZS_BFLOAT16;
    o.ndim = 1;
    o.shape = &kSizes[k];
    o.init = ZS_INIT_FROM_ALL;
    o.data = init.data();
    o.data_bytes = init.size() * 2;
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, m.ctx, &o), ZS_OK) << zs_last_error();
    m.params.push_back(p);
  }
  EXPECT_EQ(zs_optimizer_create(&m.opt, m.ctx, kind), ZS_OK) << zs_last_error();
  const zs_optim_hparams hp = hparams(kind);
  EXPECT_EQ(zs_optimizer_add_group(m.opt, m.params.data(), m.params.size(), &hp, nullptr), ZS_OK)
      << zs_last_error();
  return m;
}

void destroy(Model& m) {
  zs_optimizer_destroy(m.opt);
  zs_context_destroy(m.ctx);
  m = Model();
}

std::vector<uint16_t> gathered(Model& m, int k) {
  zs_param p = m.params[static_cast<size_t>(k)];
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, m.ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  std::vector<uint16_t> out(static_cast<size_t>(kSizes[k]));
  EXPECT_EQ(zs_param_copy_to(p, out.data(), out.size() * 2), ZS_OK) << zs_last_error();
  zs_release(m.ctx, &p, 1);
  zs_gather_destroy(g);
  return out;
}

// Engine step `step` (0-based, optimizer step step + 1) and the same on the
// references.
void step_both(Model& m, std::vector<Ref>& r, zs_optimizer_kind kind, int step) {
  ZS_ASSERT_OK(zs_optimizer_set_lr(m.opt, -1, lr_at(kind, step)));
  for (int k = 0; k < kParams; ++k) {
    const auto g = grads_of(step, k);
    ZS_ASSERT_OK(zs_grad_push(m.params[static_cast<size_t>(k)], g.data(), ZS_FLOAT32, g.size() * 4));
  }
  zs_step_result res = ZS_STEP_RESULT_INIT;
  ZS_ASSERT_OK(zs_optimizer_step(m.opt, &res));
  ASSERT_EQ(res.skipped, 0);
  ASSERT_EQ(res.step, step + 1);
  for (int k = 0; k < kParams; ++k) r[static_cast<size_t>(k)].step(kind, lr_at(kind, step), step + 1, grads_of(step, k));
}

void expect_params(Model& m, const std::vector<Ref>& r, const std::string& what) {
  for (int k = 0; k < kParams; ++k)
    ASSERT_EQ(gathered(m, k), r[static_cast<size_t>(k)].working) << what << ", param " << kNames[k];
}

uint64_t shard_elements(Model& m) {
  uint64_t total = 0;
  for (zs_param p : m.params) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    EXPECT_EQ(zs_param_get_info(p, &info), ZS_OK) << zs_last_error();
    total += info.shard_numel;
  }
  return total;
}

zs_memory_stats memory(Model& m) {
  zs_memory_stats s = ZS_MEMORY_STATS_INIT;
  EXPECT_EQ(zs_context_memory(m.ctx, &s), ZS_OK) << zs_last_error();
  return s;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- the engine against the reference ---------------------------------------

struct Case {
  int world;
  bool states;
  zs_optimizer_kind kind;
};

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return std::string(i.param.kind == ZS_OPTIM_SGD ? "Sgd" : "AdamW") + (i.param.states ? "Bf16States" : "Fp32States") +
         std::to_string(i.param.world) + "Ranks";
}

class OptimizerBf16Masters : public ::testing::TestWithParam<Case> {};

// Bit for bit with the reference at every step, and the ledger holding
// exactly the bytes of the state kept: per shard element, no master (0
// bytes) and 4 (fp32) or 2 (bf16) bytes per moment.
TEST_P(OptimizerBf16Masters, StepsMatchTheReferenceBitwise) {
  const Case c = GetParam();
  run_ranks(c.world, [c](const RankEnv& env) {
    Model m = make_model(env, config(true, c.states), c.kind);
    ASSERT_NE(m.ctx, nullptr);
    auto r = refs(true, c.states);
    for (int s = 0; s < 4; ++s) {
      step_both(m, r, c.kind, s);
      expect_params(m, r, "step " + std::to_string(s));
    }
    const uint64_t elems = shard_elements(m);
    const uint64_t moments = c.kind == ZS_OPTIM_SGD ? 1 : 2;
    const auto mem = memory(m);
    EXPECT_EQ(mem.optimizer_bytes, elems * moments * (c.states ? 2 : 4));
    EXPECT_EQ(mem.grad_bytes, elems * 4) << "gradient shards stay fp32";
    zs_optimizer_destroy(m.opt);
    m.opt = nullptr;
    EXPECT_EQ(memory(m).optimizer_bytes, 0u);
    destroy(m);
  });
}

INSTANTIATE_TEST_SUITE_P(All, OptimizerBf16Masters,
                         ::testing::Values(Case{2, false, ZS_OPTIM_ADAMW}, Case{3, false, ZS_OPTIM_ADAMW},
                                           Case{2, true, ZS_OPTIM_ADAMW}, Case{3, true, ZS_OPTIM_ADAMW},
                                           Case{3, false, ZS_OPTIM_SGD}, Case{2, true, ZS_OPTIM_SGD}),
                         case_name);

// ---- memory --------------------------------------------------------------------

struct Measured {
  uint64_t elements = 0, optimizer = 0, grads = 0;
};

Measured measure(const std::string& cfg, zs_optimizer_kind kind, const std::string& out) {
  run_ranks(2, [&](const RankEnv& env) {
    Model m = make_model(env, cfg, kind);
    ASSERT_NE(m.ctx, nullptr);
    auto r = refs(false, false);  // only to drive the step
    step_both(m, r, kind, 0);
    const auto mem = memory(m);
    if (env.rank == 0) {
      std::ofstream f(out);
      f << shard_elements(m) << " " << mem.optimizer_bytes << " " << mem.grad_bytes << "\n";
    }
    destroy(m);
  });
  Measured got;
  std::ifstream f(out);
  f >> got.elements >> got.optimizer >> got.grads;
  return got;
}

// The saving the keys promise, measured on the ledger (zs_context_memory's
// optimizer_bytes) of rank 0 at 2 ranks: 521 shard elements (4 + 17 + 500).
TEST(OptimizerBf16Memory, LedgerDropsByTheBytesPerShardElement) {
  const std::string dir = zs::test::make_temp_dir("bf16mem");
  for (auto kind : {ZS_OPTIM_ADAMW, ZS_OPTIM_SGD}) {
    const char* name = kind == ZS_OPTIM_SGD ? "sgd" : "adamw";
    const Measured base = measure(R"({"bf16": {"enabled": true}})", kind, dir + "/base");
    const Measured masters = measure(config(true, false), kind, dir + "/masters");
    const Measured states = measure(config(true, true), kind, dir + "/states");
    ASSERT_EQ(base.elements, 521u);
    ASSERT_EQ(masters.elements, base.elements);
    ASSERT_EQ(states.elements, base.elements);
    const uint64_t e = base.elements;
    const uint64_t moments = kind == ZS_OPTIM_SGD ? 1 : 2;
    // fp32 master + fp32 moments; no master; bf16 moments.
    EXPECT_EQ(base.optimizer, e * 4 * (1 + moments)) << name;
    EXPECT_EQ(base.optimizer - masters.optimizer, e * 4) << name << ": the fp32 master (4 B/element) is gone";
    EXPECT_EQ(masters.optimizer - states.optimizer, e * 2 * moments) << name << ": moments 4 -> 2 B/element";
    EXPECT_EQ(states.optimizer, e * 2 * moments) << name;
    // Gradient shards are fp32 under either key.
    EXPECT_EQ(base.grads, e * 4) << name;
    EXPECT_EQ(masters.grads, base.grads) << name;
    EXPECT_EQ(states.grads, base.grads) << name;
    std::printf("[ measured ] %s, %llu shard elements: optimizer bytes %llu (fp32 masters) -> %llu "
                "(bf16 masters) -> %llu (+ bf16 states), i.e. %.0f -> %.0f -> %.0f B/element; "
                "grad bytes %llu\n",
                name, static_cast<unsigned long long>(e), static_cast<unsigned long long>(base.optimizer),
                static_cast<unsigned long long>(masters.optimizer),
                static_cast<unsigned long long>(states.optimizer), static_cast<double>(base.optimizer) / e,
                static_cast<double>(masters.optimizer) / e, static_cast<double>(states.optimizer) / e,
                static_cast<unsigned long long>(base.grads));
  }
  std::filesystem::remove_all(dir);
}

// ---- config ----------------------------------------------------------------------

void expect_config_error(const std::string& cfg, const std::vector<std::string>& parts) {
  EXPECT_EQ(zs_config_check(cfg.c_str(), 0), ZS_ERR_INVALID_CONFIG) << cfg;
  const std::string error = zs_last_error();
  for (const auto& part : parts) EXPECT_TRUE(contains(error, part)) << "'" << part << "' not in: " << error;
}

TEST(OptimizerBf16Config, KeysNeedBf16AndStatesNeedMasters) {
  expect_config_error(R"({"bf16": {"bf16_master_weights_and_grads": true}})",
                      {"bf16.bf16_master_weights_and_grads (true)", "bf16.enabled"});
  expect_config_error(R"({"bf16": {"enabled": false, "bf16_master_weights_and_grads": true}})",
                      {"bf16.bf16_master_weights_and_grads (true)", "bf16.enabled"});
  expect_config_error(R"({"fp16": {"enabled": true}, "bf16": {"bf16_master_weights_and_grads": true}})",
                      {"bf16.bf16_master_weights_and_grads (true)", "fp16.enabled"});
  expect_config_error(R"({"bf16": {"bf16_optimizer_states": true}})",
                      {"bf16.bf16_optimizer_states (true)", "bf16.enabled"});
  expect_config_error(R"({"bf16": {"enabled": true, "bf16_optimizer_states": true}})",
                      {"bf16.bf16_optimizer_states (true)", "bf16.bf16_master_weights_and_grads"});
  expect_config_error(R"({"bf16": {"enabled": true, "bf16_optimizer_states": 1}})",
                      {"bf16.bf16_optimizer_states", "got 1"});
  // The bfloat16 spelling of the section, and "auto" (unset).
  expect_config_error(R"({"bfloat16": {"enabled": true, "bf16_optimizer_states": true}})",
                      {"bf16_optimizer_states (true)", "bf16_master_weights_and_grads"});
  EXPECT_EQ(zs_config_check(R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": "auto",
      "bf16_optimizer_states": false}})", 0), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_config_check(config(true, true).c_str(), 0), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_config_check(R"({"bf16": {"enabled": false, "bf16_master_weights_and_grads": false,
      "bf16_optimizer_states": false}})", 0), ZS_OK) << zs_last_error();
}

// Read into the config, in the effective config, and neither unused nor
// listed as inactive.
TEST(OptimizerBf16Config, KeysAreReadAndNotListedAsInactive) {
  const zs::Config c = zs::parse_config(config(true, true), 0);
  EXPECT_TRUE(c.bf16_master_weights_and_grads);
  EXPECT_TRUE(c.bf16_optimizer_states);
  EXPECT_TRUE(zs::inactive_keys(c).empty());
  EXPECT_TRUE(c.unused_keys.empty());
  const auto j = nlohmann::json::parse(zs::config_to_json(c));
  EXPECT_EQ(j.at("bf16").at("bf16_master_weights_and_grads"), true);
  EXPECT_EQ(j.at("bf16").at("bf16_optimizer_states"), true);
  const zs::Config again = zs::parse_config(zs::config_to_json(c), 0);
  EXPECT_TRUE(again.bf16_master_weights_and_grads && again.bf16_optimizer_states);
  const zs::Config plain = zs::parse_config(R"({"bf16": {"enabled": true}})", 0);
  EXPECT_FALSE(plain.bf16_master_weights_and_grads);
  EXPECT_FALSE(plain.bf16_optimizer_states);
}

// ---- refusals ----------------------------------------------------------------------

// A torch optimizer stepping the shards (External) steps fp32 masters,
// which bf16_master_weights_and_grads removes: refused at creation.
TEST(OptimizerBf16Refusals, ExternalOptimizerIsRefusedUnderBf16Masters) {
  run_ranks(1, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config(true, false).c_str());
    ASSERT_NE(ctx, nullptr);
    zs_optimizer opt = nullptr;
    EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_EXTERNAL), ZS_ERR_NOT_SUPPORTED);
    const std::string error = zs_last_error();
    EXPECT_TRUE(contains(error, "bf16.bf16_master_weights_and_grads")) << error;
    EXPECT_TRUE(contains(error, "external optimizer")) << error;
    EXPECT_EQ(opt, nullptr);
    zs_context_destroy(ctx);
  });
}

// The slots the C ABI cannot hand out as float*: a bf16 param's master
// (its shard is the master) and bf16 moments.
TEST(OptimizerBf16Refusals, StateDataRefusesBf16SlotsNamingTheKey) {
  run_ranks(1, [](const RankEnv& env) {
    Model m = make_model(env, config(true, true), ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    float* data = nullptr;
    uint64_t n = 0;
    EXPECT_EQ(zs_optimizer_state_data(m.opt, m.params[0], 0, &data, &n), ZS_ERR_INVALID_STATE);
    EXPECT_TRUE(contains(zs_last_error(), "bf16.bf16_master_weights_and_grads")) << zs_last_error();
    for (int slot : {1, 2}) {
      EXPECT_EQ(zs_optimizer_state_data(m.opt, m.params[0], slot, &data, &n), ZS_ERR_INVALID_STATE);
      EXPECT_TRUE(contains(zs_last_error(), "bf16.bf16_optimizer_states")) << zs_last_error();
    }
    destroy(m);
    // bf16 masters with fp32 moments: the moments are fp32 views as before.
    Model f = make_model(env, config(true, false), ZS_OPTIM_ADAMW);
    ASSERT_NE(f.ctx, nullptr);
    EXPECT_EQ(zs_optimizer_state_data(f.opt, f.params[2], 1, &data, &n), ZS_OK) << zs_last_error();
    EXPECT_EQ(n, 1000u);
    EXPECT_EQ(zs_optimizer_state_data(f.opt, f.params[2], 0, &data, &n), ZS_ERR_INVALID_STATE);
    destroy(f);
  });
}

std::string nvme_config(const std::string& dir, bool states) {
  return R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": )" +
         std::string(states ? "true" : "false") +
         R"(}, "zero_optimization": {"sub_group_size": 300, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         dir + R"(", "buffer_count": 2}}, "aio": {"block_size": 8192, "queue_depth": 4}})";
}

// The swap file holds fp32 arrays: bf16 moments there are refused, naming
// both keys, before anything is allocated.
TEST(OptimizerBf16Refusals, NvmeRefusesBf16StatesNamingBothKeys) {
  const std::string dir = zs::test::make_temp_dir("bf16nvme");
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nvme_config(dir, true).c_str());
    ASSERT_NE(ctx, nullptr);
    zs_optimizer opt = nullptr;
    EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_ERR_NOT_SUPPORTED);
    const std::string error = zs_last_error();
    EXPECT_TRUE(contains(error, "bf16.bf16_optimizer_states")) << error;
    EXPECT_TRUE(contains(error, "offload_optimizer.device \"nvme\"")) << error;
    zs_context_destroy(ctx);
  });
  std::filesystem::remove_all(dir);
}

// Steps 2 ranks with state on NVMe against refs(masters, false) bit for
// bit; returns rank 0's swap file bytes (zs_memory_stats.nvme_bytes).
uint64_t nvme_run(const std::string& cfg, bool masters, const std::string& out) {
  run_ranks(2, [&](const RankEnv& env) {
    Model m = make_model(env, cfg, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    auto r = refs(masters, false);
    for (int s = 0; s < 3; ++s) {
      step_both(m, r, ZS_OPTIM_ADAMW, s);
      expect_params(m, r, "step " + std::to_string(s));
    }
    if (env.rank == 0) std::ofstream(out) << memory(m).nvme_bytes << "\n";
    destroy(m);
  });
  uint64_t bytes = 0;
  std::ifstream(out) >> bytes;
  return bytes;
}

// bf16 masters alone on NVMe: the swap file keeps only the moments (the
// masters are the shards, stepped in place) and the steps are the
// in-memory ones, bit for bit.
TEST(OptimizerBf16Refusals, NvmeWithBf16MastersStepsAsInMemory) {
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("bf16nvme");
  std::string plain = nvme_config(dir, false);
  plain.replace(plain.find("\"bf16_master_weights_and_grads\": true"), 37,
                "\"bf16_master_weights_and_grads\": false");
  const uint64_t with_masters = nvme_run(plain, false, dir + "/plain.txt");
  const uint64_t without = nvme_run(nvme_config(dir, false), true, dir + "/masters.txt");
  EXPECT_GT(with_masters, 0u);
  EXPECT_GT(without, 0u);
  EXPECT_LT(without, with_masters) << "the swap file still holds fp32 masters";
  std::printf("[ measured ] NVMe swap file, rank 0: %llu bytes with fp32 masters, %llu with bf16 masters\n",
              static_cast<unsigned long long>(with_masters), static_cast<unsigned long long>(without));
  std::filesystem::remove_all(dir);
}

// ---- checkpoints ------------------------------------------------------------------

zs_status save(Model& m, const std::string& dir) {
  zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
  o.tag = "t";
  return zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
}

zs_status load(Model& m, const std::string& dir) {
  zs_checkpoint_load_options o = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
  o.tag = "t";
  return zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o, nullptr);
}

// The slot of param k on this rank, against the reference's full array.
void expect_slot(Model& m, int k, int slot, const std::vector<float>& full, const std::string& what) {
  float* data = nullptr;
  uint64_t n = 0;
  ZS_ASSERT_OK(zs_optimizer_state_data(m.opt, m.params[static_cast<size_t>(k)], slot, &data, &n));
  zs_param_info info = ZS_PARAM_INFO_INIT;
  ZS_ASSERT_OK(zs_param_get_info(m.params[static_cast<size_t>(k)], &info));
  ASSERT_EQ(n, info.shard_numel);
  for (uint64_t i = 0; i < info.shard_valid; ++i) {
    uint32_t a, b;
    std::memcpy(&a, &data[i], 4);
    std::memcpy(&b, &full[info.shard_offset + i], 4);
    ASSERT_EQ(a, b) << what << ": param " << kNames[k] << " slot " << slot << " element "
                    << info.shard_offset + i;
  }
}

constexpr int kBefore = 3;

// Saved at 2 ranks with bf16 masters and states: the manifest holds no
// master and bf16 moments; loaded at 3 ranks into an optimizer with fp32
// masters and moments (the bf16 values widened, exactly) and into one with
// bf16 states (bit for bit), each then stepping as its reference.
TEST(OptimizerBf16Checkpoint, Bf16StatesSavedAt2LoadAt3IntoFp32AndBf16States) {
  const std::string dir = zs::test::make_temp_dir("bf16ckpt");
  const auto kind = ZS_OPTIM_ADAMW;
  run_ranks(2, [&](const RankEnv& env) {
    Model m = make_model(env, config(true, true), kind);
    ASSERT_NE(m.ctx, nullptr);
    auto r = refs(true, true);
    for (int s = 0; s < kBefore; ++s) step_both(m, r, kind, s);
    ZS_ASSERT_OK(save(m, dir));
    destroy(m);
  });
  {
    std::ifstream f(dir + "/t/manifest.json");
    ASSERT_TRUE(f.good());
    const auto j = nlohmann::json::parse(f);
    for (const auto& p : j.at("params")) {
      const auto& states = p.at("states");
      EXPECT_FALSE(states.contains("master")) << p.at("name") << ": the bf16 shard is the master";
      for (const char* s : {"param", "exp_avg", "exp_avg_sq"})
        for (const auto& c : states.at(s)) EXPECT_EQ(c.at("dtype"), "BF16") << p.at("name") << " " << s;
    }
  }
  ASSERT_EQ(zs_checkpoint_verify(dir.c_str(), "t", nullptr, nullptr), ZS_OK) << zs_last_error();
  // What the saved run holds after kBefore steps.
  auto saved = refs(true, true);
  for (int s = 0; s < kBefore; ++s)
    for (int k = 0; k < kParams; ++k) saved[static_cast<size_t>(k)].step(kind, lr_at(kind, s), s + 1, grads_of(s, k));

  // Into fp32 masters and moments (bf16.enabled alone).
  run_ranks(3, [&](const RankEnv& env) {
    Model m = make_model(env, R"({"bf16": {"enabled": true}})", kind);
    ASSERT_NE(m.ctx, nullptr);
    auto scratch = refs(false, false);
    step_both(m, scratch, kind, 0);  // state the load must replace
    ZS_ASSERT_OK(load(m, dir));
    expect_params(m, saved, "loaded into fp32 state");
    std::vector<Ref> r = saved;  // continues with an fp32 master from here
    for (int k = 0; k < kParams; ++k) {
      Ref& x = r[static_cast<size_t>(k)];
      x.master16 = x.states16 = false;
      expect_slot(m, k, 0, x.master, "master (the bf16 param widened)");
      expect_slot(m, k, 1, x.m, "exp_avg (bf16 widened)");
      expect_slot(m, k, 2, x.v, "exp_avg_sq (bf16 widened)");
    }
    for (int s = kBefore; s < kBefore + 2; ++s) {
      step_both(m, r, kind, s);
      expect_params(m, r, "fp32 state, step " + std::to_string(s));
    }
    destroy(m);
  });
  // Into bf16 masters and states.
  run_ranks(3, [&](const RankEnv& env) {
    Model m = make_model(env, config(true, true), kind);
    ASSERT_NE(m.ctx, nullptr);
    auto scratch = refs(true, true);
    step_both(m, scratch, kind, 0);
    ZS_ASSERT_OK(load(m, dir));
    int64_t steps = 0;
    ZS_ASSERT_OK(zs_optimizer_get_step(m.opt, &steps));
    EXPECT_EQ(steps, kBefore);
    expect_params(m, saved, "loaded into bf16 state");
    std::vector<Ref> r = saved;
    for (int s = kBefore; s < kBefore + 2; ++s) {
      step_both(m, r, kind, s);
      expect_params(m, r, "bf16 state, step " + std::to_string(s));
    }
    destroy(m);
  });
  std::filesystem::remove_all(dir);
}

// Saved at 2 ranks with fp32 masters and moments, loaded at 3 into bf16
// masters and states: the params are the saved masters rounded to bf16,
// the moments the saved ones rounded, and the steps go on from there.
TEST(OptimizerBf16Checkpoint, Fp32StateSavedAt2LoadsAt3IntoBf16States) {
  const std::string dir = zs::test::make_temp_dir("bf16ckpt");
  const auto kind = ZS_OPTIM_ADAMW;
  run_ranks(2, [&](const RankEnv& env) {
    Model m = make_model(env, R"({"bf16": {"enabled": true}})", kind);
    ASSERT_NE(m.ctx, nullptr);
    auto r = refs(false, false);
    for (int s = 0; s < kBefore; ++s) step_both(m, r, kind, s);
    ZS_ASSERT_OK(save(m, dir));
    destroy(m);
  });
  {
    std::ifstream f(dir + "/t/manifest.json");
    const auto j = nlohmann::json::parse(f);
    for (const auto& p : j.at("params"))
      for (const char* s : {"master", "exp_avg", "exp_avg_sq"})
        for (const auto& c : p.at("states").at(s)) EXPECT_EQ(c.at("dtype"), "F32") << p.at("name") << " " << s;
  }
  auto saved = refs(false, false);
  for (int s = 0; s < kBefore; ++s)
    for (int k = 0; k < kParams; ++k) saved[static_cast<size_t>(k)].step(kind, lr_at(kind, s), s + 1, grads_of(s, k));
  std::vector<Ref> expect = saved;
  for (auto& x : expect) {
    x.master16 = x.states16 = true;
    for (size_t i = 0; i < x.master.size(); ++i) {
      ASSERT_EQ(x.working[i], bf16(x.master[i]));  // the saved param is the saved master rounded
      x.master[i] = round_bf16(x.master[i]);
      x.m[i] = round_bf16(x.m[i]);
      x.v[i] = round_bf16(x.v[i]);
    }
  }
  run_ranks(3, [&](const RankEnv& env) {
    Model m = make_model(env, config(true, true), kind);
    ASSERT_NE(m.ctx, nullptr);
    ZS_ASSERT_OK(load(m, dir));
    expect_params(m, expect, "loaded");
    std::vector<Ref> r = expect;
    for (int s = kBefore; s < kBefore + 2; ++s) {
      step_both(m, r, kind, s);
      expect_params(m, r, "step " + std::to_string(s));
    }
    destroy(m);
  });
  std::filesystem::remove_all(dir);
}

// ---- the kernels ---------------------------------------------------------------------

using zs::kernels::SimdPath;

struct PathGuard {
  SimdPath path = zs::kernels::simd_path_id();
  ~PathGuard() { zs::kernels::set_simd_path_for_testing(path); }
};

// n elements of a bf16 master with fp32 or bf16 moments, several steps:
// adam_step_mixed / sgd_step_mixed on every SIMD path (and threaded, n >
// 64K), and their scalar twins, against the fp32 kernels plus rounding.
TEST(OptimizerBf16Kernels, MixedStepsMatchTheFp32KernelsThenRounding) {
  PathGuard guard;
  const size_t sizes[] = {1, 7, 33, 65, 1000, 100003};
  for (SimdPath path : {SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512}) {
    if (!zs::kernels::set_simd_path_for_testing(path)) continue;
    for (size_t n : sizes) {
      for (WorkDtype st : {WorkDtype::F32, WorkDtype::BF16}) {
        for (const auto& ac : zs::test::kAdamCases) {
          const auto init = zs::test::normal(n, 3, 0.5f);
          std::vector<float> rp(n), rm(n, 0.0f), rv(n, 0.0f);
          std::vector<uint16_t> rw(n), p16(n), s16m(n, 0), s16v(n, 0), q16(n);
          std::vector<float> s32m(n, 0.0f), s32v(n, 0.0f), t32m(n, 0.0f), t32v(n, 0.0f);
          std::vector<uint16_t> t16m(n, 0), t16v(n, 0);
          for (size_t i = 0; i < n; ++i) rp[i] = round_bf16(init[i]), p16[i] = q16[i] = bf16(init[i]);
          for (int64_t step = 1; step <= 3; ++step) {
            const auto g = zs::test::normal(n, static_cast<uint32_t>(100 + step), 0.1f);
            zs::kernels::AdamHyper h{1e-2f, ac.beta1, 0.999f, 1e-8f, ac.wd, ac.adamw, ac.bias, step};
            zs::kernels::adam_step_scalar(rp.data(), rm.data(), rv.data(), g.data(), n, h, 0.5f, rw.data(),
                                          WorkDtype::BF16);
            for (size_t i = 0; i < n; ++i) {
              rp[i] = widen(rw[i]);
              if (st == WorkDtype::BF16) rm[i] = round_bf16(rm[i]), rv[i] = round_bf16(rv[i]);
            }
            void* m = st == WorkDtype::BF16 ? static_cast<void*>(s16m.data()) : s32m.data();
            void* v = st == WorkDtype::BF16 ? static_cast<void*>(s16v.data()) : s32v.data();
            void* tm = st == WorkDtype::BF16 ? static_cast<void*>(t16m.data()) : t32m.data();
            void* tv = st == WorkDtype::BF16 ? static_cast<void*>(t16v.data()) : t32v.data();
            zs::kernels::adam_step_mixed(p16.data(), WorkDtype::BF16, m, v, st, g.data(), n, h, 0.5f);
            zs::kernels::adam_step_mixed_scalar(q16.data(), WorkDtype::BF16, tm, tv, st, g.data(), n, h, 0.5f);
          }
          const std::string what = std::string("adam path=") + zs::kernels::simd_path() + " n=" +
                                   std::to_string(n) + " states=" + (st == WorkDtype::BF16 ? "bf16" : "f32");
          ASSERT_EQ(p16, rw) << what;
          ASSERT_EQ(q16, rw) << what << " (scalar)";
          for (size_t i = 0; i < n; ++i) {
            const float m = st == WorkDtype::BF16 ? widen(s16m[i]) : s32m[i];
            const float v = st == WorkDtype::BF16 ? widen(s16v[i]) : s32v[i];
            ASSERT_EQ(std::memcmp(&m, &rm[i], 4), 0) << what << " exp_avg " << i;
            ASSERT_EQ(std::memcmp(&v, &rv[i], 4), 0) << what << " exp_avg_sq " << i;
          }
        }
        for (const auto& sc : zs::test::kSgdCases) {
          const auto init = zs::test::normal(n, 5, 0.5f);
          std::vector<float> rp(n), rb(n, 0.0f), b32(n, 0.0f);
          std::vector<uint16_t> rw(n), p16(n), b16(n, 0);
          for (size_t i = 0; i < n; ++i) rp[i] = round_bf16(init[i]), p16[i] = bf16(init[i]);
          for (int step = 1; step <= 3; ++step) {
            const auto g = zs::test::normal(n, static_cast<uint32_t>(200 + step), 0.1f);
            zs::kernels::SgdHyper h{0.05f, sc.momentum, sc.dampening, sc.wd, sc.nesterov, step == 1};
            zs::kernels::sgd_step_scalar(rp.data(), rb.data(), g.data(), n, h, 1.0f, rw.data(), WorkDtype::BF16);
            for (size_t i = 0; i < n; ++i) {
              rp[i] = widen(rw[i]);
              if (st == WorkDtype::BF16) rb[i] = round_bf16(rb[i]);
            }
            void* b = st == WorkDtype::BF16 ? static_cast<void*>(b16.data()) : b32.data();
            zs::kernels::sgd_step_mixed(p16.data(), WorkDtype::BF16, sc.momentum != 0.0f ? b : nullptr, st,
                                        g.data(), n, h, 1.0f);
          }
          const std::string what = std::string("sgd path=") + zs::kernels::simd_path() + " n=" + std::to_string(n);
          ASSERT_EQ(p16, rw) << what;
          if (sc.momentum != 0.0f)
            for (size_t i = 0; i < n; ++i) {
              const float b = st == WorkDtype::BF16 ? widen(b16[i]) : b32[i];
              ASSERT_EQ(std::memcmp(&b, &rb[i], 4), 0) << what << " momentum " << i;
            }
        }
      }
    }
  }
}

TEST(OptimizerBf16Kernels, MixedStepsRefuseOtherDtypesAndNulls) {
  std::vector<uint16_t> p(4), m(4), v(4);
  std::vector<float> g(4, 0.1f);
  zs::kernels::AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1};
  EXPECT_THROW(zs::kernels::adam_step_mixed(p.data(), WorkDtype::F16, m.data(), v.data(), WorkDtype::BF16,
                                            g.data(), 4, h, 1.0f),
               std::invalid_argument);
  EXPECT_THROW(zs::kernels::adam_step_mixed(p.data(), WorkDtype::BF16, m.data(), nullptr, WorkDtype::BF16,
                                            g.data(), 4, h, 1.0f),
               std::invalid_argument);
  zs::kernels::SgdHyper s{0.1f, 0.9f, 0.0f, 0.0f, false, false};
  EXPECT_THROW(zs::kernels::sgd_step_mixed(p.data(), WorkDtype::BF16, nullptr, WorkDtype::BF16, g.data(), 4, s,
                                           1.0f),
               std::invalid_argument);
}

// ---- CUDA ----------------------------------------------------------------------------

#ifdef ZS_WITH_CUDA

bool gpu_visible() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  void* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T) + 16) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(d);
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

// The CUDA kernels bit for bit against the CPU scalar twins, odd sizes
// (vector and scalar tails), both state dtypes, Adam and SGD.
TEST(OptimizerBf16Cuda, MixedKernelsMatchTheCpu) {
  if (!gpu_visible()) GTEST_SKIP() << "no CUDA device";
  namespace cu = zs::kernels::cuda;
  for (size_t n : {size_t{1}, size_t{7}, size_t{1001}, size_t{100003}}) {
    for (WorkDtype st : {WorkDtype::F32, WorkDtype::BF16}) {
      const auto init = zs::test::normal(n, 9, 0.5f);
      std::vector<uint16_t> p(n);
      for (size_t i = 0; i < n; ++i) p[i] = bf16(init[i]);
      std::vector<float> m32(n, 0.0f), v32(n, 0.0f);
      std::vector<uint16_t> m16(n, 0), v16(n, 0);
      uint16_t* dp = to_device(p);
      void* dm = st == WorkDtype::BF16 ? static_cast<void*>(to_device(m16)) : to_device(m32);
      void* dv = st == WorkDtype::BF16 ? static_cast<void*>(to_device(v16)) : to_device(v32);
      void* hm = st == WorkDtype::BF16 ? static_cast<void*>(m16.data()) : m32.data();
      void* hv = st == WorkDtype::BF16 ? static_cast<void*>(v16.data()) : v32.data();
      for (int64_t step = 1; step <= 3; ++step) {
        const auto g = zs::test::normal(n, static_cast<uint32_t>(300 + step), 0.1f);
        float* dg = to_device(g);
        zs::kernels::AdamHyper h{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, true, true, step};
        ASSERT_EQ(cu::adam_step_mixed(dp, WorkDtype::BF16, dm, dv, st, dg, n, h, 0.5f, nullptr), 0);
        zs::kernels::adam_step_mixed_scalar(p.data(), WorkDtype::BF16, hm, hv, st, g.data(), n, h, 0.5f);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cudaFree(dg);
      }
      EXPECT_EQ(to_host(dp, n), p) << "n=" << n;
      if (st == WorkDtype::BF16) {
        EXPECT_EQ(to_host(static_cast<uint16_t*>(dm), n), m16);
        EXPECT_EQ(to_host(static_cast<uint16_t*>(dv), n), v16);
      } else {
        const auto dm32 = to_host(static_cast<float*>(dm), n), dv32 = to_host(static_cast<float*>(dv), n);
        EXPECT_EQ(std::memcmp(dm32.data(), m32.data(), n * 4), 0);
        EXPECT_EQ(std::memcmp(dv32.data(), v32.data(), n * 4), 0);
      }
      // SGD with Nesterov momentum on the same buffers.
      for (int step = 1; step <= 2; ++step) {
        const auto g = zs::test::normal(n, static_cast<uint32_t>(400 + step), 0.1f);
        float* dg = to_device(g);
        zs::kernels::SgdHyper h{0.05f, 0.9f, 0.0f, 0.01f, true, step == 1};
        ASSERT_EQ(cu::sgd_step_mixed(dp, WorkDtype::BF16, dm, st, dg, n, h, 1.0f, nullptr), 0);
        zs::kernels::sgd_step_mixed_scalar(p.data(), WorkDtype::BF16, hm, st, g.data(), n, h, 1.0f);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cudaFree(dg);
      }
      EXPECT_EQ(to_host(dp, n), p) << "sgd n=" << n;
      cudaFree(dp);
      cudaFree(dm);
      cudaFree(dv);
    }
  }
  std::vector<float> g(4);
  zs::kernels::AdamHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, true, true, 1};
  EXPECT_NE(cu::adam_step_mixed(nullptr, WorkDtype::F16, nullptr, nullptr, WorkDtype::BF16, g.data(), 4, h, 1.0f,
                                nullptr),
            0);
}

// A world of one on cuda:0 with bf16 masters and states: the engine's steps
// (through the CUDA kernels) equal the CPU reference bit for bit, and the
// ledger holds 4 bytes per element.
TEST(OptimizerBf16Cuda, EngineStepsOnTheGpuMatchTheReference) {
  if (!gpu_visible()) GTEST_SKIP() << "no CUDA device";
  const std::string cfg = config(true, true);
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.device = "cuda:0";
  o.config_json = cfg.c_str();
  Model m;
  ZS_ASSERT_OK(zs_context_create(&m.ctx, &o));
  for (int k = 0; k < kParams; ++k) {
    std::vector<uint16_t> init(static_cast<size_t>(kSizes[k]));
    for (size_t i = 0; i < init.size(); ++i) init[i] = bf16(init_value(k, i));
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = kNames[k];
    po.dtype = ZS_BFLOAT16;
    po.ndim = 1;
    po.shape = &kSizes[k];
    po.init = ZS_INIT_FROM_ALL;
    po.data = init.data();
    po.data_bytes = init.size() * 2;
    zs_param p = nullptr;
    ZS_ASSERT_OK(zs_param_register(&p, m.ctx, &po));
    m.params.push_back(p);
  }
  ZS_ASSERT_OK(zs_optimizer_create(&m.opt, m.ctx, ZS_OPTIM_ADAMW));
  const zs_optim_hparams hp = hparams(ZS_OPTIM_ADAMW);
  ZS_ASSERT_OK(zs_optimizer_add_group(m.opt, m.params.data(), m.params.size(), &hp, nullptr));
  auto r = refs(true, true);
  for (int s = 0; s < 3; ++s) {
    step_both(m, r, ZS_OPTIM_ADAMW, s);
    for (int k = 0; k < kParams; ++k) {
      void* shard = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_param_shard_data(m.params[static_cast<size_t>(k)], &shard, &n));
      auto got = to_host(static_cast<uint16_t*>(shard), n);
      got.resize(static_cast<size_t>(kSizes[k]));
      ASSERT_EQ(got, r[static_cast<size_t>(k)].working) << "step " << s << " param " << kNames[k];
    }
  }
  EXPECT_EQ(memory(m).optimizer_bytes, (7 + 33 + 1000) * 4u);
  destroy(m);
}

#endif  // ZS_WITH_CUDA

}  // namespace
