// Landing step 3 of docs/healing.md under the launcher: the C example
// trainer (examples/c/train_mlp.c, which heals through zs_heal_agree and
// zs_heal_join) under `zsrun --restarts 1`, with no config change (zsrun
// exports ZS_HEAL=auto), loses a rank to SIGKILL (ZS_FAULT_POINT) mid-run;
// zsrun starts that rank again alone, it joins, and the run prints the
// losses of an uninterrupted run, bit for bit, with no restart of the job.
// Rank 0 heals too: zsrun serves the store from zsstore.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "tests/support/train_mlp_run.h"

namespace {

const char* kFastHeartbeat = "ZS_HEARTBEAT_MS=100 ZS_HEARTBEAT_TIMEOUT_MS=600 ZS_DEVICE=cpu";
constexpr int kSteps = 12;

zs::test::ExampleRun reference(int ranks) {
  return zs::test::run_train_mlp(ranks, "--steps " + std::to_string(kSteps), kFastHeartbeat);
}

// train_mlp under `zsrun --restarts <restarts>` with `env` (the faults)
// beside the fast heartbeat; *took, if given, the seconds it ran.
zs::test::ExampleRun faulted(int ranks, const std::string& env, int restarts, double* took = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  auto run = zs::test::run_train_mlp(ranks, "--steps " + std::to_string(kSteps),
                                     std::string(kFastHeartbeat) + " " + env, "--restarts " + std::to_string(restarts));
  if (took) *took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

// The fault's count is the victim's passes: its replacement, which starts
// counting again, runs fewer steps after the join than that, so it is not
// killed too.
void heals_under_zsrun(int ranks, const std::string& fault) {
  const auto ref = reference(ranks);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kSteps)) << ref.out;
  double took = 0;
  const auto run = faulted(ranks, "ZS_FAULT_POINT=" + fault, 1, &took);
  std::printf("[heal-zsrun] %s on %d ranks: %.2f s\n", fault.c_str(), ranks, took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("killed by signal SIGKILL"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: starting a replacement of rank"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("replaced a lost rank and joined at step"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_EQ(run.losses, ref.losses) << run.out;
  EXPECT_FALSE(run.json.empty()) << run.out;
}

TEST(HealZsrun, TrainMlpHealsARankKilledInTheUpdateOnThreeRanks) { heals_under_zsrun(3, "update:1:8"); }

// The store's own process is lost too: zsstore SIGKILLs itself
// (ZS_FAULT_STORE) at a request of the heal of rank 1 (killed in step 8's
// update), applied but not answered. zsrun starts it again on the same port
// from its journal; the survivors and the replacement resend what it cut
// short and the heal ends as without it: no job restart, the uninterrupted
// run's losses bit for bit. kStoreKillAt is past the rendezvous' requests
// (about 50 on 3 ranks) and short of the healed run's (about 100).
TEST(HealZsrun, AZsstoreKilledInTheJoinIsStartedAgainAndTheHealEndsBitwise) {
  constexpr int kStoreKillAt = 70;
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto run = faulted(3, "ZS_FAULT_POINT=update:1:8 ZS_FAULT_STORE=" + std::to_string(kStoreKillAt), 1);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("ZS_FAULT_STORE=" + std::to_string(kStoreKillAt) + ": killed at its request"),
            std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: the store (zsstore) was killed by signal SIGKILL; starting it again on port"),
            std::string::npos) << run.out;
  EXPECT_NE(run.out.find("replaced a lost rank and joined at step"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_EQ(run.out.find("torn down"), std::string::npos) << run.out;
  EXPECT_EQ(run.losses, ref.losses) << run.out;
}

// zsrun --min-nproc 2 --shrink: rank 1, killed in step 8's update on 3
// ranks, is not started again; train_mlp's zs_heal_join shrinks the two
// others over the live ranks (ZS_HEAL_MIN_RANKS, which zsrun exports) and
// they train to the end on their own data shares, the job ending 0 with no
// restart. The same steps' losses as the uninterrupted run's up to the
// loss (the shrink itself is checked bit for bit in heal_shrink_test).
// With one rank more than --min-nproc allows (--min-nproc 3), the lost rank
// is replaced instead, as under plain --restarts.
TEST(HealZsrun, UnderMinNprocShrinkTheSurvivorsGoOnWithoutTheLostRank) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  double took = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = zs::test::run_train_mlp(3, "--steps " + std::to_string(kSteps),
                                           std::string(kFastHeartbeat) + " ZS_FAULT_POINT=update:1:8",
                                           "--restarts 1 --min-nproc 2 --shrink");
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[heal-zsrun] update:1:8 on 3 ranks, shrunk to 2: %.2f s\n", took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: rank 1 is lost and not started again (--min-nproc 2 --shrink): the 2 "
                         "others go on without it"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("starting a replacement"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_NE(run.out.find("train_mlp: healed; the run goes on after step"), std::string::npos) << run.out;
  ASSERT_EQ(run.losses.size(), static_cast<size_t>(kSteps)) << run.out;
  for (size_t s = 0; s < 7; ++s) EXPECT_EQ(run.losses[s], ref.losses[s]) << "step " << s << ": " << run.out;
  EXPECT_NE(run.losses.back(), ref.losses.back()) << "two ranks' data, not three";

  const auto replaced = zs::test::run_train_mlp(3, "--steps " + std::to_string(kSteps),
                                                std::string(kFastHeartbeat) + " ZS_FAULT_POINT=update:1:8",
                                                "--restarts 1 --min-nproc 3 --shrink");
  EXPECT_EQ(replaced.rc, 0) << replaced.out;
  EXPECT_NE(replaced.out.find("zsrun: healing: starting a replacement of rank 1"), std::string::npos) << replaced.out;
  EXPECT_EQ(replaced.losses, ref.losses) << replaced.out;
}

// zsrun --min-nproc 2 --shrink --replacement-wait S: the lost rank is
// started again first, and the survivors wait up to S for it. One that
// comes in time joins (the uninterrupted run's losses); one that comes
// later (it sleeps 5 s before train_mlp starts, as on a slow host: the
// survivors find the loss within about 2 s of it, under load too) finds
// the two others gone on without it, exits with ZS_EXIT_NOT_TAKEN, and the
// job ends 0 with the shrunk run's losses, no restart.
TEST(HealZsrun, UnderReplacementWaitAReplacementInTimeJoinsAndALateOneIsNotTaken) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const std::string env = std::string(kFastHeartbeat) + " ZS_FAULT_POINT=update:1:8";
  const auto in_time = zs::test::run_train_mlp(3, "--steps " + std::to_string(kSteps), env,
                                               "--restarts 1 --min-nproc 2 --shrink --replacement-wait 20");
  EXPECT_EQ(in_time.rc, 0) << in_time.out;
  EXPECT_NE(in_time.out.find("zsrun: healing: starting a replacement of rank 1 (ZS_HEAL_REPLACEMENT=1; restart 1 "
                             "of 1); the other ranks keep running, and wait up to 20 s for it (--replacement-wait)"),
            std::string::npos) << in_time.out;
  EXPECT_EQ(in_time.out.find("went on without"), std::string::npos) << in_time.out;
  EXPECT_EQ(in_time.losses, ref.losses) << in_time.out;

  const auto t0 = std::chrono::steady_clock::now();
  const auto late = zs::test::run_train_mlp(3, "--steps " + std::to_string(kSteps), env,
                                            "--restarts 1 --min-nproc 2 --shrink --replacement-wait 0.5", 5.0);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[heal-zsrun] update:1:8 on 3 ranks, the replacement 5 s late for a 0.5 s deadline: %.2f s\n", took);
  EXPECT_EQ(late.rc, 0) << late.out;
  EXPECT_NE(late.out.find("no replacement of rank 1 came within zeroshard.healing.replacement_wait_s = 0.5 s; "
                          "the 2 live ranks go on without it"), std::string::npos) << late.out;
  EXPECT_NE(late.out.find("ZS_ERR_NOT_TAKEN"), std::string::npos) << late.out;
  EXPECT_NE(late.out.find("zsrun: healing: rank 1's replacement came after --replacement-wait 0.5 s: the 2 others "
                          "went on without it"), std::string::npos) << late.out;
  EXPECT_EQ(late.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << late.out;
  // The shrunk run: the steps before the loss as the reference's, the
  // last on two ranks' data (as UnderMinNprocShrink... above).
  ASSERT_EQ(late.losses.size(), static_cast<size_t>(kSteps)) << late.out;
  for (size_t s = 0; s < 7; ++s) EXPECT_EQ(late.losses[s], ref.losses[s]) << "step " << s << ": " << late.out;
  EXPECT_NE(late.losses.back(), ref.losses.back()) << "two ranks' data, not three";
}

// --regrow-after: the two others go on without rank 1 at once (--shrink);
// zsrun starts it again right after (ZS_HEAL_JOIN=grow), and the others take
// it back at a step: the job is whole again, ends 0 with no restart, and
// every rank reports at the end. Steps pause 50 ms (--pause-ms) so that the
// run outlasts the process's start under sanitizers too; the process that
// comes back runs without the fault point (it would pass it too).
TEST(HealZsrun, UnderRegrowAfterTheJobGrowsBackToEveryRank) {
  const std::string env = std::string(kFastHeartbeat) + " ZS_FAULT_POINT=update:1:4";
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = zs::test::run_train_mlp(3, "--steps 100 --pause-ms 50", env,
                                           "--restarts 1 --min-nproc 2 --shrink --regrow-after 0", 0,
                                           "unset ZS_FAULT_POINT;");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[heal-zsrun] update:1:4 on 3 ranks, shrunk to 2 and grown back to 3: %.2f s\n", took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: rank 1 is lost and not started again (--min-nproc 2 --shrink)"),
            std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: starting rank 1 again to grow the job back to 3 ranks (--regrow-after 0 s; "
                         "ZS_HEAL_JOIN=grow ZS_HEAL_REPLACEMENT=1; restart 1 of 1)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank(s) 1 came back (ZS_HEAL_JOIN=grow): the world grows back to 3 of 3 ranks after optimizer "
                         "step"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_EQ(run.losses.size(), 100u) << run.out;
  // Every rank, rank 1 among them, in the end's memory all-gather.
  EXPECT_NE(run.out.find("\"per_rank\":[{\"rank\":0,"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("},{\"rank\":1,"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("},{\"rank\":2,"), std::string::npos) << run.out;
}

TEST(HealZsrun, TrainMlpHealsARankKilledInTheFetchOnFourRanks) { heals_under_zsrun(4, "fetch:2:20"); }

// Rank 0 killed: zsrun's zsstore serves the store, so rank 0 is replaced
// like any rank. Killed in a fetch (the step is redone, and the replacement
// rank 0 prints it).
TEST(HealZsrun, TrainMlpHealsRankZeroKilledInTheFetchOnThreeRanks) { heals_under_zsrun(3, "fetch:0:20"); }

// A rank that stops (SIGSTOP: hung, or starved past the heartbeat's limit)
// instead of dying is taken for lost all the same; after the agreement the
// lowest survivor kills its process (the fence: it must not come back into
// the run), and zsrun replaces it as any killed rank. Without the fence
// zsrun never learns of it and the survivors wait in the join until the
// store's timeout.
TEST(HealZsrun, TrainMlpFencesAndReplacesARankStoppedInTheUpdateOnThreeRanks) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  double took = 0;
  const auto run = faulted(3, "ZS_FAULT_POINT=update:2:8:stop", 1, &took);
  std::printf("[heal-zsrun] rank 2 stopped in the update, fenced and replaced: %.2f s\n", took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("rank 0: healing: rank 2 was taken for lost while its process lives: killed pid"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("(it was stopped), so that it cannot come back into the run"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank 2 killed by signal SIGKILL"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: starting a replacement of rank 2"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_EQ(run.losses, ref.losses) << run.out;
  EXPECT_LT(took, 30.0);
}

// The last kSteps losses printed: a job restarted whole prints the steps of
// its first attempt too, before its own from step 0 (train_mlp keeps no
// checkpoint).
std::vector<double> last_run(const std::vector<double>& losses) {
  return losses.size() < kSteps ? losses : std::vector<double>(losses.end() - kSteps, losses.end());
}

// Without a zsstore, rank 0 serves the store: its loss restarts the job
// (which runs clean: a fault is armed in the first attempt only), never a
// hang.
TEST(HealZsrun, RankZeroLostWithoutZsstoreRestartsTheJob) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  double took = 0;
  const auto run = faulted(3, "ZS_FAULT_POINT=update:0:8 ZSRUN_ZSSTORE=/nonexistent/zsstore", 1, &took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("rank 0 killed by signal SIGKILL"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("healing: starting a replacement"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("restart 1 of 1: starting the job again with 3 ranks"), std::string::npos) << run.out;
  EXPECT_EQ(last_run(run.losses), ref.losses) << run.out;
  EXPECT_LT(took, 30.0);
}

// A rank and the holder of its copy (rank + 1 on one host) killed in the
// same update: zsrun starts a replacement of each, but the survivor's heal
// is impossible (ZS_ERR_STATE_LOST naming both); it exits with
// ZS_EXIT_STATE_LOST, and zsrun says so and restarts the job whole, which
// runs from the start (train_mlp keeps no checkpoint) to the uninterrupted
// run's losses. Never a hang, never a silent heal with lost state.
TEST(HealZsrun, ARankAndItsHolderLostTogetherRestartTheJobByName) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  double took = 0;
  const auto run = faulted(3, "ZS_FAULT_POINT=update:1:8,update:2:8", 3, &took);
  std::printf("[heal-zsrun] rank 1 and its holder lost, restarted whole: %.2f s\n", took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("ZS_ERR_STATE_LOST"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing impossible: rank 0 exited with status 75 (ZS_ERR_STATE_LOST)"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("restarting every rank from the last checkpoint"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("restart 1 of 3: starting the job again with 3 ranks"), std::string::npos) << run.out;
  EXPECT_EQ(last_run(run.losses), ref.losses) << run.out;
  EXPECT_LT(took, 30.0);
}

// Rank 1 killed in its first step's seed (the first copy of its state, to
// rank 2): no copy of its state exists yet, so no heal can bring it back.
// Every survivor's agreement names it alike (not only the holder's join,
// while the others go on as if healed), each exits with status 75, and
// zsrun restarts the job whole, which then runs to the reference's losses.
TEST(HealZsrun, ARankLostInItsFirstSeedRestartsTheJobByName) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto run = faulted(3, "ZS_FAULT_POINT=grad_copy:1:1", 2);
  EXPECT_EQ(run.rc, 0) << run.out;
  const std::string named = "rank 1's shard state is lost: rank 2, which holds its copy, has none yet";
  size_t said = 0;
  for (size_t at = run.out.find(named); at != std::string::npos; at = run.out.find(named, at + 1)) ++said;
  EXPECT_EQ(said, 2u) << "each survivor names it: " << run.out;
  EXPECT_EQ(run.out.find("healed; the run goes on"), std::string::npos) << "a survivor went on: " << run.out;
  EXPECT_TRUE(std::regex_search(run.out, std::regex("zsrun: healing impossible: rank [02] exited with status 75 "
                                                    "\\(ZS_ERR_STATE_LOST\\)")))
      << run.out;
  EXPECT_NE(run.out.find("restart 1 of 2: starting the job again with 3 ranks"), std::string::npos) << run.out;
  EXPECT_EQ(last_run(run.losses), ref.losses) << run.out;
}

// A second loss while the survivors join the first one's replacement
// (ZS_FAULT_POINT "join": a survivor's, before the hand-over). Rank 3,
// which takes no part in handing rank 1's state over (rank 2 holds it),
// dies there: the join ends without it, and the next step finds its loss
// and heals it in turn. Two replacements, no job restart, the
// uninterrupted run's losses.
TEST(HealZsrun, ASecondLossInAJoinThatTakesNoPartInTheHandOverHealsInTurn) {
  const auto ref = reference(4);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  const auto run = faulted(4, "ZS_FAULT_POINT=update:1:8,join:3:1", 2);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: starting a replacement of rank 1"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("zsrun: healing: starting a replacement of rank 3"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank 1 replaced a lost rank and joined at step 8"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rank 3 replaced a lost rank and joined at step 8"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("starting the job again"), std::string::npos) << "the job was restarted: " << run.out;
  EXPECT_EQ(run.losses, ref.losses) << run.out;
}

// The holder of the lost rank's copy dies in the join, before handing it
// over: no copy of rank 1's state is left. The replacement, waiting for
// it, names that (ZS_ERR_STATE_LOST, not one more lost rank) and exits
// with status 75; zsrun says the heal is impossible and restarts the job,
// which runs to the uninterrupted run's losses. Never a hang.
TEST(HealZsrun, TheHolderLostInTheJoinBeforeTheHandOverRestartsTheJobByName) {
  const auto ref = reference(3);
  ASSERT_EQ(ref.rc, 0) << ref.out;
  double took = 0;
  const auto run = faulted(3, "ZS_FAULT_POINT=update:1:8,join:2:1", 3, &took);
  EXPECT_EQ(run.rc, 0) << run.out;
  EXPECT_NE(run.out.find("rank 1's shard state is lost: rank 2, which held its copy, was lost while handing it over"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("zsrun: healing impossible: rank 1 exited with status 75 (ZS_ERR_STATE_LOST)"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("starting the job again with 3 ranks"), std::string::npos) << run.out;
  EXPECT_EQ(last_run(run.losses), ref.losses) << run.out;
  EXPECT_LT(took, 30.0);
}

}  // namespace
