// A rank whose launcher is killed ends (impl/core/launcher_watch.h): a
// "launcher" process starts a rank that makes a zeroshard context as
// torchrun's workers do (TORCHELASTIC_RUN_ID set), then the launcher is
// killed with SIGKILL. The rank must end within seconds; with
// ZS_WATCH_LAUNCHER=0 it runs on.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "tests/support/multirank.h"
#include "zeroshard/zeroshard.h"

namespace {

// Starts launcher -> rank; returns the launcher's pid and the rank's (read
// from a pipe once its context exists), or -1s.
void start(bool watch, pid_t* launcher, pid_t* rank) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  *launcher = fork();
  ASSERT_GE(*launcher, 0);
  if (*launcher == 0) {
    close(fds[0]);
    const pid_t r = fork();
    if (r == 0) {
      setenv("TORCHELASTIC_RUN_ID", "launcher-watch-test", 1);
      if (!watch) setenv("ZS_WATCH_LAUNCHER", "0", 1);
      zs_context_options o = zs::test::rank_options(zs::test::RankEnv{0, 1, 0});
      zs_context ctx = nullptr;
      if (zs_context_create(&ctx, &o) != ZS_OK) _exit(3);
      const pid_t me = getpid();
      if (write(fds[1], &me, sizeof me) != sizeof me) _exit(4);
      sleep(30);
      _exit(0);
    }
    pause();  // the launcher waits, until killed
    _exit(0);
  }
  close(fds[1]);
  *rank = -1;
  const ssize_t got = read(fds[0], rank, sizeof *rank);
  close(fds[0]);
  ASSERT_EQ(got, static_cast<ssize_t>(sizeof *rank)) << "the rank did not make its context";
}

bool gone_within(pid_t pid, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (zs::test::process_gone(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return zs::test::process_gone(pid);
}

TEST(LauncherWatch, ARankWhoseLauncherIsKilledEnds) {
  pid_t launcher = -1, rank = -1;
  start(true, &launcher, &rank);
  ASSERT_GT(rank, 0);
  ASSERT_EQ(kill(launcher, SIGKILL), 0);
  waitpid(launcher, nullptr, 0);
  const bool ended = gone_within(rank, std::chrono::seconds(5));
  EXPECT_TRUE(ended) << "rank " << rank << " outlived its launcher";
  if (!ended) kill(rank, SIGKILL);
}

TEST(LauncherWatch, OffKeepsTheRankRunning) {
  pid_t launcher = -1, rank = -1;
  start(false, &launcher, &rank);
  ASSERT_GT(rank, 0);
  ASSERT_EQ(kill(launcher, SIGKILL), 0);
  waitpid(launcher, nullptr, 0);
  EXPECT_FALSE(gone_within(rank, std::chrono::milliseconds(1000)));
  kill(rank, SIGKILL);
}

}  // namespace
