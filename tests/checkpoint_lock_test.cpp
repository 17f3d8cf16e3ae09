// One checkpoint directory, one live job: the first save takes
// dir/.zeroshard.lock naming its holder; a second live job saving there is
// refused on every rank with the holder's name; a lock left by a job that
// was SIGKILLed, or by another host that stopped refreshing it, is taken
// over with a message. Real processes, real files.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::CkptModel;
using zs::test::RankEnv;
using zs::test::run_ranks;
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

zs_status save(CkptModel& m, const std::string& dir, const char* tag) {
  zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
  o.tag = tag;
  return zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
}

void redirect_stderr(const std::string& path) {
  const int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  dup2(fd, 2);
  close(fd);
}

void wait_for_file(const std::string& path, int timeout_s = 60) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (!fs::exists(path)) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no " << path;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Job A: `world` ranks that save once into dir, say so (dir/../saved), then
// wait for `release` (or for SIGKILL). Returns their pids.
std::vector<pid_t> start_holder(int world, const std::string& dir, const std::string& flags) {
  const int port = zs::test::free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      CkptModel m = zs::test::make_ckpt_model(RankEnv{r, world, port}, ZS_FLOAT32, ZS_OPTIM_ADAMW);
      zs::test::train_ckpt_model(m, 1);
      const zs_status s = save(m, dir, "step-1");
      if (s != ZS_OK) {
        std::fprintf(stderr, "holder rank %d: %s\n", r, zs_last_error());
        _exit(1);
      }
      std::ofstream(flags + "/saved." + std::to_string(r)) << "1";
      while (!fs::exists(flags + "/release")) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      zs::test::destroy_ckpt_model(m);
      _exit(0);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < world; ++r) wait_for_file(flags + "/saved." + std::to_string(r));
  return pids;
}

int reap(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return st;
}

TEST(CheckpointLock, ASecondLiveJobIsRefusedByNameAndTheDirectoryIsFreedWhenTheFirstEnds) {
  const std::string root = zs::test::make_temp_dir("ckpt_lock_live");
  const std::string dir = root + "/ckpt", flags = root;
  const std::vector<pid_t> holder = start_holder(2, dir, flags);
  const std::string lock = slurp(dir + "/.zeroshard.lock");
  EXPECT_TRUE(contains(lock, "\"pid\":" + std::to_string(holder[0]))) << lock;

  // Job B, 3 ranks, while A lives: every rank is told, nothing is written.
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    zs::test::train_ckpt_model(m, 2);
    EXPECT_EQ(save(m, dir, "step-2"), ZS_ERR_INVALID_ARGUMENT);
    const std::string msg = zs_last_error();
    EXPECT_TRUE(contains(msg, "in use by another live job")) << msg;
    EXPECT_TRUE(contains(msg, "pid " + std::to_string(holder[0]))) << msg;
    EXPECT_TRUE(contains(msg, "a job of 2 ranks")) << msg;
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_FALSE(fs::exists(dir + "/step-2"));
  EXPECT_EQ(slurp(dir + "/latest"), "step-1\n");
  EXPECT_EQ(slurp(dir + "/.zeroshard.lock"), lock) << "the refused job must not touch the lock";

  // A ends cleanly: its lock goes with its context, and the next job saves
  // without a takeover.
  std::ofstream(flags + "/release") << "1";
  for (pid_t p : holder) EXPECT_EQ(reap(p), 0);
  EXPECT_FALSE(fs::exists(dir + "/.zeroshard.lock"));
  run_ranks(2, [&](const RankEnv& env) {
    redirect_stderr(root + "/c.err." + std::to_string(env.rank));
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    zs::test::train_ckpt_model(m, 2);
    ZS_EXPECT_OK(save(m, dir, "step-2"));
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_FALSE(contains(slurp(root + "/c.err.0"), "took over")) << slurp(root + "/c.err.0");
  EXPECT_EQ(slurp(dir + "/latest"), "step-2\n");
  fs::remove_all(root);
}

TEST(CheckpointLock, TheLockOfAKilledJobIsTakenOverWithAMessage) {
  const std::string root = zs::test::make_temp_dir("ckpt_lock_stale");
  const std::string dir = root + "/ckpt";
  const std::vector<pid_t> holder = start_holder(2, dir, root);
  for (pid_t p : holder) kill(p, SIGKILL);
  for (pid_t p : holder) reap(p);
  ASSERT_TRUE(fs::exists(dir + "/.zeroshard.lock")) << "a SIGKILLed job leaves its lock";
  run_ranks(2, [&](const RankEnv& env) {
    redirect_stderr(root + "/b.err." + std::to_string(env.rank));
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    zs::test::train_ckpt_model(m, 2);
    ZS_EXPECT_OK(save(m, dir, "step-2"));
    // Held now by this job: a second save does not take it over again.
    ZS_EXPECT_OK(save(m, dir, "step-3"));
    if (env.rank == 0) {
      const std::string lock = slurp(dir + "/.zeroshard.lock");
      EXPECT_TRUE(contains(lock, "\"pid\":" + std::to_string(getpid()))) << lock;
    }
    zs::test::destroy_ckpt_model(m);
  });
  const std::string err = slurp(root + "/b.err.0");
  EXPECT_TRUE(contains(err, "took over the checkpoint lock of '" + dir + "' from pid " +
                                std::to_string(holder[0]))) << err;
  EXPECT_TRUE(contains(err, "its process has exited")) << err;
  size_t n = 0;
  for (size_t at = err.find("took over"); at != std::string::npos; at = err.find("took over", at + 1)) ++n;
  EXPECT_EQ(n, 1u) << err;
  EXPECT_EQ(slurp(dir + "/latest"), "step-3\n");
  fs::remove_all(root);
}

// Another host's lock cannot be checked by pid: it is live while its holder
// refreshes it, and stale once it has not for ZS_CHECKPOINT_LOCK_STALE_S.
TEST(CheckpointLock, AnotherHostsLockIsLiveUntilItGoesStale) {
  const std::string root = zs::test::make_temp_dir("ckpt_lock_host");
  const std::string dir = root + "/ckpt";
  fs::create_directories(dir);
  const std::string lock = dir + "/.zeroshard.lock";
  std::ofstream(lock) << R"({"host":"node-elsewhere","boot_id":"0000","pid":4242,"start":"7",)"
                      << R"("world_size":64,"since":"2026-01-01T00:00:00Z"})" << "\n";
  run_ranks(1, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_SGD);
    EXPECT_EQ(save(m, dir, "a"), ZS_ERR_INVALID_ARGUMENT);
    const std::string msg = zs_last_error();
    EXPECT_TRUE(contains(msg, "pid 4242 on host 'node-elsewhere' (a job of 64 ranks")) << msg;
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_FALSE(fs::exists(dir + "/a"));
  // Not refreshed for 200 s: stale under the default of 120.
  const timespec old[2] = {{time(nullptr) - 200, 0}, {time(nullptr) - 200, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, lock.c_str(), old, 0), 0);
  run_ranks(1, [&](const RankEnv& env) {
    redirect_stderr(root + "/err");
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_SGD);
    ZS_EXPECT_OK(save(m, dir, "a"));
    zs::test::destroy_ckpt_model(m);
  });
  const std::string err = slurp(root + "/err");
  EXPECT_TRUE(contains(err, "from pid 4242 on host 'node-elsewhere'")) << err;
  EXPECT_TRUE(contains(err, "has not refreshed the lock for")) << err;
  EXPECT_TRUE(fs::exists(dir + "/a"));
  fs::remove_all(root);
}

}  // namespace
