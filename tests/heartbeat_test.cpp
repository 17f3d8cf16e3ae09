// A peer that is alive but not running (SIGSTOP) keeps its sockets open:
// only its missing heartbeats tell. The other ranks get ZS_ERR_COMM naming
// it within the heartbeat limit (2 s by default) during a gather, a step or
// a destroy, instead of waiting out the collective timeout; a rank that is
// only busy is waited for; ZS_HEARTBEAT_MS=0 restores the timeout alone.
// The stopped rank is killed at the end of each test.
#include <gtest/gtest.h>

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/transport/heartbeat.h"
#include "impl/comm/store/store.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/counting_store.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

using Clock = std::chrono::steady_clock;

// Shared by the forked ranks (mapped before the fork): who to kill, when it
// stopped (steady_clock is the system's monotonic clock, the same in every
// process), and how many survivors are done with it.
struct Shared {
  std::atomic<int> pid[4];
  std::atomic<int64_t> stopped_ns;
  std::atomic<int> done;
};

Shared* make_shared_block() {
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return new (p) Shared{};
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// The victim: waits `after`, notes the time, stops itself. It never runs
// again: a survivor kills it.
[[noreturn]] void stop_self(Shared* sh, std::chrono::milliseconds after) {
  std::this_thread::sleep_for(after);
  sh->stopped_ns = now_ns();
  kill(getpid(), SIGSTOP);
  for (;;) pause();  // not reached unless someone sends SIGCONT
}

double seconds_since_stop(const Shared* sh) {
  return static_cast<double>(now_ns() - sh->stopped_ns.load()) / 1e9;
}

// Every survivor calls this once it is done; the last one kills the victim.
void survivor_done(Shared* sh, int survivors, int victim) {
  if (sh->done.fetch_add(1) + 1 == survivors) kill(sh->pid[victim].load(), SIGKILL);
}

zs_param small_param(zs_context ctx, const char* name = "w") {
  const int64_t shape[1] = {1000};
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name;
  o.ndim = 1;
  o.shape = shape;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

// The error a survivor must see: the stopped rank, its host, why, and what
// could not complete.
void expect_named(zs_status s, int victim, const char* what) {
  const std::string msg = zs_last_error();
  EXPECT_EQ(s, ZS_ERR_COMM) << zs_status_string(s) << ": " << msg;
  EXPECT_NE(msg.find("rank " + std::to_string(victim) + " (host 127.0.0.1) has sent no heartbeat"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("stopped or hung"), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
}

void report_latency(const char* test, int rank, int victim, double latency) {
  std::printf("[heartbeat] %s: rank %d named stopped rank %d after %.2f s: %s\n", test, rank,
              victim, latency, zs_last_error());
  std::fflush(stdout);
}

// The limit is 2 s; 5 s leaves room for a loaded machine and is still far
// from the 30 s collective timeout of these contexts.
constexpr double kMaxLatency = 5.0;
constexpr int kTimeoutMs = 30000;

void stopped_during_gather(int world, int victim) {
  Shared* sh = make_shared_block();
  run_ranks(
      world,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        zs_param p = small_param(ctx);
        // The survivors are waiting in the gather when the victim stops.
        if (env.rank == victim) stop_self(sh, std::chrono::milliseconds(300));
        zs_gather g = nullptr;
        ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
        const zs_status s = zs_gather_wait(g, ZS_WAIT_FOREVER);
        const double latency = seconds_since_stop(sh);
        report_latency("gather", env.rank, victim, latency);
        expect_named(s, victim, "fetch");
        EXPECT_LT(latency, kMaxLatency);
        // Later work fails the same way at once; destroy returns promptly.
        EXPECT_EQ(zs_context_async_error(ctx), ZS_ERR_COMM);
        zs_gather g2 = nullptr;
        EXPECT_EQ(zs_fetch(&g2, ctx, &p, 1), ZS_ERR_COMM);
        zs_gather_destroy(g);
        zs_param_destroy(p);
        const auto t0 = Clock::now();
        EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
        const double destroy_s = std::chrono::duration<double>(Clock::now() - t0).count();
        std::printf("[heartbeat] gather: rank %d destroyed its context in %.2f s\n", env.rank,
                    destroy_s);
        EXPECT_LT(destroy_s, 3.0) << "destroy after the failure waited for the stopped rank";
        survivor_done(sh, world - 1, victim);
      },
      60, {victim});
}

TEST(Heartbeat, StoppedPeerDuringAGatherIsNamedOn2Ranks) { stopped_during_gather(2, 1); }
TEST(Heartbeat, StoppedPeerDuringAGatherIsNamedOn3Ranks) { stopped_during_gather(3, 2); }
TEST(Heartbeat, StoppedStoreServerDuringAGatherIsNamedOn3Ranks) { stopped_during_gather(3, 0); }

// A training step: the survivors push their gradient (reduced in the
// background) and step; the victim stops after the first step.
void stopped_during_step(int world, int victim) {
  Shared* sh = make_shared_block();
  run_ranks(
      world,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        zs_param p = small_param(ctx);
        zs_optimizer opt = nullptr;
        ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
        zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
        ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
        std::vector<float> grad(1000, 0.5f);
        zs_step_result r = ZS_STEP_RESULT_INIT;
        ZS_ASSERT_OK(zs_grad_push(p, grad.data(), ZS_FLOAT32, grad.size() * sizeof(float)));
        ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
        if (env.rank == victim) stop_self(sh, std::chrono::milliseconds(300));
        zs_status s = zs_grad_push(p, grad.data(), ZS_FLOAT32, grad.size() * sizeof(float));
        if (s == ZS_OK) s = zs_optimizer_step(opt, &r);
        const double latency = seconds_since_stop(sh);
        report_latency("step", env.rank, victim, latency);
        expect_named(s, victim, "group 'world'");
        EXPECT_LT(latency, kMaxLatency);
        EXPECT_EQ(zs_optimizer_step(opt, &r), ZS_ERR_COMM);
        zs_optimizer_destroy(opt);
        zs_param_destroy(p);
        const auto t0 = Clock::now();
        EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
        EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 3.0);
        survivor_done(sh, world - 1, victim);
      },
      60, {victim});
}

TEST(Heartbeat, StoppedPeerDuringAStepIsNamedOn2Ranks) { stopped_during_step(2, 1); }
TEST(Heartbeat, StoppedPeerDuringAStepIsNamedOn3Ranks) { stopped_during_step(3, 1); }

// Destroy with a peer that stopped and never resumes: the survivors return
// within about the limit, also when the stopped rank serves the store.
void stopped_before_destroy(int world, int victim) {
  Shared* sh = make_shared_block();
  run_ranks(
      world,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
        ASSERT_NE(ctx, nullptr);
        zs_param p = small_param(ctx);
        zs_gather g = nullptr;
        ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
        ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
        zs_gather_destroy(g);
        zs_param_destroy(p);
        if (env.rank == victim) stop_self(sh, std::chrono::milliseconds(0));
        while (sh->stopped_ns.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const auto t0 = Clock::now();
        EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
        const double destroy_s = std::chrono::duration<double>(Clock::now() - t0).count();
        std::printf("[heartbeat] destroy: rank %d returned after %.2f s (stopped rank %d)\n",
                    env.rank, destroy_s, victim);
        std::fflush(stdout);
        EXPECT_LT(destroy_s, kMaxLatency) << "destroy waited for the stopped rank";
        survivor_done(sh, world - 1, victim);
      },
      60, {victim});
}

TEST(Heartbeat, DestroyWithAStoppedPeerReturnsOn2Ranks) { stopped_before_destroy(2, 1); }
TEST(Heartbeat, DestroyWithAStoppedStoreServerReturnsOn3Ranks) { stopped_before_destroy(3, 0); }

// Creating a group with a stopped or dead member: the members that came
// wait for its address in the store, which the store's timeout (30 s
// here) alone would end. The heartbeat cuts the wait short, naming the
// rank, over the TCP store (also when the stopped rank serves it) and over
// a file store. A group without the victim (unless it is rank 0, which
// serves the store) is created as usual first.
enum class Victim { Stopped, Killed };

void silent_member_at_group_create(int world, int victim, Victim how, bool file_store) {
  Shared* sh = make_shared_block();
  char tmpl[] = "/tmp/zs_hb_group_XXXXXX";
  const std::string dir = file_store ? mkdtemp(tmpl) : "";
  run_ranks(
      world,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        zs_context_options o = zs::test::rank_options(env, nullptr, kTimeoutMs);
        if (file_store) o.file_store_path = dir.c_str();
        zs_context ctx = nullptr;
        ZS_ASSERT_OK(zs_context_create(&ctx, &o));
        std::vector<int> others, all;
        for (int r = 0; r < world; ++r) {
          all.push_back(r);
          if (r != victim) others.push_back(r);
        }
        if (env.rank == victim) {
          if (how == Victim::Killed) {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            sh->stopped_ns = now_ns();
            kill(getpid(), SIGKILL);
          }
          stop_self(sh, std::chrono::milliseconds(300));
        }
        zs_group g = nullptr;
        if (victim != 0) {  // a stopped rank 0 holds up every rendezvous: it serves the store
          ZS_ASSERT_OK(zs_group_create(&g, ctx, others.data(), static_cast<int>(others.size())));
          ZS_EXPECT_OK(zs_group_destroy(g));
          g = nullptr;
        }
        const zs_status s = zs_group_create(&g, ctx, all.data(), static_cast<int>(all.size()));
        const double latency = seconds_since_stop(sh);
        const std::string msg = zs_last_error();
        std::printf("[heartbeat] group create (%s rank %d, %s store): rank %d failed after %.2f s: %s\n",
                    how == Victim::Killed ? "killed" : "stopped", victim,
                    file_store ? "file" : "tcp", env.rank, latency, msg.c_str());
        std::fflush(stdout);
        EXPECT_EQ(s, ZS_ERR_COMM) << zs_status_string(s) << ": " << msg;
        EXPECT_EQ(g, nullptr);
        EXPECT_NE(msg.find("rank " + std::to_string(victim) + " (host 127.0.0.1) has sent no heartbeat"),
                  std::string::npos)
            << msg;
        EXPECT_NE(msg.find("group 'group"), std::string::npos) << msg;
        EXPECT_LT(latency, kMaxLatency);
        survivor_done(sh, world - 1, victim);
        _exit(::testing::Test::HasFailure() ? 1 : 0);  // the goodbye wait is not under test
      },
      60, {victim});
  if (file_store) {
    std::string rm = "rm -rf " + dir;
    EXPECT_EQ(std::system(rm.c_str()), 0);
  }
}

