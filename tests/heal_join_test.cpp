// Landing step 3 of docs/healing.md, a replacement with the same rank id:
// a rank SIGKILLed at a phase of step 3 (ZS_FAULT_POINT: the fetch, the
// gradient reduce-scatter, after the norm all-reduce, the update) on 3 and
// 4 ranks is started again by the parent with its rank id and
// ZS_HEAL_REPLACEMENT=1 (as zsrun does). It registers its params
// (ZS_INIT_FROM_RANK: no scatter in a replacement) and optimizer as at the
// start and calls zs_heal_join; the survivors call zs_heal_agree, then
// zs_heal_join. Every rank redoes step C + 1 and runs to the end: each
// rank's state after the last step equals the uninterrupted run's bit for
// bit (zs_heal_state_digest), the replacement's at C too, and the survivors'
// processes are the ones started (no checkpoint directory anywhere). A
// replacement that builds another model is a named error on every rank.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>
#include <thread>
#include <csignal>
#include <sys/wait.h>

#include "tests/support/heal_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using namespace zs::test::heal;

namespace {

// Shared by the forked ranks (mapped before the forks).
struct Shared {
  std::atomic<uint64_t> ref[kMaxWorld][kSteps + 1];  // the uninterrupted run: rank r's digest after step s
  std::atomic<int64_t> committed[kMaxWorld];         // each rank's C from zs_heal_join (-1: none)
  std::atomic<int> pid_at_start[kMaxWorld], pid_at_end[kMaxWorld];
  std::atomic<int> finished[kMaxWorld];              // ranks whose final state was checked
  std::atomic<double> kill_to_commit_s;              // a survivor's: the failing step's start to step C + 1's commit
  std::atomic<int> agreed;                           // survivors past zs_heal_agree
  std::atomic<int> stale_status;                     // what the stopped victim's agreement returned, had it returned
};

// The frozen param's full values (a gather: collective) equal those it
// was registered with; a replacement registers it without them (no
// scatter), so they must have come with its join.
bool frozen_is_initial(Model& m) {
  zs_gather g = nullptr;
  if (zs_fetch(&g, m.ctx, &m.frozen, 1) != ZS_OK || zs_gather_wait(g, 30000) != ZS_OK) return false;
  zs_gather_destroy(g);
  std::vector<float> full(777);
  const bool copied = zs_param_copy_to(m.frozen, full.data(), full.size() * sizeof(float)) == ZS_OK;
  zs_release(m.ctx, &m.frozen, 1);
  return copied && full == initial_values(2, 777);
}

// The victim dies at the count-th pass of `point` in step 3; the parent
// starts its replacement, which joins; all run to step kSteps. With
// `external`, a process of its own serves the store (as zsrun's zsstore
// does), so rank 0 may be the victim.
// With `hosts` > 1 the ranks play that many hosts (rank * hosts / world).
// With `stop` the victim stops (SIGSTOP) instead of dying; once the
// survivors agreed, the test's parent lets it go on (SIGCONT): it must
// fence itself (it was taken for lost on a host where no survivor could
// kill it), dying as a lost rank does, and its replacement takes its place.
void replaced_at(int world, int victim, const char* point, int count, bool external = false, int hosts = 1,
                 bool stop = false) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  reference_run(world, sh->ref, [](const RankEnv& env, Model& m) { ZS_ASSERT_OK(build_with_frozen(env, m)); });
  std::unique_ptr<zs::test::ExternalStore> store;
  if (external) store = std::make_unique<zs::test::ExternalStore>();
  const std::string fault =
      std::string(point) + ":" + std::to_string(victim) + ":" + std::to_string(count) + (stop ? ":stop" : "");
  sh->stale_status = -1;
  // A process, not a thread: the parent forks the replacement later (and
  // TSan refuses a fork from a multi-threaded process).
  pid_t resume = -1;
  if (stop) {
    resume = fork();
    ASSERT_GE(resume, 0);
    if (resume == 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (sh->agreed.load() < world - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      kill(sh->pid_at_start[victim].load(), SIGCONT);
      _exit(0);
    }
  }
  const auto pids = zs::test::run_ranks_replacing(
      world,
      [&](const RankEnv& env) {
        if (hosts > 1) zs::test::play_host(env.rank * hosts / world);
        if (env.replacement == 0) {
          setenv("ZS_FAULT_POINT", fault.c_str(), 1);
          sh->pid_at_start[env.rank] = getpid();
        } else {
          unsetenv("ZS_FAULT_POINT");  // the replacement's own passes count from zero
        }
        Model m;
        ZS_ASSERT_OK(build_with_frozen(env, m));
        int step = 1;
        if (env.replacement > 0) {
          // Nothing collective before the join (the survivors wait there):
          // refused at once by name, the replacement still able to join.
          zs_gather g = nullptr;
          EXPECT_EQ(zs_fetch(&g, m.ctx, m.params, 2), ZS_ERR_INVALID_STATE);
          EXPECT_NE(std::string(zs_last_error()).find("before zs_heal_join"), std::string::npos) << zs_last_error();
          EXPECT_EQ(zs_param_update(m.ctx, m.params, 1, 0), ZS_ERR_INVALID_STATE);
          int64_t committed = -1;
          ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
          sh->committed[env.rank] = committed;
          int64_t at = -1;
          EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][committed].load()) << "the replacement's state at C";
          EXPECT_EQ(at, committed);
          step = static_cast<int>(committed) + 1;
        }
        auto failed_step_began = std::chrono::steady_clock::now();
        bool healed = false;
        while (step <= kSteps) {
          const auto began = std::chrono::steady_clock::now();
          const zs_status s = train_step(env, m, step);
          if (s == ZS_OK) {
            if (healed && sh->kill_to_commit_s.load() == 0.0)
              sh->kill_to_commit_s =
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_step_began).count();
            healed = false;
            ++step;
            continue;
          }
          if (stop && env.rank == victim) {
            // Back from the stop, into the agreement as a survivor would
            // go: it must end there, fenced.
            int64_t agreed = -1;
            sh->stale_status = zs_heal_agree(&agreed, nullptr, m.opt);
            std::fprintf(stderr, "the stopped victim's step: %s; its agreement: %s\n", zs_status_string(s),
                         zs_last_error());
            _exit(3);
          }
          ASSERT_NE(env.rank, victim) << "the victim outlived its fault point " << fault;
          ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
          ASSERT_EQ(sh->committed[env.rank].load(), -1) << "a second loss";
          failed_step_began = began;
          int64_t agreed = -1, committed = -1;
          ZS_ASSERT_OK(zs_heal_agree(&agreed, nullptr, m.opt));
          sh->agreed += 1;
          ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
          EXPECT_EQ(committed, agreed);
          sh->committed[env.rank] = committed;
          int64_t at = -1;
          EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][committed].load()) << "rank " << env.rank << " at C";
          EXPECT_EQ(at, committed);
          step = static_cast<int>(committed) + 1;
          healed = true;
        }
        int64_t at = -1;
        EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][kSteps].load())
            << "rank " << env.rank << (env.replacement ? " (the replacement)" : "") << " after the last step";
        EXPECT_EQ(at, kSteps);
        EXPECT_EQ(zs_context_async_error(m.ctx), ZS_OK) << zs_last_error();
        EXPECT_TRUE(frozen_is_initial(m)) << "rank " << env.rank << (env.replacement ? " (the replacement)" : "")
                                          << ": the frozen param in no optimizer";
        sh->pid_at_end[env.rank] = getpid();
        sh->finished[env.rank] += 1;
        destroy(m);
      },
      60, {victim}, 1, store ? store->port() : 0);
  if (resume > 0) waitpid(resume, nullptr, 0);
  EXPECT_EQ(sh->stale_status.load(), -1) << "the stopped victim's agreement returned instead of fencing it";
  std::printf("[heal-join] %s on %d ranks%s: C = %lld, kill to the next committed step %.3f s\n", fault.c_str(), world,
              external ? " (external store)" : "", static_cast<long long>(sh->committed[victim].load()), sh->kill_to_commit_s.load());
  std::fflush(stdout);
  ASSERT_EQ(pids[static_cast<size_t>(victim)].size(), 2u) << "the victim was replaced once";
  int64_t c = sh->committed[victim];
  EXPECT_GE(c, 2);
  EXPECT_LE(c, 3);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
    EXPECT_EQ(sh->committed[r].load(), c) << "rank " << r << " joined at another C";
    if (r == victim) continue;
    EXPECT_EQ(pids[static_cast<size_t>(r)].size(), 1u) << "survivor " << r << " was started again";
    EXPECT_EQ(sh->pid_at_start[r].load(), sh->pid_at_end[r].load()) << "survivor " << r << "'s process changed";
    EXPECT_EQ(sh->pid_at_start[r].load(), pids[static_cast<size_t>(r)][0]);
  }
  EXPECT_EQ(sh->pid_at_end[victim].load(), pids[static_cast<size_t>(victim)][1]) << "the replacement finished";
}

