// Checkpoint faults on real processes and files: ranks killed with SIGKILL
// at many points of a save (from inside the save's own progress calls, and
// from outside at random times), a rank that never joins, flipped bytes and
// truncated files. The previous checkpoint must always load bit-exact.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::CkptModel;
using zs::test::RankEnv;
using zs::test::run_ranks;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBig = 1 << 21;  // 8 MiB of fp32 (+ 16 MiB of moments): pieces per rank

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Whole or not at all: a parent polling for the file kills its writer as
// soon as the name appears, so the text must be there by then.
void write_text(const std::string& path, const std::string& s) {
  std::ofstream(path + ".tmp") << s;
  fs::rename(path + ".tmp", path);
}

zs_status save(CkptModel& m, const std::string& dir, const char* tag, int timeout_ms,
               zs_progress_fn progress = nullptr, void* user = nullptr) {
  zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
  o.tag = tag;
  o.timeout_ms = timeout_ms;
  o.progress = progress;
  o.progress_user = user;
  return zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
}

zs_status load(CkptModel& m, const std::string& dir, const char* tag = nullptr) {
  zs_checkpoint_load_options o = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
  o.tag = tag;
  return zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o, nullptr);
}

// Forks `world` ranks running body and waits for all, whatever becomes of
// them (killed ranks are the point here); a rank still alive after
// timeout_s is a hang and fails the test.
void fork_ranks(int world, const std::function<void(const RankEnv&)>& body,
                const std::function<void(const std::vector<pid_t>&)>& parent = nullptr,
                int timeout_s = 60) {
  const int port = zs::test::free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      body(RankEnv{r, world, port});
      std::fflush(stdout);
      _exit(::testing::Test::HasFailure() ? 1 : 0);
    }
    pids.push_back(pid);
  }
  if (parent) parent(pids);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (pid_t pid : pids) {
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        ADD_FAILURE() << "rank pid " << pid << " hung";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (WIFEXITED(st)) {
      EXPECT_EQ(WEXITSTATUS(st), 0) << "a surviving rank failed";
    }
  }
}

struct Killer {
  int victim;  // rank, or -1: every rank
  int at;      // progress call (0-based) at which the victim dies
  int rank;
  int calls = 0;
};

void kill_at(void* user, const char*, uint64_t, uint64_t) {
  auto* k = static_cast<Killer*>(user);
  if ((k->victim == -1 || k->victim == k->rank) && k->calls++ == k->at) raise(SIGKILL);
}

// After any crash: latest names a whole checkpoint, and every checkpoint
// directory there is whole (the partial one is not a checkpoint).
void expect_consistent(const std::string& dir, const std::string& why) {
  const std::string latest = read_text(dir + "/latest");
  EXPECT_TRUE(latest == "good" || latest.rfind("attempt-", 0) == 0) << why << ": latest = " << latest;
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_OK) << why << ": " << zs_last_error();
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename();
    if (!e.is_directory() || name[0] == '.') continue;
    EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), name.c_str(), nullptr, nullptr), ZS_OK)
        << why << ": " << zs_last_error();
  }
}

// fork_ranks' parent: SIGKILL to every rank delay_us after `marker` appears.
std::function<void(const std::vector<pid_t>&)> kill_all_after(std::string marker, int delay_us) {
  return [marker = std::move(marker), delay_us](const std::vector<pid_t>& pids) {
    while (!fs::exists(marker)) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    for (pid_t p : pids) kill(p, SIGKILL);
  };
}

// The good checkpoint (2 ranks, one step; its full values in good.bin),
// and how long its save took, in ms.
double save_good_checkpoint(const std::string& dir, int timeout_ms) {
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig);
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 1);
    const auto t0 = std::chrono::steady_clock::now();
    ZS_ASSERT_OK(save(m, dir, "good", timeout_ms));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto v = zs::test::full_values(m);
    if (env.rank == 0) {
      zs::test::write_floats(dir + "/good.bin", v);
      write_text(dir + "/save_ms", std::to_string(ms));
    }
    zs::test::destroy_ckpt_model(m);
  });
  return std::stod(read_text(dir + "/save_ms"));
}

}  // namespace