TEST(Heartbeat, StoppedPeerAtGroupCreateIsNamed) {
  silent_member_at_group_create(3, 2, Victim::Stopped, false);
}
TEST(Heartbeat, StoppedStoreServerAtGroupCreateIsNamed) {
  silent_member_at_group_create(3, 0, Victim::Stopped, false);
}
TEST(Heartbeat, DeadPeerAtGroupCreateIsNamed) {
  silent_member_at_group_create(3, 2, Victim::Killed, false);
}
TEST(Heartbeat, StoppedPeerAtGroupCreateOverAFileStoreIsNamed) {
  silent_member_at_group_create(3, 1, Victim::Stopped, true);
}

// The groups made inside zs_context_create (MiCS here) meet through the
// store in the same way. The victim, given no MiCS (the configs are
// compared only after the groups are made), passes on to the ready round
// and stops there; the others, making the MiCS shard group, name it.
TEST(Heartbeat, StoppedPeerWhileCreateMakesTheMicsGroupsIsNamed) {
  Shared* sh = make_shared_block();
  run_ranks(
      3,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        const bool victim = env.rank == 2;
        zs_context_options o = zs::test::rank_options(
            env, victim ? nullptr : R"({"zero_optimization": {"mics_shard_size": 3}})", kTimeoutMs);
        if (victim) std::thread([sh] { stop_self(sh, std::chrono::milliseconds(1000)); }).detach();
        zs_context ctx = nullptr;
        const zs_status s = zs_context_create(&ctx, &o);
        const double latency = seconds_since_stop(sh);
        const std::string msg = zs_last_error();
        std::printf("[heartbeat] context create (MiCS groups), stopped rank 2: rank %d failed %.2f s "
                    "after the stop: %s\n",
                    env.rank, latency, msg.c_str());
        std::fflush(stdout);
        EXPECT_EQ(s, ZS_ERR_COMM) << zs_status_string(s) << ": " << msg;
        EXPECT_NE(msg.find("rank 2 (host 127.0.0.1) has sent no heartbeat"), std::string::npos) << msg;
        EXPECT_NE(msg.find("group 'mics_shard0[0,1,2]'"), std::string::npos) << msg;
        EXPECT_GT(sh->stopped_ns.load(), 0) << "failed before the victim stopped";
        EXPECT_LT(latency, kMaxLatency);
        survivor_done(sh, 2, 2);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {2});
}

