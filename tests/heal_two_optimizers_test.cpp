// A replacement joins a world that trains two optimizers (docs/healing.md,
// section 3: a GAN's shape, or a body and a head stepped apart): w0 under
// AdamW, w1 under SGD with momentum, each iteration fetches both, pushes
// both gradients and steps the first optimizer, then the second. A rank is
// SIGKILLed in step 3 before either commits (the reduce-scatter), in the
// first optimizer's update (it commits, the second has not begun), or
// before the second's norm all-reduce (the first committed, the second
// not): in the last two the optimizers heal at different steps. The
// survivors agree and join for each optimizer in the order made, the
// replacement joins each, and every rank redoes what its optimizers had
// not committed: both optimizers' states after the last step equal the
// uninterrupted run's bit for bit, and every rank's at the join where both
// optimizers are at the same step.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/ckpt_model.h"
#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using namespace zs::test::heal;

namespace {

struct TwoOptimizers {
  zs_context ctx = nullptr;
  zs_param params[2] = {nullptr, nullptr};
  zs_optimizer opts[2] = {nullptr, nullptr};  // w0's AdamW, w1's SGD, made in that order
  bool second_first = false;  // an iteration steps the SGD one first (made second, stepped first)
  // A GAN's shape: the second-stepped optimizer's loss reaches the
  // first-stepped one's param too (a gradient pending after its step), which
  // the next iteration drops first (netD.zero_grad(): zs_grad_discard).
  bool reaches_first = false;
};

void destroy(TwoOptimizers& m) {
  for (zs_optimizer o : m.opts) zs_optimizer_destroy(o);
  for (zs_param p : m.params) zs_param_destroy(p);
  zs_context_destroy(m.ctx);
}

zs_status build(const RankEnv& env, TwoOptimizers& m) {
  zs_context_options o = zs::test::rank_options(env, kHealOn, kTimeoutMs);
  zs_status s = zs_context_create(&m.ctx, &o);
  for (int i = 0; i < 2 && s == ZS_OK; ++i) s = register_from_rank0(m.ctx, i, &kNumel[i], &m.params[i]);
  const zs_optimizer_kind kinds[2] = {ZS_OPTIM_ADAMW, ZS_OPTIM_SGD};
  for (int i = 0; i < 2 && s == ZS_OK; ++i) {
    s = zs_optimizer_create(&m.opts[i], m.ctx, kinds[i]);
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    hp.lr = i == 0 ? 0.01 : 0.05;
    hp.momentum = i == 0 ? 0.0 : 0.9;
    if (s == ZS_OK) s = zs_optimizer_add_group(m.opts[i], &m.params[i], 1, &hp, nullptr);
  }
  return s;
}

// Both optimizers' own states, one digest; *steps[i]: optimizer i's count.
uint64_t digest(TwoOptimizers& m, int64_t steps[2]) {
  uint64_t all = 0;
  for (int i = 0; i < 2; ++i) {
    uint64_t h = 0;
    EXPECT_EQ(zs_heal_state_digest(&h, nullptr, &steps[i], m.opts[i], 0), ZS_OK) << zs_last_error();
    all = all * 1000003u ^ h;
  }
  return all;
}

// Optimizer i's part of step `step`: its param's gradient, its step.
zs_status optimizer_part(const RankEnv& env, TwoOptimizers& m, int step, int i) {
  std::vector<float> grad(static_cast<size_t>(kNumel[i]));
  for (size_t k = 0; k < grad.size(); ++k) grad[k] = grad_value(env.rank, step, i, k);
  zs_status s = zs_grad_push(m.params[i], grad.data(), ZS_FLOAT32, grad.size() * sizeof(float));
  return s == ZS_OK ? zs_optimizer_step(m.opts[i], nullptr) : s;
}

// Step `step` from the `from`-th optimizer it steps on (0: the whole step,
// with its forward's fetch; 1: the other optimizer's part only, the one
// stepped first having committed it).
zs_status iteration(const RankEnv& env, TwoOptimizers& m, int step, int from) {
  zs_status s = ZS_OK;
  const int first = m.second_first ? 1 : 0;  // the optimizer stepped first
  if (from == 0) {
    if (m.reaches_first) s = zs_grad_discard(m.ctx, &m.params[first], 1);
    zs_gather g = nullptr;
    s = zs_fetch(&g, m.ctx, m.params, 2);
    if (s == ZS_OK) s = zs_gather_wait(g, ZS_WAIT_FOREVER);
    if (g) zs_gather_destroy(g);
    if (s == ZS_OK) s = zs_release(m.ctx, m.params, 2);
  }
  for (int k = from; k < 2 && s == ZS_OK; ++k) {
    if (k == 1 && m.reaches_first) {
      std::vector<float> grad(static_cast<size_t>(kNumel[first]));
      for (size_t e = 0; e < grad.size(); ++e) grad[e] = grad_value(env.rank, step, 7, e);
      s = zs_grad_push(m.params[first], grad.data(), ZS_FLOAT32, grad.size() * sizeof(float));
    }
    if (s == ZS_OK) s = optimizer_part(env, m, step, m.second_first ? 1 - k : k);
  }
  return s;
}

struct Shared {
  std::atomic<uint64_t> ref[kMaxWorld][kSteps + 1];  // the uninterrupted run: rank r's digest after step s
  std::atomic<int64_t> committed[kMaxWorld];         // each rank's C of the first optimizer from its join (-1: none)
  std::atomic<int64_t> committed_second[kMaxWorld];  // and of the second
  std::atomic<int> pid_at_start[kMaxWorld], pid_at_end[kMaxWorld];
  std::atomic<int> finished[kMaxWorld];
};

// Where the optimizers' counts say the run stands: (step, first optimizer
// to run) of the next work.
std::pair<int, int> next_work(const int64_t c[2]) {
  if (c[0] == c[1]) return {static_cast<int>(c[0]) + 1, 0};
  EXPECT_EQ(c[0], c[1] + 1) << "the first optimizer is one step ahead of the second at most";
  return {static_cast<int>(c[0]), 1};
}

// `first`, `second`: each optimizer's C the kill must leave.
void replaced_at(int world, int victim, const char* point, int count, int64_t first, int64_t second) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  for (auto& c : sh->committed_second) c = -1;
  zs::test::run_ranks(world, [&](const RankEnv& env) {
    TwoOptimizers m;
    ZS_ASSERT_OK(build(env, m));
    int64_t steps[2];
    sh->ref[env.rank][0] = digest(m, steps);
    for (int s = 1; s <= kSteps; ++s) {
      ZS_ASSERT_OK(iteration(env, m, s, 0));
      sh->ref[env.rank][s] = digest(m, steps);
    }
    destroy(m);
  });
  const std::string fault = std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count);
  const auto pids = zs::test::run_ranks_replacing(
      world,
      [&](const RankEnv& env) {
        if (env.replacement == 0) {
          setenv("ZS_FAULT_POINT", fault.c_str(), 1);
          sh->pid_at_start[env.rank] = getpid();
        } else {
          unsetenv("ZS_FAULT_POINT");
        }
        TwoOptimizers m;
        ZS_ASSERT_OK(build(env, m));
        std::pair<int, int> next{1, 0};
        const auto joined = [&](const int64_t c[2]) {
          sh->committed[env.rank] = c[0];
          sh->committed_second[env.rank] = c[1];
          next = next_work(c);
          int64_t at[2];
          const uint64_t d = digest(m, at);
          EXPECT_EQ(at[0], c[0]);
          EXPECT_EQ(at[1], c[1]);
          if (c[0] == c[1]) {
            EXPECT_EQ(d, sh->ref[env.rank][c[0]].load()) << "rank " << env.rank << " at C";
          }
        };
        if (env.replacement > 0) {
          int64_t c[2] = {-1, -1};
          for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_join(&c[i], m.opts[i]));
          joined(c);
        }
        while (next.first <= kSteps) {
          const zs_status s = iteration(env, m, next.first, next.second);
          if (s == ZS_OK) {
            next = {next.first + 1, 0};
            continue;
          }
          ASSERT_NE(env.rank, victim) << "the victim outlived its fault point " << fault;
          ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
          ASSERT_EQ(sh->committed[env.rank].load(), -1) << "a second loss";
          int64_t agreed[2] = {-1, -1}, c[2] = {-1, -1};
          for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_agree(&agreed[i], nullptr, m.opts[i]));
          for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_join(&c[i], m.opts[i]));
          EXPECT_EQ(c[0], agreed[0]);
          EXPECT_EQ(c[1], agreed[1]);
          joined(c);
        }
        int64_t at[2];
        EXPECT_EQ(digest(m, at), sh->ref[env.rank][kSteps].load())
            << "rank " << env.rank << (env.replacement ? " (the replacement)" : "") << " after the last step";
        EXPECT_EQ(at[0], kSteps);
        EXPECT_EQ(at[1], kSteps);
        EXPECT_EQ(zs_context_async_error(m.ctx), ZS_OK) << zs_last_error();
        sh->pid_at_end[env.rank] = getpid();
        sh->finished[env.rank] += 1;
        destroy(m);
      },
      60, {victim});
  std::printf("[heal-two-optimizers] %s on %d ranks: C = %lld, %lld\n", fault.c_str(), world,
              static_cast<long long>(sh->committed[victim].load()),
              static_cast<long long>(sh->committed_second[victim].load()));
  std::fflush(stdout);
  ASSERT_EQ(pids[static_cast<size_t>(victim)].size(), 2u) << "the victim was replaced once";
  EXPECT_EQ(sh->committed[victim].load(), first) << "the first optimizer's C";
  EXPECT_EQ(sh->committed_second[victim].load(), second) << "the second optimizer's C";
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
    EXPECT_EQ(sh->committed[r].load(), sh->committed[victim].load()) << "rank " << r << ": the first's C";
    EXPECT_EQ(sh->committed_second[r].load(), sh->committed_second[victim].load()) << "rank " << r << ": the second's C";
    if (r == victim) continue;
    EXPECT_EQ(pids[static_cast<size_t>(r)].size(), 1u) << "survivor " << r << " was started again";
    EXPECT_EQ(sh->pid_at_start[r].load(), sh->pid_at_end[r].load()) << "survivor " << r << "'s process changed";
  }
}

