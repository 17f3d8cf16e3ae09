// Clear errors instead of hangs: a rank that never joins a collective, a
// rank that dies, a rank that never starts. Every case ends in bounded time
// with a status and a message, and the context refuses new work after.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "impl/comm/store/store.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

zs_param small_param(zs_context ctx) {
  const int64_t shape[1] = {1000};
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = "w";
  o.ndim = 1;
  o.shape = shape;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

TEST(Failure, CollectiveWithAMissingPeerTimesOut) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, 1500);
    ASSERT_NE(ctx, nullptr);
    zs_param p = small_param(ctx);
    if (env.rank == 1) {  // never fetches; stays alive past rank 0's timeout
      std::this_thread::sleep_for(std::chrono::seconds(4));
      _exit(0);
    }
    const auto t0 = std::chrono::steady_clock::now();
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    const zs_status s = zs_gather_wait(g, ZS_WAIT_FOREVER);
    EXPECT_EQ(s, ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << zs_last_error();
    EXPECT_LT(seconds_since(t0), 5.0);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("fetch"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1500 ms"), std::string::npos) << msg;
    // Where the peer was: it never came to wait in this group's collective.
    EXPECT_NE(msg.find("rank 1 never waited in a collective of this group"), std::string::npos)
        << msg;
    // The failed gather leaves the param as it was, and the context refuses
    // new collective work with the same status.
    zs_param_status st;
    ZS_ASSERT_OK(zs_param_get_status(p, &st));
    EXPECT_EQ(st, ZS_PARAM_NOT_AVAILABLE);
    EXPECT_EQ(zs_context_async_error(ctx), ZS_ERR_TIMEOUT);
    zs_gather g2 = nullptr;
    EXPECT_EQ(zs_fetch(&g2, ctx, &p, 1), ZS_ERR_TIMEOUT);
    EXPECT_NE(std::string(zs_last_error()).find("refuses new work"), std::string::npos);
    zs_gather_destroy(g);
    _exit(::testing::Test::HasFailure() ? 1 : 0);  // skip the goodbye wait for rank 1
  });
}

TEST(Failure, DeadPeerIsACommErrorNotAHang) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, 20000);
    ASSERT_NE(ctx, nullptr);
    zs_param p = small_param(ctx);
    if (env.rank == 2) _exit(0);  // dies without a word
    const auto t0 = std::chrono::steady_clock::now();
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    const zs_status s = zs_gather_wait(g, ZS_WAIT_FOREVER);
    EXPECT_TRUE(s == ZS_ERR_COMM || s == ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << zs_last_error();
    // Within 2 s here; 5 s leaves room for a loaded machine scheduling the
    // victim's exit late, and is still far from the 20 s timeout.
    EXPECT_LT(seconds_since(t0), 5.0) << "a dead peer must be named at once, not at the 20 s timeout";
    EXPECT_NE(std::string(zs_last_error()).find("group 'world'"), std::string::npos) << zs_last_error();
    // The store saw rank 2's connection close: the message names it. Or,
    // where this rank's own links stayed quiet, its heartbeat did first.
    const std::string msg = zs_last_error();
    EXPECT_TRUE(msg.find("rank 2 is gone") != std::string::npos ||
                msg.find("rank 2 (host 127.0.0.1) has sent no heartbeat") != std::string::npos)
        << msg;
    zs_gather_destroy(g);
    // Rank 0 serves the store: it stays until rank 1 has asked it who is
    // gone, which may take rank 1 the heartbeat's 2 s limit (when rank 1's
    // own links stay quiet); rank 1 stays too, or rank 0 could find it gone
    // as well.
    std::this_thread::sleep_for(std::chrono::milliseconds(env.rank == 0 ? 5000 : 1000));
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// The optimizer step's small collectives run on the caller's thread (not
// the group's, which starts with SIGPIPE blocked): a dead peer there is
// still an error, never a SIGPIPE that kills the process.
TEST(Failure, DeadPeerDuringAStepIsAnErrorNotASignal) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, 20000);
    ASSERT_NE(ctx, nullptr);
    zs_param p = small_param(ctx);
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
    if (env.rank == 2) _exit(0);  // dies between steps
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = std::chrono::steady_clock::now();
    zs_status s = ZS_OK;
    for (int i = 0; i < 3 && s == ZS_OK; ++i) s = zs_optimizer_step(opt, &r);
    EXPECT_TRUE(s == ZS_ERR_COMM || s == ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << zs_last_error();
    // Within 2 s here; 5 s leaves room for a loaded machine scheduling the
    // victim's exit late, and is still far from the 20 s timeout.
    EXPECT_LT(seconds_since(t0), 5.0) << "a dead peer must be named at once, not at the 20 s timeout";
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// After `victim` died, a survivor's destroy returns promptly (the context's
// timeout is 20 s): `what` it would otherwise wait for.
void destroy_after_rank_died(int world, int victim, const char* what) {
  run_ranks(world, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, 20000);
    ASSERT_NE(ctx, nullptr);
    zs_param p = small_param(ctx);
    // A gather every rank completes first: the victim leaves only once the
    // others are past their create (rank 0 serves its store).
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    zs_gather_destroy(g);
    ZS_ASSERT_OK(zs_release(ctx, &p, 1));
    if (env.rank == victim) _exit(0);
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    EXPECT_NE(zs_gather_wait(g, ZS_WAIT_FOREVER), ZS_OK);
    zs_gather_destroy(g);
    zs_param_destroy(p);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
    EXPECT_LT(seconds_since(t0), 3.0) << "destroy waited for " << what << " (timeout 20 s)";
  });
}