// Without heartbeats the same wait ends at the user's timeout, and says so.
TEST(Heartbeat, OffGroupCreateWithAStoppedPeerTimesOutSayingSo) {
  Shared* sh = make_shared_block();
  run_ranks(
      2,
      [&](const RankEnv& env) {
        setenv("ZS_HEARTBEAT_MS", "0", 1);
        sh->pid[env.rank] = getpid();
        zs_context ctx = zs::test::make_context(env, nullptr, 2000);
        ASSERT_NE(ctx, nullptr);
        if (env.rank == 1) stop_self(sh, std::chrono::milliseconds(100));
        const int all[2] = {0, 1};
        zs_group g = nullptr;
        const auto t0 = Clock::now();
        const zs_status s = zs_group_create(&g, ctx, all, 2);
        const double took = std::chrono::duration<double>(Clock::now() - t0).count();
        const std::string msg = zs_last_error();
        std::printf("[heartbeat] group create, heartbeats off: failed after %.2f s: %s\n", took,
                    msg.c_str());
        std::fflush(stdout);
        EXPECT_EQ(s, ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << msg;
        EXPECT_NE(msg.find("timed out after"), std::string::npos) << msg;
        EXPECT_NE(msg.find("(timeout 2000 ms)"), std::string::npos) << msg;
        EXPECT_NE(msg.find("connecting group 'group"), std::string::npos) << msg;
        EXPECT_LT(took, 8.0);
        survivor_done(sh, 1, 1);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {1});
}

// A checkpoint save waits for every rank's shards through the store, not in
// a collective: rank 0 names the stopped rank there too, and the others
// learn it from rank 0's verdict.
TEST(Heartbeat, StoppedPeerDuringACheckpointSaveIsNamed) {
  Shared* sh = make_shared_block();
  char tmpl[] = "/tmp/zs_hb_ckpt_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  run_ranks(
      3,
      [&](const RankEnv& env) {
        sh->pid[env.rank] = getpid();
        zs::test::CkptModel m =
            zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_SGD, 0, kTimeoutMs);
        ASSERT_NE(m.ctx, nullptr);
        if (env.rank == 2) stop_self(sh, std::chrono::milliseconds(300));
        zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
        o.tag = "t";
        o.timeout_ms = kTimeoutMs;
        const zs_status s =
            zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
        const double latency = seconds_since_stop(sh);
        report_latency("checkpoint save", env.rank, 2, latency);
        expect_named(s, 2, "checkpoint save");
        EXPECT_LT(latency, kMaxLatency);
        survivor_done(sh, 2, 2);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      60, {2});
  std::string rm = "rm -rf " + dir;
  EXPECT_EQ(std::system(rm.c_str()), 0);
}

// A rank computing for 6 s outside any collective keeps beating: the
// others wait for it in a barrier (timeout 30 s) and it completes late.
TEST(Heartbeat, BusyPeerIsWaitedFor) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    if (env.rank == 1) {
      // Busy, not stopped: half of it spinning on a core, half asleep.
      const auto until = Clock::now() + std::chrono::seconds(3);
      volatile uint64_t x = 0;
      while (Clock::now() < until) x = x + 1;
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    const auto t0 = Clock::now();
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_barrier(&w, world));
    ZS_EXPECT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
    if (env.rank != 1) {
      EXPECT_GT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.0);
    }
    zs_work_destroy(w);
    zs_group_destroy(world);
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

