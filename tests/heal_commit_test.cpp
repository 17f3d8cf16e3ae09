// Landing step 2 of docs/healing.md, the commit: a rank SIGKILLed at each
// phase of a step (ZS_FAULT_POINT: the fetch, the gradient reduce-scatter,
// the gradient copy, before and after the norm all-reduce, the update) on 3
// and 4 ranks; every survivor gets ZS_ERR_RANK_LOST, then
// zs_heal_agree gives every survivor the same committed step C (rolling
// forward those whose all-reduce failed where another's completed), and
// the survivors' states plus the victim's replica at its holder equal an
// uninterrupted run's states at C, bit for bit (zs_heal_state_digest). A
// rank killed in a checkpoint save: the save fails as the loss. A rank and
// the holder of its copy killed together: ZS_ERR_STATE_LOST naming both on
// every survivor.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;
using namespace zs::test::heal;

namespace {

// Shared by the forked ranks of both runs (mapped before the forks).
struct Shared {
  std::atomic<uint64_t> ref[kMaxWorld][kSteps + 1];  // the uninterrupted run: rank r's own digest after step s
  std::atomic<int64_t> committed[kMaxWorld];         // each survivor's C (-1: none)
  std::atomic<int> rolled[kMaxWorld];
  std::atomic<int> replica_checked;                  // the victim's holder compared its replica
  std::atomic<double> norm[kMaxWorld];               // each survivor's zs_heal_committed_result (-1: none)
};

void build(const RankEnv& env, Model& m) {
  m.ctx = zs::test::make_context(env, kHealOn, kTimeoutMs);
  ASSERT_NE(m.ctx, nullptr);
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> init = initial_values(i, kNumel[i]);
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = i == 0 ? "w0" : "w1";
    o.ndim = 1;
    o.shape = &kNumel[i];
    o.init = ZS_INIT_FROM_ALL;
    o.data = init.data();
    o.data_bytes = init.size() * sizeof(float);
    ZS_ASSERT_OK(zs_param_register(&m.params[i], m.ctx, &o));
  }
  ZS_ASSERT_OK(zs_optimizer_create(&m.opt, m.ctx, ZS_OPTIM_ADAMW));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.01;
  ZS_ASSERT_OK(zs_optimizer_add_group(m.opt, m.params, 2, &hp, nullptr));
}

// The victim dies at the count-th pass of `point` (step 3, or 2 for a point
// that passes more than once a step); the survivors agree.
void killed_at(int world, int victim, const char* point, int count) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  reference_run(world, sh->ref, build);
  const int holder = (victim + 1) % world;
  const std::string fault = std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count);
  run_ranks(
      world,
      [&](const RankEnv& env) {
        setenv("ZS_FAULT_POINT", fault.c_str(), 1);
        Model m;
        build(env, m);
        zs_status s = ZS_OK;
        int step = 1;
        // The failing step began at most a step's time (milliseconds here)
        // before the kill: its length bounds the time to the error.
        auto began = std::chrono::steady_clock::now();
        for (; step <= kSteps && s == ZS_OK; ++step) {
          began = std::chrono::steady_clock::now();
          s = train_step(env, m, step);
        }
        const double failed_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
        ASSERT_NE(env.rank, victim) << "the victim outlived its fault point " << fault;
        // The limit (0.6 s) and room for a loaded machine; never the 30 s timeout.
        EXPECT_LT(failed_after, 3.6) << "rank " << env.rank << " took " << failed_after << " s to learn of the loss";
        ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
        EXPECT_NE(std::string(zs_last_error()).find("rank " + std::to_string(victim) + " is lost"), std::string::npos)
            << zs_last_error();
        int64_t committed = -1;
        int rolled = 0;
        const auto t0 = std::chrono::steady_clock::now();
        ZS_ASSERT_OK(zs_heal_agree(&committed, &rolled, m.opt));
        const double agree_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sh->committed[env.rank] = committed;
        sh->rolled[env.rank] = rolled;
        std::printf("[heal-commit] %s on %d ranks: rank %d failed in step %d %.3f s after it began, agreed C = "
                    "%lld%s in %.3f s\n",
                    fault.c_str(), world, env.rank, step - 1, failed_after, static_cast<long long>(committed),
                    rolled ? " (rolled forward)" : "", agree_s);
        std::fflush(stdout);
        ASSERT_GE(committed, 1);
        ASSERT_LE(committed, kSteps);
        int64_t at = -1;
        EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][committed].load()) << "rank " << env.rank << " at C";
        EXPECT_EQ(at, committed);
        if (env.rank == holder) {
          uint64_t hash = 0;
          int source = -1;
          int64_t replica_at = -1;
          ZS_ASSERT_OK(zs_heal_state_digest(&hash, &source, &replica_at, m.opt, 1));
          EXPECT_EQ(source, victim);
          EXPECT_EQ(replica_at, committed);
          EXPECT_EQ(hash, sh->ref[victim][committed].load()) << "the replica of rank " << victim << " at C";
          sh->replica_checked = 1;
        }
        // The context still refuses other work.
        EXPECT_EQ(zs_context_async_error(m.ctx), ZS_ERR_RANK_LOST);
        _exit(::testing::Test::HasFailure() ? 1 : 0);  // as a survivor would: zsrun restarts the job
      },
      60, {victim});
  EXPECT_EQ(sh->replica_checked.load(), 1);
  int64_t c = -1;
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    if (c < 0) c = sh->committed[r];
    EXPECT_EQ(sh->committed[r].load(), c) << "rank " << r << " agreed on another C";
  }
}