// Rank 0, which serves the store, sees that no peer is connected any more:
// it does not wait for the dead rank's goodbye.
TEST(Failure, DestroyAfterAPeerDiedReturnsPromptly) { destroy_after_rank_died(3, 2, "the dead rank"); }

// The dead rank served the store: the survivor's goodbye would retry
// connecting to the exited server until the timeout.
TEST(Failure, DestroyAfterTheStoreServerDiedReturnsPromptly) {
  destroy_after_rank_died(2, 0, "the store's server");
}

TEST(Failure, RankThatNeverStartsFailsBootstrap) {
  run_ranks(2, [](const RankEnv& env) {
    if (env.rank == 1) return;  // never shows up
    zs_context_options o = zs::test::rank_options(env, nullptr, 1000);
    zs_context ctx = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const zs_status s = zs_context_create(&ctx, &o);
    EXPECT_EQ(s, ZS_ERR_TIMEOUT) << zs_status_string(s) << ": " << zs_last_error();
    EXPECT_LT(seconds_since(t0), 8.0);
    EXPECT_NE(std::string(zs_last_error()).find("world"), std::string::npos) << zs_last_error();
    EXPECT_EQ(ctx, nullptr);
  });
}

// zs_context_create with o, which must be refused as a bootstrap error
// with no context made: how long it took and its message, printed with
// `what` and the rank.
struct Refused {
  double took;
  std::string msg;
};
Refused refused_create(const zs_context_options& o, const char* what, int rank) {
  zs_context ctx = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  const zs_status s = zs_context_create(&ctx, &o);
  const Refused r{seconds_since(t0), zs_last_error()};
  std::printf("[create] %s: rank %d failed after %.2f s: %s\n", what, rank, r.took, r.msg.c_str());
  EXPECT_EQ(s, ZS_ERR_BOOTSTRAP) << zs_status_string(s) << ": " << r.msg;
  EXPECT_EQ(ctx, nullptr);
  return r;
}

// A port held by another program (it accepts connections and says
// nothing): rank 0 cannot serve there and says so at once; rank 1 is
// greeted by nobody and says so at its timeout, not a multiple of it.
TEST(Failure, CreateOnAPortHeldByAnotherProgramFailsWithinTheTimeout) {
  const int holder = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(holder, 16), 0);
  socklen_t len = sizeof a;
  getsockname(holder, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  run_ranks(2, [&](const RankEnv& env) {
    zs_context_options o = zs::test::rank_options(env, nullptr, 1500);
    o.store_port = port;
    const auto [took, msg] = refused_create(o, "port held by another program", env.rank);
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
    if (env.rank == 0) {
      EXPECT_NE(msg.find("cannot bind store server"), std::string::npos) << msg;
      EXPECT_NE(msg.find("another process holds that port"), std::string::npos) << msg;
      EXPECT_LT(took, 1.5) << "rank 0 needs no peer to know: within the timeout at the latest";
    } else {
      EXPECT_NE(msg.find("another program (a previous job?) holds that port"), std::string::npos)
          << msg;
      EXPECT_LT(took, 3.0) << "more than twice the 1.5 s timeout";
    }
  });
  close(holder);
}