// Every rank busy on four spinning threads (on a 2-core machine: a load
// of 12 from this test alone) while one rank arrives 4 s late: the
// heartbeat threads still get their turns, and nobody is called stopped.
TEST(Heartbeat, LoadedMachineBlamesNobody) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    std::atomic<bool> stop{false};
    std::vector<std::thread> spinners;
    for (int i = 0; i < 4; ++i)
      spinners.emplace_back([&stop] {
        volatile uint64_t x = 0;
        while (!stop.load(std::memory_order_relaxed)) x = x + 1;
      });
    if (env.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_barrier(&w, world));
    ZS_EXPECT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
    zs_work_destroy(w);
    float x = 1.0f;
    ZS_ASSERT_OK(zs_allreduce(&w, world, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
    ZS_EXPECT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
    EXPECT_EQ(x, 3.0f);
    zs_work_destroy(w);
    stop = true;
    for (auto& t : spinners) t.join();
    zs_group_destroy(world);
    ZS_EXPECT_OK(zs_context_destroy(ctx));
  });
}

// ZS_HEARTBEAT_MS=0: a stopped peer is found at the collective timeout, as
// before heartbeats.
TEST(Heartbeat, OffMeansTheCollectiveTimeout) {
  Shared* sh = make_shared_block();
  run_ranks(
      2,
      [&](const RankEnv& env) {
        setenv("ZS_HEARTBEAT_MS", "0", 1);
        sh->pid[env.rank] = getpid();
        zs_context ctx = zs::test::make_context(env, nullptr, 3000);
        ASSERT_NE(ctx, nullptr);
        zs_param p = small_param(ctx);
        if (env.rank == 1) stop_self(sh, std::chrono::milliseconds(100));
        zs_gather g = nullptr;
        ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
        const zs_status s = zs_gather_wait(g, ZS_WAIT_FOREVER);
        const double latency = seconds_since_stop(sh);
        EXPECT_EQ(s, ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << zs_last_error();
        EXPECT_EQ(std::string(zs_last_error()).find("heartbeat"), std::string::npos)
            << zs_last_error();
        EXPECT_GT(latency, 2.5) << "found before the 3 s timeout with heartbeats off";
        survivor_done(sh, 1, 1);
        _exit(::testing::Test::HasFailure() ? 1 : 0);  // the goodbye wait is not under test
      },
      60, {1});
}

// Bad knobs are refused at create, naming the variable.
TEST(Heartbeat, LimitShorterThanTwoPeriodsIsRefused) {
  run_ranks(2, [](const RankEnv& env) {
    setenv("ZS_HEARTBEAT_MS", "500", 1);
    setenv("ZS_HEARTBEAT_TIMEOUT_MS", "900", 1);
    zs_context_options o = zs::test::rank_options(env, nullptr, 2000);
    zs_context ctx = nullptr;
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP);
    EXPECT_NE(std::string(zs_last_error()).find("ZS_HEARTBEAT_TIMEOUT_MS 900"), std::string::npos)
        << zs_last_error();
  });
}

