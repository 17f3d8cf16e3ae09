#include "tests/support/multirank.h"

#include "impl/core/context.h"

#include "tests/support/bench_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace zs::test {

int free_port() { return zs::bench::free_port(); }

bool process_gone(int pid) {
  if (kill(pid, 0) < 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || (close + 2 < line.size() && line[close + 2] == 'Z');
}
ScopedEnv::ScopedEnv(const char* name, const char* value) : name_(name) {
  if (const char* v = std::getenv(name)) {
    had_ = true;
    old_ = v;
  }
  if (value)
    setenv(name, value, 1);
  else
    unsetenv(name);
}

ScopedEnv::~ScopedEnv() {
  if (had_)
    setenv(name_.c_str(), old_.c_str(), 1);
  else
    unsetenv(name_.c_str());
}

void play_host(int host) { setenv("ZS_HOST_ID", ("test-host-" + std::to_string(host)).c_str(), 1); }

zs_context_options rank_options(const RankEnv& env, const char* config_json, int timeout_ms) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = env.rank;
  o.world_size = env.world;
  o.local_rank = env.rank;
  o.local_world_size = env.world;
  o.store_host = "127.0.0.1";
  o.store_port = env.port;
  o.config_json = config_json;
  o.timeout_ms = timeout_ms;
  return o;
}

std::shared_ptr<zs::Context> make_engine_context(const RankEnv& env) {
  zs::ContextOptions o;
  o.rank = env.rank;
  o.world_size = env.world;
  o.local_rank = env.rank;
  o.local_world_size = env.world;
  o.store_host = "127.0.0.1";
  o.store_port = env.port;
  o.timeout_ms = 30000;
  o.device = "cpu";
  return zs::Context::create(o);
}

zs_context make_context(const RankEnv& env, const char* config_json, int timeout_ms) {
  zs_context_options o = rank_options(env, config_json, timeout_ms);
  zs_context ctx = nullptr;
  const zs_status s = zs_context_create(&ctx, &o);
  if (s != ZS_OK) {
    ADD_FAILURE() << "rank " << env.rank << ": zs_context_create -> " << zs_status_string(s)
                  << ": " << zs_last_error();
  }
  return ctx;
}

void run_ranks(int world, const std::function<void(const RankEnv&)>& body, int timeout_s,
               const std::vector<int>& killed) {
  const int port = free_port();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      int code = 0;
      try {
        body(RankEnv{r, world, port});
        code = ::testing::Test::HasFailure() ? 1 : 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d threw: %s\n", r, e.what());
        code = 2;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  std::vector<int> status(pids.size(), -1);
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (status[i] == -1) kill(pids[i], SIGKILL);
      ADD_FAILURE() << "ranks still running after " << timeout_s << " s: killed (a hang)";
      deadline = std::chrono::steady_clock::time_point::max();  // reported once; SIGKILL ends them
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    const int st = status[i];
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL &&
        std::find(killed.begin(), killed.end(), static_cast<int>(i)) != killed.end())
      continue;
    if (WIFEXITED(st)) {
      ADD_FAILURE() << "rank " << i << " of " << world << " exited with " << WEXITSTATUS(st);
    } else {
      ADD_FAILURE() << "rank " << i << " of " << world << " died by signal " << WTERMSIG(st);
    }
  }
}

ExternalStore::ExternalStore() {
  int fds[2];
  if (pipe(fds) != 0) {
    ADD_FAILURE() << "pipe failed";
    return;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  pid_ = fork();
  if (pid_ == 0) {
    close(fds[0]);
    zs_store_server server = nullptr;
    int port = 0;
    if (zs_store_serve(&server, "127.0.0.1", 0, &port) != ZS_OK) {
      std::fprintf(stderr, "external store: %s\n", zs_last_error());
      port = -1;
    }
    if (write(fds[1], &port, sizeof port) != sizeof port) _exit(1);
    close(fds[1]);
    for (;;) pause();  // until the test kills it
  }
  close(fds[1]);
  if (read(fds[0], &port_, sizeof port_) != sizeof port_ || port_ <= 0)
    ADD_FAILURE() << "the external store did not start";
  close(fds[0]);
}

ExternalStore::~ExternalStore() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int st = 0;
  waitpid(pid_, &st, 0);
}

namespace {

pid_t fork_rank(const std::function<void(const RankEnv&)>& body, const RankEnv& env) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (env.replacement > 0) setenv("ZS_HEAL_REPLACEMENT", std::to_string(env.replacement).c_str(), 1);
  int code = 0;
  try {
    body(env);
    code = ::testing::Test::HasFailure() ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d threw: %s\n", env.rank, e.what());
    code = 2;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

}  // namespace

std::vector<std::vector<int>> run_ranks_replacing(int world, const std::function<void(const RankEnv&)>& body,
                                                  int timeout_s, const std::vector<int>& replaced, int max_each,
                                                  int port) {
  if (port == 0) port = free_port();
  struct Proc {
    int rank;
    int replacement;
    pid_t pid;
    int status = -1;
  };
  std::vector<Proc> procs;
  std::vector<std::vector<int>> pids(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork_rank(body, RankEnv{r, world, port, 0});
    EXPECT_GE(pid, 0) << "fork failed";
    if (pid < 0) return pids;
    procs.push_back({r, 0, pid});
    pids[static_cast<size_t>(r)].push_back(pid);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    bool running = false;
    for (size_t i = 0; i < procs.size(); ++i) {
      if (procs[i].status != -1) continue;
      int st = 0;
      if (waitpid(procs[i].pid, &st, WNOHANG) != procs[i].pid) {
        running = true;
        continue;
      }
      procs[i].status = st;
      const Proc p = procs[i];
      const bool replace = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && p.replacement < max_each &&
                           std::find(replaced.begin(), replaced.end(), p.rank) != replaced.end();
      if (!replace) continue;
      const pid_t pid = fork_rank(body, RankEnv{p.rank, world, port, p.replacement + 1});
      EXPECT_GE(pid, 0) << "fork failed";
      if (pid < 0) continue;
      procs.push_back({p.rank, p.replacement + 1, pid});
      pids[static_cast<size_t>(p.rank)].push_back(pid);
      running = true;
    }
    if (!running) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (auto& p : procs)
        if (p.status == -1) kill(p.pid, SIGKILL);
      ADD_FAILURE() << "ranks still running after " << timeout_s << " s: killed (a hang)";
      deadline = std::chrono::steady_clock::time_point::max();  // reported once; SIGKILL ends them
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (const Proc& p : procs) {
    const int st = p.status;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
    const bool replaced_kill = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL &&
                               std::find(replaced.begin(), replaced.end(), p.rank) != replaced.end();
    if (replaced_kill) continue;
    if (WIFEXITED(st)) {
      ADD_FAILURE() << "rank " << p.rank << " (replacement " << p.replacement << ") of " << world << " exited with "
                    << WEXITSTATUS(st);
    } else {
      ADD_FAILURE() << "rank " << p.rank << " (replacement " << p.replacement << ") of " << world
                    << " died by signal " << WTERMSIG(st);
    }
  }
  return pids;
}

}  // namespace zs::test