TEST(CheckpointFault, KilledRanksDuringSaveLeaveThePreviousOneLoadable) {
  const std::string dir = zs::test::make_temp_dir("ckpt_kill");
  const double save_ms = save_good_checkpoint(dir, 2000);

  // Killed from inside the save: rank 0 makes 2 write calls per piece... then
  // manifest, rename, latest, done; rank 1 its write calls, then done.
  std::vector<Killer> points;
  for (int k = 0; k < 8; ++k) points.push_back({0, k, 0});
  for (int k = 0; k < 5; ++k) points.push_back({1, k, 0});
  for (int k = 0; k < 5; ++k) points.push_back({-1, k, 0});
  int attempt = 0;
  for (const Killer& point : points) {
    const std::string tag = "attempt-" + std::to_string(attempt++);
    const std::string why = "victim " + std::to_string(point.victim) + " at call " + std::to_string(point.at);
    fork_ranks(2, [&](const RankEnv& env) {
      // A dead peer is seen at once (its pidfd, its closed connections), so
      // the collective timeout only bounds a hang; short, it failed the
      // training steps of ranks a loaded sanitizer run drifted apart.
      CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig, 15000);
      if (m.ctx == nullptr) return;
      zs::test::train_ckpt_model(m, 2);  // not the good state
      Killer k = point;
      k.rank = env.rank;
      const zs_status s = save(m, dir, tag.c_str(), 700, kill_at, &k);
      // Survivors: an error that names the dead rank, or success when the
      // victim died after the commit.
      if (s != ZS_OK && env.rank == 0 && point.victim == 1) {
        const std::string msg = zs_last_error();
        EXPECT_NE(msg.find("rank 1"), std::string::npos) << why << ": " << msg;
      }
      _exit(::testing::Test::HasFailure() ? 1 : 0);  // no goodbye with a dead peer
    });
    expect_consistent(dir, why);
  }
  // Killed from outside, every rank at once, at random times of the save;
  // the last attempt only once rank 0's save returned, so at least one kill
  // falls after a commit however slow a loaded machine makes the saves.
  std::mt19937 rng(1234);
  for (int i = 0; i < 8; ++i) {
    const std::string tag = "attempt-" + std::to_string(attempt++);
    const std::string ready = dir + "/ready-" + std::to_string(i);
    const std::string saved = dir + "/saved-" + std::to_string(i);
    const bool after_save = i == 7;
    const int delay_us = std::uniform_int_distribution<int>(0, static_cast<int>(save_ms * 1500))(rng);
    fork_ranks(2, [&](const RankEnv& env) {
      CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig, 15000);
      if (m.ctx == nullptr) return;
      zs::test::train_ckpt_model(m, 2);
      if (env.rank == 0) write_text(ready, "1");
      // 700 ms bounds a save that lost a rank; the last attempt must commit
      // even where a loaded machine makes a whole save take longer.
      const zs_status s = save(m, dir, tag.c_str(), after_save ? 20000 : 700);
      if (env.rank == 0) write_text(saved, s == ZS_OK ? "ok" : zs_last_error());
      std::this_thread::sleep_for(std::chrono::seconds(30));  // killed before this ends
    }, kill_all_after(after_save ? saved : ready, after_save ? 0 : delay_us));
    if (after_save) {
      EXPECT_EQ(read_text(saved), "ok") << "the save before the last kill failed";
    }
    expect_consistent(dir, after_save ? std::string("all ranks killed after the save returned")
                                      : "all ranks killed " + std::to_string(delay_us) +
                                            " us into the save");
  }
  // The kills fell both before and after commits.
  int committed = 0;
  for (int i = 0; i < attempt; ++i) committed += fs::exists(dir + "/attempt-" + std::to_string(i));
  EXPECT_GT(committed, 0);
  EXPECT_LT(committed, attempt);
  std::printf("kill points: %d, of which the save had committed: %d\n", attempt, committed);
  // The good checkpoint loads bit-exact (at another world size too), latest
  // loads, and saving again works despite the debris.
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig);
    ASSERT_NE(m.ctx, nullptr);
    ZS_ASSERT_OK(load(m, dir, "good"));
    const auto v = zs::test::full_values(m);
    EXPECT_TRUE(v == zs::test::read_floats(dir + "/good.bin"));
    ZS_ASSERT_OK(load(m, dir));
    ZS_ASSERT_OK(save(m, dir, "after", 5000));
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_EQ(read_text(dir + "/latest"), "after");
  fs::remove_all(dir);
}