// Shrink and regrow (docs/healing.md, section 4) -----------------------

constexpr int kRegrowSteps = 9;  // at least; and 3 iterations after the regrow

struct Regrown {
  std::atomic<int64_t> committed[kMaxWorld];  // each survivor's C from its shrink (-1: none), both optimizers'
  std::atomic<int64_t> grown_at;              // the joiner's C from its joins
  std::atomic<int64_t> steps_at_end[kMaxWorld][2];
  std::atomic<int> pid_at_start[kMaxWorld], pid_at_end[kMaxWorld];
  std::atomic<int> finished[kMaxWorld];
  float healed0[kNumel[0]], healed1[kNumel[1]], ref0[kNumel[0]], ref1[kNumel[1]];
};

// Both optimizers saved (or loaded) under `tag`.0 and `tag`.1, each with its param.
zs_status save_or_load(TwoOptimizers& m, const std::string& dir, bool save, const std::string& tag) {
  zs_status s = ZS_OK;
  for (int i = 0; i < 2 && s == ZS_OK; ++i) {
    const std::string t = tag + "." + std::to_string(i);
    if (save) {
      zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
      o.tag = t.c_str();
      s = zs_checkpoint_save(m.ctx, &m.params[i], 1, m.opts[i], dir.c_str(), &o);
    } else {
      zs_checkpoint_load_options o = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
      o.tag = t.c_str();
      s = zs_checkpoint_load(m.ctx, &m.params[i], 1, m.opts[i], dir.c_str(), &o, nullptr);
    }
  }
  return s;
}

