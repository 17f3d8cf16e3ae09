// Landing step 6 of docs/healing.md, the shrink: a rank SIGKILLed at a
// phase of step 3 (ZS_FAULT_POINT) on 3 and 4 ranks is not replaced. The
// survivors agree (zs_heal_agree), shrink (zs_heal_shrink) and run to the
// end over the live ranks, each with its own rank id's gradients: their
// processes are the ones started, nothing is read from disk. The
// reference is the checkpoint route over the same data: the uninterrupted
// run on all ranks saves at C; a run on world - 1 ranks loads that
// checkpoint and trains steps C + 1 .. with the survivors' rank ids'
// gradients. The full params after the last step, the frozen param in no
// optimizer and the step count must agree within 1e-6 (relative); a
// checkpoint the survivors save after the shrink loads on world - 1 ranks
// as the state they had. What a shrink cannot lay out in memory is
// refused by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/ckpt_model.h"
#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using namespace zs::test::heal;

namespace {

constexpr int64_t kFrozen = kFrozenNumel;

// Shared by the forked ranks (mapped before the forks).
struct Shared {
  std::atomic<int64_t> committed[kMaxWorld];  // each survivor's C from zs_heal_shrink (-1: none)
  std::atomic<int> pid_at_start[kMaxWorld], pid_at_end[kMaxWorld];
  std::atomic<int> finished[kMaxWorld];
  std::atomic<int64_t> steps_at_end[kMaxWorld];
  // The lowest survivor's full values after the last step, and the reference's.
  float healed0[kNumel[0]], healed1[kNumel[1]], healed_frozen[kFrozen];
  float ref0[kNumel[0]], ref1[kNumel[1]], ref_frozen[kFrozen];
  // What a checkpoint the survivors saved after the shrink loads as.
  float saved0[kNumel[0]], saved1[kNumel[1]], saved_frozen[kFrozen];
  char refused[kMaxWorld][512];
};

// The checkpoint route: all ranks to step c and a save, then the live
// ranks (rank i playing live[i]) load it and train to the end.
void checkpoint_route(Shared* sh, int world, int64_t c, const std::vector<int>& live) {
  const zs::test::TempDir temp("heal_shrink_ref");
  const std::string& dir = temp.path();
  train_and_save(world, c, dir, "c");
  zs::test::run_ranks(static_cast<int>(live.size()), [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    ZS_ASSERT_OK(save_or_load(m, dir, false, "c"));
    const int id = live[static_cast<size_t>(env.rank)];
    for (int s = static_cast<int>(c) + 1; s <= kSteps; ++s) ZS_ASSERT_OK(step_as(env, id, m, s));
    keep_values(m, env.rank == 0, sh->ref0, sh->ref1, sh->ref_frozen);
    destroy(m);
  });
}

// A replacement of the victim under a deadline (healing.replacement_wait_s),
// started by the parent at once. A late one holds its create until the
// survivors have shrunk (on a loaded machine a fixed delay could still
// beat the deadline, and the test would not test what it says).
struct Deadline {
  double wait_s = 0;  // 0: no replacement is started, the survivors call zs_heal_shrink
  bool late = false;
  bool joins() const { return wait_s > 0 && !late; }
};

void shrunk_at(int world, int victim, const char* point, int count, Deadline deadline = {}) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  const std::string fault = std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count);
  const bool replaced = deadline.wait_s > 0;
  std::vector<int> live;
  for (int r = 0; r < world; ++r)
    if (r != victim || deadline.joins()) live.push_back(r);
  const int lowest = live.front();
  const zs::test::TempDir after_dir("heal_shrink_after");
  const std::string& after = after_dir.path();
  const std::string min_ranks = std::to_string(world - 1), wait = std::to_string(deadline.wait_s);
  zs::test::ScopedEnv shrink_env("ZS_HEAL_MIN_RANKS", replaced ? min_ranks.c_str() : nullptr);
  zs::test::ScopedEnv wait_env("ZS_HEAL_REPLACEMENT_WAIT_S", replaced ? wait.c_str() : nullptr);
  // A late replacement may come after the survivors' last step: a store of
  // its own outlives them (as zsrun's zsstore does), so it reads the verdict.
  std::unique_ptr<zs::test::ExternalStore> store;
  if (replaced && !deadline.joins()) store = std::make_unique<zs::test::ExternalStore>();
  const auto body = [&](const RankEnv& env) {
        if (env.replacement == 0) {
          setenv("ZS_FAULT_POINT", fault.c_str(), 1);
          sh->pid_at_start[env.rank] = getpid();
        } else {
          unsetenv("ZS_FAULT_POINT");
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (deadline.late && sh->committed[lowest].load() <= 0 && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        Model m;
        const zs_status built = build_with_frozen(env, m);
        if (env.replacement > 0 && !deadline.joins()) {
          // Too late: the survivors went on without it, and it says so.
          EXPECT_EQ(built, ZS_ERR_NOT_TAKEN) << zs_last_error();
          std::snprintf(sh->refused[env.rank], sizeof sh->refused[env.rank], "%s", zs_last_error());
          destroy(m);
          return;
        }
        ZS_ASSERT_OK(built);
        int step = 1;
        if (env.replacement > 0) {
          int64_t committed = -1;
          ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
          sh->committed[env.rank] = committed;
          sh->pid_at_start[env.rank] = getpid();
          step = static_cast<int>(committed) + 1;
        }
        bool shrunk = false;
        while (step <= kSteps) {
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
          // Under a deadline the join decides: the replacement, or a shrink.
          ZS_ASSERT_OK(replaced ? zs_heal_join(&committed, m.opt) : zs_heal_shrink(&committed, m.opt));
          EXPECT_EQ(committed, agreed);
          sh->committed[env.rank] = committed;
          step = static_cast<int>(committed) + 1;
          shrunk = true;
        }
        EXPECT_TRUE(shrunk || env.replacement > 0) << "rank " << env.rank << " never saw the loss";
        int64_t steps = -1;
        ZS_ASSERT_OK(zs_optimizer_get_step(m.opt, &steps));
        sh->steps_at_end[env.rank] = steps;
        keep_values(m, env.rank == lowest, sh->healed0, sh->healed1, sh->healed_frozen);
        // A save after the shrink writes the live ranks' shards.
        ZS_ASSERT_OK(save_or_load(m, after, true, "after"));
        EXPECT_EQ(zs_context_async_error(m.ctx), ZS_OK) << zs_last_error();
        sh->pid_at_end[env.rank] = getpid();
        sh->finished[env.rank] += 1;
        destroy(m);
      };
  if (replaced)
    zs::test::run_ranks_replacing(world, body, 90, {victim}, 1, store ? store->port() : 0);
  else
    zs::test::run_ranks(world, body, 90, {victim});
  store.reset();
  if (replaced && !deadline.joins()) {
    const std::string why = sh->refused[victim];
    EXPECT_NE(why.find("went on without rank " + std::to_string(victim)), std::string::npos) << why;
    std::printf("[heal-shrink] the late replacement: %s\n", why.c_str());
  }
  const int64_t c = sh->committed[lowest];
  ASSERT_GE(c, 2);
  ASSERT_LE(c, 3);
  for (const int r : live) {
    EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
    EXPECT_EQ(sh->committed[r].load(), c) << "rank " << r << " shrank at another C";
    EXPECT_EQ(sh->steps_at_end[r].load(), kSteps) << "rank " << r;
    EXPECT_EQ(sh->pid_at_start[r].load(), sh->pid_at_end[r].load()) << "survivor " << r << "'s process changed";
  }
  zs::test::run_ranks(static_cast<int>(live.size()), [&](const RankEnv& env) {
    Model m;
    ZS_ASSERT_OK(build_with_frozen(env, m));
    ZS_ASSERT_OK(save_or_load(m, after, false, "after"));
    keep_values(m, env.rank == 0, sh->saved0, sh->saved1, sh->saved_frozen);
    destroy(m);
  });
  EXPECT_EQ(std::memcmp(sh->saved0, sh->healed0, sizeof sh->saved0), 0) << "the save after the shrink";
  EXPECT_EQ(std::memcmp(sh->saved1, sh->healed1, sizeof sh->saved1), 0) << "the save after the shrink";
  EXPECT_EQ(std::memcmp(sh->saved_frozen, sh->healed_frozen, sizeof sh->saved_frozen), 0);
  checkpoint_route(sh, world, c, live);
  bool bitwise = true;
  const double w = std::max({worst(sh->healed0, sh->ref0, kNumel[0], &bitwise),
                             worst(sh->healed1, sh->ref1, kNumel[1], &bitwise),
                             worst(sh->healed_frozen, sh->ref_frozen, kFrozen, &bitwise)});
  std::printf("[heal-shrink] %s on %d ranks: C = %lld, against the checkpoint route: largest relative difference "
              "%.3g%s\n", fault.c_str(), world, static_cast<long long>(c), w, bitwise ? " (bit for bit)" : "");
  std::fflush(stdout);
  EXPECT_LE(w, 1e-6);
}

}  // namespace