// Beats that claim to be rank 1 (its epoch, fresh sequence numbers) but
// carry no valid MAC keep rank 1 alive in rank 0's eyes without a job
// secret (which shows the forgery is well-formed), and are dropped with one.
bool forged_beats_keep_rank_1_alive(const char* secret) {
  const char* outer = std::getenv("ZS_JOB_SECRET");
  const std::string saved = outer ? outer : "";
  if (secret) {
    setenv("ZS_JOB_SECRET", secret, 1);
  } else {
    unsetenv("ZS_JOB_SECRET");
  }
  const auto period = std::chrono::milliseconds(100), limit = std::chrono::milliseconds(600);
  std::shared_ptr<zs::Store> store = zs::make_memory_store(std::chrono::milliseconds(5000));
  zs::Heartbeat hb0(0, 2, "127.0.0.1", *store, period, limit);
  auto hb1 = std::make_unique<zs::Heartbeat>(1, 2, "127.0.0.1", *store, period, limit);
  hb0.start(*store);
  hb1->start(*store);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(hb0.silence({1}), "");
  hb1.reset();  // rank 1 goes silent without a goodbye

  const auto published = [&](int rank) {
    const std::vector<char> raw = store->get("zs/heartbeat/" + std::to_string(rank));
    return std::string(raw.begin(), raw.end());
  };
  std::istringstream to(published(0)), from(published(1));
  std::string host, port, ignored;
  uint64_t epoch1 = 0;
  to >> host >> port;
  from >> ignored >> ignored >> epoch1;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* dest = nullptr;
  EXPECT_EQ(getaddrinfo(host.c_str(), port.c_str(), &hints, &dest), 0);
  const int fd = socket(dest->ai_family, SOCK_DGRAM, 0);
  for (uint64_t seq = 1000; seq < 1030; ++seq) {
    char beat[48] = {'Z', 'S', 'H', 'B'};
    beat[8] = 1;  // rank 1
    std::memcpy(beat + 16, &epoch1, 8);  // little-endian, as on the wire
    std::memcpy(beat + 24, &seq, 8);
    sendto(fd, beat, sizeof beat, 0, dest->ai_addr, dest->ai_addrlen);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  close(fd);
  freeaddrinfo(dest);
  const std::string why = hb0.silence({1});
  if (outer) {
    setenv("ZS_JOB_SECRET", saved.c_str(), 1);
  } else {
    unsetenv("ZS_JOB_SECRET");
  }
  return why.empty();
}

TEST(Heartbeat, BeatsWithoutTheJobSecretAreDropped) {
  EXPECT_TRUE(forged_beats_keep_rank_1_alive(nullptr));
  EXPECT_FALSE(forged_beats_keep_rank_1_alive("a-secret-of-more-than-16-chars"));
}

}  // namespace

