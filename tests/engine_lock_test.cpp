// The engine lock (impl/core/engine_lock.h) is the engine's own and not
// recursive: a second take on the thread that holds it fails, naming both
// callers, where a plain mutex would deadlock; a progress callback that
// calls back into the engine gets that error and the save goes on.
//
// A blocking call holds it, and the status queries (memory, fetch and
// coordinator counters, the async error) answer from another thread without
// waiting for that call. Rank 1 joins rank 0's blocking gather only after
// rank 0's queries have returned, so a query that waited for the lock would
// leave rank 1 waiting in vain.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "impl/common/error.h"
#include "impl/core/engine_lock.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

bool wait_for_file(const std::string& path, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (access(path.c_str(), F_OK) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

zs_param register_vector(zs_context ctx, int64_t n) {
  const int64_t shape[1] = {n};
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = "w";
  o.ndim = 1;
  o.shape = shape;
  o.init = ZS_INIT_NORMAL;
  o.seed = 7;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

}  // namespace

TEST(EngineLock, StatusQueriesDoNotWaitForABlockingFetch) {
  const int port = zs::test::free_port();
  const std::string signal = "/tmp/zs_engine_lock_" + std::to_string(getpid()) + "_" + std::to_string(port);
  std::remove(signal.c_str());
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    zs_param w = register_vector(ctx, 1001);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    if (env.rank == 1) {
      // Joins the gather only once rank 0 answered its queries.
      ASSERT_TRUE(wait_for_file(signal, std::chrono::seconds(20)))
          << "rank 0's status queries waited for its blocking zs_coord_fetch";
      ZS_ASSERT_OK(zs_coord_fetch(ctx, &w, 1));
    } else {
      std::atomic<bool> fetched{false};
      zs_status fetch_status = ZS_OK;
      std::thread blocking([&] {
        fetch_status = zs_coord_fetch(ctx, &w, 1);
        fetched = true;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the fetch holds the lock
      zs_memory_stats m = ZS_MEMORY_STATS_INIT;
      ZS_EXPECT_OK(zs_context_memory(ctx, &m));
      zs_fetch_stats f = ZS_FETCH_STATS_INIT;
      ZS_EXPECT_OK(zs_context_fetch_stats(ctx, &f));
      zs_coord_stats c = ZS_COORD_STATS_INIT;
      ZS_EXPECT_OK(zs_coord_get_stats(ctx, &c));
      ZS_EXPECT_OK(zs_context_async_error(ctx));
      EXPECT_FALSE(fetched.load()) << "the fetch ended before the queries: nothing was tested";
      EXPECT_EQ(m.num_params, 1u);
      EXPECT_GE(m.gathered_bytes, 1001u * 4) << "the gather's buffer is counted while in flight";
      EXPECT_EQ(f.gathers, 1u);
      EXPECT_EQ(c.fetch_calls, 0u) << "counters are those of the last call that returned";
      FILE* out = std::fopen(signal.c_str(), "w");
      ASSERT_NE(out, nullptr);
      std::fclose(out);
      blocking.join();
      ZS_ASSERT_OK(fetch_status);
      ZS_EXPECT_OK(zs_coord_get_stats(ctx, &c));
      EXPECT_EQ(c.fetch_calls, 1u);
    }
    ZS_ASSERT_OK(zs_coord_release(ctx, &w, 1));
    ZS_ASSERT_OK(zs_step_end(ctx));
    ZS_ASSERT_OK(zs_param_destroy(w));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
  std::remove(signal.c_str());
}

TEST(EngineLock, ASecondTakeOnTheHoldingThreadFailsNamingBothWhereAMutexWouldDeadlock) {
  zs::EngineLock lock;
  EXPECT_FALSE(lock.held_by_this_thread());
  EXPECT_THROW(lock.expect_held("settle_locked"), zs::Error);
  {
    auto outer = lock.take("step");
    EXPECT_TRUE(lock.held_by_this_thread());
    lock.expect_held("settle_locked");  // what the entry point calls checks, and passes
    try {
      const auto inner = lock.take("sync");
      ADD_FAILURE() << "a second take on the holding thread was granted";
    } catch (const zs::Error& e) {
      EXPECT_EQ(e.code(), zs::Code::InvalidState);
      const std::string m = e.what();
      EXPECT_NE(m.find("sync needs the engine lock"), std::string::npos) << m;
      EXPECT_NE(m.find("holds already for step"), std::string::npos) << m;
    }
    // Another thread is neither the holder nor let in while the hold lasts.
    std::atomic<bool> entered{false};
    std::atomic<zs::Code> other_code{zs::Code::Ok};
    std::thread other([&] {
      try {
        lock.expect_held("release_one");
      } catch (const zs::Error& e) {
        other_code = e.code();
      }
      const auto held = lock.take("fetch");
      entered = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(entered.load()) << "another thread took the lock while it was held";
    EXPECT_EQ(other_code.load(), zs::Code::Internal) << "expect_held passed on a thread that does not hold it";
    auto moved = std::move(outer);  // the hold moves with its guard
    EXPECT_TRUE(lock.held_by_this_thread());
    {
      const auto released = std::move(moved);
    }
    other.join();
    EXPECT_TRUE(entered.load());
  }
  EXPECT_FALSE(lock.held_by_this_thread());
  const auto again = lock.take("step");  // free again once every guard is gone
  EXPECT_TRUE(lock.held_by_this_thread());
}

namespace {

struct CallbackProbe {
  zs_optimizer opt = nullptr;
  zs_context ctx = nullptr;
  zs_param param = nullptr;
  int calls = 0;
  zs_status reentry = ZS_OK;
  std::string reentry_message;
  zs_status memory = ZS_ERR_INTERNAL;
  // Destroys (a garbage collector running in the callback): each refused
  // before it gives its handle up.
  zs_status param_destroy = ZS_OK, optimizer_destroy = ZS_OK, context_destroy = ZS_OK;
};

void probe_from_progress(void* user, const char*, uint64_t, uint64_t) {
  auto* probe = static_cast<CallbackProbe*>(user);
  if (probe->calls++ > 0) return;
  int64_t step = 0;
  probe->reentry = zs_optimizer_get_step(probe->opt, &step);
  probe->reentry_message = zs_last_error();
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  probe->memory = zs_context_memory(probe->ctx, &m);
  probe->param_destroy = zs_param_destroy(probe->param);
  probe->optimizer_destroy = zs_optimizer_destroy(probe->opt);
  probe->context_destroy = zs_context_destroy(probe->ctx);
}

}  // namespace

TEST(EngineLock, AProgressCallbackThatCallsBackIntoTheEngineIsRefusedAndTheSaveGoesOn) {
  const zs::test::TempDir temp("engine_lock_callback");
  const std::string& dir = temp.path();
  run_ranks(2, [&](const RankEnv& env) {
    auto m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    zs::test::train_ckpt_model(m, 2);
    CallbackProbe probe;
    probe.opt = m.opt;
    probe.ctx = m.ctx;
    probe.param = m.params[0];
    zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    o.tag = "t";
    o.progress = probe_from_progress;
    o.progress_user = &probe;
    ZS_ASSERT_OK(zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o));
    EXPECT_GT(probe.calls, 1);
    EXPECT_EQ(probe.reentry, ZS_ERR_INVALID_STATE) << probe.reentry_message;
    EXPECT_NE(probe.reentry_message.find("which this thread holds already for save"), std::string::npos)
        << probe.reentry_message;
    EXPECT_EQ(probe.memory, ZS_OK) << "a status query takes no lock, so a callback may make it";
    EXPECT_EQ(probe.param_destroy, ZS_ERR_INVALID_STATE);
    EXPECT_EQ(probe.optimizer_destroy, ZS_ERR_INVALID_STATE);
    EXPECT_EQ(probe.context_destroy, ZS_ERR_INVALID_STATE);
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ZS_EXPECT_OK(zs_param_get_info(m.params[0], &info));  // the refused destroy kept the handle
    // The engine is whole: the same call outside the callback answers, and
    // the checkpoint loads.
    int64_t step = -1;
    ZS_ASSERT_OK(zs_optimizer_get_step(m.opt, &step));
    EXPECT_EQ(step, 2);
    zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
    lo.tag = "t";
    ZS_ASSERT_OK(zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &lo, nullptr));
    zs::test::destroy_ckpt_model(m);
  });
}