TEST(CheckpointFault, KilledDuringAnAsynchronousWriteLeavesLatestValid) {
  // Every rank killed at random times after its asynchronous save returned
  // (the background write and commit in flight, training going on), and
  // once after the wait: latest always names a whole checkpoint.
  const std::string dir = zs::test::make_temp_dir("ckpt_async_kill");
  const double save_ms = save_good_checkpoint(dir, 5000);
  std::mt19937 rng(99);
  int committed = 0;
  for (int i = 0; i < 6; ++i) {
    const std::string tag = "attempt-" + std::to_string(i);
    const std::string staged = dir + "/staged-" + std::to_string(i);
    const std::string waited = dir + "/waited-" + std::to_string(i);
    const bool after_wait = i == 5;
    // Within the time a synchronous save takes: most kills land mid-write.
    const int delay_us = std::uniform_int_distribution<int>(0, static_cast<int>(save_ms * 1000))(rng);
    fork_ranks(2, [&](const RankEnv& env) {
      CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig, 20000);
      if (m.ctx == nullptr) return;
      zs::test::train_ckpt_model(m, 2);
      zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
      o.tag = tag.c_str();
      o.timeout_ms = 20000;
      o.async_save = 1;
      const zs_status s = zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o);
      if (env.rank == 0) write_text(staged, s == ZS_OK ? "ok" : zs_last_error());
      zs::test::train_ckpt_model(m, 2);  // training goes on beside the write
      const zs_status w = zs_checkpoint_wait(m.ctx);
      if (env.rank == 0) write_text(waited, w == ZS_OK ? "ok" : zs_last_error());
      std::this_thread::sleep_for(std::chrono::seconds(30));  // killed before this ends
    }, kill_all_after(after_wait ? waited : staged, after_wait ? 0 : delay_us));
    EXPECT_EQ(read_text(staged), "ok");
    if (after_wait) {
      EXPECT_EQ(read_text(waited), "ok") << "the asynchronous save before the last kill failed";
    }
    expect_consistent(dir, after_wait ? std::string("killed after the wait")
                                      : "killed " + std::to_string(delay_us) + " us after the save returned");
    committed += fs::exists(dir + "/" + tag);
  }
  EXPECT_GT(committed, 0);  // at least the one killed after its wait
  std::printf("asynchronous saves killed: 6, of which had committed: %d\n", committed);
  fs::remove_all(dir);
}

TEST(CheckpointFault, ARankThatNeverSavesIsNamedWithinTheTimeout) {
  const std::string dir = zs::test::make_temp_dir("ckpt_missing");
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_SGD, 0, 5000);
    ASSERT_NE(m.ctx, nullptr);
    ZS_ASSERT_OK(save(m, dir, "first", 0));
    if (env.rank == 2) {  // never joins the second save
      std::this_thread::sleep_for(std::chrono::seconds(3));
      _exit(0);
    }
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(save(m, dir, "second", 1000), ZS_ERR_TIMEOUT) << zs_last_error();
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("rank 2 of 3 did not finish writing"), std::string::npos) << msg;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.5);
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  EXPECT_EQ(read_text(dir + "/latest"), "first");
  EXPECT_FALSE(fs::exists(dir + "/second"));
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_OK) << zs_last_error();
  fs::remove_all(dir);
}