namespace {

// Light ranks: N heartbeats in this process over one memory store, each on
// its own UDP socket, as N processes would run them.
std::vector<std::unique_ptr<zs::Heartbeat>> light_ranks(int n, zs::Store& store,
                                                        std::chrono::milliseconds period,
                                                        std::chrono::milliseconds limit) {
  std::vector<std::unique_ptr<zs::Heartbeat>> hbs;
  for (int r = 0; r < n; ++r) hbs.push_back(std::make_unique<zs::Heartbeat>(r, n, "127.0.0.1", store, period, limit));
  for (auto& hb : hbs) hb->start(store);
  return hbs;
}

// A shrink of the mesh without `dropped`: their heartbeats go, the others
// drop them and lay their beats out again. Returns the ranks left.
std::vector<int> shrink_mesh(std::vector<std::unique_ptr<zs::Heartbeat>>& hbs, zs::Store& store,
                             const std::vector<int>& dropped) {
  for (const int r : dropped) hbs[static_cast<size_t>(r)].reset();
  std::vector<int> live;
  for (int r = 0; r < static_cast<int>(hbs.size()); ++r)
    if (hbs[static_cast<size_t>(r)]) live.push_back(r);
  for (const int r : live) {
    for (const int d : dropped) hbs[static_cast<size_t>(r)]->drop(d);
    hbs[static_cast<size_t>(r)]->reform(store);
  }
  return live;
}

// Each of `live` is some live rank's target (someone judges it), none
// beats to a rank of `out`, and after three periods none finds another
// live one silent.
void expect_watched(const std::vector<std::unique_ptr<zs::Heartbeat>>& hbs, const std::vector<int>& live,
                    const std::vector<int>& out, std::chrono::milliseconds period) {
  for (const int r : live) {
    int watchers = 0;
    for (const int w : live)
      for (const int t : hbs[static_cast<size_t>(w)]->targets()) watchers += t == r;
    EXPECT_GE(watchers, 1) << "rank " << r << " is judged by nobody";
    for (const int t : hbs[static_cast<size_t>(r)]->targets())
      EXPECT_FALSE(std::find(out.begin(), out.end(), t) != out.end()) << r << " beats to rank " << t << ", out";
  }
  std::this_thread::sleep_for(3 * period);
  for (const int r : live) EXPECT_EQ(hbs[static_cast<size_t>(r)]->silence(live), "") << "rank " << r;
}

}  // namespace

