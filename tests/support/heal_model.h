// The model the healing tests train and kill ranks in (heal_commit_test,
// heal_join_test): two fp32 params of odd sizes under AdamW with gradient
// clipping (so the norm all-reduce runs), each rank's gradients a function
// of its rank, the step and the element; the heartbeat shortened so a loss
// is seen within 0.6 s; and the uninterrupted run whose per-step state
// digests the healed runs must equal bit for bit.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/multirank.h"
#include "zeroshard/zeroshard.h"

namespace zs::test::heal {

constexpr int kSteps = 5;
constexpr int kMaxWorld = 4;
constexpr int kTimeoutMs = 30000;
inline constexpr const char* kHealOn =
    R"({"zeroshard": {"healing": {"peer_copy": true}}, "gradient_clipping": 0.5})";
inline constexpr int64_t kNumel[2] = {1003, 4097};
constexpr int64_t kFrozenNumel = 777;  // build_with_frozen's "reference.w"

struct ShortHeartbeat {
  ScopedEnv period{"ZS_HEARTBEAT_MS", "100"};
  ScopedEnv limit{"ZS_HEARTBEAT_TIMEOUT_MS", "600"};
};

inline float grad_value(int rank, int step, int p, uint64_t i) {
  return std::cos(static_cast<float>(i * 7 + static_cast<uint64_t>(step * 13 + p * 5 + rank * 31))) * 0.1f;
}

// Param i's initial values (every rank's the same).
inline std::vector<float> initial_values(int i, int64_t numel) {
  std::vector<float> init(static_cast<size_t>(numel));
  for (size_t k = 0; k < init.size(); ++k) init[k] = std::sin(static_cast<float>(k * 3 + i)) * 0.5f;
  return init;
}

// Param i ("w0", "w1", or `name`) of `*numel` elements with
// initial_values(i, ...), from rank 0 (a scatter, which a replacement
// skips: its shard comes from the replica at the join). `numel` must
// outlive the call.
inline zs_status register_from_rank0(zs_context ctx, int i, const int64_t* numel, zs_param* out,
                                     const char* name = nullptr) {
  const std::vector<float> init = initial_values(i, *numel);
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.name = name != nullptr ? name : i == 0 ? "w0" : "w1";
  po.ndim = 1;
  po.shape = numel;
  po.init = ZS_INIT_FROM_RANK;
  po.src_rank = 0;
  po.data = init.data();
  po.data_bytes = init.size() * sizeof(float);
  return zs_param_register(out, ctx, &po);
}

struct Model {
  zs_context ctx = nullptr;
  zs_param params[2] = {nullptr, nullptr};
  zs_optimizer opt = nullptr;
  zs_param frozen = nullptr;  // in no optimizer (a reference model's), where a test registers one
};

inline void destroy(Model& m) {
  zs_optimizer_destroy(m.opt);
  for (zs_param p : m.params) zs_param_destroy(p);
  zs_param_destroy(m.frozen);
  zs_context_destroy(m.ctx);
}

// The model with a frozen param in no optimizer ("reference.w", 777
// elements, as a reference model's: its shard rides in the peer copy).
// The initial values come from rank 0 (a scatter), which a replacement
// skips: its shard comes from the replica at the join. `numel1` lets a
// replacement build another model.
inline zs_status build_with_frozen(const RankEnv& env, Model& m, int64_t numel1 = kNumel[1]) {
  zs_context_options o = zs::test::rank_options(env, kHealOn, kTimeoutMs);
  zs_status s = zs_context_create(&m.ctx, &o);
  const int64_t numel[2] = {kNumel[0], numel1};
  for (int i = 0; i < 2 && s == ZS_OK; ++i) s = register_from_rank0(m.ctx, i, &numel[i], &m.params[i]);
  // A frozen param in no optimizer, as a reference model's: its shard
  // reaches a replacement with the optimizer's state (the digests cover it).
  const int64_t numel_frozen = kFrozenNumel;
  const std::vector<float> frozen = initial_values(2, numel_frozen);
  zs_param_options fo = ZS_PARAM_OPTIONS_INIT;
  fo.name = "reference.w";
  fo.ndim = 1;
  fo.shape = &numel_frozen;
  fo.init = ZS_INIT_FROM_RANK;
  fo.src_rank = 0;
  fo.data = frozen.data();
  fo.data_bytes = frozen.size() * sizeof(float);
  if (s == ZS_OK) s = zs_param_register(&m.frozen, m.ctx, &fo);
  if (s == ZS_OK) s = zs_param_freeze(m.frozen);
  if (s == ZS_OK) s = zs_optimizer_create(&m.opt, m.ctx, ZS_OPTIM_ADAMW);
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.01;
  if (s == ZS_OK) s = zs_optimizer_add_group(m.opt, m.params, 2, &hp, nullptr);
  return s;
}

// This rank's gradients of step `step` pushed for both params; the first
// failing push's status.
inline zs_status push_grads(const RankEnv& env, Model& m, int step) {
  zs_status s = ZS_OK;
  for (int i = 0; i < 2 && s == ZS_OK; ++i) {
    std::vector<float> grad(static_cast<size_t>(kNumel[i]));
    for (size_t k = 0; k < grad.size(); ++k) grad[k] = grad_value(env.rank, step, i, k);
    s = zs_grad_push(m.params[i], grad.data(), ZS_FLOAT32, grad.size() * sizeof(float));
  }
  return s;
}

// One training step: the forward's fetch (and release), each param's
// gradient, the optimizer step. The first failing call's status.
inline zs_status train_step(const RankEnv& env, Model& m, int step) {
  zs_gather g = nullptr;
  zs_status s = zs_fetch(&g, m.ctx, m.params, 2);
  if (s == ZS_OK) s = zs_gather_wait(g, ZS_WAIT_FOREVER);
  if (g) zs_gather_destroy(g);
  if (s == ZS_OK) s = zs_release(m.ctx, m.params, 2);
  if (s == ZS_OK) s = push_grads(env, m, step);
  if (s == ZS_OK) s = zs_optimizer_step(m.opt, nullptr);
  return s;
}

// This rank's own state's digest; *step: the step it is at.
inline uint64_t own_digest(Model& m, int64_t* step) {
  uint64_t hash = 0;
  EXPECT_EQ(zs_heal_state_digest(&hash, nullptr, step, m.opt, 0), ZS_OK) << zs_last_error();
  return hash;
}

// Checks of a run that changed its world in memory (heal_shrink_test,
// heal_regrow_test) against the checkpoint route.

// A param's full values (a gather: collective).
inline std::vector<float> full_values(zs_context ctx, zs_param p, int64_t numel) {
  std::vector<float> full(static_cast<size_t>(numel));
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  zs_gather_destroy(g);
  EXPECT_EQ(zs_param_copy_to(p, full.data(), full.size() * sizeof(float)), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_release(ctx, &p, 1), ZS_OK) << zs_last_error();
  return full;
}

// Every param's full values (collective), into w0, w1 and frozen where
// `keep` (the lowest rank).
inline void keep_values(Model& m, bool keep, float* w0, float* w1, float* frozen) {
  const auto a = full_values(m.ctx, m.params[0], kNumel[0]);
  const auto b = full_values(m.ctx, m.params[1], kNumel[1]);
  const auto c = full_values(m.ctx, m.frozen, kFrozenNumel);
  if (!keep) return;
  std::copy(a.begin(), a.end(), w0);
  std::copy(b.begin(), b.end(), w1);
  std::copy(c.begin(), c.end(), frozen);
}

inline zs_status save_or_load(Model& m, const std::string& dir, bool save, const char* tag) {
  zs_param all[3] = {m.params[0], m.params[1], m.frozen};
  if (save) {
    zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    o.tag = tag;
    return zs_checkpoint_save(m.ctx, all, 3, m.opt, dir.c_str(), &o);
  }
  zs_checkpoint_load_options o = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
  o.tag = tag;
  return zs_checkpoint_load(m.ctx, all, 3, m.opt, dir.c_str(), &o, nullptr);
}

// One step with the gradients of world rank `id` (a survivor keeps its id
// after a shrink; the checkpoint route's rank i plays the i-th live one's).
inline zs_status step_as(const RankEnv& env, int id, Model& m, int step) {
  RankEnv as = env;
  as.rank = id;
  return train_step(as, m, step);
}

// The checkpoint route's first leg: `world` ranks train steps 1 .. steps
// uninterrupted and save under `tag`.
inline void train_and_save(int world, int64_t steps, const std::string& dir, const char* tag) {
  run_ranks(world, [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    for (int s = 1; s <= steps; ++s) ZS_ASSERT_OK(train_step(env, m, s));
    ZS_ASSERT_OK(save_or_load(m, dir, true, tag));
    destroy(m);
  });
}

// The largest |a - b| / max(1, |b|) over n values; *bitwise: all equal bits.
inline double worst(const float* a, const float* b, size_t n, bool* bitwise) {
  double w = 0.0;
  for (size_t i = 0; i < n; ++i) {
    w = std::max(w, std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(1.0, std::fabs(static_cast<double>(b[i]))));
    *bitwise = *bitwise && std::memcmp(&a[i], &b[i], sizeof(float)) == 0;
  }
  return w;
}

// A T the forked ranks share (mapped before the forks, never unmapped: a
// test's few blocks), each of its `committed` entries -1 (no step yet).
template <class T>
T* shared_block() {
  void* p = mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  auto* t = new (p) T{};
  for (auto& c : t->committed) c = -1;
  return t;
}

// A shrink-and-regrow test's rank as it starts (`sh` a shared_block with
// `committed` and `pid_at_start`): the first process of each rank arms
// `fault` and notes its pid; a later one, the rank coming back, arms
// `joiner_fault` (none when empty) and asks to grow (ZS_HEAL_JOIN=grow)
// once the lowest survivor's committed step is above `shrunk_after` (the
// survivors have shrunk), or at `until`.
template <class Shared>
void start_shrink_or_regrow(const RankEnv& env, Shared* sh, const std::string& fault, const std::string& joiner_fault,
                            int lowest, int64_t shrunk_after, std::chrono::steady_clock::time_point until) {
  if (env.replacement == 0) {
    setenv("ZS_FAULT_POINT", fault.c_str(), 1);
    sh->pid_at_start[env.rank] = getpid();
    return;
  }
  if (joiner_fault.empty())
    unsetenv("ZS_FAULT_POINT");
  else
    setenv("ZS_FAULT_POINT", joiner_fault.c_str(), 1);
  setenv("ZS_HEAL_JOIN", "grow", 1);
  while (sh->committed[lowest].load() <= shrunk_after && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// The uninterrupted run on `world` ranks: ref[r][s] is rank r's digest
// after step s (0: as built). `build(env, m)` makes the model.
template <class Build>
void reference_run(int world, std::atomic<uint64_t> (*ref)[kSteps + 1], Build build) {
  run_ranks(world, [&](const RankEnv& env) {
    Model m;
    build(env, m);
    int64_t step = -1;
    ref[env.rank][0] = own_digest(m, &step);
    for (int s = 1; s <= kSteps; ++s) {
      ZS_ASSERT_OK(train_step(env, m, s));
      ref[env.rank][s] = own_digest(m, &step);
      EXPECT_EQ(step, s);
    }
    destroy(m);
  });
}

}  // namespace zs::test::heal
