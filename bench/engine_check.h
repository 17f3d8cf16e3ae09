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

// Runs body(rank, out) in `world` forked processes; rank 0's `out` (plain
// bytes) comes back by pipe into *out. True when it arrived and every rank
// exited 0.
template <typename Out, typename Body>
bool fork_ranks_collect(int world, Out* out, Body&& body) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      Out mine{};
      body(r, &mine);
      if (r == 0 && write(fds[1], &mine, sizeof mine) != static_cast<ssize_t>(sizeof mine)) _exit(1);
      _exit(0);
    }
    pids.push_back(pid);
  }
  close(fds[1]);
  bool ok = read(fds[0], out, sizeof *out) == static_cast<ssize_t>(sizeof *out);
  close(fds[0]);
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
  }
  return ok;
}

}  // namespace zs::bench