// Past kFullMeshPeers peers each rank beats to ceil(log2 N) others, so the
// world's datagrams grow as N log N (not N^2); a rank that dies is still
// named by every other rank, those that do not watch it through the reports
// relayed to them, within the limit and a few hops.
TEST(HeartbeatScale, BeatsGrowAsNLogNAndADeadRankIsNamedByEveryRank) {
  using namespace std::chrono_literals;
  const auto period = 100ms, limit = 1000ms;
  for (int n : {8, 32}) {
    SCOPED_TRACE("world of " + std::to_string(n));
    auto memory = zs::make_memory_store(10s);
    zs::test::CountingStore store(*memory);
    auto hbs = light_ranks(n, store, period, limit);
    // Each rank publishes its address and reads its peers' in one call
    // each, whatever the world size.
    EXPECT_EQ(store.calls.load(), 2u * static_cast<uint64_t>(n));
    const size_t fan = n - 1 <= zs::Heartbeat::kFullMeshPeers ? n - 1 : 5;  // log2(32)
    for (const auto& hb : hbs) EXPECT_EQ(hb->targets().size(), fan);
    std::this_thread::sleep_for(300ms);
    uint64_t before = 0, after = 0;
    for (const auto& hb : hbs) before += hb->datagrams_sent();
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(1s);
    for (const auto& hb : hbs) after += hb->datagrams_sent();
    const double periods = std::chrono::duration<double>(Clock::now() - t0) / period;
    const double per_rank_per_period = static_cast<double>(after - before) / n / periods;
    // A beat per target per period (a late tick sends fewer, never more).
    EXPECT_LE(per_rank_per_period, fan * 1.2) << per_rank_per_period;
    EXPECT_GE(per_rank_per_period, fan * 0.5) << per_rank_per_period;
    std::vector<int> all;
    for (int r = 0; r < n; ++r) all.push_back(r);
    for (int r = 0; r < n; ++r) EXPECT_EQ(hbs[r]->silence(all), "") << "rank " << r << " before any death";

    const int victim = n - 1;
    hbs[victim].reset();  // its beats stop, as a dead (or stopped) process's do
    const auto died = Clock::now();
    std::vector<std::string> named(n);
    int missing = n - 1;
    while (missing > 0 && Clock::now() - died < 3 * limit + 2s) {
      std::this_thread::sleep_for(20ms);
      for (int r = 0; r < victim; ++r)
        if (named[r].empty() && !(named[r] = hbs[r]->silence({victim})).empty()) --missing;
    }
    EXPECT_EQ(missing, 0);
    int reported = 0;
    for (int r = 0; r < victim; ++r) {
      EXPECT_NE(named[r].find("rank " + std::to_string(victim) + " "), std::string::npos) << named[r];
      reported += named[r].find("reported by rank") != std::string::npos;
    }
    // Beyond the full mesh most ranks do not watch it: they were told.
    if (n - 1 > zs::Heartbeat::kFullMeshPeers) {
      EXPECT_GE(reported, n - 1 - 5);
    }
    // Nobody else is named.
    std::vector<int> others(all.begin(), all.end() - 1);
    for (int r = 0; r < victim; ++r) EXPECT_EQ(hbs[r]->silence(others), "") << "rank " << r;
  }
}

