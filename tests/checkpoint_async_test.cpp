// Asynchronous saves (zs_checkpoint_save_options.async_save) on real ranks
// and files: the checkpoint holds the state at the call however training
// changes it while the write runs; the wait (or the next load) raises the
// background's error naming the checkpoint; the call blocks for a fraction
// of a synchronous save (bench_checkpoint). Kills during the background
// write: checkpoint_fault_test.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::CkptModel;
using zs::test::RankEnv;
using zs::test::run_ranks;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBig = 1 << 21;  // 8 MiB of fp32 and 16 MiB of moments, split over the ranks

zs_status save_async(CkptModel& m, const std::string& dir, const char* tag, bool async, int timeout_ms = 0) {
  zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
  o.tag = tag;
  o.timeout_ms = timeout_ms;
  o.async_save = async ? 1 : 0;
  return zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
}

zs_status load_tag(CkptModel& m, const std::string& dir, const char* tag) {
  zs_checkpoint_load_options o = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
  o.tag = tag;
  return zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o, nullptr);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

class CheckpointAsync : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointAsync, SavesTheStateAtTheCallWhileTrainingGoesOn) {
  const int world = GetParam();
  const std::string dir = zs::test::make_temp_dir("ckpt_async");
  run_ranks(world, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig);
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 2);
    const auto params = zs::test::full_values(m);
    const auto state = zs::test::optimizer_values(m);
    ZS_ASSERT_OK(save_async(m, dir, "async", true));
    zs::test::train_ckpt_model(m, 3);  // changes every shard and moment while the write runs
    ZS_ASSERT_OK(zs_checkpoint_wait(m.ctx));
    ZS_ASSERT_OK(zs_checkpoint_wait(m.ctx));  // nothing in flight: returns at once
    EXPECT_FALSE(zs::test::bitwise_equal(zs::test::full_values(m), params));
    // The checkpoint is the state at the call: loaded back here, and the
    // next async save's wait comes from the load itself.
    ZS_ASSERT_OK(save_async(m, dir, "later", true));
    ZS_ASSERT_OK(load_tag(m, dir, "async"));
    EXPECT_TRUE(zs::test::bitwise_equal(zs::test::full_values(m), params));
    EXPECT_TRUE(zs::test::bitwise_equal(zs::test::optimizer_values(m), state));
    if (env.rank == 0) zs::test::write_floats(dir + "/params.bin", params);
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_EQ(read_text(dir + "/latest"), "later");
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), "async", nullptr, nullptr), ZS_OK) << zs_last_error();
  // At another world size too.
  run_ranks(world == 2 ? 3 : 2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig);
    ASSERT_NE(m.ctx, nullptr);
    ZS_ASSERT_OK(load_tag(m, dir, "async"));
    EXPECT_TRUE(zs::test::bitwise_equal(zs::test::full_values(m), zs::test::read_floats(dir + "/params.bin")));
    zs::test::destroy_ckpt_model(m);
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CheckpointAsync, ::testing::Values(1, 2, 3));

TEST(CheckpointAsyncError, ARankThatNeverSavesIsNamedAtTheWaitAndAtTheNextLoad) {
  const std::string dir = zs::test::make_temp_dir("ckpt_async_missing");
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_SGD, 0, 5000);
    ASSERT_NE(m.ctx, nullptr);
    ZS_ASSERT_OK(save_async(m, dir, "first", false));
    if (env.rank == 2) {  // never joins the second save
      std::this_thread::sleep_for(std::chrono::seconds(3));
      _exit(0);
    }
    ZS_ASSERT_OK(save_async(m, dir, "second", true, 1000));  // staged: the failure is in the background
    const std::string expect = "asynchronous checkpoint save of '" + dir + "/second' failed: ";
    zs_status s = env.rank == 0 ? zs_checkpoint_wait(m.ctx) : load_tag(m, dir, "first");
    EXPECT_EQ(s, ZS_ERR_TIMEOUT) << zs_last_error();
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 2 of 3 did not finish writing"), std::string::npos) << msg;
    // Collected once (a load is collective: rank 2 is not there for one).
    ZS_EXPECT_OK(zs_checkpoint_wait(m.ctx));
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  EXPECT_EQ(read_text(dir + "/latest"), "first");
  EXPECT_FALSE(fs::exists(dir + "/second"));
  fs::remove_all(dir);
}
