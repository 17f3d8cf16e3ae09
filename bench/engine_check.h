// What the engine benchmarks share: stop at the first failed call with the
// engine's own message, the median of repeated timings, and ranks forked
// with rank 0's results sent back.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "zeroshard/zeroshard.h"

#define CHECK(call)                                                                       \
  do {                                                                                    \
    zs_status s_ = (call);                                                                \
    if (s_ != ZS_OK) {                                                                    \
      std::fprintf(stderr, "%s: %s: %s\n", #call, zs_status_string(s_), zs_last_error()); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace zs::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs body(rank) in `world` forked processes (each flushes stdout and
// exits 0 when body returns). True when every rank exited 0. What the
// caller printed is flushed first: each rank would print its copy of the
// stdio buffers again (a pipe's stdout is fully buffered).
template <typename Body>
bool fork_ranks(int world, Body&& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      body(r);
      std::fflush(stdout);
      _exit(0);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
  }
  return ok;
}

// fork_ranks with body(rank, out): rank 0's `out` (plain bytes, at most a
// pipe's buffer) comes back into *out. True when it arrived and every rank
// exited 0.
template <typename Out, typename Body>
bool fork_ranks_collect(int world, Out* out, Body&& body) {
  static_assert(sizeof(Out) <= 4096, "rank 0's result must fit a pipe's buffer while the parent waits");
  int fds[2];
  if (pipe(fds) != 0) return false;
  bool ok = fork_ranks(world, [&](int r) {
    close(fds[0]);
    Out mine{};
    body(r, &mine);
    if (r == 0 && write(fds[1], &mine, sizeof mine) != static_cast<ssize_t>(sizeof mine)) _exit(1);
  });
  close(fds[1]);
  ok = read(fds[0], out, sizeof *out) == static_cast<ssize_t>(sizeof *out) && ok;
  close(fds[0]);
  return ok;
}

}  // namespace zs::bench
