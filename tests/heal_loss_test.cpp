// Landing step 2 of docs/healing.md, detection and abort: with healing on
// (zeroshard.healing.peer_copy), a rank that dies is learnt from the
// heartbeat (Heartbeat::on_loss), whether or not anyone waits on it; every
// survivor's groups are aborted (Group::abort, Communicator::abort), and
// every survivor gets ZS_ERR_RANK_LOST naming the lost rank within the
// heartbeat limit (plus scheduling), never a hang, never the collective
// timeout. A group aborted from another thread ends its collective in
// flight at once. Real forked ranks over loopback; the victim SIGKILLs
// itself in the middle of a stream of all-reduces.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/group.h"
#include "impl/common/error.h"
#include "impl/core/context.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

using Clock = std::chrono::steady_clock;

// A short heartbeat, so each test takes about a second: beats every 100 ms,
// silent past 600 ms.
constexpr int kPeriodMs = 100;
constexpr int kLimitMs = 600;
// What a survivor may take from the kill to its error: the limit, plus room
// for a loaded 2-core machine (the bound that matters is the 30 s
// collective timeout, which it must never wait out).
constexpr double kMaxSeconds = kLimitMs / 1000.0 + 3.0;
constexpr int kTimeoutMs = 30000;
const char* kHealOn = R"({"zeroshard": {"healing": {"peer_copy": true}}})";

struct ShortHeartbeat {
  zs::test::ScopedEnv period{"ZS_HEARTBEAT_MS", "100"};
  zs::test::ScopedEnv limit{"ZS_HEARTBEAT_TIMEOUT_MS", "600"};
};

// Shared by the forked ranks (mapped before the fork; steady_clock is the
// system's monotonic clock, the same in every process).
struct Shared {
  std::atomic<int64_t> killed_ns;
  std::atomic<int64_t> latency_us[8];
  std::atomic<int> status[8];
};

Shared* shared_block() {
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return new (p) Shared{};
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

double seconds_since_kill(const Shared* sh) {
  return static_cast<double>(now_ns() - sh->killed_ns.load()) / 1e9;
}

// The victim's: after `after`, notes the time and dies as a SIGKILL does
// (the OS closes its sockets; it says no goodbye).
void kill_self_after(Shared* sh, std::chrono::milliseconds after) {
  std::thread([sh, after] {
    std::this_thread::sleep_for(after);
    sh->killed_ns = now_ns();
    kill(getpid(), SIGKILL);
  }).detach();
}

void expect_rank_lost(zs_status s, int victim) {
  const std::string msg = zs_last_error();
  EXPECT_EQ(s, ZS_ERR_RANK_LOST) << zs_status_string(s) << ": " << msg;
  EXPECT_NE(msg.find("rank " + std::to_string(victim) + " is lost"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has sent no heartbeat"), std::string::npos) << msg;
}

// Every rank runs all-reduces of 1M floats back to back on the world group
// until one fails; the victim kills itself 150 ms after its first one
// completed, in the middle of a later one (each takes tens of ms here;
// counted from the first, not from the start, so that a loaded machine
// cannot kill it before the stream began). Every survivor's failing call
// must be RANK_LOST naming the victim, within the limit of the kill; later
// calls of the context fail the same way at once, and destroy returns
// promptly.
void killed_mid_allreduce(int world, int victim) {
  ShortHeartbeat hb;
  Shared* sh = shared_block();
  run_ranks(
      world,
      [&](const RankEnv& env) {
        zs_context ctx = zs::test::make_context(env, kHealOn, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        zs_group g = nullptr;
        ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
        std::vector<float> send(1 << 20, 1.0f), recv(send.size());
        zs_status s = ZS_OK;
        int done = 0;
        const auto t0 = Clock::now();
        while (s == ZS_OK && Clock::now() - t0 < std::chrono::seconds(20)) {
          zs_work w = nullptr;
          s = zs_allreduce(&w, g, send.data(), recv.data(), send.size(), ZS_FLOAT32, ZS_SUM);
          if (s == ZS_OK) s = zs_work_wait(w, ZS_WAIT_FOREVER);
          zs_work_destroy(w);
          ++done;
          if (env.rank == victim && done == 1 && s == ZS_OK) kill_self_after(sh, std::chrono::milliseconds(150));
        }
        ASSERT_GT(sh->killed_ns.load(), 0) << "the victim never died";
        const double latency = seconds_since_kill(sh);
        sh->latency_us[env.rank] = static_cast<int64_t>(latency * 1e6);
        sh->status[env.rank] = s;
        std::printf("[heal-loss] %d ranks: rank %d: %s %.3f s after rank %d was killed (%d all-reduces): %s\n",
                    world, env.rank, zs_status_string(s), latency, victim, done, zs_last_error());
        std::fflush(stdout);
        expect_rank_lost(s, victim);
        EXPECT_LT(latency, kMaxSeconds);
        EXPECT_GT(done, 1) << "the victim died before the stream of all-reduces began";
        // Later work is refused at once with the same status.
        EXPECT_EQ(zs_context_async_error(ctx), ZS_ERR_RANK_LOST);
        zs_work w = nullptr;
        const auto t1 = Clock::now();
        zs_status again = zs_allreduce(&w, g, send.data(), recv.data(), 1, ZS_FLOAT32, ZS_SUM);
        if (again == ZS_OK) again = zs_work_wait(w, ZS_WAIT_FOREVER);
        zs_work_destroy(w);
        expect_rank_lost(again, victim);
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - t1).count(), 1.0);
        zs_group_destroy(g);
        const auto t2 = Clock::now();
        EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - t2).count(), 3.0);
      },
      60, {victim});
}