void keep_values(TwoOptimizers& m, bool keep, float* w0, float* w1) {
  const auto a = full_values(m.ctx, m.params[0], kNumel[0]);
  const auto b = full_values(m.ctx, m.params[1], kNumel[1]);
  if (!keep) return;
  std::copy(a.begin(), a.end(), w0);
  std::copy(b.begin(), b.end(), w1);
}

// The checkpoint route over the same data: `world` ranks to c, save; the
// survivors' ids to g, save; every rank to the end.
void checkpoint_route(Regrown* sh, int world, bool second_first, bool reaches_first, int64_t c, int64_t g,
                      int64_t end, const std::vector<int>& shrunk) {
  const zs::test::TempDir temp("heal_two_optimizers_regrow");
  const std::string& dir = temp.path();
  std::vector<int> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
  const auto leg = [&](const std::vector<int>& ids, const char* load, int64_t from, int64_t to, const char* save) {
    zs::test::run_ranks(static_cast<int>(ids.size()), [&](const RankEnv& env) {
      TwoOptimizers m;
      m.second_first = second_first;
      m.reaches_first = reaches_first;
      ZS_ASSERT_OK(build(env, m));
      if (load != nullptr) ZS_ASSERT_OK(save_or_load(m, dir, false, load));
      RankEnv as = env;
      as.rank = ids[static_cast<size_t>(env.rank)];
      for (int s = static_cast<int>(from) + 1; s <= to; ++s) ZS_ASSERT_OK(iteration(as, m, s, 0));
      if (save != nullptr) ZS_ASSERT_OK(save_or_load(m, dir, true, save));
      else keep_values(m, env.rank == 0, sh->ref0, sh->ref1);
      destroy(m);
    });
  };
  leg(all, nullptr, 0, c, "c");
  leg(shrunk, "c", c, g, "g");
  leg(all, "g", g, end, nullptr);
}