TEST(HealCommit, KilledInTheFetchOnThreeRanks) { killed_at(3, 1, "fetch", 3); }
TEST(HealCommit, KilledInTheReduceScatterOnThreeRanks) { killed_at(3, 1, "reduce_scatter", 4); }
TEST(HealCommit, KilledInTheGradientCopyOnThreeRanks) { killed_at(3, 2, "grad_copy", 3); }
TEST(HealCommit, KilledBeforeTheNormAllReduceOnThreeRanks) { killed_at(3, 1, "norm_allreduce", 3); }
TEST(HealCommit, KilledAfterTheNormAllReduceOnThreeRanks) { killed_at(3, 1, "norm_allreduce_done", 3); }
TEST(HealCommit, KilledInTheUpdateOnThreeRanks) { killed_at(3, 1, "update", 3); }
// In its replay of its source's step 3 (the copy's worker thread): step 3
// committed everywhere, the next step's forward is cut short.
TEST(HealCommit, KilledInTheReplayOnThreeRanks) { killed_at(3, 1, "replay", 3); }
TEST(HealCommit, KilledInTheGradientCopyOnFourRanks) { killed_at(4, 1, "grad_copy", 3); }
TEST(HealCommit, KilledAfterTheNormAllReduceOnFourRanks) { killed_at(4, 2, "norm_allreduce_done", 3); }
TEST(HealCommit, KilledInTheUpdateOnFourRanks) { killed_at(4, 3, "update", 3); }

// The norm all-reduce of step 3 completes on some survivors and fails on
// others (the victim dies once its own completed; ":fail" makes the
// others' fail as a real loss does only by chance): those roll forward in
// the agreement, applying step 3 with the result the first ones saw, and
// every state equals the uninterrupted run's at C = 3. The victim's holder
// is among those that roll forward, so its replica replays step 3 there.
void half_finished(int world, int victim, const std::vector<int>& failing) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  reference_run(world, sh->ref, build);
  const int holder = (victim + 1) % world;
  std::string fault = "norm_allreduce_done:" + std::to_string(victim) + ":3";
  for (const int r : failing) fault += ",norm_allreduce_done:" + std::to_string(r) + ":3:fail";
  zs::test::ScopedEnv env_fault("ZS_FAULT_POINT", fault.c_str());
  run_ranks(
      world,
      [&](const RankEnv& env) {
        Model m;
        build(env, m);
        zs_status s = ZS_OK;
        for (int step = 1; step <= kSteps && s == ZS_OK; ++step) s = train_step(env, m, step);
        const bool fails = std::find(failing.begin(), failing.end(), env.rank) != failing.end();
        if (fails) {
          EXPECT_EQ(s, ZS_ERR_COMM) << zs_status_string(s) << ": " << zs_last_error();
        } else {
          EXPECT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
        }
        int64_t committed = -1;
        int rolled = 0;
        ZS_ASSERT_OK(zs_heal_agree(&committed, &rolled, m.opt));
        std::printf("[heal-commit] half-finished all-reduce on %d ranks: rank %d agreed C = %lld%s\n", world,
                    env.rank, static_cast<long long>(committed), rolled ? " (rolled forward)" : "");
        std::fflush(stdout);
        EXPECT_EQ(committed, 3);
        EXPECT_EQ(rolled, fails ? 1 : 0);
        // Step 3's result, as step 3's zs_optimizer_step would have given
        // it: from the all-reduce here, from the roll-forward there.
        zs_step_result result = ZS_STEP_RESULT_INIT;
        int found = 0;
        ZS_ASSERT_OK(zs_heal_committed_result(&result, &found, m.opt));
        EXPECT_EQ(found, 1);
        EXPECT_EQ(result.step, 3);
        EXPECT_EQ(result.skipped, 0);
        sh->norm[env.rank] = found ? result.grad_norm : -1.0;
        int64_t at = -1;
        EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][3].load()) << "rank " << env.rank << " at C";
        EXPECT_EQ(at, 3);
        if (env.rank == holder) {
          uint64_t hash = 0;
          int64_t replica_at = -1;
          ZS_ASSERT_OK(zs_heal_state_digest(&hash, nullptr, &replica_at, m.opt, 1));
          EXPECT_EQ(replica_at, 3);
          EXPECT_EQ(hash, sh->ref[victim][3].load()) << "the replica of rank " << victim << " at C";
          sh->replica_checked = 1;
        }
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {victim});
  EXPECT_EQ(sh->replica_checked.load(), 1);
  // One norm, bit for bit, whichever way each survivor got it.
  const int first = victim == 0 ? 1 : 0;
  EXPECT_GT(sh->norm[first].load(), 0.0);
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    EXPECT_EQ(sh->norm[r].load(), sh->norm[first].load()) << "rank " << r;
  }
}