TEST(HealJoin, ReplacedAfterAKillInTheFetchOnThreeRanks) { replaced_at(3, 1, "fetch", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheReduceScatterOnThreeRanks) { replaced_at(3, 2, "reduce_scatter", 4); }
TEST(HealJoin, ReplacedAfterAKillBeforeTheNormAllReduceOnThreeRanks) { replaced_at(3, 1, "norm_allreduce", 3); }
TEST(HealJoin, ReplacedAfterAKillAfterTheNormAllReduceOnThreeRanks) { replaced_at(3, 1, "norm_allreduce_done", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheUpdateOnThreeRanks) { replaced_at(3, 2, "update", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheFetchOnFourRanks) { replaced_at(4, 3, "fetch", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheReduceScatterOnFourRanks) { replaced_at(4, 1, "reduce_scatter", 4); }
TEST(HealJoin, ReplacedAfterAKillAfterTheNormAllReduceOnFourRanks) { replaced_at(4, 2, "norm_allreduce_done", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheUpdateOnFourRanks) { replaced_at(4, 1, "update", 3); }
TEST(HealJoin, ReplacedAfterAKillInTheReplayOnFourRanks) { replaced_at(4, 2, "replay", 3); }
// Rank 0 lost: the store is served by a process of its own.
TEST(HealJoin, RankZeroReplacedAfterAKillInTheFetchOnThreeRanks) { replaced_at(3, 0, "fetch", 3, true); }
TEST(HealJoin, RankZeroReplacedAfterAKillBeforeTheNormAllReduceOnThreeRanks) {
  replaced_at(3, 0, "norm_allreduce", 3, true);
}
TEST(HealJoin, RankZeroReplacedAfterAKillInTheUpdateOnThreeRanks) { replaced_at(3, 0, "update", 3, true); }
TEST(HealJoin, RankZeroReplacedAfterAKillInTheReduceScatterOnFourRanks) {
  replaced_at(4, 0, "reduce_scatter", 4, true);
}
TEST(HealJoin, RankZeroReplacedAfterAKillAfterTheNormAllReduceOnFourRanks) {
  replaced_at(4, 0, "norm_allreduce_done", 3, true);
}

// A rank stopped in the update, on the host the lowest survivor is not on:
// it fences itself once it goes on.
TEST(HealJoin, AStoppedRankOnAnotherHostFencesItselfAndIsReplacedOnFourRanks) {
  replaced_at(4, 3, "update", 3, false, 2, true);
}

// The replacement registers w1 with another shape: zs_heal_join fails on
// every rank, naming the param and both shapes, within the heartbeat limit
// and the join (never the store's timeout).
TEST(HealJoin, AReplacementWithAnotherModelIsANamedError) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  zs::test::run_ranks_replacing(
      3,
      [&](const RankEnv& env) {
        if (env.replacement == 0) setenv("ZS_FAULT_POINT", "update:1:2", 1);
        else unsetenv("ZS_FAULT_POINT");
        Model m;
        ZS_ASSERT_OK(build_with_frozen(env, m, env.replacement > 0 ? 4000 : kNumel[1]));
        const auto t0 = std::chrono::steady_clock::now();
        zs_status s = ZS_OK;
        if (env.replacement == 0) {
          for (int step = 1; step <= kSteps && s == ZS_OK; ++step) s = train_step(env, m, step);
          ASSERT_NE(env.rank, 1) << "the victim outlived its fault point";
          ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_last_error();
          int64_t c = -1;
          ZS_ASSERT_OK(zs_heal_agree(&c, nullptr, m.opt));
        }
        int64_t committed = -1;
        s = zs_heal_join(&committed, m.opt);
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_EQ(s, ZS_ERR_INVALID_STATE) << zs_status_string(s) << ": " << zs_last_error();
        const std::string e = zs_last_error();
        std::printf("[heal-join] rank %d%s: %s\n", env.rank, env.replacement ? " (replacement)" : "", e.c_str());
        std::fflush(stdout);
        EXPECT_NE(e.find("the replacement of rank 1 built another model"), std::string::npos) << e;
        EXPECT_NE(e.find("param 'w1' float32 [4000]"), std::string::npos) << e;
        EXPECT_NE(e.find("param 'w1' float32 [4097]"), std::string::npos) << e;
        EXPECT_LT(took, 10.0) << "rank " << env.rank;
        sh->finished[env.rank] += 1;
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {1});
  for (int r = 0; r < 3; ++r) EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
}

// A step through the fetch coordinator: its step (zs_step_begin ..
// zs_step_end) around the fetch (zs_coord_fetch / zs_coord_release), the
// gradients and the optimizer step, so that a loss in the optimizer step
// leaves the coordinator's step open on the survivors.
zs_status coordinated_step(const RankEnv& env, Model& m, int step) {
  zs_status s = zs_step_begin(m.ctx);
  if (s == ZS_OK) s = zs_coord_fetch(m.ctx, m.params, 2);
  if (s == ZS_OK) s = zs_coord_release(m.ctx, m.params, 2);
  if (s == ZS_OK) s = push_grads(env, m, step);
  if (s == ZS_OK) s = zs_optimizer_step(m.opt, nullptr);
  if (s == ZS_OK) s = zs_step_end(m.ctx);
  return s;
}

// This rank's blob for step `step`: about 1 MiB, its size and bytes
// differing by rank and step, so that a blob of another step or rank, or
// one cut short, shows.
std::string rank_blob(int rank, int step) {
  return "rank " + std::to_string(rank) + " step " + std::to_string(step) + "/" +
         std::string((size_t{1} << 20) + 4099 * static_cast<size_t>(step), static_cast<char>('a' + (rank + step) % 26));
}

// Landing step 4: the trainer's own state reaches the replacement. Each
// rank sets its blob (rank_blob) before step s and the shared state
// ("after step s") after it; rank 1 dies in step 3 at `fault`, before the
// step commits (C = 2) or after (C = 3): the replacement gets its own blob
// of step C, which rode in the gradient copy to its holder, and the
// survivors' shared state of step C (zs_heal_joined_state, the size asked
// first); a survivor was handed nothing. The fetch coordinator, whose step
// the loss left open on the survivors, is reset at the join on every rank
// (it was refused), and every rank ends with the uninterrupted run's state
// (the reference steps without the coordinator: the same numbers).
void trainers_state_reaches_the_replacement(const char* fault, int64_t expect_committed) {
  ShortHeartbeat hb;
  Shared* sh = shared_block<Shared>();
  reference_run(3, sh->ref, [](const RankEnv& env, Model& m) { ZS_ASSERT_OK(build_with_frozen(env, m)); });
  zs::test::run_ranks_replacing(
      3,
      [&](const RankEnv& env) {
        if (env.replacement == 0) setenv("ZS_FAULT_POINT", fault, 1);
        else unsetenv("ZS_FAULT_POINT");
        Model m;
        ZS_ASSERT_OK(build_with_frozen(env, m));
        const auto get = [&](zs_heal_state_kind which, int* found) {
          size_t size = 7;
          EXPECT_EQ(zs_heal_joined_state(&size, found, m.ctx, which, nullptr, 0), ZS_OK) << zs_last_error();
          std::string out(size, '\0');
          if (size > 1) {
            EXPECT_EQ(zs_heal_joined_state(&size, found, m.ctx, which, out.data(), 1), ZS_ERR_BUFFER_SIZE);
          }
          if (size > 0) {
            EXPECT_EQ(zs_heal_joined_state(&size, found, m.ctx, which, out.data(), out.size()), ZS_OK);
          }
          return out;
        };
        int step = 1;
        if (env.replacement > 0) {
          int64_t committed = -1;
          ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
          EXPECT_EQ(committed, expect_committed);
          int found = 0;
          const std::string blob = get(ZS_HEAL_RANK_STATE, &found);
          EXPECT_EQ(blob.size(), rank_blob(1, static_cast<int>(committed)).size());
          EXPECT_TRUE(blob == rank_blob(1, static_cast<int>(committed))) << blob.substr(0, 40);
          EXPECT_EQ(found, 1);
          // Of step C, or C - 1 where the loss surfaced in step C's own
          // optimizer call after it committed (a persistent param's gather
          // after the update): the survivors set none for C then.
          const std::string shared = get(ZS_HEAL_SHARED_STATE, &found);
          EXPECT_TRUE(shared == "after step " + std::to_string(committed) ||
                      shared == "after step " + std::to_string(committed - 1))
              << shared << " at C = " << committed;
          EXPECT_EQ(found, 1);
          step = static_cast<int>(committed) + 1;
        }
        while (step <= kSteps) {
          const std::string blob = rank_blob(env.rank, step);
          ZS_ASSERT_OK(zs_heal_set_rank_state(m.opt, blob.data(), blob.size()));
          const zs_status s = coordinated_step(env, m, step);
          if (s == ZS_OK) {
            const std::string shared = "after step " + std::to_string(step);
            ZS_ASSERT_OK(zs_heal_set_shared_state(m.ctx, shared.data(), shared.size()));
            ++step;
            continue;
          }
          ASSERT_NE(env.rank, 1) << "the victim outlived its fault point";
          ASSERT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << zs_last_error();
          int64_t agreed = -1, committed = -1;
          ZS_ASSERT_OK(zs_heal_agree(&agreed, nullptr, m.opt));
          ZS_ASSERT_OK(zs_heal_join(&committed, m.opt));
          EXPECT_EQ(committed, agreed);
          EXPECT_EQ(committed, expect_committed);
          int found = 1;
          EXPECT_EQ(get(ZS_HEAL_SHARED_STATE, &found), "");
          EXPECT_EQ(found, 0) << "a survivor is handed nothing";
          EXPECT_EQ(get(ZS_HEAL_RANK_STATE, &found), "");
          EXPECT_EQ(found, 0) << "a survivor is handed nothing";
          step = static_cast<int>(committed) + 1;
        }
        int64_t at = -1;
        EXPECT_EQ(own_digest(m, &at), sh->ref[env.rank][kSteps].load()) << "rank " << env.rank;
        sh->finished[env.rank] += 1;
        destroy(m);
      },
      60, {1});
  for (int r = 0; r < 3; ++r) EXPECT_EQ(sh->finished[r].load(), 1) << "rank " << r;
}

TEST(HealJoin, TheTrainersStateReachesTheReplacementWithTheCoordinatorInUse) {
  trainers_state_reaches_the_replacement("norm_allreduce:1:3", 2);
}

TEST(HealJoin, TheTrainersStateOfACommittedStepReachesTheReplacement) {
  trainers_state_reaches_the_replacement("update:1:3", 3);
}

}  // namespace