TEST(CheckpointFault, FlippedByteAndTruncatedFileAreNamed) {
  const std::string dir = zs::test::make_temp_dir("ckpt_corrupt");
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 2);
    ZS_ASSERT_OK(save(m, dir, "c", 0));
    zs::test::destroy_ckpt_model(m);
  });
  const auto manifest = nlohmann::json::parse(std::ifstream(dir + "/c/manifest.json"));
  // exp_avg of w1 held by rank 1 (elements 18..34 at 2 ranks).
  uint64_t begin = 0;
  for (const auto& p : manifest["params"])
    if (p["name"] == "w1")
      for (const auto& c : p["states"]["exp_avg"])
        if (c["file"] == 1) begin = c["begin"].get<uint64_t>();
  ASSERT_GT(begin, 0u);
  const std::string f1 = dir + "/c/rank-00001-of-00002.safetensors";
  auto flip = [&](uint64_t at) {
    std::fstream f(f1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&b, 1);
  };
  flip(begin + 5);
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_ERR_IO);
  std::string msg = zs_last_error();
  EXPECT_NE(msg.find("rank-00001-of-00002.safetensors': tensor 'exp_avg/w1' (param 'w1', exp_avg) fails its checksum"),
            std::string::npos) << msg;
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    const auto before = zs::test::full_values(m);
    EXPECT_EQ(load(m, dir), ZS_ERR_IO);
    const std::string lmsg = zs_last_error();
    if (env.rank == 1) {
      EXPECT_NE(lmsg.find("rank-00001-of-00002.safetensors': tensor 'exp_avg/w1' (param 'w1', exp_avg) fails its checksum"),
                std::string::npos) << lmsg;
    } else {
      EXPECT_NE(lmsg.find("failed on rank 1"), std::string::npos) << lmsg;
    }
    EXPECT_TRUE(zs::test::full_values(m) == before);  // nothing changed
    zs::test::destroy_ckpt_model(m);
  });
  flip(begin + 5);  // back
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_OK) << zs_last_error();
  // Truncated: the last tensor of rank 1's file loses its tail.
  fs::resize_file(f1, fs::file_size(f1) - 6);
  EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_ERR_IO);
  msg = zs_last_error();
  EXPECT_NE(msg.find("rank-00001-of-00002.safetensors' is truncated: tensor '"), std::string::npos) << msg;
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    EXPECT_EQ(load(m, dir), ZS_ERR_IO);
    const std::string lmsg = zs_last_error();
    EXPECT_NE(lmsg.find("rank-00001-of-00002.safetensors' is truncated: tensor '"), std::string::npos) << lmsg;
    zs::test::destroy_ckpt_model(m);
  });
  fs::remove_all(dir);
}

// The loop "load latest, train, save every step" (default tags: step-N)
// killed at each point of a save: before it, during rank 1's or rank 0's
// write, after the manifest, and between the commit and `latest` moving.
// The resumed job loads the newest committed step (step-2 once the save
// committed, though `latest` still names step-1), and its next save's tag
// is new: it never trips on the save that was cut off.
struct CutSave {
  const char* name;
  int victim;          // rank killed (-1: every rank, before the save)
  const char* phase;   // the progress phase at which it dies
  bool committed;      // step-2 was committed before the kill
};

void die_at_phase(void* user, const char* phase, uint64_t, uint64_t) {
  const auto* c = static_cast<const std::pair<const CutSave*, int>*>(user);
  if (c->first->victim == c->second && std::strcmp(phase, c->first->phase) == 0) raise(SIGKILL);
}