// Rank 1 SIGKILLed in a checkpoint save after two steps, its shard file
// written but not yet reported to rank 0 (the fault point "save"): every
// survivor's save fails as the loss, ZS_ERR_RANK_LOST naming it within the
// heartbeat's limit (not the save's timeout), so a trainer heals and saves
// again; the steps before stay committed, the survivors' states equal the
// uninterrupted run's, and nothing of the cut save is left: the
// directory it made (<tmp>/checkpoints) goes, its lock with it, so the save
// run again finds things as they were (Lightning's ModelCheckpoint would
// otherwise name it "-v1").
TEST(HealCommit, KilledInACheckpointSaveOnThreeRanks) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  reference_run(3, sh->ref, build);
  char dir_template[] = "/tmp/zs_heal_save_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string root = dir_template, dir = root + "/checkpoints";
  zs::test::ScopedEnv fault("ZS_FAULT_POINT", "save:1:1");
  run_ranks(
      3,
      [&](const RankEnv& env) {
        Model m;
        build(env, m);
        for (int step = 1; step <= 2; ++step) ZS_ASSERT_OK(train_step(env, m, step));
        zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
        o.tag = "state";
        const auto t0 = std::chrono::steady_clock::now();
        const zs_status s = zs_checkpoint_save(m.ctx, m.params, 2, m.opt, dir.c_str(), &o);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ASSERT_NE(env.rank, 1) << "the victim outlived its fault point";
        EXPECT_LT(took, 3.6) << "rank " << env.rank << " took " << took << " s to learn of the loss";
        ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
        EXPECT_NE(std::string(zs_last_error()).find("rank 1 is lost"), std::string::npos) << zs_last_error();
        int64_t committed = -1;
        ZS_ASSERT_OK(zs_heal_agree(&committed, nullptr, m.opt));
        EXPECT_EQ(committed, 2);
        int64_t at = -1;
        EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][2].load()) << "rank " << env.rank;
        std::printf("[heal-commit] save:1:1 on 3 ranks: rank %d's save failed after %.3f s, agreed C = %lld\n",
                    env.rank, took, static_cast<long long>(committed));
        std::fflush(stdout);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {1});
  EXPECT_FALSE(std::filesystem::exists(dir)) << "the directory the cut save made is left";
  std::filesystem::remove_all(root);
}

TEST(HealCommit, HalfFinishedNormAllReduceRollsForwardOnThreeRanks) { half_finished(3, 1, {2}); }
TEST(HealCommit, HalfFinishedNormAllReduceRollsForwardOnFourRanks) { half_finished(4, 2, {0, 3}); }

// Rank 1 and rank 2, which holds rank 1's copy, die in the same step:
// every survivor's agreement names both, ZS_ERR_STATE_LOST.
TEST(HealCommit, ARankAndItsHolderLostTogetherIsStateLost) {
  ShortHeartbeat hb;
  zs::test::ScopedEnv fault("ZS_FAULT_POINT", "grad_copy:1:3,grad_copy:2:3");
  run_ranks(
      4,
      [&](const RankEnv& env) {
        Model m;
        build(env, m);
        zs_status s = ZS_OK;
        for (int step = 1; step <= kSteps && s == ZS_OK; ++step) s = train_step(env, m, step);
        ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
        int64_t committed = -1;
        EXPECT_EQ(zs_heal_agree(&committed, nullptr, m.opt), ZS_ERR_STATE_LOST);
        const std::string e = zs_last_error();
        std::printf("[heal-commit] double loss: rank %d: %s\n", env.rank, e.c_str());
        std::fflush(stdout);
        EXPECT_NE(e.find("rank 1's shard state is lost: rank 1 and rank 2, which held its copy, were lost together"),
                  std::string::npos)
            << e;
        EXPECT_EQ(zs_context_async_error(m.ctx), ZS_ERR_STATE_LOST);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {1, 2});
}

}  // namespace
