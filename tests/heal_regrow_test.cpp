// The regrow of docs/healing.md, section 4: after a shrink, a process
// started for the rank left out with ZS_HEAL_JOIN=grow comes back, and the
// world grows back to every rank at a step boundary, in memory. The
// survivors' loop is unchanged (the vote rides on the step's norm
// all-reduce; the regrow runs inside zs_optimizer_step); the joiner calls
// zs_heal_join after its create, as a replacement does. The reference is
// the checkpoint route over the same data: all ranks to C and a save, the
// survivors' ids on N - 1 ranks load it and train to G (where the joiner
// came back) and save, then N ranks load that and train to the end. The
// full params, the frozen param in no optimizer and the step count must
// agree within 1e-6 (relative); the survivors keep their processes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/ckpt_model.h"
#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using namespace zs::test::heal;

namespace {

constexpr int kRegrowSteps = 9;
constexpr int64_t kFrozen = 777;

struct Shared {
  std::atomic<int64_t> committed[kMaxWorld];  // each survivor's C from its shrink (-1: none)
  std::atomic<int64_t> grown_at;              // the joiner's C from zs_heal_join
  std::atomic<int> asking;                    // the joiner is about to create its context
  std::atomic<int> pid_at_start[kMaxWorld], pid_at_end[kMaxWorld];
  std::atomic<int> finished[kMaxWorld];
  std::atomic<int64_t> steps_at_end[kMaxWorld];
  std::atomic<int> live_at_end[kMaxWorld];
  float healed0[kNumel[0]], healed1[kNumel[1]], healed_frozen[kFrozen];
  float ref0[kNumel[0]], ref1[kNumel[1]], ref_frozen[kFrozen];
};

std::vector<float> full_values(Model& m, zs_param p, int64_t numel) {
  std::vector<float> full(static_cast<size_t>(numel));
  zs_gather g = nullptr;
  EXPECT_EQ(zs_fetch(&g, m.ctx, &p, 1), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
  zs_gather_destroy(g);
  EXPECT_EQ(zs_param_copy_to(p, full.data(), full.size() * sizeof(float)), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_release(m.ctx, &p, 1), ZS_OK) << zs_last_error();
  return full;
}

void keep_values(Model& m, bool keep, float* w0, float* w1, float* frozen) {
  const auto a = full_values(m, m.params[0], kNumel[0]);
  const auto b = full_values(m, m.params[1], kNumel[1]);
  const auto c = full_values(m, m.frozen, kFrozen);
  if (!keep) return;
  std::copy(a.begin(), a.end(), w0);
  std::copy(b.begin(), b.end(), w1);
  std::copy(c.begin(), c.end(), frozen);
}

zs_status save_or_load(Model& m, const std::string& dir, bool save, const char* tag) {
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

zs_status step_as(const RankEnv& env, int id, Model& m, int step) {
  RankEnv as = env;
  as.rank = id;
  return train_step(as, m, step);
}

double worst(const float* a, const float* b, size_t n, bool* bitwise) {
  double w = 0.0;
  for (size_t i = 0; i < n; ++i) {
    w = std::max(w, std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(1.0, std::fabs(static_cast<double>(b[i]))));
    *bitwise = *bitwise && std::memcmp(&a[i], &b[i], sizeof(float)) == 0;
  }
  return w;
}

// The checkpoint route: world ranks to c, save; the live ids to g, save;
// world ranks to the end.
void checkpoint_route(Shared* sh, int world, int64_t c, int64_t g, const std::vector<int>& live) {
  const std::string dir = zs::test::make_temp_dir("heal_regrow_ref");
  zs::test::run_ranks(world, [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    for (int s = 1; s <= c; ++s) ZS_ASSERT_OK(train_step(env, m, s));
    ZS_ASSERT_OK(save_or_load(m, dir, true, "c"));
    destroy(m);
  });
  zs::test::run_ranks(static_cast<int>(live.size()), [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    ZS_ASSERT_OK(save_or_load(m, dir, false, "c"));
    for (int s = static_cast<int>(c) + 1; s <= g; ++s) ZS_ASSERT_OK(step_as(env, live[env.rank], m, s));
    ZS_ASSERT_OK(save_or_load(m, dir, true, "g"));
    destroy(m);
  });
  zs::test::run_ranks(world, [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    ZS_ASSERT_OK(save_or_load(m, dir, false, "g"));
    for (int s = static_cast<int>(g) + 1; s <= kRegrowSteps; ++s) ZS_ASSERT_OK(train_step(env, m, s));
    keep_values(m, env.rank == 0, sh->ref0, sh->ref1, sh->ref_frozen);
    destroy(m);
  });
}

// `victim` killed at `point` of step `count`; the survivors shrink at
// once (healing.min_ranks world - 1); a process for the victim's id,
// started once they have shrunk, comes back with ZS_HEAL_JOIN=grow.
void shrunk_then_regrown(int world, int victim, const char* point, int count) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  sh->grown_at = -1;
  const std::string fault = std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count);
  std::vector<int> live;
  for (int r = 0; r < world; ++r)
    if (r != victim) live.push_back(r);
  const int lowest = live.front();
  const std::string min_ranks = std::to_string(world - 1);
  zs::test::ScopedEnv shrink_env("ZS_HEAL_MIN_RANKS", min_ranks.c_str());
  const auto body = [&](const RankEnv& env) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    if (env.replacement == 0) {
      setenv("ZS_FAULT_POINT", fault.c_str(), 1);
      sh->pid_at_start[env.rank] = getpid();
    } else {
      unsetenv("ZS_FAULT_POINT");
      setenv("ZS_HEAL_JOIN", "grow", 1);
      while (sh->committed[lowest].load() <= 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      sh->asking = 1;
    }
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    int step = 1;
    if (env.replacement > 0) {
      int64_t committed = -1;
      ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
      sh->grown_at = committed;
      step = static_cast<int>(committed) + 1;
    }
    bool shrunk = false;
    while (step <= kRegrowSteps) {
      // Two steps after the shrink, wait until the joiner asks, so that it
      // comes back before the run ends (where is for the vote to say).
      if (shrunk && step == sh->committed[env.rank].load() + 2) {
        while (!sh->asking.load() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      }
      const zs_status s = train_step(env, m, step);
      if (s == ZS_OK) {
        ++step;
        continue;
      }
      ASSERT_NE(env.rank, victim) << "the victim outlived its fault point " << fault;
      ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
      ASSERT_FALSE(shrunk) << "a second loss";
      int64_t agreed = -1, committed = -1;
      ZS_ASSERT_OK(zs_heal_agree(&agreed, nullptr, m.opt));
      ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));  // a shrink: healing.min_ranks
      EXPECT_EQ(committed, agreed);
      sh->committed[env.rank] = committed;
      step = static_cast<int>(committed) + 1;
      shrunk = true;
    }
    int64_t steps = -1;
    ZS_ASSERT_OK(zs_optimizer_get_step(m.opt, &steps));
    sh->steps_at_end[env.rank] = steps;
    zs_group wg = nullptr;
    ZS_ASSERT_OK(zs_context_group(&wg, m.ctx, ZS_GROUP_WORLD));
    int size = 0;
    ZS_ASSERT_OK(zs_group_size(wg, &size));
    sh->live_at_end[env.rank] = size;
    zs_group_destroy(wg);
    keep_values(m, env.rank == lowest, sh->healed0, sh->healed1, sh->healed_frozen);
    EXPECT_EQ(zs_context_async_error(m.ctx), ZS_OK) << zs_last_error();
    sh->pid_at_end[env.rank] = getpid();
    sh->finished[env.rank] += 1;
    destroy(m);
  };
  zs::test::run_ranks_replacing(world, body, 90, {victim}, 1);
  const int64_t c = sh->committed[lowest];
  const int64_t g = sh->grown_at;
  ASSERT_GE(c, count - 1);
  ASSERT_LE(c, count);
  ASSERT_GT(g, c) << "the joiner came back at step " << g << ", the survivors shrank at " << c;
  ASSERT_LT(g, kRegrowSteps);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
    EXPECT_EQ(sh->steps_at_end[r].load(), kRegrowSteps) << "rank " << r;
    EXPECT_EQ(sh->live_at_end[r].load(), world) << "rank " << r << "'s world group at the end";
    if (r != victim) {
      EXPECT_EQ(sh->committed[r].load(), c) << "rank " << r << " shrank at another C";
      EXPECT_EQ(sh->pid_at_start[r].load(), sh->pid_at_end[r].load()) << "survivor " << r << "'s process changed";
    }
  }
  checkpoint_route(sh, world, c, g, live);
  bool bitwise = true;
  const double w = std::max({worst(sh->healed0, sh->ref0, kNumel[0], &bitwise),
                             worst(sh->healed1, sh->ref1, kNumel[1], &bitwise),
                             worst(sh->healed_frozen, sh->ref_frozen, kFrozen, &bitwise)});
  std::printf("[heal-regrow] %s on %d ranks: shrunk at C = %lld, grown back at G = %lld, against the checkpoint "
              "route: largest relative difference %.3g%s\n", fault.c_str(), world, static_cast<long long>(c),
              static_cast<long long>(g), w, bitwise ? " (bit for bit)" : "");
  std::fflush(stdout);
  EXPECT_LE(w, 1e-6);
}

}  // namespace

TEST(HealRegrow, ThreeRanksShrinkToTwoAndGrowBackToThree) { shrunk_then_regrown(3, 1, "update", 3); }