TEST(HealLoss, RankKilledMidAllReduceIsRankLostOnThreeRanks) { killed_mid_allreduce(3, 1); }
TEST(HealLoss, RankKilledMidAllReduceIsRankLostOnFourRanks) { killed_mid_allreduce(4, 2); }
// Rank 0 serves the store: the survivors learn of its loss from the
// heartbeat all the same.
TEST(HealLoss, StoreServerKilledMidAllReduceIsRankLost) { killed_mid_allreduce(3, 0); }

// No survivor waits on the victim when it dies (they sleep): the loss
// subscription names it anyway, and the next call fails with it at once.
TEST(HealLoss, RankLostWhileNobodyWaitsIsRecordedAndRefusesTheNextCall) {
  ShortHeartbeat hb;
  Shared* sh = shared_block();
  const int victim = 2;
  run_ranks(
      3,
      [&](const RankEnv& env) {
        zs_context ctx = zs::test::make_context(env, kHealOn, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        if (env.rank == victim) {
          kill_self_after(sh, std::chrono::milliseconds(100));
          for (;;) pause();
        }
        // Poll the context's error without calling into any collective.
        const auto t0 = Clock::now();
        while (zs_context_async_error(ctx) == ZS_OK && Clock::now() - t0 < std::chrono::seconds(20))
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        const double latency = seconds_since_kill(sh);
        EXPECT_EQ(zs_context_async_error(ctx), ZS_ERR_RANK_LOST);
        std::printf("[heal-loss] idle: rank %d recorded the loss %.3f s after the kill\n", env.rank, latency);
        std::fflush(stdout);
        EXPECT_LT(latency, kMaxSeconds);
        zs_group g = nullptr;
        ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
        float x = 1.0f, y = 0.0f;
        zs_work w = nullptr;
        zs_status s = zs_allreduce(&w, g, &x, &y, 1, ZS_FLOAT32, ZS_SUM);
        if (s == ZS_OK) s = zs_work_wait(w, ZS_WAIT_FOREVER);
        zs_work_destroy(w);
        expect_rank_lost(s, victim);
        zs_group_destroy(g);
        EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
      },
      60, {victim});
}

// With healing off the same death stays what it was: ZS_ERR_COMM (the
// heartbeat or the closed connection names it), never RANK_LOST.
TEST(HealLoss, HealingOffKeepsCommError) {
  ShortHeartbeat hb;
  Shared* sh = shared_block();
  run_ranks(
      3,
      [&](const RankEnv& env) {
        zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        zs_group g = nullptr;
        ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
        std::vector<float> send(1 << 18, 1.0f), recv(send.size());
        if (env.rank == 1) kill_self_after(sh, std::chrono::milliseconds(200));
        zs_status s = ZS_OK;
        const auto t0 = Clock::now();
        while (s == ZS_OK && Clock::now() - t0 < std::chrono::seconds(20)) {
          zs_work w = nullptr;
          s = zs_allreduce(&w, g, send.data(), recv.data(), send.size(), ZS_FLOAT32, ZS_SUM);
          if (s == ZS_OK) s = zs_work_wait(w, ZS_WAIT_FOREVER);
          zs_work_destroy(w);
        }
        EXPECT_EQ(s, ZS_ERR_COMM) << zs_status_string(s) << ": " << zs_last_error();
        EXPECT_LT(seconds_since_kill(sh), kMaxSeconds);
        zs_group_destroy(g);
        // Rank 0 serves the store: it stays until rank 2 is done with it.
        std::this_thread::sleep_for(std::chrono::milliseconds(env.rank == 0 ? 1500 : 0));
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {1});
}

// Group::abort from another thread ends a collective that would otherwise
// wait out the timeout (rank 1 never joins it) within milliseconds, and
// fails what is queued and submitted later with the abort's code.
TEST(HealLoss, GroupAbortEndsTheCollectiveInFlightAtOnce) {
  run_ranks(2, [](const RankEnv& env) {
    auto ctx = zs::test::make_engine_context(env);
    const auto& world = ctx->world();
    if (env.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      _exit(0);  // never joins; its exit after rank 0's abort changes nothing
    }
    std::vector<float> send(1024, 1.0f), recv(1024);
    auto running = world->submit("a test all-reduce", [&](zs::Communicator& c) {
      c.allreduce(send.data(), recv.data(), send.size(), zs::DType::F32, zs::ReduceOp::Sum);
    });
    auto queued = world->submit("a queued all-reduce", [&](zs::Communicator& c) {
      c.allreduce(send.data(), recv.data(), send.size(), zs::DType::F32, zs::ReduceOp::Sum);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = Clock::now();
    world->abort(zs::Code::RankLost, "rank 1 is lost: a test says so");
    try {
      running->wait(-1);
      ADD_FAILURE() << "the aborted all-reduce completed";
    } catch (const zs::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 is lost: a test says so"), std::string::npos) << e.what();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("[heal-loss] the aborted all-reduce ended %.4f s after Group::abort\n", took);
    std::fflush(stdout);
    EXPECT_LT(took, 1.0);
    try {
      queued->wait(-1);
      ADD_FAILURE() << "the queued all-reduce ran";
    } catch (const zs::Error& e) {
      EXPECT_EQ(e.code(), zs::Code::RankLost) << e.what();
    }
    EXPECT_THROW(world->submit("later", [](zs::Communicator&) {}), zs::Error);
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

}  // namespace