// Rank `victim` killed at `point`; the survivors shrink both optimizers at
// once (healing.min_ranks), and its next process (ZS_HEAL_JOIN=grow),
// started once they have, joins both and is taken back where an iteration
// ends: after the step of the optimizer stepped last, the other at the
// same count (after the first's step it is one behind, and the world must
// not grow there). reaches_first: a GAN's shape (TwoOptimizers), the
// gradient pending at the regrow dropped by it as by the next iteration's
// zs_grad_discard on the checkpoint route.
void shrunk_then_regrown(int world, int victim, const char* point, int count, bool second_first,
                         bool reaches_first = false) {
  ShortHeartbeat hb;
  Regrown* sh = shared_block<Regrown>();
  sh->grown_at = -1;
  const std::string fault = std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count);
  std::vector<int> shrunk;
  for (int r = 0; r < world; ++r)
    if (r != victim) shrunk.push_back(r);
  const int lowest = shrunk.front();
  const std::string min_ranks = std::to_string(shrunk.size());
  zs::test::ScopedEnv shrink_env("ZS_HEAL_MIN_RANKS", min_ranks.c_str());
  const auto body = [&](const RankEnv& env) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    start_shrink_or_regrow(env, sh, fault, "", lowest, -1, until);
    TwoOptimizers m;
    m.second_first = second_first;
    m.reaches_first = reaches_first;
    ZS_ASSERT_OK(build(env, m));
    int step = 1;
    if (env.replacement > 0) {
      int64_t c[2] = {-1, -1};
      for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_join(&c[i], m.opts[i]));
      EXPECT_EQ(c[0], c[1]) << "the joiner came back mid-iteration";
      sh->grown_at = c[0];
      step = static_cast<int>(c[0]) + 1;
    }
    bool shrunk_here = false;
    const auto last_step = [&] {
      const int64_t g = sh->grown_at.load();
      return g < 0 ? INT32_MAX : static_cast<int>(std::max<int64_t>(kRegrowSteps, g + 3));
    };
    while (step <= last_step() && std::chrono::steady_clock::now() < until) {
      if (shrunk_here && sh->grown_at.load() < 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const zs_status s = iteration(env, m, step, 0);
      if (s == ZS_OK) {
        ++step;
        continue;
      }
      ASSERT_NE(env.rank, victim) << "the victim outlived its fault point " << fault;
      ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
      ASSERT_FALSE(shrunk_here) << "a second loss";
      int64_t agreed[2] = {-1, -1}, c[2] = {-1, -1};
      for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_agree(&agreed[i], nullptr, m.opts[i]));
      for (int i = 0; i < 2; ++i) ZS_ASSERT_OK(zs_heal_join(&c[i], m.opts[i]));  // a shrink: healing.min_ranks
      ASSERT_EQ(c[0], c[1]) << "the kill must leave both optimizers at one step";
      sh->committed[env.rank] = c[0];
      step = static_cast<int>(c[0]) + 1;
      shrunk_here = true;
    }
    for (int i = 0; i < 2; ++i) {
      int64_t steps = -1;
      ZS_ASSERT_OK(zs_optimizer_get_step(m.opts[i], &steps));
      sh->steps_at_end[env.rank][i] = steps;
    }
    keep_values(m, env.rank == lowest, sh->healed0, sh->healed1);
    EXPECT_EQ(zs_context_async_error(m.ctx), ZS_OK) << zs_last_error();
    sh->pid_at_end[env.rank] = getpid();
    sh->finished[env.rank] += 1;
    destroy(m);
  };
  const auto pids = zs::test::run_ranks_replacing(world, body, 90, {victim});
  const int64_t c = sh->committed[lowest];
  const int64_t g = sh->grown_at;
  const int64_t end = std::max<int64_t>(kRegrowSteps, g + 3);
  ASSERT_GE(c, 0);
  ASSERT_GT(g, c) << "the joiner came back at step " << g << ", the survivors shrank at " << c;
  ASSERT_EQ(pids[static_cast<size_t>(victim)].size(), 2u) << "the victim came back once";
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
    EXPECT_EQ(sh->steps_at_end[r][0].load(), end) << "rank " << r << "'s first optimizer";
    EXPECT_EQ(sh->steps_at_end[r][1].load(), end) << "rank " << r << "'s second optimizer";
    if (r == victim) continue;
    EXPECT_EQ(sh->committed[r].load(), c) << "rank " << r << " shrank at another C";
    EXPECT_EQ(sh->pid_at_start[r].load(), sh->pid_at_end[r].load()) << "survivor " << r << "'s process changed";
  }
  checkpoint_route(sh, world, second_first, reaches_first, c, g, end, shrunk);
  bool bitwise = true;
  const double w = std::max(worst(sh->healed0, sh->ref0, kNumel[0], &bitwise),
                            worst(sh->healed1, sh->ref1, kNumel[1], &bitwise));
  std::printf("[heal-two-optimizers] %s on %d ranks, %s stepped first%s: shrunk at C = %lld, grown back at G = %lld, "
              "against the checkpoint route: largest relative difference %.3g%s\n", fault.c_str(), world,
              second_first ? "SGD" : "AdamW", reaches_first ? ", its param's gradient pending at the regrow" : "",
              static_cast<long long>(c), static_cast<long long>(g), w,
              bitwise ? " (bit for bit)" : "");
  std::fflush(stdout);
  EXPECT_LE(w, 1e-6);
}

}  // namespace