TEST(CheckpointFault, ResumingFromLatestNeverTripsOnTheSaveThatWasCutOff) {
  const CutSave cuts[] = {{"before the save", -1, "", false},
                          {"during rank 1's write", 1, "write", false},
                          {"during rank 0's write", 0, "write", false},
                          {"after the manifest", 0, "manifest", false},
                          {"between the commit and latest", 0, "rename", true}};
  for (const CutSave& cut : cuts) {
    SCOPED_TRACE(cut.name);
    const std::string dir = zs::test::make_temp_dir("ckpt_resume");
    // The job: steps 1 and 2, each saved; killed at the cut.
    fork_ranks(2, [&](const RankEnv& env) {
      // A short timeout: the ranks left wait for the one killed.
      CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, 0, 3000);
      zs::test::train_ckpt_model(m, 1);
      EXPECT_EQ(save(m, dir, nullptr, 3000), ZS_OK) << zs_last_error();
      zs::test::train_ckpt_model(m, 1);
      zs::test::write_floats(dir + ".step2." + std::to_string(env.rank), zs::test::full_values(m));
      if (cut.victim == -1) raise(SIGKILL);
      std::pair<const CutSave*, int> at{&cut, env.rank};
      (void)save(m, dir, nullptr, 2000, die_at_phase, &at);  // fails on the ranks left
      destroy_ckpt_model(m);
    });
    EXPECT_EQ(read_text(dir + "/latest"), "step-1");  // the cut save never moved it
    // The resumed job: load latest, train a step, save under the default tag.
    fork_ranks(2, [&](const RankEnv& env) {
      CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
      ASSERT_EQ(load(m, dir), ZS_OK) << zs_last_error();
      int64_t step = -1;
      ASSERT_EQ(zs_optimizer_get_step(m.opt, &step), ZS_OK);
      EXPECT_EQ(step, cut.committed ? 2 : 1);
      if (cut.committed) {
        const auto want = zs::test::read_floats(dir + ".step2." + std::to_string(env.rank));
        EXPECT_TRUE(zs::test::bitwise_equal(zs::test::full_values(m), want)) << "step-2 was not what loaded";
      }
      zs::test::train_ckpt_model(m, 1);
      EXPECT_EQ(save(m, dir, nullptr, 5000), ZS_OK) << zs_last_error();
      destroy_ckpt_model(m);
    });
    EXPECT_EQ(read_text(dir + "/latest"), cut.committed ? "step-3" : "step-2");
    EXPECT_EQ(zs_checkpoint_verify(dir.c_str(), nullptr, nullptr, nullptr), ZS_OK) << zs_last_error();
    fs::remove_all(dir);
    for (int r = 0; r < 2; ++r) fs::remove(dir + ".step2." + std::to_string(r));
  }
}

TEST(CheckpointFault, AFullDiskIsACleanErrorAndLosesNothing) {
  // The kernel refuses writes past RLIMIT_FSIZE on rank 1 (EFBIG), as it
  // refuses them on a full disk (ENOSPC): a real failed write() mid-file.
  const std::string dir = zs::test::make_temp_dir("ckpt_full");
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW, kBig);
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 1);
    ZS_ASSERT_OK(save(m, dir, "good", 5000));
    const auto good = zs::test::full_values(m);
    zs::test::train_ckpt_model(m, 1);
    if (env.rank == 1) {
      signal(SIGXFSZ, SIG_IGN);
      rlimit lim{4u << 20, 4u << 20};  // 4 MiB: a few pieces into its file
      ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
    }
    EXPECT_EQ(save(m, dir, "full", 5000), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("cannot write '"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank-00001-of-00002.safetensors': File too large"), std::string::npos) << msg;
    if (env.rank == 0) {
      EXPECT_NE(msg.find("failed on rank 1"), std::string::npos) << msg;
    }
    // Nothing previous changed, and the debris is gone.
    ZS_ASSERT_OK(load(m, dir));
    EXPECT_TRUE(zs::test::full_values(m) == good);
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_EQ(read_text(dir + "/latest"), "good");
  EXPECT_FALSE(fs::exists(dir + "/full"));
  EXPECT_FALSE(fs::exists(dir + "/.full.partial"));
  fs::remove_all(dir);
}