// A shrink past the full mesh (12 ranks, each judged by the 4 ranks 1, 2,
// 4 and 8 places before it): the survivors drop ranks 1, 5, 7 and 8, every
// one of rank 9's monitors. Without laying the beats out again over the
// live ranks nobody would judge rank 9 any more, and its death would go
// unnoticed until a collective's timeout; after reform() each live rank is
// judged by live ones, a later death is named by every survivor, and
// nobody else is.
TEST(HeartbeatScale, AfterAShrinkEveryLiveRankIsStillWatched) {
  using namespace std::chrono_literals;
  const auto period = 100ms, limit = 1000ms;
  const int n = 12;
  auto store = zs::make_memory_store(10s);
  auto hbs = light_ranks(n, *store, period, limit);
  const std::vector<int> dropped = {1, 5, 7, 8};
  const std::vector<int> live = shrink_mesh(hbs, *store, dropped);
  // Each live rank is some live rank's target: someone judges it.
  expect_watched(hbs, live, dropped, period);

  const int victim = 9;
  hbs[victim].reset();
  const auto died = Clock::now();
  int missing = static_cast<int>(live.size()) - 1;
  std::vector<std::string> named(n);
  while (missing > 0 && Clock::now() - died < 3 * limit + 2s) {
    std::this_thread::sleep_for(20ms);
    for (const int r : live)
      if (r != victim && named[r].empty() && !(named[r] = hbs[static_cast<size_t>(r)]->silence({victim})).empty())
        --missing;
  }
  EXPECT_EQ(missing, 0) << "survivors that never named rank " << victim;
  std::vector<int> others;
  for (const int r : live)
    if (r != victim) others.push_back(r);
  for (const int r : others) EXPECT_EQ(hbs[static_cast<size_t>(r)]->silence(others), "") << "rank " << r;
}

// A partial regrow past the full mesh: after a shrink left ranks 1, 5, 7
// and 8 out, a process for rank 5 comes back (generation 1) while the
// others stay out. It starts with them absent (their addresses, never
// posted in that generation, are not read), the survivors readmit it and
// lay their beats out again: every live rank is judged by someone, nobody
// beats to a rank still out, and the joiner's later death is named by
// every other live rank.
TEST(HeartbeatScale, AJoinerAfterAShrinkIsWatchedAndWatchesWithRanksStillOut) {
  using namespace std::chrono_literals;
  const auto period = 100ms, limit = 1000ms;
  const int n = 12;
  auto store = zs::make_memory_store(10s);
  auto hbs = light_ranks(n, *store, period, limit);
  const std::vector<int> survivors = shrink_mesh(hbs, *store, {1, 5, 7, 8});
  const int joiner = 5;
  const std::vector<int> out = {1, 7, 8};
  for (const int r : survivors) hbs[static_cast<size_t>(r)]->republish(*store, "zs/gen1/");
  hbs[joiner] = std::make_unique<zs::Heartbeat>(joiner, n, "127.0.0.1", *store, period, limit, "zs/gen1/");
  hbs[joiner]->start(*store, out);
  for (const int r : survivors) {
    hbs[static_cast<size_t>(r)]->readmit(joiner, *store);
    hbs[static_cast<size_t>(r)]->reform(*store);
  }
  std::vector<int> live = survivors;
  live.push_back(joiner);
  std::sort(live.begin(), live.end());
  expect_watched(hbs, live, out, period);

  hbs[joiner].reset();
  const auto died = Clock::now();
  int missing = static_cast<int>(survivors.size());
  std::vector<std::string> named(n);
  while (missing > 0 && Clock::now() - died < 3 * limit + 2s) {
    std::this_thread::sleep_for(20ms);
    for (const int r : survivors)
      if (named[r].empty() && !(named[r] = hbs[static_cast<size_t>(r)]->silence({joiner})).empty()) --missing;
  }
  EXPECT_EQ(missing, 0) << "survivors that never named the joiner's death";
}