// The port is held by an earlier job's store, whose rank 0 still runs and
// whose rank 1 had joined it: the new rank 0 cannot serve there, the new
// rank 1 is refused at once instead of reading that job's keys.
TEST(Failure, CreateOnAnEarlierJobsStoreIsRefusedAtOnce) {
  int port = 0;
  auto earlier = zs::make_tcp_store("127.0.0.1", 0, true, std::chrono::milliseconds(30000), &port);
  earlier->add("zs/joined/1", 1);
  run_ranks(2, [&](const RankEnv& env) {
    zs_context_options o = zs::test::rank_options(env, nullptr, 30000);
    o.store_port = port;
    const auto [took, msg] = refused_create(o, "earlier job's store", env.rank);
    EXPECT_NE(msg.find(env.rank == 0 ? "another process holds that port"
                                     : "was joined by a rank 1 before: it is an earlier job's store"),
              std::string::npos)
        << msg;
    EXPECT_LT(took, 2.0) << "the timeout is 30 s";
  });
  EXPECT_FALSE(earlier->check("zs/finalize")) << "the refused rank said goodbye to another job's store";
}

size_t files_in(const std::string& dir) {
  size_t n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") ++n;
    closedir(d);
  }
  return n;
}

// A file store directory left by a job whose ranks did not destroy their
// contexts (they died) is refused at once by every rank of the next job,
// naming the directory; one whose job ended cleanly is left empty and
// serves the next job as usual.
TEST(Failure, StaleFileStoreIsRefusedAtOnceAndACleanEndLeavesItEmpty) {
  char tmpl[] = "/tmp/zs_stale_store_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const auto job = [&](bool destroy, bool expect_ok) {
    run_ranks(2, [&](const RankEnv& env) {
      zs_context_options o = zs::test::rank_options(env, nullptr, 30000);
      o.store_port = -1;
      o.file_store_path = dir.c_str();
      if (expect_ok) {
        zs_context ctx = nullptr;
        ASSERT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
        if (destroy) ZS_EXPECT_OK(zs_context_destroy(ctx));
        _exit(::testing::Test::HasFailure() ? 1 : 0);  // died, when not destroyed
      }
      const auto [took, msg] = refused_create(o, "stale file store", env.rank);
      EXPECT_NE(msg.find("file store '" + dir + "' was joined by a rank " +
                         std::to_string(env.rank) + " before"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("an earlier job that did not finish"), std::string::npos) << msg;
      EXPECT_LT(took, 2.0) << "the timeout is 30 s";
    });
  };
  job(/*destroy=*/true, /*expect_ok=*/true);
  EXPECT_EQ(files_in(dir), 0u) << "a cleanly ended job left its keys in " << dir;
  job(/*destroy=*/false, /*expect_ok=*/true);  // this job's ranks die
  EXPECT_GT(files_in(dir), 0u);
  job(/*destroy=*/true, /*expect_ok=*/false);
  EXPECT_GT(files_in(dir), 0u) << "a refused job emptied the earlier job's directory";
  job(/*destroy=*/true, /*expect_ok=*/false);  // still refused
  ASSERT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

TEST(Failure, ShortWaitTimesOutThenCompletes) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, 20000);
    ASSERT_NE(ctx, nullptr);
    zs_group world = nullptr;
    ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
    if (env.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    float x = 1.0f;
    zs_work w = nullptr;
    ZS_ASSERT_OK(zs_allreduce(&w, world, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
    if (env.rank == 0) {
      EXPECT_EQ(zs_work_wait(w, 50), ZS_ERR_TIMEOUT);
      EXPECT_NE(std::string(zs_last_error()).find("still running after 50 ms"), std::string::npos);
      int done = 1;
      ZS_ASSERT_OK(zs_work_test(w, &done));
      EXPECT_EQ(done, 0);
    }
    ZS_ASSERT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
    EXPECT_EQ(x, 2.0f);
    zs_work_destroy(w);
    zs_group_destroy(world);
    zs_context_destroy(ctx);
  });
}

}  // namespace