TEST(HealShrink, ThreeRanksGoOnAsTwoAfterAKillInTheUpdate) { shrunk_at(3, 1, "update", 3); }
TEST(HealShrink, FourRanksGoOnAsThreeAfterAKillInTheReduceScatter) { shrunk_at(4, 2, "reduce_scatter", 4); }
TEST(HealShrink, ThreeRanksGoOnAsTwoAfterRankZerosNeighbourIsKilledBeforeTheNormAllReduce) {
  shrunk_at(3, 2, "norm_allreduce", 3);
}

// healing.replacement_wait_s: the survivors wait that long for the
// replacement before they shrink. One that comes in time joins (the run is
// the uninterrupted one's); one that comes late finds the survivors gone on
// without it and says so, and they train on as after a shrink.
TEST(HealShrink, AReplacementWithinTheDeadlineJoins) { shrunk_at(3, 1, "update", 3, {10.0, false}); }
TEST(HealShrink, AReplacementPastTheDeadlineFindsTheSurvivorsShrunk) {
  shrunk_at(4, 2, "reduce_scatter", 4, {0.4, true});
}

// A param no peer copy carries (in no optimizer, not frozen): no survivor
// has the lost rank's shard of it, so the shrink is refused by name and
// the survivors' state is left as it was.
TEST(HealShrink, AParamNoCopyCarriesIsRefusedByName) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  zs::test::run_ranks(
      3,
      [&](const RankEnv& env) {
        setenv("ZS_FAULT_POINT", "update:1:2", 1);
        Model m;
        ZS_ASSERT_OK(build_with_frozen(env, m));
        zs_param loose = nullptr;
        const int64_t n = 11;
        zs_param_options po = ZS_PARAM_OPTIONS_INIT;
        po.name = "loose.bias";
        po.ndim = 1;
        po.shape = &n;
        ZS_ASSERT_OK(zs_param_register(&loose, m.ctx, &po));
        zs_status s = ZS_OK;
        for (int step = 1; step <= kSteps && s == ZS_OK; ++step) s = train_step(env, m, step);
        ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_last_error();
        int64_t agreed = -1, committed = -1;
        ZS_ASSERT_OK(zs_heal_agree(&agreed, nullptr, m.opt));
        EXPECT_EQ(zs_heal_shrink(&committed, m.opt), ZS_ERR_NOT_SUPPORTED);
        std::snprintf(sh->refused[env.rank], sizeof sh->refused[env.rank], "%s", zs_last_error());
        EXPECT_EQ(committed, -1);
        zs_param_destroy(loose);
        destroy(m);
      },
      60, {1});
  for (const int r : {0, 2}) {
    const std::string why = sh->refused[r];
    EXPECT_NE(why.find("loose.bias"), std::string::npos) << why;
    EXPECT_NE(why.find("no peer holds the lost rank's shard"), std::string::npos) << why;
    EXPECT_NE(why.find("resume from the last disk checkpoint"), std::string::npos) << why;
  }
}