// Fault points count both optimizers' passes: step 3's updates are the 5th
// (AdamW's) and 6th (SGD's), and so are its norm all-reduces. A kill in an
// update comes after the step's commit point (its norm all-reduce done).
TEST(HealTwoOptimizers, ReplacedAfterAKillInTheReduceScatterOnThreeRanks) {
  replaced_at(3, 1, "reduce_scatter", 5, 2, 2);
}
TEST(HealTwoOptimizers, ReplacedAfterAKillInTheFirstOptimizersUpdateOnThreeRanks) {
  replaced_at(3, 2, "update", 5, 3, 2);
}
TEST(HealTwoOptimizers, ReplacedAfterAKillBeforeTheSecondOptimizersNormAllReduceOnFourRanks) {
  replaced_at(4, 1, "norm_allreduce", 6, 3, 2);
}

// Step 3's first reduce-scatter: both optimizers at C = 2 after the shrink.
TEST(HealTwoOptimizers, ShrunkAndGrownBackWhereAnIterationEndsOnThreeRanks) {
  shrunk_then_regrown(3, 1, "reduce_scatter", 5, false);
}
TEST(HealTwoOptimizers, ShrunkAndGrownBackWhereAnIterationEndsWithTheSecondSteppedFirst) {
  shrunk_then_regrown(3, 2, "reduce_scatter", 5, true);
}
TEST(HealTwoOptimizers, ShrunkAndGrownBackWithAGradientPendingForTheFirstAsAGansLoopLeavesIt) {
  shrunk_then_regrown(3, 1, "reduce_scatter", 5, false, true);
}
